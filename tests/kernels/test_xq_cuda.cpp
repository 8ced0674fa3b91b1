// The CUDA kernels of the X caches (kernels/cuda/xq.cu).
// Host suites (XqCudaHost*, what this CPU-only CI runs): the contraction-free calibration, the
// first-of-equal min/max reduction in the device's tree order, the launch plans (coverage,
// shared-memory layout and budget), and the whole attention block of xq.cuh emulated on the
// CPU phase by phase (every block of the grid, split partials merged by ref::merge_partials,
// then the projection) against ref::attention_xq.
// Device suites (XqCudaDevice*) GTEST_SKIP without a usable CUDA device: encode bytes equal to
// ref::xq_encode for both axes, bits 1..4, with and without calibration and codes, from f32 or
// fp16 rows, with the fp16 first channel; attention against ref::attention_xq for the cases of
// the host emulation; the row products (latents x·U, acc += z·Uᵀ) and decoded rows against ref
// with derived bounds.
//
// Tolerance of an attention output (eps = FLT_EPSILON; each term overestimates its error by the
// factor 2 of eps vs the unit roundoff):
//   decode     the device may fuse code*scale + zero: |dz| <= eps P, P = max (2^b - 1) scale
//   K rebuild  FMA chain over C_k channels plus b_k: dk0 <= eps P_k |M_k|_1 + (C_k + 2) eps K_max,
//              K_max = Z_k,max |M_k|_1 + |b_k|_max, |M|_1 = max column sum of |M| (1: identity)
//   RoPE       dk <= 2 dk0 + (kvq_rope_cs_err + kRopeRotEps eps) 2 K_max   (kvq.cuh's bound)
//   scores     ds <= scale Q_1 ((hd + 2) eps K_max + dk), Q_1 = max row sum of |q|
//   output     tol_o = V_max (4 ds + (2 n + 16) eps) + |M_v|_1 (eps P_v + (C_v + 2) eps Z_v,max)
//                      + eps |o|,   V_max = Z_v,max |M_v|_1 + |b_v|_max, n = visible rows
//   lse        tol_lse = 2 ds + (n + 8) eps (1 + |lse|)
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/half.h"
#include "kernels/cuda/xq.cuh"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"
#include "kernels/x_quant.h"

#if XCTX_USE_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#include "kernels/cuda/kernels.cuh"
#include "registry/registry.h"
#include "require_gpu.h"  // XCTX_REQUIRE_CUDA
#endif

