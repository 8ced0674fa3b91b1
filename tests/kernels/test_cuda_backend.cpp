// The CUDA backend against the reference backend, op by op, through the backend interface
// (alloc/upload/run/download). Device tests GTEST_SKIP when no usable CUDA device is present
// (or CUDA was not compiled in). Two host-only suites run everywhere: the block decoders the
// kernels use (kernels/cuda/dequant.cuh, compiled here by the host compiler) must be bit-equal
// to ref::dequantize_row, and the attention launch plans must cover the cache within the
// shared-memory budget.
//
// Tolerances are worst-case bounds with eps = FLT_EPSILON (= 2u, a 2x margin per rounding):
//  * fused matvec (n_tok <= 32): decoded weights are bit-equal to the reference, so only the
//    fp32 accumulation counts: each lane chains n_cols/8 FMAs, then a 5-level shuffle tree:
//      |y - y_ref| <= (n_cols/8 + 6) eps sum|w x| + eps |y_ref|
//  * GEMM (n_tok > 32): cuBLAS's order is unknown: (n_cols + 2) eps sum|w x|, plus, with TF32,
//    both operands rounded to 10 mantissa bits (truncation bound 2^-10 each): + 2^-9 sum|w x|.
//  * rms_norm: a per-thread chain of dim/256 plus an 8-level tree for the sum of squares, half
//    of that relative error through 1/sqrt, two float products: (dim/256 + 12) eps |y|.
//  * rope: both sides work in double; CUDA's pow/sincos may differ from glibc's by a few double
//    ulps of theta: (|x0|+|x1|) (2 eps + 8·2^-53 |theta|).
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

// ---- host-only: the device block decoders ------------------------------------------------

class CudaDequantMath : public testing::TestWithParam<ggml_type> {};

