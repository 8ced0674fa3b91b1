// The CUDA attention and partial-merge kernels against the reference backend through the
// backend interface (tests/kernels/cuda_backend_test_util.h). Device tests GTEST_SKIP when no
// usable CUDA device is present (or CUDA was not compiled in).
//
// Tolerances are worst-case bounds with eps = FLT_EPSILON (= 2u, a 2x margin per rounding):
//  * attention, per row: scores are FMA chains of length head_dim on pre-scaled q:
//    ds = (head_dim + 2) eps max_j scale·sum|q k_j|; exp adds 2 ulps per weight and per online
//    rescale; sums over n visible keys add n eps:
//      tol_o = max|v| (4 ds + (2 n + 16) eps) + eps |o|,  tol_lse = 2 ds + (n + 8) eps (1 + |lse|)
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/dequant.cuh"
#include "kernels/cuda/kvq.cuh"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"

#include "kernels/cuda_backend_test_util.h"

namespace xctx {
namespace {

using namespace cuda_test;

// ---- device: attention -------------------------------------------------------------------

enum class pos_layout { layout_decode, layout_causal, layout_gapped };

struct attn_case {
  int64_t n_q, n_kv;
  int n_head, n_head_kv, head_dim;
  kv_dtype kv;
  pos_layout layout;
  int se_group = 1, se_window = 0;  // SelfExtend when se_group > 1
  int n_rot = 0;                    // rotated dims SelfExtend turns (0: head_dim)
  int select = 0;                   // retrieval selection: 0 none, 1 one list per query, 2 one per KV head
  std::string name() const {
    const char* lay = layout == pos_layout::layout_decode ? "decode" : layout == pos_layout::layout_causal ? "causal" : "gapped";
    return std::string(lay) + "_q" + std::to_string(n_q) + "_kv" + std::to_string(n_kv) + "_h" +
           std::to_string(n_head) + "x" + std::to_string(n_head_kv) + "_d" + std::to_string(head_dim) +
           (kv == kv_dtype::kv_f16 ? "_f16" : "_f32") +
           (se_group > 1 ? "_se" + std::to_string(se_group) + "w" + std::to_string(se_window) : "") +
           (n_rot > 0 ? "_rot" + std::to_string(n_rot) : "") +
           (select == 1 ? "_sel" : select == 2 ? "_selkv" : "");
  }
};

std::vector<attn_case> attn_cases() {
  using L = pos_layout;
  const kv_dtype f16 = kv_dtype::kv_f16, f32 = kv_dtype::kv_f32;
  std::vector<attn_case> cs;
  for (kv_dtype kv : {f16, f32}) {
    for (int64_t n_kv : {0, 1, 31, 33, 1000, 20000}) cs.push_back({1, n_kv, 9, 3, 64, kv, L::layout_decode});
    cs.push_back({77, 77, 9, 3, 64, kv, L::layout_causal});     // SmolLM2 prefill
    cs.push_back({300, 300, 9, 3, 64, kv, L::layout_causal});
    cs.push_back({64, 1000, 9, 3, 64, kv, L::layout_causal});   // chunked prefill over a cache
    cs.push_back({5, 700, 9, 3, 64, kv, L::layout_gapped});     // repeats, gaps, blind queries
    cs.push_back({40, 900, 9, 3, 64, kv, L::layout_gapped});
  }
  cs.push_back({1, 5000, 32, 8, 128, f16, L::layout_decode});   // Llama-3-8B-like
  cs.push_back({3, 5000, 32, 8, 128, f16, L::layout_decode});
  cs.push_back({100, 100, 32, 8, 128, f16, L::layout_causal});
  cs.push_back({1, 3000, 8, 1, 80, f16, L::layout_decode});      // MQA, head_dim 80
  cs.push_back({50, 400, 8, 1, 80, f32, L::layout_causal});
  cs.push_back({2, 500, 4, 4, 70, f32, L::layout_decode});       // head_dim % 4 != 0: scalar loads
  cs.push_back({33, 200, 4, 4, 70, f16, L::layout_gapped});
  cs.push_back({1, 2000, 4, 2, 256, f16, L::layout_decode});     // largest head_dim
  cs.push_back({70, 300, 4, 2, 256, f32, L::layout_causal});     // > 48 KiB shared memory
  // SelfExtend: grouped keys turned on the device; windows small enough that tiles hold both
  // sides, rows of one block on both sides of a key, and partial rotation (n_rot < head_dim).
  cs.push_back({1, 20000, 9, 3, 64, f16, L::layout_decode, 8, 1024});
  cs.push_back({3, 5000, 32, 8, 128, f16, L::layout_decode, 4, 40});
  cs.push_back({1, 3000, 8, 1, 80, f32, L::layout_decode, 16, 100, 64});
  cs.push_back({300, 300, 9, 3, 64, f32, L::layout_causal, 4, 64});
  cs.push_back({64, 1000, 9, 3, 64, f16, L::layout_causal, 16, 100});
  cs.push_back({40, 900, 9, 3, 64, f16, L::layout_gapped, 3, 50});
  cs.push_back({70, 300, 4, 2, 128, f32, L::layout_causal, 2, 33, 96});
  // SelfExtend decode at head_dim 256: exactly 48 KiB of dynamic shared memory plus the static
  // merge arrays, over the limit a block gets without opting in (issue 54: once a launch failure).
  cs.push_back({1, 2000, 4, 2, 256, f16, L::layout_decode, 8, 100});
  cs.push_back({1, 2000, 4, 2, 253, f32, L::layout_decode, 8, 100, 252});
  // Retrieval: random unit lists (one per query, or one per KV head) with the fixed-distance
  // rope retrieval runs with (far keys at distance W), on both kernels and both element types.
  const int far = kFixedDistanceGroup;
  cs.push_back({1, 20000, 9, 3, 64, f16, L::layout_decode, far, 4096, 0, 1});
  cs.push_back({1, 20000, 9, 3, 64, f16, L::layout_decode, far, 4096, 0, 2});
  cs.push_back({3, 5000, 32, 8, 128, f32, L::layout_decode, far, 700, 0, 2});
  cs.push_back({1, 3000, 9, 3, 64, f32, L::layout_decode, 1, 0, 0, 1});  // a selection without a rope turn
  cs.push_back({64, 3000, 9, 3, 64, f16, L::layout_causal, far, 1000, 0, 1});
  cs.push_back({40, 2900, 9, 3, 64, f32, L::layout_gapped, far, 500, 0, 2});
  return cs;
}

void PrintTo(const attn_case& c, std::ostream* os) { *os << c.name(); }

class CudaAttention : public testing::TestWithParam<attn_case> {};

TEST_P(CudaAttention, MatchesReference) {
  XCTX_REQUIRE_CUDA();
  const attn_case c = GetParam();
  const uint32_t seed = seed_of(c.name());
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int hd = c.head_dim;
  const size_t kv_elems = (size_t)(c.n_kv * c.n_head_kv * hd);
  const std::vector<float> q = uniform((size_t)(c.n_q * c.n_head * hd), -1, 1, rng);  // [n_q, n_head, hd]
  std::vector<float> k = uniform(kv_elems, -1, 1, rng), v = uniform(kv_elems, -1, 1, rng);
  std::vector<int32_t> kv_pos((size_t)c.n_kv), q_pos((size_t)c.n_q);
  std::uniform_int_distribution<int> step(0, 3);
  for (int64_t j = 0; j < c.n_kv; ++j)
    kv_pos[(size_t)j] = c.layout == pos_layout::layout_gapped ? (j ? kv_pos[(size_t)j - 1] + step(rng) : 5) : (int32_t)j;
  const int32_t last = c.n_kv ? kv_pos.back() : 0;
  for (int64_t i = 0; i < c.n_q; ++i) {
    switch (c.layout) {
      case pos_layout::layout_decode: q_pos[(size_t)i] = last + (int32_t)i; break;
      case pos_layout::layout_causal: q_pos[(size_t)i] = last - (int32_t)(c.n_q - 1 - i); break;
      case pos_layout::layout_gapped: q_pos[(size_t)i] = std::uniform_int_distribution<int32_t>(0, last + 2)(rng); break;
    }
  }
  if (c.layout == pos_layout::layout_gapped && c.n_q > 1) q_pos[0] = 0;  // sees nothing (kv_pos starts at 5)
  // Both backends get the same K/V values: round through half first for f16 caches.
  std::vector<uint16_t> k16(kv_elems), v16(kv_elems);
  for (size_t e = 0; e < kv_elems; ++e) {
    k16[e] = fp32_to_fp16(k[e]), v16[e] = fp32_to_fp16(v[e]);
    if (c.kv == kv_dtype::kv_f16) k[e] = fp16_to_fp32(k16[e]), v[e] = fp16_to_fp32(v16[e]);
  }
  const float scale = 1.0f / std::sqrt((float)hd);
  const size_t n_o = q.size(), n_lse = (size_t)(c.n_q * c.n_head);
  attn_selection sel;  // retrieval: each list holds each unit up to the query's with probability 1/3
  if (c.select > 0) {
    sel.lists_per_query = c.select == 1 ? 1 : c.n_head_kv;
    sel.offsets.push_back(0);
    std::bernoulli_distribution pick(1.0 / 3.0);
    for (int64_t i = 0; i < c.n_q; ++i)
      for (int g = 0; g < sel.lists_per_query; ++g) {
        for (int64_t u = 0; u <= attn_unit_of(std::max<int32_t>(0, q_pos[(size_t)i])); ++u)
          if (pick(rng)) sel.units.push_back(u);
        sel.offsets.push_back((int64_t)sel.units.size());
      }
  }

  backends be;
  std::vector<float> o[2], lse[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  for (int b = 0; b < 2; ++b) {
    const bool h = c.kv == kv_dtype::kv_f16;
    buffer qd(*list[b], q), qp(*list[b], q_pos), kp(*list[b], kv_pos);
    buffer kd = h ? buffer(*list[b], k16) : buffer(*list[b], k);
    buffer vd = h ? buffer(*list[b], v16) : buffer(*list[b], v);
    buffer od(*list[b], n_o * sizeof(float)), ld(*list[b], n_lse * sizeof(float));
    attn_args a;
    a.q = qd.as<float>(), a.q_pos = qp.as<int32_t>(), a.n_q = c.n_q;
    a.k = kd.as<void>(), a.v = vd.as<void>(), a.kv_pos = kp.as<int32_t>(), a.n_kv = c.n_kv, a.kv_type = c.kv;
    a.n_head = c.n_head, a.n_head_kv = c.n_head_kv, a.head_dim = hd, a.scale = scale;
    a.o = od.as<float>(), a.lse = ld.as<float>();
    a.rope.head_dim = hd;
    a.rope.n_rot = c.n_rot > 0 ? c.n_rot : hd;
    a.rope.se_group = c.se_group, a.rope.se_window = c.se_window;
    if (c.select > 0) a.select = &sel;
    list[b]->attention_partial(a);
    o[b] = od.read<float>(n_o);
    lse[b] = ld.read<float>(n_lse);
  }

  std::vector<double> tol_o(n_o), tol_lse(n_lse);
  const int group = c.n_head / c.n_head_kv;
  for (int64_t i = 0; i < c.n_q; ++i) {
    for (int h = 0; h < c.n_head; ++h) {
      double smax = 0.0, vmax = 0.0;
      int64_t n_vis = 0;
      for (int64_t j = 0; j < c.n_kv; ++j) {
        if (kv_pos[(size_t)j] > q_pos[(size_t)i]) continue;
        if (c.select > 0 && !sel.sees(i, h / group, attn_unit_of(kv_pos[(size_t)j]))) continue;
        ++n_vis;
        const size_t kr = (size_t)((j * c.n_head_kv + h / group) * hd);
        double s = 0.0;
        const float* qr = q.data() + (size_t)((i * c.n_head + h) * hd);
        for (int d = 0; d < hd; ++d) {
          s += std::fabs((double)qr[d] * k[kr + d]);
          vmax = std::max(vmax, (double)std::fabs(v[kr + d]));
        }
        if (c.se_group > 1) {  // turned pairs: |x·y| <= |x||y| bounds the products at any angle
          s = 0.0;
          for (int d = 0; d < hd; d += 2) {
            const double q1 = d + 1 < hd ? qr[d + 1] : 0.0, k1 = d + 1 < hd ? k[kr + d + 1] : 0.0;
            s += std::hypot((double)qr[d], q1) * std::hypot((double)k[kr + d], k1);
          }
        }
        smax = std::max(smax, s * scale);
      }
      // SelfExtend turns the query and the key (each within 2 eps in cos/sin, 1.5 eps in the
      // rotation) where the reference turns the key once in double.
      const double ds = (hd + 2 + (c.se_group > 1 ? 8 : 0)) * kEps * smax;
      const size_t r = (size_t)(i * c.n_head + h);
      for (int d = 0; d < hd; ++d)
        tol_o[r * hd + d] = vmax * (4 * ds + (double)(2 * n_vis + 16) * kEps) + kEps * std::fabs(o[0][r * hd + d]);
      tol_lse[r] = 2 * ds + (double)(n_vis + 8) * kEps * (1.0 + std::fabs(lse[0][r]));
    }
  }
  expect_close(o[1], o[0], tol_o, c.name() + " o");
  expect_close(lse[1], lse[0], tol_lse, c.name() + " lse");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention, testing::ValuesIn(attn_cases()),
                         [](const testing::TestParamInfo<attn_case>& i) { return i.param.name(); });

struct merge_case {
  int n_part;
  int64_t n_row;
  int head_dim;
  bool aliased;
  std::string name() const {
    return "p" + std::to_string(n_part) + "_r" + std::to_string(n_row) + "_d" + std::to_string(head_dim) +
           (aliased ? "_aliased" : "");
  }
};

void PrintTo(const merge_case& c, std::ostream* os) { *os << c.name(); }

class CudaMerge : public testing::TestWithParam<merge_case> {};

TEST_P(CudaMerge, MatchesReference) {
  XCTX_REQUIRE_CUDA();
  const merge_case c = GetParam();
  const uint32_t seed = seed_of("merge" + c.name());
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::vector<float> o_parts = uniform((size_t)(c.n_part * c.n_row * c.head_dim), -1, 1, rng);
  std::vector<float> lse_parts = uniform((size_t)(c.n_part * c.n_row), -6, 6, rng);
  // Empty parts (lse = -inf, o = 0): a few per row, and one row empty in every part.
  for (size_t e = 0; e < lse_parts.size(); e += 3) lse_parts[e] = -kInf;
  for (int p = 0; p < c.n_part; ++p) lse_parts[(size_t)p * c.n_row] = -kInf;
  for (int p = 0; p < c.n_part; ++p)
    for (int64_t r = 0; r < c.n_row; ++r)
      if (lse_parts[(size_t)(p * c.n_row + r)] == -kInf)
        std::fill_n(o_parts.begin() + (p * c.n_row + r) * c.head_dim, c.head_dim, 0.0f);
  backends be;
  std::vector<float> o[2], lse[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  const size_t n_o = (size_t)(c.n_row * c.head_dim), n_lse = (size_t)c.n_row;
  for (int b = 0; b < 2; ++b) {
    buffer op(*list[b], o_parts), lp(*list[b], lse_parts), od(*list[b], n_o * 4), ld(*list[b], n_lse * 4);
    float* out_o = c.aliased ? op.as<float>() : od.as<float>();
    float* out_lse = c.aliased ? lp.as<float>() : ld.as<float>();
    list[b]->merge_partials(op.as<float>(), lp.as<float>(), c.n_part, c.n_row, c.head_dim, out_o, out_lse);
    o[b] = (c.aliased ? op : od).read<float>(n_o);
    lse[b] = (c.aliased ? lp : ld).read<float>(n_lse);
  }
  // Weights exp(lse_p - max) carry expf's 2 ulps; the sums n_part roundings each.
  std::vector<double> tol_o(n_o), tol_lse(n_lse);
  for (size_t i = 0; i < n_o; ++i) tol_o[i] = (double)(2 * c.n_part + 8) * kEps + kEps * std::fabs(o[0][i]);
  for (size_t r = 0; r < n_lse; ++r) tol_lse[r] = (double)(c.n_part + 4) * kEps * (1.0 + std::fabs(lse[0][r]));
  expect_close(o[1], o[0], tol_o, c.name() + " o");
  expect_close(lse[1], lse[0], tol_lse, c.name() + " lse");
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMerge,
                         testing::Values(merge_case{1, 10, 64, false}, merge_case{2, 27, 64, true},
                                         merge_case{5, 100, 128, false}, merge_case{40, 9, 64, true},
                                         merge_case{3, 6, 300, false}),
                         [](const testing::TestParamInfo<merge_case>& i) { return i.param.name(); });

}  // namespace
}  // namespace xctx