namespace xctx {
namespace {

using namespace xctx::cuda;

constexpr double kEps = FLT_EPSILON;
constexpr double kRopeRotEps = 2.0;  // in eps: float rotation + the reference's rounding
constexpr float kInf = std::numeric_limits<float>::infinity();


// ---- host: encode pieces ----------------------------------------------------------------------

TEST(XqCudaHost, calibrate_without_contraction_matches_xq_calibrate) {
  const uint32_t seed = 31;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ue(0.0f, 0.49f);
  for (int it = 0; it < 20000; ++it) {
    const kvq_affine p{fp32_to_fp16(std::fabs(nd(rng))), fp32_to_fp16(nd(rng) * 4.0f)};
    const int bits = 1 + it % kXqMaxBits;
    const float eta = it % 7 == 0 ? 0.0f : ue(rng);
    const kvq_affine a = xq_calibrate_nc(p, bits, eta), b = xq_calibrate(p, bits, eta);
    ASSERT_TRUE(a.scale == b.scale && a.zero == b.zero) << "it " << it << " eta " << eta << " bits " << bits;
  }
}

// The device's reduction order: lane-strided partial extremes, then the xor butterfly.
std::pair<xq_extreme, xq_extreme> tree_extremes(const std::vector<float>& x) {
  xq_extreme lo[32], hi[32];
  for (int l = 0; l < 32; ++l) {
    lo[l] = hi[l] = {0.0f, -1};
    for (int c = l; c < (int)x.size(); c += 32) lo[l] = xq_pick_min(lo[l], {x[c], c}), hi[l] = xq_pick_max(hi[l], {x[c], c});
  }
  for (int o = 16; o > 0; o >>= 1) {
    xq_extreme nlo[32], nhi[32];
    for (int l = 0; l < 32; ++l) nlo[l] = xq_pick_min(lo[l], lo[l ^ o]), nhi[l] = xq_pick_max(hi[l], hi[l ^ o]);
    std::copy(nlo, nlo + 32, lo), std::copy(nhi, nhi + 32, hi);
  }
  return {lo[0], hi[0]};
}

TEST(XqCudaHost, tree_min_max_keeps_the_sequential_first_of_equal) {
  const uint32_t seed = 32;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (int it = 0; it < 400; ++it) {
    const int n = 1 + it % 97;
    std::vector<float> x(n);
    for (float& v : x) v = std::round(nd(rng) * 2.0f) / 2.0f;  // coarse: many ties
    for (int c = it % 3; c < n; c += 5) x[c] = (c / 5) % 2 ? -0.0f : 0.0f;
    float lo = x[0], hi = x[0];
    for (int c = 1; c < n; ++c) lo = std::min(lo, x[c]), hi = std::max(hi, x[c]);
    const auto [tlo, thi] = tree_extremes(x);
    ASSERT_EQ(float_to_bits(tlo.v), float_to_bits(lo)) << "it " << it;
    ASSERT_EQ(float_to_bits(thi.v), float_to_bits(hi)) << "it " << it;
  }
}

TEST(XqCudaHost, encode_plan_covers_rows_and_groups) {
  const xq_encode_plan t = plan_xq_encode(xq_axis::xq_per_token, 200, 64, 1000, 4);
  EXPECT_EQ(t.blocks_x, 32u);
  EXPECT_EQ(t.smem_bytes, 4 * sizeof(kvq_affine));  // ceil(200 / 64) groups
  const xq_encode_plan c = plan_xq_encode(xq_axis::xq_per_channel, 200, 32, 96, 4);
  EXPECT_EQ(c.blocks_x, 2u);
  EXPECT_EQ(c.blocks_y, 3u);
  EXPECT_EQ(plan_xq_encode(xq_axis::xq_per_token, 200, 64, 0, 4).blocks_x, 0u);
}

// ---- host: attention plan ---------------------------------------------------------------------

TEST(XqCudaHost, attention_plan_layout_fits_and_splits_cover_the_stream) {
  struct shape {
    int64_t n_q, n;
    int n_head, n_head_kv, hd, n_rot, wv;
  };
  const shape shapes[] = {{1, 5000, 9, 3, 64, 64, 192}, {40, 700, 6, 2, 32, 16, 96}, {1, 100, 32, 32, 128, 128, 128},
                          {2, 9000, 32, 32, 128, 128, 4096}, {64, 20000, 9, 3, 64, 64, 576}};
  for (const shape& s : shapes) {
    for (size_t cap : {size_t(48) << 10, size_t(227) << 10})
      for (bool se : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "n_q " << s.n_q << " n " << s.n << " wv " << s.wv << " cap " << cap
                                          << " se " << se);
        const xq_attn_plan p = plan_xq_attention(s.n_q, s.n, s.n_head, s.n_head_kv, s.hd, s.n_rot, s.wv, 108, cap, se);
        if (p.smem_bytes > cap) {  // hd 128 tiles alone take ~49 KiB: only opt-in devices run them
          ASSERT_EQ(p.R, 1);
          ASSERT_LT(cap, size_t(227) << 10);
        }
        ASSERT_GE(p.R, 1);
        ASSERT_LE(p.R, xq_max_rows);
        ASSERT_GE(p.row_blocks * p.R, p.rows_total);
        ASSERT_LT((p.row_blocks - 1) * p.R, p.rows_total);
        ASSERT_EQ(p.chunk % xq_tile, 0);
        ASSERT_GE(p.chunk * p.n_split, s.n);
        ASSERT_LT(p.chunk * (p.n_split - 1), std::max<int64_t>(s.n, 1));
        ASSERT_EQ(p.k_stride % 2, 1);
        // Regions in order, 16-byte aligned, none overlapping the next.
        const size_t offs[] = {p.off_w, p.off_pos_eff, p.off_q,     p.off_k, p.off_zc, p.off_mk,      p.off_bk,
                               p.off_s, p.off_alpha,   p.off_m,     p.off_l, p.off_u,  p.off_row_pos, p.off_pos};
        const size_t sizes[] = {p.n_pair * 8u,          xq_tile * 8u,         (size_t)p.R * p.hd * 4,
                                (size_t)xq_tile * p.k_stride * 4, (size_t)xq_tile * p.zc_stride * 4,
                                (size_t)xq_kc * p.hd * 4, (size_t)p.hd * 4,   (size_t)p.R * xq_tile * 4,
                                p.R * 4u,               p.R * 4u,             p.R * 4u,
                                (size_t)p.R * p.wv * 4, p.R * 4u,             xq_tile * 4u};
        std::vector<std::pair<size_t, size_t>> regions;
        for (size_t r = 0; r < std::size(offs); ++r) regions.push_back({offs[r], sizes[r]});
        if (se) {  // SelfExtend's turned rows and grouped K tile, after the others
          regions.push_back({p.off_qf, (size_t)p.R * p.hd * 4});
          regions.push_back({p.off_kf, (size_t)xq_tile * p.k_stride * 4});
        }
        for (size_t r = 0; r < regions.size(); ++r) {
          ASSERT_EQ(regions[r].first % 16, 0u) << r;
          ASSERT_LE(regions[r].first + regions[r].second, r + 1 < regions.size() ? regions[r + 1].first : p.smem_bytes)
              << r;
        }
      }
  }
  // SmolLM2 decode (3 rows per kv head, latents of 192): one block holds the GQA group, and
  // 3 kv heads on 108 SMs split the 5000 rows.
  const xq_attn_plan sm = plan_xq_attention(1, 5000, 9, 3, 64, 64, 192, 108, size_t(227) << 10);
  EXPECT_EQ(sm.R, 3);
  EXPECT_GT(sm.n_split, 1);
  // A window that does not fit even one row: the plan says so (attention_xq turns it into an Error).
  const xq_attn_plan big = plan_xq_attention(1, 100, 8, 8, 64, 64, 60000, 8, size_t(48) << 10);
  EXPECT_EQ(big.R, 1);
  EXPECT_GT(big.smem_bytes, size_t(48) << 10);
}

// ---- test data ---------------------------------------------------------------------------------

struct xq_case {
  const char* name;
  int64_t n_q, n;
  int n_head, n_head_kv, hd, n_rot;
  int ck, cv;         // latent widths; 0 = identity (the stream is K or V itself)
  bool same_stream;   // zv is zk (requires ck == cv)
  bool dense;         // f32 streams
  int bits_k, bits_v, group_k, group_v;
  int64_t nq_k, nq_v;  // quantized rows
  bool ch0, bias;
  float eta;
  int se_group = 1, se_window = 0;  // SelfExtend when se_group > 1
  int select = 0;                   // retrieval selection: 0 none, 1 one list per query, 2 one per KV head
};
void PrintTo(const xq_case& c, std::ostream* os) { *os << c.name; }

const xq_case kCases[] = {
    {"gqa_latent_decode", 1, 300, 9, 3, 64, 64, 96, 96, false, false, 4, 2, 32, 32, 288, 280, true, true, 0.0f},
    {"gqa_latent_prefill", 40, 150, 6, 2, 32, 32, 48, 40, false, false, 3, 4, 16, 8, 144, 150, false, true, 0.0f},
    {"mha_x_same_stream", 3, 200, 4, 4, 32, 16, 128, 128, true, false, 3, 3, 64, 64, 192, 192, false, true, 0.0f},
    {"clkv_identity_calibrated", 2, 180, 4, 2, 32, 32, 0, 0, false, false, 1, 2, 32, 32, 160, 176, false, false,
     0.1f},
    {"dense_latent", 5, 90, 8, 2, 64, 48, 64, 72, false, true, 0, 0, 0, 0, 0, 0, false, true, 0.0f},
    // SelfExtend: windows that put the rows on both sides of tiles; partial rotation; identity
    {"gqa_latent_decode_se", 1, 300, 9, 3, 64, 64, 96, 96, false, false, 4, 2, 32, 32, 288, 280, true, true, 0.0f, 4, 40},
    {"gqa_latent_prefill_se", 40, 150, 6, 2, 32, 32, 48, 40, false, false, 3, 4, 16, 8, 144, 150, false, true, 0.0f, 3,
     25},
    {"mha_x_same_stream_se", 3, 200, 4, 4, 32, 16, 128, 128, true, false, 3, 3, 64, 64, 192, 192, false, true, 0.0f, 16,
     50},
    {"clkv_identity_se", 2, 180, 4, 2, 32, 32, 0, 0, false, false, 1, 2, 32, 32, 160, 176, false, false, 0.1f, 8, 16},
    // Retrieval: random unit lists over a stream of 7 units, far keys at distance W (as it runs).
    {"gqa_latent_decode_sel", 1, 1500, 9, 3, 64, 64, 96, 96, false, false, 4, 2, 32, 32, 1472, 1490, true, true, 0.0f,
     kFixedDistanceGroup, 300, 1},
    {"gqa_latent_prefill_selkv", 40, 1500, 6, 2, 32, 32, 48, 40, false, false, 3, 4, 16, 8, 1488, 1500, false, true,
     0.0f, kFixedDistanceGroup, 200, 2},
    {"clkv_identity_selkv", 2, 1200, 4, 2, 32, 32, 0, 0, false, false, 1, 2, 32, 32, 1184, 1190, false, false, 0.1f,
     1, 0, 2},
};

struct host_stream {
  xq_axis axis;
  int C = 0, bits = 0, group = 0;
  int64_t nq = 0;
  std::vector<uint8_t> codes;
  std::vector<kvq_affine> params;
  std::vector<uint16_t> tail, ch0;
  std::vector<float> dense;
  xq_stream view() const {
    xq_stream s;
    s.axis = axis, s.channels = C, s.bits = bits, s.group = group, s.nq = nq;
    if (!dense.empty()) {
      s.dense = dense.data();
      return s;
    }
    s.codes = codes.data(), s.params = params.data(), s.tail = tail.data();
    s.ch0 = ch0.empty() ? nullptr : ch0.data();
    return s;
  }
};

host_stream make_stream(xq_axis axis, int C, int bits, int group, int64_t n, int64_t nq, bool ch0, bool dense,
                        float eta, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x((size_t)n * C);
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) x[t * C + c] = nd(rng) * (c == 0 ? 6.0f : 1.0f + 0.02f * (c % 17));
  host_stream s;
  s.axis = axis, s.C = C, s.bits = bits, s.group = group, s.nq = nq;
  if (dense) {
    s.dense = x;
    return s;
  }
  s.codes.resize((size_t)nq * kvq_row_bytes(C, bits));
  s.params.resize(axis == xq_axis::xq_per_channel ? (size_t)(nq / group) * C : (size_t)nq * ((C + group - 1) / group));
  xq_encode_job j;
  j.axis = axis, j.bits = bits, j.channels = C, j.group = group, j.eta = eta, j.n = nq, j.x = x.data();
  j.codes = s.codes.data(), j.params = s.params.data();
  ref::xq_encode(j);
  for (int64_t t = nq; t < n; ++t)
    for (int c = 0; c < C; ++c) s.tail.push_back(fp32_to_fp16(x[t * C + c]));
  if (s.tail.empty()) s.tail.push_back(0);  // a valid pointer even when every row is quantized
  if (ch0)
    for (int64_t t = 0; t < nq; ++t) s.ch0.push_back(fp32_to_fp16(x[t * C]));
  return s;
}

