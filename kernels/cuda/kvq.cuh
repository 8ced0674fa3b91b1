// CUDA kernels of the quantized KV cache (kernels/cuda/kvq.cu): launch planning and the per-item
// logic of the fused attention's tile decode. Everything here is host-device (XCTX_HOST_DEVICE)
// or host-only and needs no CUDA header outside nvcc, so the test binary runs the same index math and
// the same plans on the CPU, without a GPU (house style §2).
//
// Attention tile decode, per block (one kv head g, slots [s0, s0 + nt), nt <= kvq_tile):
//   setup     once per block: LUTs, head g's key channel scales, value group of each channel,
//             RoPE frequencies (kvq_tile_setup, item = table index)
//   meta      per slot: position, effective RoPE position, quantized row index, per-row value
//             scale (kvq_tile_meta, item = slot)
//   dense     per element: fp16 row or code -> f32 (kvq_tile_dense, item = (slot, channel))
//   outliers  per slot: sparse entries add their δ to dense elements (kvq_tile_outliers, lane-strided)
//   rope      per (slot, rotary pair): pre-RoPE key rotated to its position (kvq_tile_rope)
// Each phase only reads what earlier phases wrote, so a block needs one barrier between phases.
//
// RoPE accuracy. The angle a = (pos / pos_div) * w_i is formed in double exactly as
// ref::rope_theta forms it (same operations, w_i from the same host pow), reduced modulo 2 pi in
// double with a two-constant 2 pi (error ~1e-32 k, k < 2^29), scaled to half turns t in [-1, 1]
// and rounded to float: |dt| <= 2^-25, i.e. <= pi 2^-25 = 0.8 eps rad. sincospif (1 ulp, no
// range reduction of its own) adds <= 0.5 eps, so |cos_gpu - cos(a)|, |sin_gpu - sin(a)| <=
// kvq_rope_cs_err = 2 eps at ANY position: the reduction absorbs the magnitude of pos. The float
// rotation then adds <= 1.5 eps (|x0| + |x1|). Double work per (slot, pair): 4 multiplies,
// 2 FMAs and a rint; the pow per pair is done once on the host.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cuda/attention.cuh"  // SelfExtend shifts
#include "kernels/kv_quant.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace xctx::cuda {

struct context;  // kernels.cuh

// Backend entry points (kvq.cu); every pointer in the job/args is a device pointer.
void kvq_encode(context& ctx, const kvq_encode_job& job);
void kvq_append_outliers(context& ctx, const kvq_outlier_append& a);
void attention_kvq(context& ctx, const kvq_attn_args& a);

constexpr int kvq_threads = 128;  // every kvq kernel: 4 warps
constexpr int kvq_warps = kvq_threads / 32;
constexpr int kvq_tile = 32;                          // slots per attention tile: one per lane when scoring
constexpr int kvq_max_head_dim = 256;                 // per-lane accumulators: head_dim in 32-wide slices
constexpr int kvq_max_pairs = kvq_max_head_dim / 2;   // rotary pairs the parameter block carries
constexpr int kvq_decode_rows_per_warp = 2;           // (query, head) rows: 8 per block when few
constexpr int kvq_prefill_rows_per_warp = 8;          // 32 per block otherwise
constexpr int64_t kvq_min_split_slots = 256;          // below this a key-axis split costs more than it brings
constexpr size_t kvq_scratch_cap = 256u << 20;        // split partials; bounds n_split for huge n_q
constexpr int kvq_max_sort_channels = 8192;           // lut values: one row's sort keys in shared memory
// Blocks of the outlier copy (one row per block at a time): enough to fill the SMs, never more
// than there are rows.
inline int kvq_outlier_copy_blocks(int64_t n_rows, int n_sm) {
  return (int)std::max<int64_t>(0, std::min<int64_t>(n_rows, 8 * (int64_t)std::max(n_sm, 1)));
}
constexpr double kvq_rope_cs_err = 2.0 * FLT_EPSILON;  // |cos/sin error| of the on-the-fly RoPE (above)