TEST_P(CudaDequantMath, BitEqualToReference) {
  const ggml_type t = GetParam();
  const uint32_t seed = seed_of("dequant" + type_name(t));
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int64_t n = 4 * qk_super;  // whole blocks of every type
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<uint8_t> row;
    if (variant == 0) {
      row = make_weight(t, 1, n, rng);
    } else {  // every code value: random bytes (finite scales) for all block types
      if (ggml_traits(t).block_elems == 1) continue;
      row.resize(ggml_row_bytes(t, n));
      std::uniform_int_distribution<int> byte(0, 255);
      for (uint8_t& b : row) b = (uint8_t)byte(rng);
      for (size_t off = 0; off < row.size(); off += (size_t)ggml_traits(t).block_bytes)
        fix_scales(t, row.data() + off, rng);
    }
    std::vector<float> want((size_t)n), got((size_t)n, -1.0f);
    ref::dequantize_row(t, row.data(), want.data(), n);
    ASSERT_TRUE(cuda::dispatch_weight_type(
        t, [&](auto tag) { cuda::dequantize_row_via_device_math<decltype(tag)::value>(row.data(), got.data(), n); }));
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(float_to_bits(got[(size_t)i]), float_to_bits(want[(size_t)i]))
          << type_name(t) << " variant " << variant << " element " << i << ": " << got[(size_t)i] << " vs "
          << want[(size_t)i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllTypes, CudaDequantMath, testing::ValuesIn(kAllTypes),
                         [](const testing::TestParamInfo<ggml_type>& i) { return type_name(i.param); });

// ---- host-only: attention launch plans ---------------------------------------------------

TEST(CudaAttentionPlan, CoversCacheWithinBudget) {
  // 99 KiB: the smallest opt-in shared memory per block among sm_80+ parts (sm_86/sm_89).
  constexpr size_t kSmemOptinMin = 101376;
  constexpr size_t kSmemOptinH100 = 232448;  // sm_90: 227 KiB
  for (int n_sm : {1, 108, 132}) {
    for (int64_t n_q : {1, 2, 5, 64, 4096}) {
      for (int64_t n_kv : {0, 1, 31, 32, 33, 257, 5000, 1000000}) {
        for (int head_dim : {1, 63, 64, 70, 80, 128, 200, 256}) {
          for (auto [n_head, n_head_kv] : {std::pair{9, 3}, std::pair{32, 8}, std::pair{8, 1}, std::pair{4, 4}}) {
            for (bool se : {false, true}) {
              const cuda::attn_plan p = cuda::plan_attention(n_q, n_kv, n_head, n_head_kv, head_dim, n_sm, se);
              SCOPED_TRACE(testing::Message() << "n_sm " << n_sm << " n_q " << n_q << " n_kv " << n_kv << " hd "
                                              << head_dim << " heads " << n_head << "/" << n_head_kv << " se " << se);
              ASSERT_GE(p.n_split, 1);
              ASSERT_LE(p.n_split, 65535);
              ASSERT_EQ(p.chunk % cuda::attn_tile, 0);
              ASSERT_GE((int64_t)p.n_split * p.chunk, n_kv);                 // every key is covered
              ASSERT_LT((int64_t)(p.n_split - 1) * p.chunk, std::max<int64_t>(n_kv, 1));  // no empty split
              ASSERT_EQ(p.rows_total, n_q * (n_head / n_head_kv));
              ASSERT_GE(p.row_blocks * p.rows_per_block, p.rows_total);
              ASSERT_GE(p.kd * 32, head_dim);
              ASSERT_EQ(p.d4 % 4, 0);
              ASSERT_GE(p.d4, head_dim);
              ASSERT_GE(p.k_stride, p.d4);
              ASSERT_EQ(p.k_stride % 8, 4) << "16-byte smem reads of K rows would conflict";
              if (!se)
                ASSERT_LE(p.smem_bytes, p.decode ? (size_t)48 << 10 : kSmemOptinMin);
              else  // turned rows and keys: within sm_86's opt-in to head_dim 128, an H100's beyond
                ASSERT_LE(p.smem_bytes, head_dim <= 128 ? kSmemOptinMin : kSmemOptinH100);
            }
          }
        }
      }
    }
  }
}

// The f32/f16 attention kernels' SelfExtend arithmetic, run on the host: the row turned by the
// query's shift and the key by its own, dotted, equal the reference's single turn of the key by
// their difference, at positions up to 10M (the half-turn reduction keeps the angles exact).
// The kernels' view of a retrieval selection (attention.cuh: sel_listed, rows_seeing) sees
// exactly the (query, KV head, key) triples attn_selection::sees lists: host code, so it runs
// without a GPU.
TEST(CudaSelection, device_view_sees_what_the_host_selection_lists) {
  std::mt19937 rng(53);
  for (int lists : {1, 3}) {
    constexpr int kRows = 8, kGroup = 3;  // rows (query, head) of one KV head; 3 heads per query
    const int64_t n_q = 5;
    attn_selection s;
    s.lists_per_query = lists;
    s.offsets.push_back(0);
    std::bernoulli_distribution pick(0.4);
    for (int64_t l = 0; l < n_q * lists; ++l) {
      for (int64_t u = -2; u < 40; ++u)
        if (pick(rng)) s.units.push_back(u);
      s.offsets.push_back((int64_t)s.units.size());
    }
    const cuda::attn_sel_view v{s.offsets.data(), s.units.data(), lists};
    for (int g = 0; g < 3; ++g) {
      for (int64_t r0 = 0; r0 < n_q * kGroup; r0 += kRows) {
        int pos[kRows];
        int64_t list[kRows];
        const int n_rows = (int)std::min<int64_t>(kRows, n_q * kGroup - r0);
        for (int r = 0; r < kRows; ++r) {
          const int64_t i = std::min<int64_t>((r0 + r) / kGroup, n_q - 1);
          pos[r] = 900 + 1500 * (int)i;
          list[r] = cuda::sel_list(v, i, g);
        }
        for (int kvp = -600; kvp < 40 * cuda::attn_unit; kvp += 37) {
          const unsigned seen = cuda::rows_seeing<kRows>(v, true, pos, list, n_rows, true, kvp);
          for (int r = 0; r < kRows; ++r) {
            const int64_t i = (r0 + r) / kGroup;
            const bool want = r < n_rows && kvp <= pos[r] && s.sees(i, g, attn_unit_of(kvp));
            ASSERT_EQ(((seen >> r) & 1u) != 0, want) << "lists " << lists << " g " << g << " row " << r0 + r
                                                      << " key " << kvp;
          }
          ASSERT_EQ(cuda::rows_seeing<kRows>(v, true, pos, list, n_rows, false, kvp), 0u);  // padding lane
        }
      }
    }
  }
}

TEST(CudaSelfExtend, turned_rows_and_keys_score_like_the_reference) {
  std::mt19937 rng(20261127);
  for (auto [n_rot, scaling] : {std::pair{64, rope_scaling::rope_scaling_none}, std::pair{48, rope_scaling::rope_scaling_linear},
                                std::pair{64, rope_scaling::rope_scaling_ntk}}) {
    rope_config cfg;
    cfg.head_dim = 64, cfg.n_rot = n_rot, cfg.scaling = scaling, cfg.scaling_factor = 2.0f;
    double w[cuda::attn_max_head_dim / 2], pos_div = 1.0;
    cuda::kvq_rope_setup(cfg, w, pos_div);
    for (auto [G, W] : {std::pair{4, 1024}, std::pair{256, 1024}, std::pair{2048, 4096}, std::pair{3, 50}}) {
      cfg.se_group = G, cfg.se_window = W;
      for (int32_t i : {W + 1, 70000, 1 << 20, 10 << 20}) {
        for (int32_t p : {0, 1, G - 1, i / 2, i - W}) {
          SCOPED_TRACE(testing::Message() << "n_rot " << n_rot << " G " << G << " W " << W << " i " << i << " p " << p);
          ASSERT_TRUE(cuda::se_grouped(i, i - W, W));
          ASSERT_FALSE(cuda::se_grouped(i, i - W + 1, W));
          if (!cuda::se_grouped(i, p, W)) continue;  // a near key: scored as it is
          ASSERT_EQ(cuda::se_key_shift(p, G), self_extend_key_pos(cfg, p) - p);
          ASSERT_EQ(cuda::se_query_shift(i, G, W), self_extend_query_pos(cfg, i) - i);
          const std::vector<float> q = uniform(64, -1, 1, rng), k = uniform(64, -1, 1, rng);
          std::vector<float> qf = q, kf = k;
          const double a = (double)cuda::se_query_shift(i, G, W) / pos_div, b = (double)cuda::se_key_shift(p, G) / pos_div;
          double got = 0.0, bound = 0.0;
          for (int d = 0; d < 64; d += 2) {
            if (d / 2 < n_rot / 2) cuda::kvq_rotate_pair(qf.data() + d, a * w[d / 2]), cuda::kvq_rotate_pair(kf.data() + d, b * w[d / 2]);
            got += (double)qf[d] * kf[d] + (double)qf[d + 1] * kf[d + 1];
            bound += std::hypot(q[d], q[d + 1]) * std::hypot(k[d], k[d + 1]);
          }
          const std::vector<double> kd(k.begin(), k.end());
          const double want = ref::rope_score(q.data(), kd.data(), cfg, i, p);
          EXPECT_NEAR(got, want, 8 * kEps * bound);
        }
      }
    }
  }
}

// ---- device: matmul ----------------------------------------------------------------------

struct matmul_case {
  ggml_type type;
  int64_t n_rows, n_cols, n_tok;
  bool tf32 = true;  // only matters for the GEMM path (n_tok > 32)
  std::string name() const {
    return type_name(type) + "_" + std::to_string(n_rows) + "x" + std::to_string(n_cols) + "_t" +
           std::to_string(n_tok) + (tf32 ? "" : "_fp32");
  }
};

std::vector<matmul_case> matmul_cases() {
  std::vector<matmul_case> cs;
  for (ggml_type t : kAllTypes)
    for (int64_t nt : {1, 5, 40}) cs.push_back({t, 48, 512, nt});
  // SmolLM2-135M: q/o, k/v, gate/up, down; decode, a fused multi-pass batch, prefill.
  for (auto [r, c] : {std::pair{576, 576}, {192, 576}, {1536, 576}, {576, 1536}})
    for (int64_t nt : {1, 8, 13, 100}) cs.push_back({ggml_type::ggml_q4_1, r, c, nt});
  cs.push_back({ggml_type::ggml_q8_0, 49152, 576, 1});  // tied output / embedding
  cs.push_back({ggml_type::ggml_q8_0, 4096, 576, 33});
  // Plain types with a row length that defeats the vector paths.
  cs.push_back({ggml_type::ggml_f32, 100, 70, 3});
  cs.push_back({ggml_type::ggml_f32, 100, 70, 40});
  cs.push_back({ggml_type::ggml_f16, 96, 130, 2});
  cs.push_back({ggml_type::ggml_bf16, 64, 576, 7});
  // Exact-fp32 GEMM path.
  cs.push_back({ggml_type::ggml_q4_0, 256, 512, 64, false});
  cs.push_back({ggml_type::ggml_f32, 256, 512, 64, false});
  return cs;
}

void PrintTo(const matmul_case& c, std::ostream* os) { *os << c.name(); }

class CudaMatmul : public testing::TestWithParam<matmul_case> {};

TEST_P(CudaMatmul, MatchesReference) {
  XCTX_REQUIRE_CUDA();
  const matmul_case c = GetParam();
  const uint32_t seed = seed_of(c.name());
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const std::vector<uint8_t> wbytes = make_weight(c.type, c.n_rows, c.n_cols, rng);
  const std::vector<float> x = uniform((size_t)(c.n_tok * c.n_cols), -1.0f, 1.0f, rng);  // [n_tok, n_cols]

  if (!c.tf32) setenv("XCTX_CUDA_TF32", "0", 1);  // read when the backend is created
  backends be;
  unsetenv("XCTX_CUDA_TF32");
  std::vector<float> y[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  for (int b = 0; b < 2; ++b) {
    buffer w(*list[b], wbytes), xd(*list[b], x), yd(*list[b], (size_t)(c.n_tok * c.n_rows) * sizeof(float));
    const weight_view wv{c.type, c.n_rows, c.n_cols, w.as<void>()};
    list[b]->matmul(wv, xd.as<float>(), c.n_tok, yd.as<float>());
    y[b] = yd.read<float>((size_t)(c.n_tok * c.n_rows));
  }

  // sum_c |w_rc x_tc| with the reference's decoded weights.
  const bool gemm = c.n_tok > 32;
  const double rel = gemm ? (double)(c.n_cols + 2) * kEps + (c.tf32 ? kTf32Operands : 0.0)
                          : (double)(c.n_cols / 8 + 6) * kEps;
  std::vector<float> wrow((size_t)c.n_cols);  // [n_cols]
  std::vector<double> tol(y[0].size());
  const size_t rb = ggml_row_bytes(c.type, c.n_cols);
  for (int64_t r = 0; r < c.n_rows; ++r) {
    ref::dequantize_row(c.type, wbytes.data() + (size_t)r * rb, wrow.data(), c.n_cols);
    for (int64_t t = 0; t < c.n_tok; ++t) {
      double s = 0.0;
      for (int64_t k = 0; k < c.n_cols; ++k) s += std::fabs((double)wrow[(size_t)k] * x[(size_t)(t * c.n_cols + k)]);
      const size_t i = (size_t)(t * c.n_rows + r);
      tol[i] = rel * s + kEps * std::fabs(y[0][i]);
    }
  }
  expect_close(y[1], y[0], tol, c.name());
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaMatmul, testing::ValuesIn(matmul_cases()),
                         [](const testing::TestParamInfo<matmul_case>& i) { return i.param.name(); });

// ---- device: get_rows --------------------------------------------------------------------

class CudaGetRows : public testing::TestWithParam<ggml_type> {};

TEST_P(CudaGetRows, BitEqualToReference) {
  XCTX_REQUIRE_CUDA();
  const ggml_type t = GetParam();
  const bool embd = t == ggml_type::ggml_q8_0;  // SmolLM2's token_embd: 49152 x 576
  const int64_t n_rows = embd ? 49152 : 40, n_cols = embd ? 576 : 512;
  const uint32_t seed = seed_of("get_rows" + type_name(t));
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const std::vector<uint8_t> wbytes = make_weight(t, n_rows, n_cols, rng);
  const std::vector<int32_t> ids = {0, (int32_t)n_rows - 1, 7, 7, (int32_t)(n_rows / 2), 1};  // [n]
  backends be;
  std::vector<float> out[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  for (int b = 0; b < 2; ++b) {
    buffer w(*list[b], wbytes), idd(*list[b], ids), od(*list[b], ids.size() * n_cols * sizeof(float));
    list[b]->get_rows({t, n_rows, n_cols, w.as<void>()}, idd.as<int32_t>(), (int64_t)ids.size(), od.as<float>());
    out[b] = od.read<float>(ids.size() * n_cols);
  }
  ASSERT_EQ(out[0].size(), out[1].size());
  for (size_t i = 0; i < out[0].size(); ++i)
    ASSERT_EQ(float_to_bits(out[1][i]), float_to_bits(out[0][i])) << type_name(t) << " element " << i;
}

INSTANTIATE_TEST_SUITE_P(AllTypes, CudaGetRows, testing::ValuesIn(kAllTypes),
                         [](const testing::TestParamInfo<ggml_type>& i) { return type_name(i.param); });

TEST(CudaErrors, BadInputIsReported) {
  XCTX_REQUIRE_CUDA();
  backends be;
  backend& cu = *be.cuda;
  // Out-of-range row id: only the device sees it; reported at the next synchronizing call.
  std::mt19937 rng(1);
  const std::vector<uint8_t> wbytes = make_weight(ggml_type::ggml_q4_1, 4, 64, rng);
  const std::vector<int32_t> ids = {1, 4};
  buffer w(cu, wbytes), idd(cu, ids), od(cu, 2 * 64 * sizeof(float));
  cu.get_rows({ggml_type::ggml_q4_1, 4, 64, w.as<void>()}, idd.as<int32_t>(), 2, od.as<float>());
  EXPECT_THROW(cu.synchronize(), Error);
  EXPECT_NO_THROW(cu.synchronize()) << "the error is reported once";

  // Decreasing kv positions inside a scanned tile.
  const int hd = 64;
  const std::vector<float> q = uniform(hd, -1, 1, rng), kv = uniform(4 * hd, -1, 1, rng);
  const std::vector<int32_t> q_pos = {10}, kv_pos = {0, 5, 3, 7};
  buffer qd(cu, q), kd(cu, kv), vd(cu, kv), qp(cu, q_pos), kp(cu, kv_pos), o(cu, hd * sizeof(float)),
      lse(cu, sizeof(float));
  attn_args a;
  a.q = qd.as<float>(), a.q_pos = qp.as<int32_t>(), a.n_q = 1;
  a.k = kd.as<void>(), a.v = vd.as<void>(), a.kv_pos = kp.as<int32_t>(), a.n_kv = 4;
  a.n_head = a.n_head_kv = 1, a.head_dim = hd, a.scale = 0.125f, a.o = o.as<float>(), a.lse = lse.as<float>();
  cu.attention_partial(a);
  EXPECT_THROW(cu.synchronize(), Error);

  // Host-visible bad arguments throw at the call.
  a.head_dim = 300;
  EXPECT_THROW(cu.attention_partial(a), Error);
  EXPECT_THROW(cu.matmul({ggml_type::ggml_q4_1, 4, 63, w.as<void>()}, o.as<float>(), 1, o.as<float>()), Error);
}

TEST(CudaMemory, RoundTripAndEdgeCases) {
  XCTX_REQUIRE_CUDA();
  backends be;
  backend& cu = *be.cuda;
  EXPECT_EQ(cu.name(), "cuda");
  void* z = cu.alloc(0);
  EXPECT_NE(z, nullptr);
  cu.free(z);
  cu.free(nullptr);
  std::vector<uint8_t> host(1 << 20);
  for (size_t i = 0; i < host.size(); ++i) host[i] = (uint8_t)(i * 131 + 7);
  buffer b(cu, host);
  EXPECT_EQ(b.read<uint8_t>(host.size()), host);
}

// ---- device: elementwise -----------------------------------------------------------------

struct rows_case {
  int64_t n_tok, dim;
  bool in_place;
  std::string name() const {
    return std::to_string(n_tok) + "x" + std::to_string(dim) + (in_place ? "_inplace" : "");
  }
};

void PrintTo(const rows_case& c, std::ostream* os) { *os << c.name(); }

class CudaRmsNorm : public testing::TestWithParam<rows_case> {};

TEST_P(CudaRmsNorm, MatchesReference) {
  XCTX_REQUIRE_CUDA();
  const rows_case c = GetParam();
  const uint32_t seed = seed_of("rms" + c.name());
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const std::vector<float> x = uniform((size_t)(c.n_tok * c.dim), -3, 3, rng);  // [n_tok, dim]
  const std::vector<float> w = uniform((size_t)c.dim, 0.5f, 1.5f, rng);          // [dim]
  backends be;
  std::vector<float> y[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  for (int b = 0; b < 2; ++b) {
    buffer xd(*list[b], x), wd(*list[b], w), yd(*list[b], x.size() * sizeof(float));
    float* out = c.in_place ? xd.as<float>() : yd.as<float>();
    list[b]->rms_norm(xd.as<float>(), wd.as<float>(), c.n_tok, c.dim, 1e-5f, out);
    y[b] = (c.in_place ? xd : yd).read<float>(x.size());
  }
  std::vector<double> tol(y[0].size());
  for (size_t i = 0; i < tol.size(); ++i) tol[i] = (double)(c.dim / 256 + 12) * kEps * std::fabs(y[0][i]) + FLT_MIN;
  expect_close(y[1], y[0], tol, "rms_norm " + c.name());
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRmsNorm,
                         testing::Values(rows_case{1, 576, false}, rows_case{7, 576, true}, rows_case{3, 1536, false},
                                         rows_case{2, 4096, false}, rows_case{5, 1000, true}, rows_case{64, 576, false}),
                         [](const testing::TestParamInfo<rows_case>& i) { return i.param.name(); });

struct rope_case {
  int64_t n_tok;
  int n_head;
  rope_config cfg;
  int32_t max_pos;
  std::string name;
};

void PrintTo(const rope_case& c, std::ostream* os) { *os << c.name; }

class CudaRope : public testing::TestWithParam<rope_case> {};

TEST_P(CudaRope, MatchesReference) {
  XCTX_REQUIRE_CUDA();
  const rope_case c = GetParam();
  const uint32_t seed = seed_of("rope" + c.name);
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const int hd = c.cfg.head_dim;
  const std::vector<float> x = uniform((size_t)(c.n_tok * c.n_head * hd), -2, 2, rng);  // [n_tok, n_head, hd]
  std::vector<int32_t> pos((size_t)c.n_tok);                                            // [n_tok]
  std::uniform_int_distribution<int32_t> up(0, c.max_pos);
  for (auto& p : pos) p = up(rng);
  pos[0] = 0, pos.back() = c.max_pos;
  backends be;
  std::vector<float> y[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  for (int b = 0; b < 2; ++b) {
    buffer xd(*list[b], x), pd(*list[b], pos);
    list[b]->rope(xd.as<float>(), pd.as<int32_t>(), c.n_tok, c.n_head, c.cfg);
    y[b] = xd.read<float>(x.size());
  }
  std::vector<double> tol(x.size(), 0.0);  // pass-through dimensions must be untouched
  for (int64_t t = 0; t < c.n_tok; ++t)
    for (int h = 0; h < c.n_head; ++h)
      for (int i = 0; i < c.cfg.n_rot / 2; ++i) {
        const size_t e = (size_t)((t * c.n_head + h) * hd + 2 * i);
        const double theta = std::fabs(ref::rope_theta(c.cfg, pos[(size_t)t], i));
        const double mag = std::fabs(x[e]) + std::fabs(x[e + 1]);
        tol[e] = tol[e + 1] = mag * (2 * kEps + 8 * kDoubleUlp * theta);
      }
  expect_close(y[1], y[0], tol, "rope " + c.name);
}

rope_config rope_cfg(int hd, int n_rot, float base, rope_scaling s, float factor) {
  rope_config c;
  c.head_dim = hd, c.n_rot = n_rot, c.freq_base = base, c.scaling = s, c.scaling_factor = factor;
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CudaRope,
    testing::Values(
        rope_case{17, 9, rope_cfg(64, 64, 1e5f, rope_scaling::rope_scaling_none, 1), 8191, "smollm2_q"},
        rope_case{17, 3, rope_cfg(64, 64, 1e5f, rope_scaling::rope_scaling_none, 1), 8191, "smollm2_k"},
        rope_case{5, 4, rope_cfg(128, 64, 1e4f, rope_scaling::rope_scaling_linear, 4), 100000, "partial_linear"},
        rope_case{9, 2, rope_cfg(128, 128, 5e5f, rope_scaling::rope_scaling_ntk, 8), 1000000, "ntk_1M"},
        rope_case{3, 1, rope_cfg(64, 64, 1e4f, rope_scaling::rope_scaling_none, 1), 2000000000, "pos_2e9"}),
    [](const testing::TestParamInfo<rope_case>& i) { return i.param.name; });

class CudaPointwise : public testing::TestWithParam<int64_t> {};

TEST_P(CudaPointwise, SwigluAndAddMatchReference) {
  XCTX_REQUIRE_CUDA();
  const int64_t n = GetParam();
  const uint32_t seed = seed_of("pointwise" + std::to_string(n));
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::vector<float> gate = uniform((size_t)n, -12, 12, rng), up = uniform((size_t)n, -3, 3, rng);  // [n]
  const float extremes[] = {-100.0f, -88.0f, -20.0f, 0.0f, 20.0f, 100.0f};
  for (size_t i = 0; i < std::size(extremes) && i < gate.size(); ++i) gate[i] = extremes[i];
  backends be;
  std::vector<float> sw[2], sum[2];
  backend* list[2] = {be.ref.get(), be.cuda.get()};
  for (int b = 0; b < 2; ++b) {
    buffer g(*list[b], gate), u(*list[b], up), o(*list[b], gate.size() * sizeof(float));
    list[b]->swiglu(g.as<float>(), u.as<float>(), n, o.as<float>());
    sw[b] = o.read<float>((size_t)n);
    list[b]->add(g.as<float>(), u.as<float>(), n);
    sum[b] = g.read<float>((size_t)n);
  }
  std::vector<double> tol((size_t)n);
  for (size_t i = 0; i < tol.size(); ++i) tol[i] = 8 * kEps * std::fabs(sw[0][i]) + FLT_MIN;
  expect_close(sw[1], sw[0], tol, "swiglu");
  expect_close(sum[1], sum[0], std::vector<double>((size_t)n, 0.0), "add");
}

INSTANTIATE_TEST_SUITE_P(Lengths, CudaPointwise, testing::Values(1, 1537, 1536 * 7),
                         [](const testing::TestParamInfo<int64_t>& i) { return "n" + std::to_string(i.param); });

}  // namespace
}  // namespace xctx