struct host_problem {
  xq_case c;
  host_stream zk, zv;
  std::vector<float> m_k, m_v, b_k, b_v, q;
  std::vector<int32_t> pos, q_pos;
  rope_config rope;
  attn_selection sel;  // c.select > 0
  int kv = 0;
  xq_attn_args args(float* o, float* lse) const {
    xq_attn_args a;
    a.n = c.n, a.pos = pos.data(), a.zk = zk.view(), a.zv = c.same_stream ? zk.view() : zv.view();
    a.same_stream = c.same_stream;
    a.m_k = m_k.empty() ? nullptr : m_k.data(), a.ld_mk = kv;
    a.m_v = m_v.empty() ? nullptr : m_v.data(), a.ld_mv = kv;
    a.b_k = b_k.empty() ? nullptr : b_k.data(), a.b_v = b_v.empty() ? nullptr : b_v.data();
    a.q = q.data(), a.q_pos = q_pos.data(), a.n_q = c.n_q;
    a.n_head = c.n_head, a.n_head_kv = c.n_head_kv, a.head_dim = c.hd;
    a.scale = 1.0f / std::sqrt((float)c.hd), a.rope = rope, a.o = o, a.lse = lse;
    if (c.select > 0) a.select = &sel;
    return a;
  }
};

host_problem make_problem(const xq_case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  host_problem P;
  P.c = c;
  P.kv = c.n_head_kv * c.hd;
  const int ck = c.ck ? c.ck : P.kv, cv = c.cv ? c.cv : P.kv;
  P.zk = make_stream(xq_axis::xq_per_channel, ck, c.bits_k, c.group_k, c.n, c.nq_k, c.ch0, c.dense, c.eta, rng);
  if (!c.same_stream)
    P.zv = make_stream(xq_axis::xq_per_token, cv, c.bits_v, c.group_v, c.n, c.nq_v, false, c.dense, c.eta, rng);
  auto mat = [&](int r) {
    std::vector<float> m((size_t)r * P.kv);
    for (float& v : m) v = nd(rng) / std::sqrt((float)r);
    return m;
  };
  if (c.ck) P.m_k = mat(ck);
  if (c.cv) P.m_v = mat(cv);
  if (c.bias) {
    P.b_k.resize(P.kv), P.b_v.resize(P.kv);
    for (float& v : P.b_k) v = nd(rng) * 0.5f;
    for (float& v : P.b_v) v = nd(rng) * 0.5f;
  }
  P.q.resize((size_t)c.n_q * c.n_head * c.hd);
  for (float& v : P.q) v = nd(rng);
  for (int64_t t = 0; t < c.n; ++t) P.pos.push_back((int32_t)(3 + t + t / 7));  // ascending with gaps
  for (int64_t i = 0; i < c.n_q; ++i)  // first query sees nothing when n_q > 2, the last sees all
    P.q_pos.push_back(c.n_q > 2 && i == 0 ? 1 : P.pos[(size_t)((c.n - 1) * (i + 1) / c.n_q)]);
  P.rope.head_dim = c.hd, P.rope.n_rot = c.n_rot, P.rope.freq_base = 1e5f;
  P.rope.se_group = c.se_group, P.rope.se_window = c.se_window;
  if (c.select > 0) {  // each list holds each unit up to its query's with probability 1/2
    P.sel.lists_per_query = c.select == 1 ? 1 : c.n_head_kv;
    P.sel.offsets.push_back(0);
    std::bernoulli_distribution pick(0.5);
    for (int64_t i = 0; i < c.n_q; ++i)
      for (int l = 0; l < P.sel.lists_per_query; ++l) {
        for (int64_t u = 0; u <= attn_unit_of(P.q_pos[(size_t)i]); ++u)
          if (pick(rng)) P.sel.units.push_back(u);
        P.sel.offsets.push_back((int64_t)P.sel.units.size());
      }
  }
  return P;
}