// ---- encode ----------------------------------------------------------------------------------

// Sort key of element (x, c) such that unsigned order == the reference's (value, channel) order:
// x < y, or x == y and c < d. -0 and +0 compare equal there, so both map to +0's pattern.
XCTX_HOST_DEVICE inline uint64_t kvq_order_key(float x, int c) {
  uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) == 0) u = 0;
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((uint64_t)u << 32) | (uint32_t)c;
}
XCTX_HOST_DEVICE inline int kvq_order_channel(uint64_t key) { return (int)(uint32_t)key; }
// Padding of a sort beyond C: above every real key (a real key's low word is a channel < 65536).
constexpr uint64_t kvq_order_pad = ~0ull;

// One compare-exchange of the bitonic network that sorts keys[0, n) ascending, n a power of two:
// stage (k, j) for k = 2, 4, ..., n and j = k/2, ..., 1, element i < n. The items of one stage
// touch disjoint pairs; stages must run in order.
XCTX_HOST_DEVICE inline void kvq_bitonic_step(uint64_t* keys /*[n]*/, int k, int j, int i) {
  const int partner = i ^ j;
  if (partner <= i) return;
  const uint64_t a = keys[i], b = keys[partner];
  if ((a > b) == ((i & k) == 0)) {
    keys[i] = b;
    keys[partner] = a;
  }
}

inline int kvq_sort_size(int channels) {
  int n = 1;
  while (n < channels) n <<= 1;
  return n;
}

struct kvq_encode_plan {
  unsigned blocks = 0;    // 0: nothing to launch
  int sort_n = 0;         // lut values: keys sorted per row (power of two >= C)
  size_t smem_bytes = 0;  // dynamic shared memory (lut values: sort keys + outlier flags)
};

// Block per row (grid-stride over rows) except uniform keys: block per slab of kvq_threads
// channels, the per-channel min/max runs down the rows.
inline kvq_encode_plan plan_kvq_encode(kvq_tensor tensor, int channels, int64_t n, int n_sm) {
  kvq_encode_plan p;
  if (n <= 0) return p;
  const int64_t row_cap = 8 * (int64_t)std::max(1, n_sm);
  switch (tensor) {
    case kvq_tensor::kvq_uniform_keys:
      p.blocks = (unsigned)((channels + kvq_threads - 1) / kvq_threads);
      return p;
    case kvq_tensor::kvq_uniform_values:
    case kvq_tensor::kvq_lut_keys:
      p.blocks = (unsigned)std::min(n, row_cap);
      return p;
    case kvq_tensor::kvq_lut_values:
      XCTX_CHECK(channels <= kvq_max_sort_channels, "cuda kvq_encode: lut values rows of ", channels,
                 " channels exceed the ", kvq_max_sort_channels, " the shared-memory outlier sort supports");
      p.blocks = (unsigned)std::min(n, row_cap);
      p.sort_n = kvq_sort_size(channels);
      p.smem_bytes = (size_t)p.sort_n * sizeof(uint64_t) + ((size_t)channels + 15) / 16 * 16;
      return p;
  }
  XCTX_ASSERT(false, "plan_kvq_encode: bad tensor kind ", (int)tensor);
  return p;
}

// ---- attention: RoPE ---------------------------------------------------------------------------

// Effective-position divisor and per-pair frequency w_i, with ref::rope_theta's expressions:
// theta(pos, i) = ((double)pos / pos_div) * w[i].
inline void kvq_rope_setup(const rope_config& cfg, double* w /*[n_rot / 2]*/, double& pos_div) {
  double base_eff = (double)cfg.freq_base;
  pos_div = 1.0;
  switch (cfg.scaling) {
    case rope_scaling::rope_scaling_none: break;
    case rope_scaling::rope_scaling_linear: pos_div = (double)cfg.scaling_factor; break;
    case rope_scaling::rope_scaling_ntk:
      base_eff *= std::pow((double)cfg.scaling_factor, (double)cfg.n_rot / (double)(cfg.n_rot - 2));
      break;
  }
  for (int i = 0; i < cfg.n_rot / 2; ++i) w[i] = std::pow(base_eff, -2.0 * (double)i / (double)cfg.n_rot);
}

