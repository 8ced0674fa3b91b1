// The CUDA quantized-KV attention (kernels/cuda/kvq.cu; the encode kernels are tested in
// test_kvq_cuda_encode.cpp). The device suite runs through the backend interface and GTEST_SKIPs
// without a usable CUDA device:
//  * attention: a random layer filled by ref::kvq_encode (sink and tail fp16 rows, key and value
//    outliers, gaps in the positions), n_q = 1 and 5, against ref::attention_kvq.
// Host suites run everywhere (they are what this CPU-only CI executes): the RoPE angle reduction
// and frequencies, the launch plans (coverage, shared-memory layout and budget), and the tile-decode phases of kvq.cuh run
// item by item on the CPU against ref::kvq_decode_layer + ref::rope.
//
// Tolerances (eps = FLT_EPSILON, u = eps/2 the unit roundoff):
//  * dense decode: the device may fuse code*scale + zero into one FMA: one rounding of the
//    product less, |dx| <= u P, P = max |code*scale| (resp. |lut*scale|) of the layer;
//    kDequantUlps = 1 (in eps) covers it with a 2x margin.
//  * RoPE'd key element: the pair (x0, x1) rotated by cos/sin within kvq_rope_cs_err (kvq.cuh),
//    1.5 eps for the float rotation, 0.5 eps for the reference's own rounding:
//      dk <= eps P_k + (kvq_rope_cs_err + 2 eps) (|x0| + |x1|)          (kRopeRotEps = 2)
//  * attention row (as test_cuda_backend.cpp): scores are FMA chains over head_dim on pre-scaled
//    q, plus the key error: ds = scale ((hd + 2) eps max_j sum|q k_j| + sum|q| dk_max);
//      tol_o = max|v| (4 ds + (2 n + 16) eps) + eps P_v + eps |o|
//      tol_lse = 2 ds + (n + 8) eps (1 + |lse|),   n = visible slots.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cuda/kvq.cuh"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"
#include "kernels/kvq_cuda_test_util.h"
#include "registry/registry.h"