// ---- tolerance ---------------------------------------------------------------------------------

struct stream_mag {
  double z_max = 0, p = 0;
};
stream_mag magnitude(const xq_stream& s, int64_t n) {
  stream_mag m;
  std::vector<float> z((size_t)n * s.channels);
  ref::xq_decode_rows(s, 0, n, z.data());
  for (float v : z) m.z_max = std::max(m.z_max, (double)std::fabs(v));
  if (s.dense == nullptr) {
    const size_t n_par = s.axis == xq_axis::xq_per_channel ? (size_t)(s.nq / s.group) * s.channels
                                                           : (size_t)s.nq * s.n_groups_per_row();
    for (size_t i = 0; i < n_par; ++i)
      m.p = std::max(m.p, (double)fp16_to_fp32(s.params[i].scale) * ((1 << s.bits) - 1));
  }
  return m;
}
double col_sum(const float* m, int rows, int64_t ld, int cols) {
  if (m == nullptr) return 1.0;
  double best = 0;
  for (int c = 0; c < cols; ++c) {
    double s = 0;
    for (int r = 0; r < rows; ++r) s += std::fabs(m[r * ld + c]);
    best = std::max(best, s);
  }
  return best;
}
double abs_max(const float* v, int n) {
  double b = 0;
  for (int i = 0; v != nullptr && i < n; ++i) b = std::max(b, (double)std::fabs(v[i]));
  return b;
}

// Compares o/lse with the oracle's, per row with the bound of the header.
void expect_close(const xq_attn_args& a, const std::vector<float>& o, const std::vector<float>& lse,
                  const std::vector<float>& o_ref, const std::vector<float>& lse_ref) {
  const int kv = a.n_head_kv * a.head_dim, hd = a.head_dim;
  const stream_mag mk = magnitude(a.zk, a.n), mv = magnitude(a.zv, a.n);
  const double mk1 = col_sum(a.m_k, a.zk.channels, a.ld_mk, kv), mv1 = col_sum(a.m_v, a.zv.channels, a.ld_mv, kv);
  const double k_max = mk.z_max * mk1 + abs_max(a.b_k, kv), v_max = mv.z_max * mv1 + abs_max(a.b_v, kv);
  const int ck = a.m_k ? a.zk.channels : 1, cv = a.m_v ? a.zv.channels : 1;
  const double dk0 = kEps * mk.p * mk1 + (ck + 2) * kEps * k_max;
  const double dk = 2 * dk0 + (kvq_rope_cs_err + kRopeRotEps * kEps) * 2 * k_max;
  for (int64_t i = 0; i < a.n_q; ++i) {
    for (int h = 0; h < a.n_head; ++h) {
      int64_t n_vis = 0;  // causal and, with a selection, listed for the head's KV head
      for (int64_t t = 0; t < a.n && a.pos[t] <= a.q_pos[i]; ++t)
        n_vis += a.select == nullptr || a.select->sees(i, h / (a.n_head / a.n_head_kv), attn_unit_of(a.pos[t]));
      const int64_t row = i * a.n_head + h;
      double q1 = 0;
      for (int d = 0; d < hd; ++d) q1 += std::fabs(a.q[row * hd + d]);
      // SelfExtend turns q and k pairs (each element of a turned pair within sqrt(2) of the
      // pair's largest) and the query's turn adds its cos/sin and rotation error.
      const double ds = self_extend_on(a.rope) ? 2 * a.scale * q1 * ((hd + 10) * kEps * k_max + dk)
                                               : a.scale * q1 * ((hd + 2) * kEps * k_max + dk);
      if (n_vis == 0) {
        ASSERT_EQ(lse[row], -kInf) << "row " << row;
        for (int d = 0; d < hd; ++d) ASSERT_EQ(o[row * hd + d], 0.0f) << "row " << row;
        continue;
      }
      const double tol_lse = 2 * ds + (n_vis + 8) * kEps * (1 + std::fabs(lse_ref[row]));
      ASSERT_NEAR(lse[row], lse_ref[row], tol_lse) << "row " << row;
      for (int d = 0; d < hd; ++d) {
        const double ref = o_ref[row * hd + d];
        const double tol = v_max * (4 * ds + (2.0 * n_vis + 16) * kEps) + mv1 * (kEps * mv.p + (cv + 2) * kEps * mv.z_max) +
                           kEps * std::fabs(ref);
        ASSERT_NEAR(o[row * hd + d], ref, tol) << "row " << row << " d " << d;
      }
    }
  }
}