// Angle a as a float number of half turns t in [-1, 1] (a = pi t + 2 pi k): sincospif takes it
// with no range reduction of its own (no slow path) and within 1 ulp.
XCTX_HOST_DEVICE inline float kvq_half_turns(double a) {
  constexpr double inv_two_pi = 0.15915494309189535;
  constexpr double inv_pi = 0.3183098861837907;
  constexpr double two_pi_hi = 6.283185307179586;       // fl(2 pi)
  constexpr double two_pi_lo = 2.4492935982947064e-16;  // 2 pi - fl(2 pi)
#if defined(__CUDA_ARCH__)
  const double k = rint(a * inv_two_pi);
  return (float)(fma(-k, two_pi_lo, fma(-k, two_pi_hi, a)) * inv_pi);
#else
  const double k = std::rint(a * inv_two_pi);
  return (float)(std::fma(-k, two_pi_lo, std::fma(-k, two_pi_hi, a)) * inv_pi);
#endif
}

XCTX_HOST_DEVICE inline float kvq_h2f(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // exact, like fp16_to_fp32
#else
  return fp16_to_fp32(h);
#endif
}

// ---- attention: tile decode -------------------------------------------------------------------

// One block's shared-memory staging of a tile of kv head g (pointers set by the kernel from the
// plan's layout, or by the host test). Shapes: T = kvq_tile, hd = head_dim.
struct kvq_tile_view {
  int g = 0;          // kv head
  int64_t s0 = 0;     // first slot of the tile
  int k_stride = 0;   // floats between K rows
  int v_stride = 0;   // floats between V rows
  float* k = nullptr;  // [T, k_stride] decoded, patched, rotated keys (columns [0, hd))
  float* kf = nullptr;  // [T, k_stride] SelfExtend: the same keys rotated to floor(pos / G) instead
  float* v = nullptr;  // [T, v_stride] decoded, patched values
  // per block
  float* lut_k = nullptr;     // [2^bits]
  float* lut_v = nullptr;     // [2^bits]
  float* ch_scale = nullptr;  // [hd] lut keys, channels g*hd + d
  float* ch_zero = nullptr;   // [hd]
  int* v_grp = nullptr;       // [hd] uniform: value group of channel g*hd + d
  double* w = nullptr;        // [n_rot / 2] RoPE frequency per pair
  // per slot of the tile
  int32_t* pos = nullptr;      // [T]
  double* pos_eff = nullptr;   // [T] pos / pos_div
  int64_t* qrow = nullptr;     // [T] quantized row index, -1 for an fp16 (sink or tail) row
  int64_t* k_aff = nullptr;    // [T] uniform: first k_group entry of the row's key group
  int64_t* v_aff = nullptr;    // [T] uniform: first v_group entry of the row
  float* v_scale = nullptr;    // [T] lut: the row's value scale
  float* v_zero = nullptr;     // [T]
};

// Thread `tid` of `n_threads` calls f(j, i) for its share of the items j < n_rows, i < per
// (item index j * per + i strided by n_threads), stepping without divisions.
template <class F>
XCTX_HOST_DEVICE inline void kvq_for_items(int tid, int n_threads, int n_rows, int per, F&& f) {
  int j = tid / per, i = tid % per;
  const int dj = n_threads / per, di = n_threads % per;
  while (j < n_rows) {
    f(j, i);
    i += di;
    j += dj;
    if (i >= per) i -= per, ++j;
  }
}