namespace xctx {
namespace {

using namespace xctx::cuda;

constexpr double kEps = FLT_EPSILON;
constexpr double kDequantUlps = 1.0;  // in eps, see the header
constexpr double kRopeRotEps = 2.0;   // in eps: float rotation + the reference's rounding
constexpr float kInf = std::numeric_limits<float>::infinity();

using kvq_cuda_test::ascending_lut;
using kvq_cuda_test::device_arena;

// ---- host-only: RoPE ------------------------------------------------------------------------

rope_config rope_cfg(int head_dim, int n_rot, float base, rope_scaling sc, float factor) {
  rope_config r;
  r.head_dim = head_dim, r.n_rot = n_rot, r.freq_base = base, r.scaling = sc, r.scaling_factor = factor;
  return r;
}

TEST(KvqCudaHost, rope_frequencies_reproduce_ref_theta_bit_for_bit) {
  const rope_config cfgs[] = {rope_cfg(64, 64, 1e5f, rope_scaling::rope_scaling_none, 1.0f),
                              rope_cfg(128, 96, 5e5f, rope_scaling::rope_scaling_linear, 4.0f),
                              rope_cfg(128, 128, 1e4f, rope_scaling::rope_scaling_ntk, 8.0f)};
  for (const rope_config& cfg : cfgs) {
    double w[kvq_max_pairs], pos_div = 0;
    kvq_rope_setup(cfg, w, pos_div);
    for (int32_t pos : {0, 1, 17, 4096, 1000003, INT32_MAX})
      for (int i = 0; i < cfg.n_rot / 2; ++i)
        ASSERT_EQ((double)pos / pos_div * w[i], ref::rope_theta(cfg, pos, i)) << "pos " << pos << " pair " << i;
  }
}

// The reduction alone: t must be the float nearest to the exact (a mod 2 pi) / pi (to the
// 1e-10 the long-double check resolves; a one-constant 2 pi misses by up to 0.4 ulp at
// INT32_MAX), so cos/sin of pi t match cos/sin(a) to pi 2^-25 at every position.
TEST(KvqCudaHost, half_turn_reduction_error_does_not_grow_with_position) {
  const rope_config cfg = rope_cfg(128, 128, 1e4f, rope_scaling::rope_scaling_none, 1.0f);
  double w[kvq_max_pairs], pos_div = 0;
  kvq_rope_setup(cfg, w, pos_div);
  const long double pi_l = 3.141592653589793238462643383279502884L;
  const long double bound = pi_l * std::ldexp(1.0L, -25) + 1e-15L;
  long double worst = 0;
  for (int32_t pos : {0, 1, 3, 1000, 65535, 1 << 20, 123456789, INT32_MAX - 1, INT32_MAX}) {
    for (int i = 0; i < cfg.n_rot / 2; ++i) {
      const double a = (double)pos / pos_div * w[i];
      const float t = kvq_half_turns(a);
      ASSERT_LE(std::fabs(t), 1.0f);
      const long double k = std::nearbyint((long double)a / (2 * pi_l));
      const long double t_exact = ((long double)a - k * 2 * pi_l) / pi_l;  // ~1e-10 from pi_l * k
      const long double half_ulp = t == 0.0f ? 0.0L : std::ldexp(1.0L, std::ilogb(t) - 24);
      ASSERT_LE(std::fabs(t - t_exact), half_ulp + 1e-10L) << "pos " << pos << " pair " << i;
      const long double e = std::max(std::fabs(std::cos(pi_l * t) - std::cos((long double)a)),
                                     std::fabs(std::sin(pi_l * t) - std::sin((long double)a)));
      worst = std::max(worst, e);
      ASSERT_LE(e, bound) << "pos " << pos << " pair " << i << " angle " << a;
    }
  }
  std::printf("worst cos/sin deviation from the half-turn reduction: %.3Le (bound %.3Le)\n", worst, bound);
}

// ---- host-only: work distribution and plans -------------------------------------------------

TEST(KvqCudaHost, item_stepping_covers_every_item_once) {
  for (int per : {1, 3, 20, 32, 64, 100, 128, 129, 256})
    for (int n_rows : {0, 1, 7, 32}) {
      std::vector<int> hits((size_t)n_rows * per, 0);
      for (int tid = 0; tid < kvq_threads; ++tid)
        kvq_for_items(tid, kvq_threads, n_rows, per, [&](int j, int i) {
          ASSERT_TRUE(j >= 0 && j < n_rows && i >= 0 && i < per) << j << "," << i;
          ASSERT_EQ((j * per + i) % kvq_threads, tid) << "per " << per;
          ++hits[(size_t)j * per + i];
        });
      for (size_t e = 0; e < hits.size(); ++e)
        ASSERT_EQ(hits[e], 1) << "per " << per << " rows " << n_rows << " item " << e;
    }
}

TEST(KvqCudaHost, attention_plan_covers_the_layer_within_shared_memory) {
  struct geo {
    int n_head, n_head_kv, head_dim, n_rot;
  };
  const geo geos[] = {{9, 3, 64, 64}, {6, 2, 64, 48}, {32, 8, 128, 128}, {8, 1, 256, 256}, {4, 2, 20, 20},
                      {64, 8, 80, 80}, {16, 16, 96, 0}};
  for (const geo& G : geos)
    for (int64_t n_q : {1, 5, 300, 4096})
      for (int64_t n : {0, 1, 31, 32, 700, 100000, 3000000})
        for (int n_sm : {1, 108, 132})
          for (bool se : {false, true}) {
            const kvq_attn_plan p = plan_kvq_attention(n_q, n, G.n_head, G.n_head_kv, G.head_dim, G.n_rot, n_sm, se);
            SCOPED_TRACE(::testing::Message() << "heads " << G.n_head << "/" << G.n_head_kv << " hd " << G.head_dim
                                              << " n_q " << n_q << " n " << n << " sms " << n_sm << " se " << se);
            const int64_t rows = n_q * (G.n_head / G.n_head_kv);
            ASSERT_EQ(p.rows_total, rows);
            ASSERT_EQ(p.rows_per_block, p.rows_per_warp * kvq_warps);
            ASSERT_EQ(p.rows_per_warp, rows <= 8 ? kvq_decode_rows_per_warp : kvq_prefill_rows_per_warp);
            ASSERT_GE(p.row_blocks * p.rows_per_block, rows);
            ASSERT_LT((p.row_blocks - 1) * p.rows_per_block, rows);
            ASSERT_GE(32 * p.kd, G.head_dim);
            ASSERT_TRUE(p.d4 % 4 == 0 && p.d4 >= G.head_dim && p.d4 < G.head_dim + 4);
            ASSERT_EQ(p.k_stride % 8, 4) << "16-byte smem reads of K rows would conflict";
            ASSERT_GE(p.k_stride, p.d4);
            // Slot splits: chunks of whole tiles, together covering [0, n), none starting past it.
            ASSERT_EQ(p.chunk % kvq_tile, 0);
            ASSERT_TRUE(p.n_split >= 1 && p.n_split <= 65535);
            ASSERT_GE(p.n_split * p.chunk, n);
            ASSERT_LT((int64_t)(p.n_split - 1) * p.chunk, std::max<int64_t>(n, 1));
            if (p.n_split > 1) {
              ASSERT_LE((size_t)p.n_split * n_q * G.n_head * (G.head_dim + 1) * sizeof(float), kvq_scratch_cap);
            }
            // Shared memory: aligned, disjoint segments inside the budget of an sm_80 block.
            const size_t T = kvq_tile, hd = G.head_dim;
            const std::pair<size_t, size_t> seg[] = {
                {p.off_w, (size_t)p.n_pair * 8}, {p.off_pos_eff, T * 8},  {p.off_qrow, T * 8},
                {p.off_k_aff, T * 8},            {p.off_v_aff, T * 8},    {p.off_q, (size_t)p.rows_per_block * p.d4 * 4},
                {p.off_k, T * p.k_stride * 4},   {p.off_v, T * p.d4 * 4}, {p.off_ch_scale, hd * 4},
                {p.off_ch_zero, hd * 4},         {p.off_v_grp, hd * 4},   {p.off_lut_k, kKvqMaxLut * 4},
                {p.off_lut_v, kKvqMaxLut * 4},   {p.off_v_scale, T * 4},  {p.off_v_zero, T * 4},
                {p.off_pos, T * 4}};
            std::vector<std::pair<size_t, size_t>> s(std::begin(seg), std::end(seg));
            if (se) {  // SelfExtend's turned rows and grouped K tile
              s.push_back({p.off_qf, (size_t)p.rows_per_block * p.d4 * 4});
              s.push_back({p.off_kf, T * p.k_stride * 4});
            }
            std::sort(s.begin(), s.end());
            for (size_t e = 0; e < s.size(); ++e) {
              ASSERT_EQ(s[e].first % 16, 0u);
              ASSERT_LE(s[e].first + s[e].second, e + 1 < s.size() ? s[e + 1].first : p.smem_bytes);
            }
            // + the kernel's static 32 bytes; an sm_80 block's budget, an H100's for SelfExtend past 128
            ASSERT_LE(p.smem_bytes + 32, se && G.head_dim > 128 ? (size_t)232448 : (size_t)166912);
          }
}

// ---- layers for the tile and attention tests ------------------------------------------------

struct layer_case {
  const char* name;
  kvq_scheme scheme;
  int bits;
  int n_head, n_head_kv, head_dim, n_rot;
  int group;  // uniform
  int64_t n_sink, nq, n_tail;
  bool outliers;  // lut: key thresholds and 2 value outliers per side
  int32_t pos0;
  float k_thresh = 1.0f;  // lut key outlier thresholds at ch_zero -+ k_thresh * ch_scale
};

// A layer filled by ref::kvq_encode, kept in host vectors; view() points into them.
struct host_layer {
  layer_case c;
  std::vector<int32_t> pos;
  std::vector<uint16_t> k_sink, v_sink, k_tail, v_tail;
  std::vector<uint8_t> k_codes, v_codes;
  std::vector<kvq_affine> k_group, v_group, v_tok;
  std::vector<float> lut_k, lut_v, ch_scale, ch_zero;
  std::vector<uint32_t> k_out_off;
  std::vector<uint16_t> k_out_idx, k_out_val, v_out_idx, v_out_val;
  int v_out_per_tok = 0;