// ---- host: the attention block emulated --------------------------------------------------------

// Runs every block of the plan's grid through xq.cuh's phases in the kernel's order, merges the
// split partials, projects: what xq.cu launches, minus the parallelism.
void emulate_attention(const xq_attn_args& a, int n_sm, size_t smem_cap, int* n_split_out) {
  const int wv = a.m_v != nullptr ? a.zv.channels : a.head_dim;
  const bool se = self_extend_on(a.rope);
  const int se_window = se ? a.rope.se_window : -1;
  const xq_attn_plan pl =
      plan_xq_attention(a.n_q, a.n, a.n_head, a.n_head_kv, a.head_dim, a.rope.n_rot, wv, n_sm, smem_cap, se);
  ASSERT_LE(pl.smem_bytes, smem_cap);
  *n_split_out = pl.n_split;
  double w[kvq_max_pairs], pos_div = 0;
  kvq_rope_setup(a.rope, w, pos_div);
  const int64_t n_row = a.n_q * a.n_head;
  std::vector<float> u_parts((size_t)pl.n_split * n_row * wv, std::nanf("")), lse_parts((size_t)pl.n_split * n_row);
  std::vector<double> smem((pl.smem_bytes + 7) / 8);
  const int hd = pl.hd;
  auto items = [](int rows, int per, auto&& f) {
    for (int j = 0; j < rows; ++j)
      for (int i = 0; i < per; ++i) f(j, i);
  };
  for (int z = 0; z < pl.n_split; ++z)
    for (int g = 0; g < a.n_head_kv; ++g)
      for (int64_t b = 0; b < pl.row_blocks; ++b) {
        std::fill(smem.begin(), smem.end(), std::nan(""));  // stale shared memory must not matter
        xq_tile_view t = xq_bind_tile(pl, reinterpret_cast<char*>(smem.data()), g, b);
        t.v_off = a.m_v != nullptr ? 0 : g * hd;
        if (a.select != nullptr)
          t.sel = cuda::attn_sel_view{a.select->offsets.data(), a.select->units.data(), a.select->lists_per_query};
        t.group = a.n_head / a.n_head_kv;
        items(pl.R, hd, [&](int r, int d) { xq_setup_q(a, t, r, d); });
        if (se) items(pl.R, (hd + 1) / 2, [&](int r, int c) { xq_setup_qf(a, t, w, pos_div, r, c); });
        for (int idx = 0; idx < xq_setup_items(pl); ++idx) xq_setup_misc(a, t, w, idx);
        int max_pos = INT32_MIN;
        for (int r = 0; r < t.n_rows; ++r) max_pos = std::max(max_pos, t.row_pos[r]);
        const int64_t j_end = std::min(a.n, (z + 1) * pl.chunk);
        for (int64_t j0 = z * pl.chunk; j0 < j_end; j0 += xq_tile) {
          if (a.pos[j0] > max_pos) break;
          const int nt = (int)std::min<int64_t>(xq_tile, j_end - j0);
          if (sel_on(t.sel)) {  // the kernel's skip: a tile no row lists is not decoded
            bool any = false;
            for (int idx = 0; idx < t.n_rows * nt && !any; ++idx) any = xq_row_sees(t, idx / nt, a.pos[j0 + idx % nt]);
            if (!any) continue;
          }
          t.s0 = j0, t.nt = nt;
          for (int j = 0; j < t.nt; ++j) xq_tile_meta(a, t, pos_div, j);
          items(t.nt, hd, [&](int j, int d) { xq_tile_k_init(a, t, j, d); });
          if (a.m_k != nullptr)
            for (int c0 = 0; c0 < a.zk.channels; c0 += xq_kc) {
              items(xq_tile, xq_kc, [&](int j, int c) { xq_tile_zk_chunk(a, t, c0, j, c); });
              items(xq_kc, hd, [&](int c, int d) { xq_tile_mk_chunk(a, t, c0, c, d); });
              items(t.nt, hd, [&](int j, int d) { xq_tile_k_rebuild(t, j, d); });
            }
          if (se && (int64_t)max_pos - a.pos[j0] >= se_window)
            items(t.nt, (hd + 1) / 2, [&](int j, int c) { xq_tile_rope_grouped(t, a.rope.se_group, pos_div, j, c); });
          else
            items(t.nt, pl.n_pair, [&](int j, int i) { xq_tile_rope(t, j, i); });
          items(t.n_rows, xq_tile, [&](int r, int j) { xq_tile_score(t, r, j, se_window); });
          for (int r = 0; r < t.n_rows; ++r) xq_tile_softmax(t, r);
          for (int c0 = 0; c0 < wv; c0 += xq_vc) {
            items(xq_tile, xq_vc, [&](int j, int c) { xq_tile_zv_chunk(a, t, c0, j, c); });
            items(t.n_rows, std::min(xq_vc, wv - c0), [&](int r, int c) { xq_tile_u_update(t, c0, r, c); });
          }
        }
        items(t.n_rows, wv, [&](int r, int c) {
          xq_tile_finish(a, t, r, c, u_parts.data() + (size_t)z * n_row * wv, lse_parts.data() + (size_t)z * n_row);
        });
      }
  std::vector<float> u((size_t)n_row * wv);
  ref::merge_partials(u_parts.data(), lse_parts.data(), pl.n_split, n_row, wv, u.data(), a.lse);
  for (int64_t row = 0; row < n_row; ++row)
    for (int e = 0; e < a.head_dim; ++e)
      a.o[row * a.head_dim + e] = xq_project_item(a, u.data() + row * wv, a.lse[row], row, e);
}