XCTX_HOST_DEVICE inline int kvq_setup_items(const kvq_layer_view& L, int n_pair) {
  const int a = L.head_dim > n_pair ? L.head_dim : n_pair;
  return a > kKvqMaxLut ? a : kKvqMaxLut;
}
XCTX_HOST_DEVICE inline void kvq_tile_setup(const kvq_layer_view& L, const kvq_tile_view& t,
                                            const double* w /*[n_pair]*/, int n_pair, int idx) {
  const int hd = L.head_dim, c = t.g * hd + idx;
  if (idx < n_pair) t.w[idx] = w[idx];
  if (L.n_quant() == 0) return;  // no quantized rows: the scheme's tables may be absent
  switch (L.scheme) {
    case kvq_scheme::kvq_uniform:
      if (idx < hd) t.v_grp[idx] = c / L.group;
      break;
    case kvq_scheme::kvq_lut:
      if (idx < hd) t.ch_scale[idx] = L.k_ch_scale[c], t.ch_zero[idx] = L.k_ch_zero[c];
      if (idx < (1 << L.bits)) t.lut_k[idx] = L.lut_k[idx], t.lut_v[idx] = L.lut_v[idx];
      break;
  }
}

XCTX_HOST_DEVICE inline void kvq_tile_meta(const kvq_layer_view& L, const kvq_tile_view& t, double pos_div, int j) {
  const int64_t s = t.s0 + j;
  const int32_t p = L.pos[s];
  t.pos[j] = p;
  t.pos_eff[j] = (double)p / pos_div;
  const int64_t i = (s >= L.n_sink && s < L.q_end) ? s - L.n_sink : -1;
  t.qrow[j] = i;
  t.k_aff[j] = 0, t.v_aff[j] = 0, t.v_scale[j] = 0.0f, t.v_zero[j] = 0.0f;
  if (i < 0) return;
  const int C = L.channels();
  switch (L.scheme) {
    case kvq_scheme::kvq_uniform:
      t.k_aff[j] = i / L.group * C;
      t.v_aff[j] = i * ((C + L.group - 1) / L.group);
      break;
    case kvq_scheme::kvq_lut: {
      const kvq_affine a = L.v_tok[i];
      t.v_scale[j] = kvq_h2f(a.scale), t.v_zero[j] = kvq_h2f(a.zero);
      break;
    }
  }
}

// Element (slot j, channel d of head g): the same arithmetic as kvq_dense_key/value.
XCTX_HOST_DEVICE inline void kvq_tile_dense(const kvq_layer_view& L, const kvq_tile_view& t, int j, int d) {
  const int C = L.channels(), c = t.g * L.head_dim + d;
  const int64_t s = t.s0 + j, i = t.qrow[j];
  float k = 0.0f, v = 0.0f;
  if (i < 0) {
    const bool sink = s < L.n_sink;
    const size_t at = (size_t)(sink ? s : s - L.q_end) * C + c;
    k = kvq_h2f((sink ? L.k_sink : L.k_tail)[at]);
    v = kvq_h2f((sink ? L.v_sink : L.v_tail)[at]);
  } else {
    const size_t rb = kvq_row_bytes(C, L.bits);
    const uint32_t kc = kvq_get_code(L.k_codes + (size_t)i * rb, L.bits, c);
    const uint32_t vc = kvq_get_code(L.v_codes + (size_t)i * rb, L.bits, c);
    switch (L.scheme) {
      case kvq_scheme::kvq_uniform: {
        const kvq_affine kp = L.k_group[t.k_aff[j] + c];
        const kvq_affine vp = L.v_group[t.v_aff[j] + t.v_grp[d]];
        k = kvq_uniform_decode(kc, kvq_h2f(kp.scale), kvq_h2f(kp.zero));
        v = kvq_uniform_decode(vc, kvq_h2f(vp.scale), kvq_h2f(vp.zero));
        break;
      }
      case kvq_scheme::kvq_lut:
        k = t.lut_k[kc] * t.ch_scale[d] + t.ch_zero[d];
        v = t.lut_v[vc] * t.v_scale[j] + t.v_zero[j];
        break;
    }
  }
  t.k[(size_t)j * t.k_stride + d] = k;
  t.v[(size_t)j * t.v_stride + d] = v;
}