  kvq_layer_view view() const {
    kvq_layer_view v;
    v.scheme = c.scheme, v.bits = c.bits, v.n_head_kv = c.n_head_kv, v.head_dim = c.head_dim, v.group = c.group;
    v.n = c.n_sink + c.nq + c.n_tail, v.n_sink = c.n_sink, v.q_end = c.n_sink + c.nq;
    v.pos = pos.data(), v.k_sink = k_sink.data(), v.v_sink = v_sink.data();
    v.k_tail = k_tail.data(), v.v_tail = v_tail.data(), v.k_codes = k_codes.data(), v.v_codes = v_codes.data();
    if (c.scheme == kvq_scheme::kvq_uniform) {
      v.k_group = k_group.data(), v.v_group = v_group.data();
    } else {
      v.lut_k = lut_k.data(), v.lut_v = lut_v.data(), v.k_ch_scale = ch_scale.data(), v.k_ch_zero = ch_zero.data();
      v.v_tok = v_tok.data();
      if (c.outliers) {
        v.k_out_off = k_out_off.data(), v.k_out_idx = k_out_idx.data(), v.k_out_val = k_out_val.data();
        v.v_out_per_tok = v_out_per_tok, v.v_out_idx = v_out_idx.data(), v.v_out_val = v_out_val.data();
      }
    }
    return v;
  }
  rope_config rope() const { return rope_cfg(c.head_dim, c.n_rot, 1e4f, rope_scaling::rope_scaling_none, 1.0f); }
};

host_layer make_layer(const layer_case& c, uint32_t seed) {
  host_layer L;
  L.c = c;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::bernoulli_distribution spike(0.01);
  const int C = c.n_head_kv * c.head_dim;
  const int64_t n = c.n_sink + c.nq + c.n_tail, q_end = c.n_sink + c.nq;
  std::vector<float> k((size_t)n * C), v((size_t)n * C);  // [n, C]
  std::vector<float> ks(C), kz(C);
  for (int ch = 0; ch < C; ++ch) ks[ch] = 1.0f + 4.0f * (ch % 7 == 3), kz[ch] = 0.3f * std::sin((float)ch);
  for (int64_t t = 0; t < n; ++t) {
    const float vs = 0.5f + (float)(t % 5) * 0.3f;
    for (int ch = 0; ch < C; ++ch) {
      k[t * C + ch] = ks[ch] * nd(rng) + kz[ch] + (spike(rng) ? 9.0f * ks[ch] : 0.0f);
      v[t * C + ch] = vs * nd(rng) + (spike(rng) ? -7.0f * vs : 0.0f);
    }
  }
  L.pos.resize(n);
  int32_t p = c.pos0;
  for (int64_t t = 0; t < n; ++t) L.pos[t] = p, p += 1 + (int32_t)(rng() % 3);  // gaps of 0..2
  for (int64_t e = 0; e < n * C; ++e) {
    if (e >= c.n_sink * C && e < q_end * C) continue;
    std::vector<uint16_t>& kf = e < c.n_sink * C ? L.k_sink : L.k_tail;
    std::vector<uint16_t>& vf = e < c.n_sink * C ? L.v_sink : L.v_tail;
    kf.push_back(fp32_to_fp16(k[e])), vf.push_back(fp32_to_fp16(v[e]));
  }
  const size_t rb = kvq_row_bytes(C, c.bits);
  L.k_codes.assign(c.nq * rb, 0), L.v_codes.assign(c.nq * rb, 0);
  const float* kq = k.data() + c.n_sink * C;
  const float* vq = v.data() + c.n_sink * C;
  kvq_encode_job j;
  j.bits = c.bits, j.channels = C, j.group = c.group;
  if (c.scheme == kvq_scheme::kvq_uniform) {
    const int n_vg = (C + c.group - 1) / c.group;
    L.k_group.resize(c.nq / c.group * C), L.v_group.resize(c.nq * n_vg);
    j.tensor = kvq_tensor::kvq_uniform_keys, j.n = c.group;
    for (int64_t g = 0; g < c.nq / c.group; ++g) {
      j.x = kq + g * c.group * C, j.codes = L.k_codes.data() + g * c.group * rb, j.affine = L.k_group.data() + g * C;
      ref::kvq_encode(j);
    }
    j.tensor = kvq_tensor::kvq_uniform_values, j.n = c.nq;
    j.x = vq, j.codes = L.v_codes.data(), j.affine = L.v_group.data();
    ref::kvq_encode(j);
    return L;
  }
  L.lut_k = ascending_lut(c.bits, 1.5f), L.lut_v = ascending_lut(c.bits, 1.2f);
  L.ch_scale.resize(C), L.ch_zero = kz;
  std::vector<float> lo(C), hi(C);
  for (int ch = 0; ch < C; ++ch) {
    L.ch_scale[ch] = 2.2f * ks[ch];
    lo[ch] = kz[ch] - c.k_thresh * L.ch_scale[ch], hi[ch] = kz[ch] + c.k_thresh * L.ch_scale[ch];
  }
  std::vector<uint16_t> idx((size_t)c.nq * C), val((size_t)c.nq * C);  // [nq, C] per-row scratch
  std::vector<uint32_t> cnt(c.nq);
  j.tensor = kvq_tensor::kvq_lut_keys, j.n = c.nq, j.x = kq, j.lut = L.lut_k.data();
  j.ch_scale = L.ch_scale.data(), j.ch_zero = L.ch_zero.data(), j.codes = L.k_codes.data();
  if (c.outliers) j.ch_lo = lo.data(), j.ch_hi = hi.data();
  j.out_idx = idx.data(), j.out_val = val.data(), j.out_count = cnt.data();
  ref::kvq_encode(j);
  L.k_out_off.assign(c.nq + 1, 0);
  for (int64_t t = 0; t < c.nq; ++t) {  // compact as the cache does
    L.k_out_idx.insert(L.k_out_idx.end(), idx.begin() + t * C, idx.begin() + t * C + cnt[t]);
    L.k_out_val.insert(L.k_out_val.end(), val.begin() + t * C, val.begin() + t * C + cnt[t]);
    L.k_out_off[t + 1] = L.k_out_off[t] + cnt[t];
  }
  const int side = c.outliers ? 2 : 0;
  L.v_out_per_tok = 2 * side;
  L.v_tok.resize(c.nq), L.v_out_idx.assign(std::max<int64_t>(1, c.nq * 2 * side), 0);
  L.v_out_val.assign(L.v_out_idx.size(), 0);
  kvq_encode_job jv;
  jv.tensor = kvq_tensor::kvq_lut_values, jv.bits = c.bits, jv.channels = C, jv.n = c.nq, jv.x = vq;
  jv.lut = L.lut_v.data(), jv.v_out_side = side, jv.codes = L.v_codes.data(), jv.affine = L.v_tok.data();
  jv.out_idx = L.v_out_idx.data(), jv.out_val = L.v_out_val.data();
  ref::kvq_encode(jv);
  return L;
}

// Largest |code * scale| of the dense decode (the product an FMA may keep unrounded), keys and values.
std::pair<double, double> dense_products(const kvq_layer_view& v) {
  const int C = v.channels();
  const size_t rb = kvq_row_bytes(C, v.bits);
  double pk = 0, pv = 0;
  for (int64_t i = 0; i < v.n_quant(); ++i)
    for (int c = 0; c < C; ++c) {
      const uint32_t kc = kvq_get_code(v.k_codes + i * rb, v.bits, c), vc = kvq_get_code(v.v_codes + i * rb, v.bits, c);
      if (v.scheme == kvq_scheme::kvq_uniform) {
        const int n_vg = (C + v.group - 1) / v.group;
        pk = std::max(pk, std::fabs(kc * (double)fp16_to_fp32(v.k_group[i / v.group * C + c].scale)));
        pv = std::max(pv, std::fabs(vc * (double)fp16_to_fp32(v.v_group[i * n_vg + c / v.group].scale)));
      } else {
        pk = std::max(pk, std::fabs((double)v.lut_k[kc] * v.k_ch_scale[c]));
        pv = std::max(pv, std::fabs((double)v.lut_v[vc] * fp16_to_fp32(v.v_tok[i].scale)));
      }
    }
  return {pk, pv};
}

const layer_case kLayers[] = {
    {"uniform_2", kvq_scheme::kvq_uniform, 2, 6, 2, 64, 64, 32, 0, 256, 13, false, 0},
    {"uniform_3", kvq_scheme::kvq_uniform, 3, 6, 2, 64, 64, 32, 0, 256, 13, false, 0},
    {"uniform_4_hd128_sink", kvq_scheme::kvq_uniform, 4, 8, 1, 128, 128, 64, 1, 384, 40, false, 100000},
    {"lut_2_outliers", kvq_scheme::kvq_lut, 2, 6, 2, 64, 48, 0, 1, 300, 0, true, 1 << 20},
    {"lut_3_outliers", kvq_scheme::kvq_lut, 3, 6, 2, 64, 64, 0, 1, 700, 0, true, 0},
    {"lut_4_plain", kvq_scheme::kvq_lut, 4, 6, 2, 64, 64, 0, 0, 300, 5, false, 7},
    {"lut_3_hd20_outliers", kvq_scheme::kvq_lut, 3, 4, 2, 20, 20, 0, 1, 150, 0, true, 3},
    // tight thresholds: more key outliers per row than a warp has lanes
    {"lut_4_hd256_many_outliers", kvq_scheme::kvq_lut, 4, 2, 1, 256, 256, 0, 1, 90, 3, true, 1000000000, 0.3f},
};

class KvqCudaLayer : public ::testing::TestWithParam<layer_case> {};

// Runs kvq.cuh's tile phases item by item in the kernel's order over every tile of every kv
// head (the outlier phase's lanes emulated); with se_group > 0 the rope phase is SelfExtend's
// (kvq_tile_rope_grouped). check(t, g, s0, nt) sees each finished tile.
template <class Check>
void run_tile_phases(const kvq_layer_view& L, const kvq_attn_plan& pl, const rope_config& rope, int se_group,
                     Check&& check) {
  std::vector<double> smem(pl.smem_bytes / sizeof(double) + 1);
  double w[kvq_max_pairs], pos_div = 0;
  kvq_rope_setup(rope, w, pos_div);
  const int hd = L.head_dim;
  for (int g = 0; g < L.n_head_kv; ++g) {
    kvq_tile_view t = kvq_bind_tile(pl, reinterpret_cast<char*>(smem.data()), g);
    for (int idx = 0; idx < kvq_setup_items(L, pl.n_pair); ++idx) kvq_tile_setup(L, t, w, pl.n_pair, idx);
    for (int64_t s0 = 0; s0 < L.n; s0 += kvq_tile) {
      const int nt = (int)std::min<int64_t>(kvq_tile, L.n - s0);
      t.s0 = s0;
      for (int j = 0; j < nt; ++j) kvq_tile_meta(L, t, pos_div, j);
      for (int j = 0; j < nt; ++j)
        for (int d = 0; d < hd; ++d) kvq_tile_dense(L, t, j, d);
      for (int j = 0; j < nt; ++j)
        for (int lane = 0; lane < 32; ++lane) kvq_tile_outliers(L, t, j, lane, 32);
      for (int j = 0; j < nt; ++j) {
        if (se_group > 0)
          for (int c = 0; c < (hd + 1) / 2; ++c) kvq_tile_rope_grouped(t, j, c, hd, pl.n_pair, se_group, pos_div);
        else
          for (int p = 0; p < pl.n_pair; ++p) kvq_tile_rope(t, j, p);
      }
      check(t, g, s0, nt);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Bound on a rotated key element against the reference's: dequantization plus, for rotated
// dims, the on-the-fly RoPE's cos/sin and rotation error on the pair.
double key_tolerance(const std::vector<float>& kd, size_t at, int d, int n_rot, double pk) {
  const size_t a0 = at - (d % 2);
  const double pair = std::fabs(kd[a0]) + std::fabs(kd[a0 + 1]);
  const double rot = d < n_rot ? (kvq_rope_cs_err + kRopeRotEps * kEps) * pair : 0.0;
  return kEps * kDequantUlps * pk + rot;
}

// The tile phases, over every tile of every kv head, must reproduce the reference's decoded and
// rotated layer.
TEST_P(KvqCudaLayer, host_run_of_the_tile_phases_matches_ref_decode_and_rope) {
  const layer_case c = GetParam();
  const uint32_t seed = 501;
  SCOPED_TRACE(::testing::Message() << c.name << " seed " << seed);
  const host_layer H = make_layer(c, seed);
  const kvq_layer_view L = H.view();
  const rope_config rope = H.rope();
  const int C = L.channels(), hd = L.head_dim;
  std::vector<float> kd((size_t)L.n * C), vd((size_t)L.n * C);  // [n, C]
  ref::kvq_decode_layer(L, kd.data(), vd.data());
  std::vector<float> kr = kd;
  ref::rope(kr.data(), L.pos, L.n, L.n_head_kv, rope);
  const auto [pk, pv] = dense_products(L);

  const kvq_attn_plan pl = plan_kvq_attention(1, L.n, c.n_head, L.n_head_kv, hd, rope.n_rot, 108);
  run_tile_phases(L, pl, rope, 0, [&](const kvq_tile_view& t, int g, int64_t s0, int nt) {
    for (int j = 0; j < nt; ++j) {
      const int64_t s = s0 + j;
      ASSERT_EQ(t.pos[j], L.pos[s]);
      for (int d = 0; d < hd; ++d) {
        const size_t at = (size_t)s * C + g * hd + d;
        ASSERT_NEAR(t.v[(size_t)j * t.v_stride + d], vd[at], kEps * kDequantUlps * pv)
            << "value slot " << s << " head " << g << " d " << d;
        ASSERT_NEAR(t.k[(size_t)j * t.k_stride + d], kr[at], key_tolerance(kd, at, d, rope.n_rot, pk))
            << "key slot " << s << " head " << g << " d " << d;
      }
    }
  });
  if (c.outliers) {  // the layer must exercise both patch paths
    int64_t n_out_seen = 0;
    uint32_t most = 0;
    for (int64_t i = 0; i < L.n_quant(); ++i) {
      n_out_seen += L.k_out_off[i + 1] - L.k_out_off[i];
      most = std::max(most, L.k_out_off[i + 1] - L.k_out_off[i]);
    }
    EXPECT_GT(n_out_seen, 0);
    if (c.k_thresh < 1.0f) {
      EXPECT_GT(most, 32u);
    }
    EXPECT_GT(L.v_out_per_tok, 0);
  }
}

// SelfExtend's rope phase: kf holds the decoded keys rotated to floor(pos / G) and k the same
// keys rotated to pos, as the reference rotates them (pairs past n_rot copied).
TEST_P(KvqCudaLayer, host_run_of_the_grouped_rope_phase_matches_ref) {
  const layer_case c = GetParam();
  const host_layer H = make_layer(c, 502);
  const kvq_layer_view L = H.view();
  const rope_config rope = H.rope();
  const int C = L.channels(), hd = L.head_dim, G = 4;
  std::vector<float> kd((size_t)L.n * C), vd((size_t)L.n * C);  // [n, C]
  ref::kvq_decode_layer(L, kd.data(), vd.data());
  std::vector<int32_t> grouped_pos((size_t)L.n);
  for (int64_t s = 0; s < L.n; ++s) grouped_pos[(size_t)s] = (int32_t)se_floor_div(L.pos[s], G);
  std::vector<float> kr = kd, kg = kd;
  ref::rope(kr.data(), L.pos, L.n, L.n_head_kv, rope);
  ref::rope(kg.data(), grouped_pos.data(), L.n, L.n_head_kv, rope);
  const auto [pk, pv] = dense_products(L);

  const kvq_attn_plan pl = plan_kvq_attention(1, L.n, c.n_head, L.n_head_kv, hd, rope.n_rot, 108, /*self_extend=*/true);
  ASSERT_TRUE(pl.self_extend);
  run_tile_phases(L, pl, rope, G, [&](const kvq_tile_view& t, int g, int64_t s0, int nt) {
    ASSERT_NE(t.kf, nullptr);
    for (int j = 0; j < nt; ++j) {
      const int64_t s = s0 + j;
      for (int d = 0; d < hd; ++d) {
        const size_t at = (size_t)s * C + g * hd + d;
        const double kt = key_tolerance(kd, at, d, rope.n_rot, pk);
        ASSERT_NEAR(t.k[(size_t)j * t.k_stride + d], kr[at], kt) << "key slot " << s << " head " << g << " d " << d;
        ASSERT_NEAR(t.kf[(size_t)j * t.k_stride + d], kg[at], kt)
            << "grouped key slot " << s << " (pos " << L.pos[s] << ") head " << g << " d " << d;
      }
    }
  });
}

// ---- device: attention ----------------------------------------------------------------------

kvq_layer_view upload_layer(device_arena& d, const host_layer& H) {
  kvq_layer_view v = H.view();
  v.pos = d.put(H.pos), v.k_sink = d.put(H.k_sink), v.v_sink = d.put(H.v_sink), v.k_tail = d.put(H.k_tail);
  v.v_tail = d.put(H.v_tail), v.k_codes = d.put(H.k_codes), v.v_codes = d.put(H.v_codes);
  if (v.scheme == kvq_scheme::kvq_uniform) {
    v.k_group = d.put(H.k_group), v.v_group = d.put(H.v_group);
    return v;
  }
  v.lut_k = d.put(H.lut_k), v.lut_v = d.put(H.lut_v), v.k_ch_scale = d.put(H.ch_scale), v.k_ch_zero = d.put(H.ch_zero);
  v.v_tok = d.put(H.v_tok);
  if (H.c.outliers) {
    v.k_out_off = d.put(H.k_out_off), v.k_out_idx = d.put(H.k_out_idx), v.k_out_val = d.put(H.k_out_val);
    v.v_out_idx = d.put(H.v_out_idx), v.v_out_val = d.put(H.v_out_val);
  }
  return v;
}

TEST_P(KvqCudaLayer, device_attention_matches_ref) {
  XCTX_REQUIRE_CUDA();
  const layer_case c = GetParam();
  const uint32_t seed = 777;
  SCOPED_TRACE(::testing::Message() << c.name << " seed " << seed);
  const host_layer H = make_layer(c, seed);
  const kvq_layer_view L = H.view();
  const rope_config rope = H.rope();
  const int C = L.channels(), hd = L.head_dim, group = c.n_head / c.n_head_kv;
  std::vector<float> kd((size_t)L.n * C), vd((size_t)L.n * C);  // [n, C]
  ref::kvq_decode_layer(L, kd.data(), vd.data());
  std::vector<float> kr = kd;
  ref::rope(kr.data(), L.pos, L.n, L.n_head_kv, rope);
  const auto [pk, pv] = dense_products(L);
  double k_max = 0, v_max = 0;
  for (float x : kd) k_max = std::max(k_max, (double)std::fabs(x));
  for (float x : vd) v_max = std::max(v_max, (double)std::fabs(x));
  const double dk = kEps * kDequantUlps * pk + (kvq_rope_cs_err + kRopeRotEps * kEps) * 2 * k_max;

  auto be = make_backend(backend_kind::backend_cuda);
  device_arena dev(*be);
  const kvq_layer_view Ld = upload_layer(dev, H);
  const int64_t n = L.n;
  const std::vector<std::vector<int32_t>> q_pos_sets = {
      {L.pos[n - 1] + 2},
      {L.pos[n - 1], L.pos[n / 2], L.pos[n / 2] + 1, L.pos[0] - 1, L.pos[std::min<int64_t>(L.n_sink + 3, n - 1)]}};
  std::mt19937 rng(seed + 1);
  std::normal_distribution<float> nd;
  // Plain, and SelfExtend with windows that put the block's rows on both sides of many tiles;
  // retrieval (select: 1 list per query, 2 one per KV head) with far keys at distance W.
  struct query_case {
    std::vector<int32_t> q_pos;
    int se_group, se_window, select;
  };
  std::vector<query_case> cases;
  for (auto [G, W] : {std::pair{1, 0}, std::pair{4, 37}, std::pair{64, 100}})
    for (const std::vector<int32_t>& q_pos : q_pos_sets) cases.push_back({q_pos, G, W, 0});
  for (int select : {1, 2})
    for (const std::vector<int32_t>& q_pos : q_pos_sets) cases.push_back({q_pos, kFixedDistanceGroup, 100, select});
  for (const auto& [q_pos, se_group, se_window, select] : cases) {
    const int64_t n_q = (int64_t)q_pos.size();
    SCOPED_TRACE(::testing::Message() << "n_q " << n_q << " se_group " << se_group << " se_window " << se_window
                                      << " select " << select);
    attn_selection sel;  // each list holds each unit up to its query's with probability 1/2
    if (select > 0) {
      sel.lists_per_query = select == 1 ? 1 : c.n_head_kv;
      sel.offsets.push_back(0);
      std::bernoulli_distribution pick(0.5);
      for (int64_t i = 0; i < n_q; ++i)
        for (int l = 0; l < sel.lists_per_query; ++l) {
          for (int64_t u = 0; u <= attn_unit_of(std::max<int32_t>(0, q_pos[i])); ++u)
            if (pick(rng)) sel.units.push_back(u);
          sel.offsets.push_back((int64_t)sel.units.size());
        }
    }
    std::vector<float> q(n_q * c.n_head * hd);
    for (float& x : q) x = nd(rng);
    kvq_attn_args a;
    a.kv = L, a.q = q.data(), a.q_pos = q_pos.data(), a.n_q = n_q, a.n_head = c.n_head;
    a.scale = 1.0f / std::sqrt((float)hd), a.rope = rope;
    a.rope.se_group = se_group, a.rope.se_window = se_window;
    if (select > 0) a.select = &sel;
    const bool se = se_group > 1;
    std::vector<float> o_ref(q.size()), l_ref(n_q * c.n_head);
    a.o = o_ref.data(), a.lse = l_ref.data();
    ref::attention_kvq(a);

    kvq_attn_args ad = a;
    ad.kv = Ld, ad.q = dev.put(q), ad.q_pos = dev.put(q_pos);
    ad.o = dev.alloc<float>(o_ref.size()), ad.lse = dev.alloc<float>(l_ref.size());
    be->attention_kvq(ad);
    std::vector<float> o(o_ref.size()), l(l_ref.size());
    be->download(o.data(), ad.o, o.size() * sizeof(float));
    be->download(l.data(), ad.lse, l.size() * sizeof(float));

    for (int64_t i = 0; i < n_q; ++i)
      for (int h = 0; h < c.n_head; ++h) {
        const int64_t row = i * c.n_head + h;
        const float* qr = q.data() + row * hd;
        const int g = h / group;
        int64_t n_vis = 0;
        double s1 = 0, q1 = 0;
        for (int d = 0; d < hd; ++d) q1 += std::fabs(qr[d]);
        for (int64_t s = 0; s < n; ++s) {
          if (L.pos[s] > q_pos[i]) continue;
          if (select > 0 && !sel.sees(i, g, attn_unit_of(L.pos[s]))) continue;
          ++n_vis;
          double sum = 0;
          const float* kk = kr.data() + (size_t)s * C + g * hd;
          if (se)  // turned pairs: |x·y| <= |x||y| at any angle
            for (int d = 0; d < hd; d += 2)
              sum += std::hypot((double)qr[d], d + 1 < hd ? qr[d + 1] : 0.0) * std::hypot((double)kk[d], d + 1 < hd ? kk[d + 1] : 0.0);
          else
            for (int d = 0; d < hd; ++d) sum += std::fabs((double)qr[d] * kk[d]);
          s1 = std::max(s1, sum);
        }
        if (n_vis == 0) {
          ASSERT_EQ(l[row], -kInf) << "row " << row;
          for (int d = 0; d < hd; ++d) ASSERT_EQ(o[row * hd + d], 0.0f) << "row " << row;
          continue;
        }
        // SelfExtend also turns the query (cos/sin within kvq_rope_cs_err, the rotation 1.5 eps).
        const double ds = a.scale * ((hd + 2 + (se ? 8 : 0)) * kEps * s1 + q1 * dk);
        const double tol_lse = 2 * ds + (double)(n_vis + 8) * kEps * (1.0 + std::fabs(l_ref[row]));
        ASSERT_NEAR(l[row], l_ref[row], tol_lse) << "lse row " << row << " visible " << n_vis;
        for (int d = 0; d < hd; ++d) {
          const double ref_o = o_ref[row * hd + d];
          const double tol_o = v_max * (4 * ds + (double)(2 * n_vis + 16) * kEps) + kEps * pv + kEps * std::fabs(ref_o);
          ASSERT_NEAR(o[row * hd + d], ref_o, tol_o) << "o row " << row << " d " << d << " visible " << n_vis;
        }
      }
  }
}

INSTANTIATE_TEST_SUITE_P(layers, KvqCudaLayer, ::testing::ValuesIn(kLayers),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace xctx