class XqCudaHostBlock : public ::testing::TestWithParam<xq_case> {};

TEST_P(XqCudaHostBlock, emulated_block_matches_ref_attention_xq) {
  const xq_case c = GetParam();
  const uint32_t seed = 900 + (uint32_t)c.n;
  SCOPED_TRACE(::testing::Message() << c.name << " seed " << seed);
  const host_problem P = make_problem(c, seed);
  const size_t n_out = (size_t)c.n_q * c.n_head;
  std::vector<float> o_ref(n_out * c.hd), lse_ref(n_out);
  ref::attention_xq(P.args(o_ref.data(), lse_ref.data()));
  // A small device (n_sm 1) runs unsplit; a large one splits the rows into partials.
  for (int n_sm : {1, 64}) {
    SCOPED_TRACE(::testing::Message() << "n_sm " << n_sm);
    std::vector<float> o(n_out * c.hd, std::nanf("")), lse(n_out, std::nanf(""));
    const xq_attn_args a = P.args(o.data(), lse.data());
    int n_split = 0;
    emulate_attention(a, n_sm, size_t(96) << 10, &n_split);
    if (n_sm == 1) {
      EXPECT_EQ(n_split, 1);
    } else if (c.n > 2 * xq_min_split_rows) {
      EXPECT_GT(n_split, 1);  // the merge path is exercised
    }
    expect_close(a, o, lse, o_ref, lse_ref);
  }
}

INSTANTIATE_TEST_SUITE_P(cases, XqCudaHostBlock, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- device ------------------------------------------------------------------------------------

#if XCTX_USE_CUDA

// The state one backend instance owns, built here because the X-cache kernels are free
// functions over a cuda::context (no backend entry point yet).
struct device_ctx {
  context c;
  std::vector<void*> bufs;
  device_ctx() {
    CUDA_CHECK(cudaGetDevice(&c.device));
    int v = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, c.device));
    c.n_sm = std::max(1, v);
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, c.device));
    c.smem_optin = (size_t)std::max(v, 48 << 10);
    CUDA_CHECK(cudaStreamCreate(&c.stream));
    CUBLAS_CHECK(cublasCreate(&c.blas));
    CUBLAS_CHECK(cublasSetStream(c.blas, c.stream));
  }
  ~device_ctx() {
    (void)cudaStreamSynchronize(c.stream);
    for (void* p : bufs) (void)cudaFree(p);
    if (c.scratch_ptr != nullptr) (void)cudaFree(c.scratch_ptr);
    (void)cublasDestroy(c.blas);
    (void)cudaStreamDestroy(c.stream);
  }
  template <class T>
  T* up(const std::vector<T>& h) {
    if (h.empty()) return nullptr;
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, h.size() * sizeof(T)));
    bufs.push_back(p);
    CUDA_CHECK(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T*>(p);
  }
  template <class T>
  std::vector<T> down(const T* d, size_t n) {
    CUDA_CHECK(cudaStreamSynchronize(c.stream));
    std::vector<T> h(n);
    if (n > 0) CUDA_CHECK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  xq_stream up(const host_stream& s) {
    xq_stream v = s.view();
    if (v.dense) {
      v.dense = up(s.dense);
      return v;
    }
    v.codes = up(s.codes), v.params = up(s.params), v.tail = up(s.tail), v.ch0 = up(s.ch0);
    return v;
  }
};

struct encode_case {
  std::string name;
  xq_axis axis;
  int bits, channels, group;
  int64_t n;
  float eta;
  bool codes;
  bool x16 = false;  // rows given as fp16 (a cache's residual window)
  bool ch0 = false;  // channel 0 kept fp16 and encoded as 0
};
void PrintTo(const encode_case& c, std::ostream* os) { *os << c.name; }