// Sparse outliers of slot j that fall in head g: entries lane, lane + stride, ... of the row.
XCTX_HOST_DEVICE inline void kvq_tile_outliers(const kvq_layer_view& L, const kvq_tile_view& t, int j, int lane,
                                               int stride) {
  const int64_t i = t.qrow[j];
  if (i < 0) return;
  const int cb = t.g * L.head_dim;
  if (L.k_out_off != nullptr) {
    for (uint32_t e = L.k_out_off[i] + (uint32_t)lane; e < L.k_out_off[i + 1]; e += (uint32_t)stride) {
      const int d = (int)L.k_out_idx[e] - cb;
      if (d >= 0 && d < L.head_dim) t.k[(size_t)j * t.k_stride + d] += kvq_h2f(L.k_out_val[e]);
    }
  }
  for (int e = lane; e < L.v_out_per_tok; e += stride) {
    const size_t at = (size_t)i * L.v_out_per_tok + e;
    const int d = (int)L.v_out_idx[at] - cb;
    if (d >= 0 && d < L.head_dim) t.v[(size_t)j * t.v_stride + d] += kvq_h2f(L.v_out_val[at]);
  }
}

// The pair (x[0], x[1]) rotated by the angle a (radians), as ref::rope rotates a pair.
XCTX_HOST_DEVICE inline void kvq_rotate_pair(float* x, double a) {
  const float h = kvq_half_turns(a);
  float sn, cs;
#if defined(__CUDA_ARCH__)
  sincospif(h, &sn, &cs);
#else
  constexpr double pi = 3.141592653589793;
  sn = (float)std::sin(pi * (double)h), cs = (float)std::cos(pi * (double)h);  // sincospif within 1 ulp
#endif
  const float x0 = x[0], x1 = x[1];
  x[0] = x0 * cs - x1 * sn;
  x[1] = x0 * sn + x1 * cs;
}

// Rotary pair p (dims 2p, 2p+1) of slot j's key, as ref::rope rotates it.
XCTX_HOST_DEVICE inline void kvq_tile_rope(const kvq_tile_view& t, int j, int p) {
  kvq_rotate_pair(t.k + (size_t)j * t.k_stride + 2 * p, t.pos_eff[j] * t.w[p]);
}

// SelfExtend's rope phase for tiles that some row sees grouped, item c < (hd + 1) / 2 of slot j:
// the pair (2c, 2c+1) of the decoded key copied to kf rotated to the grouped position
// floor(pos / G), then rotated in place to pos as kvq_tile_rope does (pairs past n_pair are
// copied as they are).
XCTX_HOST_DEVICE inline void kvq_tile_rope_grouped(const kvq_tile_view& t, int j, int c, int hd, int n_pair,
                                                   int se_group, double pos_div) {
  float* x = t.k + (size_t)j * t.k_stride + 2 * c;
  float* y = t.kf + (size_t)j * t.k_stride + 2 * c;
  y[0] = x[0];
  if (2 * c + 1 < hd) y[1] = x[1];
  if (c >= n_pair) return;
  kvq_rotate_pair(y, (double)se_floor_div(t.pos[j], se_group) / pos_div * t.w[c]);
  kvq_rotate_pair(x, t.pos_eff[j] * t.w[c]);
}

// Pair (d, d + 1) of a query row of hd values (RoPE at its position), pre-multiplied by `scale`
// and turned by its SelfExtend shift (shift_eff = se_query_shift / pos_div) where pairs rotate;
// zeros past hd.
XCTX_HOST_DEVICE inline void se_turned_query_pair(const float* q_row, int hd, float scale, int n_pair, const double* w,
                                                  double shift_eff, int d, float* out /*[2]*/) {
  out[0] = d < hd ? q_row[d] * scale : 0.0f;
  out[1] = d + 1 < hd ? q_row[d + 1] * scale : 0.0f;
  if (d / 2 < n_pair) kvq_rotate_pair(out, shift_eff * w[d / 2]);
}

// ---- attention: launch plan -------------------------------------------------------------------

// Rows are (query i, head h) pairs sharing kv head g, flattened as i * group + (h - g * group);
// a block holds rows_per_block of them and walks the slots [chunk * z, chunk * (z + 1)).
struct kvq_attn_plan {
  int rows_per_warp = kvq_decode_rows_per_warp;
  int rows_per_block = kvq_decode_rows_per_warp * kvq_warps;
  int kd = 2;                 // 32-wide head_dim slices per lane: 2, 4 or 8
  int d4 = 0;                 // head_dim rounded up to 4 (q and V row length, zero padded)
  int k_stride = 0;           // K row stride (floats), == 4 (mod 8): conflict-free 16-byte reads
  int n_pair = 0;             // rotary pairs
  int64_t rows_total = 0;     // n_q * group, per kv head
  int64_t row_blocks = 0;
  int n_split = 1;            // blocks along the slot axis; > 1 means partials + a merge
  int64_t chunk = kvq_tile;   // slots per split, a multiple of kvq_tile
  bool self_extend = false;   // turned query rows (off_qf) and a grouped K tile (off_kf) too
  // dynamic shared memory layout (byte offsets, each 16-byte aligned)
  size_t off_w = 0, off_pos_eff = 0, off_qrow = 0, off_k_aff = 0, off_v_aff = 0;
  size_t off_q = 0, off_k = 0, off_v = 0, off_ch_scale = 0, off_ch_zero = 0, off_v_grp = 0;
  size_t off_lut_k = 0, off_lut_v = 0, off_v_scale = 0, off_v_zero = 0, off_pos = 0;
  size_t off_qf = 0, off_kf = 0;
  size_t smem_bytes = 0;
};