std::vector<encode_case> encode_cases() {
  std::vector<encode_case> v;
  for (int bits = 1; bits <= kXqMaxBits; ++bits) {
    const std::string b = std::to_string(bits);
    v.push_back({"token_b" + b, xq_axis::xq_per_token, bits, 200, 64, 77, 0.0f, true});
    v.push_back({"token_eta_b" + b, xq_axis::xq_per_token, bits, 576, 32, 40, 0.15f, true});
    v.push_back({"channel_b" + b, xq_axis::xq_per_channel, bits, 192, 32, 96, 0.0f, true});
    v.push_back({"channel_eta_b" + b, xq_axis::xq_per_channel, bits, 136, 16, 48, 0.2f, true});
  }
  v.push_back({"token_params_only", xq_axis::xq_per_token, 2, 96, 32, 30, 0.1f, false});
  v.push_back({"channel_params_only", xq_axis::xq_per_channel, 1, 64, 32, 64, 0.1f, false});
  v.push_back({"channel_x16_ch0_b2", xq_axis::xq_per_channel, 2, 192, 128, 256, 0.0f, true, true, true});
  v.push_back({"channel_x16_b3", xq_axis::xq_per_channel, 3, 136, 24, 48, 0.1f, true, true, false});
  v.push_back({"token_x16_b4", xq_axis::xq_per_token, 4, 576, 128, 33, 0.0f, true, true, false});
  v.push_back({"token_ch0_b2", xq_axis::xq_per_token, 2, 96, 32, 20, 0.0f, true, false, true});
  return v;
}

class XqCudaDeviceEncode : public ::testing::TestWithParam<encode_case> {};