inline kvq_attn_plan plan_kvq_attention(int64_t n_q, int64_t n_slots, int n_head, int n_head_kv, int head_dim,
                                        int n_rot, int n_sm, bool self_extend = false) {
  kvq_attn_plan p;
  p.self_extend = self_extend;
  const int group = n_head / n_head_kv;
  p.rows_total = n_q * group;
  p.rows_per_warp = p.rows_total <= kvq_decode_rows_per_warp * kvq_warps ? kvq_decode_rows_per_warp
                                                                        : kvq_prefill_rows_per_warp;
  p.rows_per_block = p.rows_per_warp * kvq_warps;
  p.kd = head_dim <= 64 ? 2 : (head_dim <= 128 ? 4 : 8);
  p.d4 = (head_dim + 3) / 4 * 4;
  p.k_stride = p.d4 % 8 == 0 ? p.d4 + 4 : p.d4;
  p.n_pair = n_rot / 2;
  p.row_blocks = (p.rows_total + p.rows_per_block - 1) / p.rows_per_block;

  size_t at = 0;
  auto carve = [&](size_t bytes) {
    const size_t off = at;
    at += (bytes + 15) / 16 * 16;
    return off;
  };
  const size_t T = kvq_tile, hd = (size_t)head_dim;
  p.off_w = carve((size_t)p.n_pair * sizeof(double));
  p.off_pos_eff = carve(T * sizeof(double));
  p.off_qrow = carve(T * sizeof(int64_t));
  p.off_k_aff = carve(T * sizeof(int64_t));
  p.off_v_aff = carve(T * sizeof(int64_t));
  p.off_q = carve((size_t)p.rows_per_block * p.d4 * sizeof(float));
  p.off_k = carve(T * p.k_stride * sizeof(float));
  p.off_v = carve(T * p.d4 * sizeof(float));
  p.off_ch_scale = carve(hd * sizeof(float));
  p.off_ch_zero = carve(hd * sizeof(float));
  p.off_v_grp = carve(hd * sizeof(int));
  p.off_lut_k = carve(kKvqMaxLut * sizeof(float));
  p.off_lut_v = carve(kKvqMaxLut * sizeof(float));
  p.off_v_scale = carve(T * sizeof(float));
  p.off_v_zero = carve(T * sizeof(float));
  p.off_pos = carve(T * sizeof(int32_t));
  if (self_extend) {
    p.off_qf = carve((size_t)p.rows_per_block * p.d4 * sizeof(float));
    p.off_kf = carve(T * p.k_stride * sizeof(float));
  }
  p.smem_bytes = at;

  // Split the slot axis when the grid would not fill the device (flash-decoding).
  const int64_t tiles = std::max<int64_t>(1, (n_slots + kvq_tile - 1) / kvq_tile);
  const int64_t base_blocks = std::max<int64_t>(1, p.row_blocks * n_head_kv);
  const int64_t target = 2 * (int64_t)std::max(1, n_sm);
  const int64_t min_tiles = kvq_min_split_slots / kvq_tile;
  int64_t n_split = 1;
  if (base_blocks < target && tiles > min_tiles) {
    n_split = std::min((target + base_blocks - 1) / base_blocks, (tiles + min_tiles - 1) / min_tiles);
    const size_t per_split = (size_t)std::max<int64_t>(1, n_q * n_head) * ((size_t)head_dim + 1) * sizeof(float);
    n_split = std::max<int64_t>(1, std::min<int64_t>(n_split, (int64_t)(kvq_scratch_cap / per_split)));
  }
  const int64_t chunk_tiles = (tiles + n_split - 1) / n_split;
  p.chunk = chunk_tiles * kvq_tile;
  p.n_split = (int)((tiles + chunk_tiles - 1) / chunk_tiles);  // no split starts past the layer
  return p;
}

// The tile arrays of a block's dynamic shared memory `sm` laid out by the plan.
XCTX_HOST_DEVICE inline kvq_tile_view kvq_bind_tile(const kvq_attn_plan& pl, char* sm, int g) {
  kvq_tile_view t;
  t.g = g, t.k_stride = pl.k_stride, t.v_stride = pl.d4;
  t.k = reinterpret_cast<float*>(sm + pl.off_k);
  t.kf = pl.self_extend ? reinterpret_cast<float*>(sm + pl.off_kf) : nullptr;
  t.v = reinterpret_cast<float*>(sm + pl.off_v);
  t.lut_k = reinterpret_cast<float*>(sm + pl.off_lut_k);
  t.lut_v = reinterpret_cast<float*>(sm + pl.off_lut_v);
  t.ch_scale = reinterpret_cast<float*>(sm + pl.off_ch_scale);
  t.ch_zero = reinterpret_cast<float*>(sm + pl.off_ch_zero);
  t.v_grp = reinterpret_cast<int*>(sm + pl.off_v_grp);
  t.w = reinterpret_cast<double*>(sm + pl.off_w);
  t.pos = reinterpret_cast<int32_t*>(sm + pl.off_pos);
  t.pos_eff = reinterpret_cast<double*>(sm + pl.off_pos_eff);
  t.qrow = reinterpret_cast<int64_t*>(sm + pl.off_qrow);
  t.k_aff = reinterpret_cast<int64_t*>(sm + pl.off_k_aff);
  t.v_aff = reinterpret_cast<int64_t*>(sm + pl.off_v_aff);
  t.v_scale = reinterpret_cast<float*>(sm + pl.off_v_scale);
  t.v_zero = reinterpret_cast<float*>(sm + pl.off_v_zero);
  return t;
}

}  // namespace xctx::cuda