TEST_P(XqCudaDeviceEncode, bytes_equal_ref) {
  XCTX_REQUIRE_CUDA();
  const encode_case p = GetParam();
  const uint32_t seed = 5150 + p.bits + 13 * p.channels;
  SCOPED_TRACE(::testing::Message() << p.name << " seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int C = p.channels;
  std::vector<float> x((size_t)p.n * C);
  for (float& v : x) v = nd(rng) * 2.0f;
  for (int64_t t = 0; t < p.n; t += 3) x[t * C + (t % C)] = x[t * C + ((t + 5) % C)];  // ties
  for (int64_t t = 0; t < p.n; t += 4) x[t * C + 3] = 0.0f, x[t * C + 4] = -0.0f;     // signed zeros
  for (int64_t t = 0; t < p.n; t += 5) x[t * C + 9] = 25.0f, x[t * C + 10] = 25.0f;   // repeated extremes
  const size_t n_codes = (size_t)p.n * kvq_row_bytes(C, p.bits);
  const size_t n_par = p.axis == xq_axis::xq_per_channel ? (size_t)(p.n / p.group) * C
                                                         : (size_t)p.n * ((C + p.group - 1) / p.group);
  std::vector<uint16_t> x16(x.size());
  for (size_t e = 0; e < x.size(); ++e) x16[e] = fp32_to_fp16(x[e]);
  std::vector<uint8_t> codes_ref(n_codes, 0xAB);
  std::vector<kvq_affine> par_ref(n_par);
  std::vector<uint16_t> ch0_ref(p.ch0 ? (size_t)p.n : 0);
  xq_encode_job j;
  j.axis = p.axis, j.bits = p.bits, j.channels = C, j.group = p.group, j.eta = p.eta, j.n = p.n;
  if (p.x16) j.x16 = x16.data();
  else j.x = x.data();
  j.codes = p.codes ? codes_ref.data() : nullptr, j.params = par_ref.data();
  j.ch0 = p.ch0 ? ch0_ref.data() : nullptr;
  ref::xq_encode(j);

  device_ctx D;
  std::vector<uint8_t> codes_init(n_codes, 0xAB);
  uint8_t* d_codes = D.up(codes_init);
  kvq_affine* d_par = D.up(std::vector<kvq_affine>(n_par));
  uint16_t* d_ch0 = p.ch0 ? D.up(std::vector<uint16_t>((size_t)p.n)) : nullptr;
  if (p.x16) j.x16 = D.up(x16);
  else j.x = D.up(x);
  j.codes = p.codes ? d_codes : nullptr, j.params = d_par, j.ch0 = d_ch0;
  xq_encode(D.c, j);
  const std::vector<uint8_t> codes = D.down(d_codes, n_codes);
  const std::vector<kvq_affine> par = D.down(d_par, n_par);
  if (p.ch0) {
    EXPECT_EQ(D.down(d_ch0, (size_t)p.n), ch0_ref);
  }
  for (size_t i = 0; i < n_par; ++i)
    ASSERT_TRUE(par[i].scale == par_ref[i].scale && par[i].zero == par_ref[i].zero) << "param " << i;
  for (size_t i = 0; i < n_codes; ++i) ASSERT_EQ(codes[i], codes_ref[i]) << "byte " << i;
}

INSTANTIATE_TEST_SUITE_P(cases, XqCudaDeviceEncode, ::testing::ValuesIn(encode_cases()),
                         [](const auto& info) { return info.param.name; });

// The latents of new rows against the double-sum reference: each device output is one f32 FMA
// chain over d terms, so |err| <= (d + 1) eps Σ_i |x_i u_ij| (d roundings of partial sums bounded
// by that sum, plus the reference's final rounding). Row counts and ranks off the 32-wide tiles.
TEST(XqCudaDeviceProject, matches_ref_xq_project) {
  XCTX_REQUIRE_CUDA();
  for (const auto& [n, d, r] : {std::tuple<int64_t, int, int>{1, 576, 192}, {77, 96, 40}, {300, 64, 33}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n << " d " << d << " r " << r);
    std::mt19937 rng(77 + (uint32_t)n);
    std::normal_distribution<float> nd;
    std::vector<float> x((size_t)n * d), u((size_t)d * r), out_ref((size_t)n * r);
    for (float& v : x) v = nd(rng);
    for (float& v : u) v = nd(rng) / 8.0f;
    ref::xq_project(x.data(), u.data(), n, d, r, out_ref.data());
    device_ctx D;
    float* d_out = D.up(std::vector<float>((size_t)n * r, -1.0f));
    xq_project(D.c, D.up(x), D.up(u), n, d, r, d_out);
    const std::vector<float> out = D.down(d_out, (size_t)n * r);
    for (int64_t t = 0; t < n; ++t)
      for (int j = 0; j < r; ++j) {
        double sa = 0;
        for (int i = 0; i < d; ++i) sa += std::fabs((double)x[t * d + i] * u[(size_t)i * r + j]);
        ASSERT_NEAR(out[t * r + j], out_ref[t * r + j], (d + 1) * kEps * sa) << "row " << t << " col " << j;
      }
  }
}

class XqCudaDeviceAttention : public ::testing::TestWithParam<xq_case> {};

TEST_P(XqCudaDeviceAttention, matches_ref_attention_xq) {
  XCTX_REQUIRE_CUDA();
  const xq_case c = GetParam();
  const uint32_t seed = 900 + (uint32_t)c.n;
  SCOPED_TRACE(::testing::Message() << c.name << " seed " << seed);
  const host_problem P = make_problem(c, seed);
  const size_t n_out = (size_t)c.n_q * c.n_head;
  std::vector<float> o_ref(n_out * c.hd), lse_ref(n_out);
  const xq_attn_args h = P.args(o_ref.data(), lse_ref.data());
  ref::attention_xq(h);

  device_ctx D;
  xq_attn_args d = h;
  d.pos = D.up(P.pos), d.q_pos = D.up(P.q_pos), d.q = D.up(P.q);
  d.zk = D.up(P.zk);
  d.zv = c.same_stream ? d.zk : D.up(P.zv);
  d.m_k = D.up(P.m_k), d.m_v = D.up(P.m_v), d.b_k = D.up(P.b_k), d.b_v = D.up(P.b_v);
  d.o = D.up(std::vector<float>(n_out * c.hd)), d.lse = D.up(std::vector<float>(n_out));
  attention_xq(D.c, d);
  const std::vector<float> o = D.down(d.o, n_out * c.hd), lse = D.down(d.lse, n_out);
  expect_close(h, o, lse, o_ref, lse_ref);
}

// acc += z·uᵀ (xquant-cl's accumulator update) against the double-sum reference: the device adds
// one f32 FMA chain over r terms to acc, so |err| <= (r + 1) eps Σ_j |z_j u_ij| + eps |acc_new|.
TEST(XqCudaDeviceProject, add_projected_matches_ref) {
  XCTX_REQUIRE_CUDA();
  for (const auto& [n, r, d] : {std::tuple<int64_t, int, int>{1, 192, 576}, {70, 64, 96}, {33, 40, 72}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n << " r " << r << " d " << d);
    std::mt19937 rng(91 + (uint32_t)n);
    std::normal_distribution<float> nd;
    std::vector<float> z((size_t)n * r), u((size_t)d * r), acc((size_t)n * d);
    for (float& v : z) v = nd(rng);
    for (float& v : u) v = nd(rng) / 8.0f;
    for (float& v : acc) v = nd(rng) * 4.0f;
    std::vector<float> ref_acc = acc;
    ref::xq_add_projected(z.data(), u.data(), n, r, d, ref_acc.data());
    device_ctx D;
    float* d_acc = D.up(acc);
    xq_add_projected(D.c, D.up(z), D.up(u), n, r, d, d_acc);
    const std::vector<float> got = D.down(d_acc, acc.size());
    for (int64_t t = 0; t < n; ++t)
      for (int i = 0; i < d; ++i) {
        double sa = 0;
        for (int j = 0; j < r; ++j) sa += std::fabs((double)z[t * r + j] * u[(size_t)i * r + j]);
        const float want = ref_acc[t * d + i];
        ASSERT_NEAR(got[t * d + i], want, (r + 1) * kEps * sa + kEps * std::fabs(want)) << "row " << t << " col " << i;
      }
  }
}

// Rows of a stream decoded on the device against the host's: the device may fuse code·scale + zero
// into one FMA, |err| <= eps ((2^b - 1) |scale| + |zero|) per element (exact for fp16 rows).
TEST(XqCudaDeviceDecode, rows_match_ref) {
  XCTX_REQUIRE_CUDA();
  for (const xq_case& c : kCases) {
    SCOPED_TRACE(c.name);
    const host_problem P = make_problem(c, 4242 + (uint32_t)c.n);
    device_ctx D;
    const xq_stream host = P.zk.view(), dev = D.up(P.zk);
    for (const auto& [t0, nt] : {std::pair<int64_t, int64_t>{0, c.n}, {c.n / 3, c.n - c.n / 3}}) {
      std::vector<float> want((size_t)nt * host.channels);
      ref::xq_decode_rows(host, t0, nt, want.data());
      float* d_out = D.up(std::vector<float>(want.size(), -7.0f));
      xq_decode_rows(D.c, dev, t0, nt, d_out);
      const std::vector<float> got = D.down(d_out, want.size());
      for (int64_t t = 0; t < nt; ++t)
        for (int ch = 0; ch < host.channels; ++ch) {
          double bound = 0;
          if (host.dense == nullptr && t0 + t < host.nq) {
            const kvq_affine p = host.axis == xq_axis::xq_per_channel
                                     ? host.params[(size_t)((t0 + t) / host.group) * host.channels + ch]
                                     : host.params[(size_t)(t0 + t) * host.n_groups_per_row() + ch / host.group];
            bound = kEps * (((1 << host.bits) - 1) * std::fabs(fp16_to_fp32(p.scale)) + std::fabs(fp16_to_fp32(p.zero)));
          }
          const size_t e = (size_t)t * host.channels + ch;
          ASSERT_NEAR(got[e], want[e], bound) << "row " << t0 + t << " channel " << ch;
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(cases, XqCudaDeviceAttention, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return std::string(info.param.name); });

#endif  // XCTX_USE_CUDA

}  // namespace
}  // namespace xctx
