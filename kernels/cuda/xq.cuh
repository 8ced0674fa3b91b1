// CUDA kernels of the X caches (kernels/cuda/xq.cu): launch plans, the shared-memory layout of
// the rebuild-attention block, and every per-item step of that block as host-device functions.
// Nothing here needs a CUDA header outside nvcc, so the test binary runs the same index math,
// the same plans and the same block phases item by item on the CPU (house style §2).
//
// Attention block: kv head g, R (query, head) rows of that head's GQA group, the rows of one
// split. Per tile of xq_tile rows, phases separated by one barrier each:
//   meta     per slot: position, effective RoPE position                 (xq_tile_meta)
//   K        k = b_k (or b_k + Z_k for the identity)                      (xq_tile_k_init)
//            then per chunk of xq_kc latent channels: decode Z_k chunk     (xq_tile_zk_chunk)
//            and M_k[chunk, head g] into shared memory, k += Z·M           (xq_tile_mk_chunk,
//                                                                          xq_tile_k_rebuild)
//   RoPE     per (slot, pair): kvq.cuh's kvq_tile_rope (same angle reduction and accuracy bound);
//            SelfExtend tiles that a row sees grouped also keep the key rotated to floor(p / G)
//            (xq_tile_rope_grouped), and the block's rows their turned queries (xq_setup_qf)
//   scores   per (row, slot): q·k with q pre-scaled, the grouped pair where the row sees the
//            slot grouped                                                  (xq_tile_score)
//   softmax  per row: online max/sum over the tile, p and the rescale α    (xq_tile_softmax)
//   U        per chunk of xq_vc latent channels: decode Z_v, U = α U + P·Z_v (xq_tile_zv_chunk,
//                                                                          xq_tile_u_update)
// V is never rebuilt: U is the row's Σ p_t z_v,t in the latent window (all C_v channels with
// M_v, head g's hd channels for the identity), written normalized (U / l) with the row's lse as
// a partial; splits merge with the ordinary merge kernel (row length = window width), and a last
// kernel projects each merged row once: o = u·M_v[:, head g] + b_v (xq_project_item).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cuda/kvq.cuh"
#include "kernels/x_quant.h"

namespace xctx::cuda {

struct context;  // kernels.cuh

// Entry points (xq.cu); every pointer in the job/args is a device pointer.
void xq_encode(context& ctx, const xq_encode_job& job);
void attention_xq(context& ctx, const xq_attn_args& a);
// out = x·u, the latents of n rows (x [n, d], u [d, r] row-major), and acc += z·uᵀ (z [n, r]):
// one FMA chain per output in channel order, so a row's result does not depend on the rows
// beside it. Rows [t0, t0 + nt) of a stream in f32 (xq_element per element).
void xq_project(context& ctx, const float* x, const float* u, int64_t n, int d, int r, float* out);
void xq_add_projected(context& ctx, const float* z, const float* u, int64_t n, int r, int d, float* acc);
void xq_decode_rows(context& ctx, const xq_stream& s, int64_t t0, int64_t nt, float* out);

constexpr int xq_threads = 128;
constexpr int xq_tile = 32;           // stream rows per attention tile
constexpr int xq_kc = 32;             // latent channels per K-rebuild chunk
constexpr int xq_vc = 128;            // latent channels per U-update chunk: one per thread
constexpr int xq_max_rows = 32;       // (query, head) rows per attention block
constexpr int xq_max_head_dim = kvq_max_head_dim;
constexpr int64_t xq_min_split_rows = 128;     // a split shorter than this costs more than it brings
constexpr size_t xq_scratch_cap = 256u << 20;  // split partials; bounds n_split for huge n_q
constexpr int xq_max_channels = 65536;

// ---- encode ----------------------------------------------------------------------------------

// xq_calibrate with contraction forbidden: nvcc would fuse z + (eta s) L into one FMA (one
// rounding less than the host's), so the device spells out the host's roundings.
XCTX_HOST_DEVICE inline kvq_affine xq_calibrate_nc(kvq_affine p, int bits, float eta) {
  if (eta == 0.0f) return p;
  const float s = fp16_to_fp32(p.scale), z = fp16_to_fp32(p.zero), lv = (float)((1 << bits) - 1);
#if defined(__CUDA_ARCH__)
  return {fp32_to_fp16(__fmul_rn(__fsub_rn(1.0f, __fmul_rn(2.0f, eta)), s)),
          fp32_to_fp16(__fadd_rn(z, __fmul_rn(__fmul_rn(eta, s), lv)))};
#else
  return {fp32_to_fp16((1.0f - 2.0f * eta) * s), fp32_to_fp16(z + eta * s * lv)};
#endif
}

// (value, index) of a running minimum / maximum with the sequential reference's tie rule (the
// first index among equal extremes wins, which decides the sign of a zero extreme). index -1 =
// no element. Associative and commutative, so any reduction tree gives the sequential answer.
struct xq_extreme {
  float v;
  int i;
};
XCTX_HOST_DEVICE inline xq_extreme xq_pick_min(xq_extreme a, xq_extreme b) {
  if (b.i < 0) return a;
  if (a.i < 0) return b;
  return (b.v < a.v || (!(a.v < b.v) && b.i < a.i)) ? b : a;
}
XCTX_HOST_DEVICE inline xq_extreme xq_pick_max(xq_extreme a, xq_extreme b) {
  if (b.i < 0) return a;
  if (a.i < 0) return b;
  return (a.v < b.v || (!(b.v < a.v) && b.i < a.i)) ? b : a;
}

struct xq_encode_plan {
  unsigned blocks_x = 0, blocks_y = 1;  // 0: nothing to launch
  size_t smem_bytes = 0;                // per token: the row's uncalibrated group parameters
};

// per_token: block per row (grid-stride), warp per channel group. per_channel: block per
// (slab of xq_threads channels, row group), thread = channel, min/max down the group's rows.
inline xq_encode_plan plan_xq_encode(xq_axis axis, int channels, int group, int64_t n, int n_sm) {
  xq_encode_plan p;
  if (n <= 0) return p;
  switch (axis) {
    case xq_axis::xq_per_token:
      p.blocks_x = (unsigned)std::min<int64_t>(n, 8 * (int64_t)std::max(1, n_sm));
      p.smem_bytes = (size_t)((channels + group - 1) / group) * sizeof(kvq_affine);
      return p;
    case xq_axis::xq_per_channel:
      p.blocks_x = (unsigned)((channels + xq_threads - 1) / xq_threads);
      p.blocks_y = (unsigned)std::min<int64_t>(n / group, 65535);
      return p;
  }
  XCTX_ASSERT(false, "plan_xq_encode: bad axis ", (int)axis);
  return p;
}

// ---- attention: plan and shared-memory layout ------------------------------------------------

struct xq_attn_plan {
  int R = 1;                 // (query, head) rows per block
  int hd = 0;                // head_dim
  int k_stride = 0;          // K tile row stride (odd: lane = slot reads hit distinct banks)
  int zc_stride = 0;         // decoded chunk row stride
  int wv = 0;                // latent window width (C_v with M_v, head_dim for the identity)
  int n_pair = 0;
  int64_t rows_total = 0;    // n_q * group, per kv head
  int64_t row_blocks = 0;
  int n_split = 1;
  int64_t chunk = xq_tile;   // stream rows per split, a multiple of xq_tile
  bool self_extend = false;  // turned query rows (off_qf) and a grouped K tile (off_kf) too
  size_t off_w = 0, off_pos_eff = 0, off_q = 0, off_k = 0, off_zc = 0, off_mk = 0, off_bk = 0;
  size_t off_s = 0, off_alpha = 0, off_m = 0, off_l = 0, off_u = 0, off_row_pos = 0, off_pos = 0;
  size_t off_qf = 0, off_kf = 0;
  size_t smem_bytes = 0;
};

inline size_t xq_attn_layout(xq_attn_plan& p) {
  size_t at = 0;
  auto carve = [&](size_t bytes) {
    const size_t off = at;
    at += (bytes + 15) / 16 * 16;
    return off;
  };
  const size_t T = xq_tile, R = (size_t)p.R, hd = (size_t)p.hd;
  p.off_w = carve((size_t)p.n_pair * sizeof(double));
  p.off_pos_eff = carve(T * sizeof(double));
  p.off_q = carve(R * hd * sizeof(float));
  p.off_k = carve(T * p.k_stride * sizeof(float));
  p.off_zc = carve(T * p.zc_stride * sizeof(float));
  p.off_mk = carve((size_t)xq_kc * hd * sizeof(float));
  p.off_bk = carve(hd * sizeof(float));
  p.off_s = carve(R * T * sizeof(float));
  p.off_alpha = carve(R * sizeof(float));
  p.off_m = carve(R * sizeof(float));
  p.off_l = carve(R * sizeof(float));
  p.off_u = carve(R * (size_t)p.wv * sizeof(float));
  p.off_row_pos = carve(R * sizeof(int32_t));
  p.off_pos = carve(T * sizeof(int32_t));
  if (p.self_extend) {
    p.off_qf = carve(R * hd * sizeof(float));
    p.off_kf = carve(T * p.k_stride * sizeof(float));
  }
  p.smem_bytes = at;
  return at;
}

// smem_cap: the dynamic shared memory a block may use. R shrinks (down to 1) until the layout
// fits; smem_bytes > smem_cap afterwards means even one row does not (the caller reports it).
inline xq_attn_plan plan_xq_attention(int64_t n_q, int64_t n, int n_head, int n_head_kv, int head_dim, int n_rot,
                                      int wv, int n_sm, size_t smem_cap, bool self_extend = false) {
  xq_attn_plan p;
  p.self_extend = self_extend;
  const int group = n_head / n_head_kv;
  p.hd = head_dim;
  p.k_stride = head_dim | 1;
  p.zc_stride = std::max(xq_kc, xq_vc) + 1;
  p.wv = wv;
  p.n_pair = n_rot / 2;
  p.rows_total = n_q * group;
  p.R = (int)std::max<int64_t>(1, std::min<int64_t>(xq_max_rows, p.rows_total));
  while (xq_attn_layout(p) > smem_cap && p.R > 1) --p.R;
  p.row_blocks = (p.rows_total + p.R - 1) / p.R;

  const int64_t tiles = std::max<int64_t>(1, (n + xq_tile - 1) / xq_tile);
  const int64_t base_blocks = std::max<int64_t>(1, p.row_blocks * n_head_kv);
  const int64_t target = 2 * (int64_t)std::max(1, n_sm);
  const int64_t min_tiles = xq_min_split_rows / xq_tile;
  int64_t n_split = 1;
  if (base_blocks < target && tiles > min_tiles) {
    n_split = std::min((target + base_blocks - 1) / base_blocks, (tiles + min_tiles - 1) / min_tiles);
    const size_t per_split = (size_t)std::max<int64_t>(1, n_q * n_head) * ((size_t)wv + 1) * sizeof(float);
    n_split = std::max<int64_t>(1, std::min<int64_t>(n_split, (int64_t)(xq_scratch_cap / per_split)));
  }
  const int64_t chunk_tiles = (tiles + n_split - 1) / n_split;
  p.chunk = chunk_tiles * xq_tile;
  p.n_split = (int)((tiles + chunk_tiles - 1) / chunk_tiles);  // no split starts past the stream
  return p;
}

// One block's view of its shared memory (set by the kernel from the plan, or by the host test).
struct xq_tile_view {
  int g = 0;             // kv head
  int64_t r0 = 0;        // first row (of rows_total) of the block
  int n_rows = 0;        // valid rows of the block (<= R)
  int64_t s0 = 0;        // first stream row of the tile
  int nt = 0;            // stream rows in the tile
  int v_off = 0;         // first channel of the latent window in Z_v
  xq_attn_plan pl;
  double* w = nullptr;        // [n_pair]
  double* pos_eff = nullptr;  // [T]
  float* q = nullptr;         // [R, hd] scaled queries
  float* k = nullptr;         // [T, k_stride] rebuilt, rotated keys of head g
  float* qf = nullptr;        // [R, hd] SelfExtend: scaled queries turned by their shift
  float* kf = nullptr;        // [T, k_stride] SelfExtend: the keys rotated to floor(p / G)
  float* zc = nullptr;        // [T, zc_stride] decoded latent chunk
  float* mk = nullptr;        // [xq_kc, hd] M_k chunk, head g's columns
  float* bk = nullptr;        // [hd] b_k of head g (zeros when absent)
  float* s = nullptr;         // [R, T] scores, then probabilities
  float* alpha = nullptr;     // [R] rescale of U for this tile
  float* m = nullptr;         // [R] running max
  float* l = nullptr;         // [R] running sum
  float* u = nullptr;         // [R, wv] Σ p z_v in the latent window
  int32_t* row_pos = nullptr;  // [R] q_pos of each row
  int32_t* pos = nullptr;      // [T]
  attn_sel_view sel;           // retrieval: the rows' unit lists (off by default)
  int group = 1;               // query heads per kv head (the rows' lists are per query)
};

XCTX_HOST_DEVICE inline xq_tile_view xq_bind_tile(const xq_attn_plan& pl, char* sm, int g, int64_t row_block) {
  xq_tile_view t;
  t.g = g;
  t.pl = pl;
  t.r0 = row_block * pl.R;
  const int64_t left = pl.rows_total - t.r0;
  t.n_rows = (int)(left < pl.R ? left : pl.R);
  t.w = reinterpret_cast<double*>(sm + pl.off_w);
  t.pos_eff = reinterpret_cast<double*>(sm + pl.off_pos_eff);
  t.q = reinterpret_cast<float*>(sm + pl.off_q);
  t.k = reinterpret_cast<float*>(sm + pl.off_k);
  t.qf = pl.self_extend ? reinterpret_cast<float*>(sm + pl.off_qf) : nullptr;
  t.kf = pl.self_extend ? reinterpret_cast<float*>(sm + pl.off_kf) : nullptr;
  t.zc = reinterpret_cast<float*>(sm + pl.off_zc);
  t.mk = reinterpret_cast<float*>(sm + pl.off_mk);
  t.bk = reinterpret_cast<float*>(sm + pl.off_bk);
  t.s = reinterpret_cast<float*>(sm + pl.off_s);
  t.alpha = reinterpret_cast<float*>(sm + pl.off_alpha);
  t.m = reinterpret_cast<float*>(sm + pl.off_m);
  t.l = reinterpret_cast<float*>(sm + pl.off_l);
  t.u = reinterpret_cast<float*>(sm + pl.off_u);
  t.row_pos = reinterpret_cast<int32_t*>(sm + pl.off_row_pos);
  t.pos = reinterpret_cast<int32_t*>(sm + pl.off_pos);
  return t;
}

XCTX_HOST_DEVICE inline float xq_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return fmaf(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

// Row r of the block: query i, head h (of head g's group).
XCTX_HOST_DEVICE inline void xq_row_of(const xq_tile_view& t, int group, int r, int64_t& i, int& h) {
  const int64_t rho = t.r0 + r;
  i = rho / group;
  h = t.g * group + (int)(rho % group);
}

// ---- attention: block setup (items before the first tile) -----------------------------------

// Item (r, d) of r < R, d < hd: scaled query (zero for rows past the block's valid rows).
XCTX_HOST_DEVICE inline void xq_setup_q(const xq_attn_args& a, const xq_tile_view& t, int r, int d) {
  const int group = a.n_head / a.n_head_kv;
  float v = 0.0f;
  if (r < t.n_rows) {
    int64_t i;
    int h;
    xq_row_of(t, group, r, i, h);
    v = a.q[(i * a.n_head + h) * (int64_t)a.head_dim + d] * a.scale;
  }
  t.q[r * t.pl.hd + d] = v;
}
// SelfExtend, item (r, c) of r < R, c < (hd + 1) / 2: pair (2c, 2c+1) of row r's scaled query
// turned by its grouped shift (zero for rows past the block's valid rows).
XCTX_HOST_DEVICE inline void xq_setup_qf(const xq_attn_args& a, const xq_tile_view& t, const double* w, double pos_div,
                                         int r, int c) {
  float x[2] = {0.0f, 0.0f};
  if (r < t.n_rows) {
    int64_t i;
    int h;
    xq_row_of(t, a.n_head / a.n_head_kv, r, i, h);
    se_turned_query_pair(a.q + (i * a.n_head + h) * (int64_t)a.head_dim, a.head_dim, a.scale, t.pl.n_pair, w,
                         (double)se_query_shift(a.q_pos[i], a.rope.se_group, a.rope.se_window) / pos_div, 2 * c, x);
  }
  t.qf[r * t.pl.hd + 2 * c] = x[0];
  if (2 * c + 1 < t.pl.hd) t.qf[r * t.pl.hd + 2 * c + 1] = x[1];
}
// Item idx < max(R, hd, n_pair, wv * R): per-row state, b_k slice, frequencies, U = 0.
XCTX_HOST_DEVICE inline void xq_setup_misc(const xq_attn_args& a, const xq_tile_view& t, const double* w, int idx) {
  const xq_attn_plan& pl = t.pl;
  if (idx < pl.R) {
    int32_t p = INT32_MIN;
    if (idx < t.n_rows) {
      int64_t i;
      int h;
      xq_row_of(t, a.n_head / a.n_head_kv, idx, i, h);
      p = a.q_pos[i];
    }
    t.row_pos[idx] = p;
    t.m[idx] = -INFINITY;
    t.l[idx] = 0.0f;
  }
  if (idx < pl.hd) t.bk[idx] = a.b_k != nullptr ? a.b_k[t.g * pl.hd + idx] : 0.0f;
  if (idx < pl.n_pair) t.w[idx] = w[idx];
  if (idx < pl.R * pl.wv) t.u[idx] = 0.0f;
}
XCTX_HOST_DEVICE inline int xq_setup_items(const xq_attn_plan& pl) {
  int n = pl.R * pl.wv;
  n = n > pl.hd ? n : pl.hd;
  return n > pl.n_pair ? n : pl.n_pair;
}

// ---- attention: tile phases ------------------------------------------------------------------

XCTX_HOST_DEVICE inline void xq_tile_meta(const xq_attn_args& a, const xq_tile_view& t, double pos_div, int j) {
  const int32_t p = a.pos[t.s0 + j];
  t.pos[j] = p;
  t.pos_eff[j] = (double)p / pos_div;
}

// Item (j, d) of j < nt, d < hd. The identity rebuild decodes head g's channels directly.
XCTX_HOST_DEVICE inline void xq_tile_k_init(const xq_attn_args& a, const xq_tile_view& t, int j, int d) {
  float v = t.bk[d];
  if (a.m_k == nullptr) v += xq_element(a.zk, t.s0 + j, t.g * t.pl.hd + d);
  t.k[j * t.pl.k_stride + d] = v;
}

// Item (j, c) of j < T, c < xq_kc: latent channel c0 + c of stream row s0 + j (zero past the
// tile or the channels, so the rebuild may run over whole chunks).
XCTX_HOST_DEVICE inline void xq_tile_zk_chunk(const xq_attn_args& a, const xq_tile_view& t, int c0, int j, int c) {
  const int ch = c0 + c;
  t.zc[j * t.pl.zc_stride + c] = (j < t.nt && ch < a.zk.channels) ? xq_element(a.zk, t.s0 + j, ch) : 0.0f;
}
// Item (c, d) of c < xq_kc, d < hd: M_k[c0 + c, g*hd + d] (zero past the channels).
XCTX_HOST_DEVICE inline void xq_tile_mk_chunk(const xq_attn_args& a, const xq_tile_view& t, int c0, int c, int d) {
  const int ch = c0 + c;
  t.mk[c * t.pl.hd + d] = ch < a.zk.channels ? a.m_k[(int64_t)ch * a.ld_mk + t.g * t.pl.hd + d] : 0.0f;
}
// Item (j, d) of j < nt, d < hd: k += Z chunk · M chunk (FMA chain in channel order).
XCTX_HOST_DEVICE inline void xq_tile_k_rebuild(const xq_tile_view& t, int j, int d) {
  float acc = t.k[j * t.pl.k_stride + d];
  const float* z = t.zc + j * t.pl.zc_stride;
  for (int c = 0; c < xq_kc; ++c) acc = xq_fma(z[c], t.mk[c * t.pl.hd + d], acc);
  t.k[j * t.pl.k_stride + d] = acc;
}

// Rotary pair p of slot j: kvq.cuh's rotation (angle reduced in double, sincospif).
XCTX_HOST_DEVICE inline void xq_tile_rope(const xq_tile_view& t, int j, int p) {
  kvq_tile_view kv;
  kv.k = t.k;
  kv.k_stride = t.pl.k_stride;
  kv.pos_eff = t.pos_eff;
  kv.w = t.w;
  kvq_tile_rope(kv, j, p);
}

// SelfExtend, item (j, c) of j < nt, c < (hd + 1) / 2, instead of xq_tile_rope where a row sees
// the tile grouped: kf = the rebuilt key rotated to floor(p / G), k = rotated to p.
XCTX_HOST_DEVICE inline void xq_tile_rope_grouped(const xq_tile_view& t, int se_group, double pos_div, int j, int c) {
  kvq_tile_view kv;
  kv.k = t.k;
  kv.kf = t.kf;
  kv.k_stride = t.pl.k_stride;
  kv.pos = t.pos;
  kv.pos_eff = t.pos_eff;
  kv.w = t.w;
  kvq_tile_rope_grouped(kv, j, c, t.pl.hd, t.pl.n_pair, se_group, pos_div);
}

// Whether row r < n_rows sees a slot at position pos: causal, and listed when selecting.
XCTX_HOST_DEVICE inline bool xq_row_sees(const xq_tile_view& t, int r, int32_t pos) {
  if (pos > t.row_pos[r]) return false;
  if (!sel_on(t.sel)) return true;
  int64_t i;
  int h;
  xq_row_of(t, t.group, r, i, h);
  return sel_listed(t.sel, sel_list(t.sel, i, t.g), pos);
}

// Item (r, j) of r < n_rows, j < T: score of row r against slot j (-inf when invisible); with
// SelfExtend (se_window >= 0) the turned row against the grouped key where the row sees it so.
XCTX_HOST_DEVICE inline void xq_tile_score(const xq_tile_view& t, int r, int j, int se_window = -1) {
  float s = -INFINITY;
  if (j < t.nt && xq_row_sees(t, r, t.pos[j])) {
    s = 0.0f;
    const bool grouped = se_window >= 0 && se_grouped(t.row_pos[r], t.pos[j], se_window);
    const float* q = (grouped ? t.qf : t.q) + r * t.pl.hd;
    const float* k = (grouped ? t.kf : t.k) + j * t.pl.k_stride;
    for (int d = 0; d < t.pl.hd; ++d) s = xq_fma(q[d], k[d], s);
  }
  t.s[r * xq_tile + j] = s;
}

// Row r < n_rows: online softmax over the tile's scores; s becomes p, alpha the rescale of U.
XCTX_HOST_DEVICE inline void xq_tile_softmax(const xq_tile_view& t, int r) {
  float* s = t.s + r * xq_tile;
  float mx = t.m[r];
  for (int j = 0; j < xq_tile; ++j) mx = s[j] > mx ? s[j] : mx;
  if (mx == -INFINITY) {  // nothing visible yet: exp(-inf - -inf) would be NaN
    for (int j = 0; j < xq_tile; ++j) s[j] = 0.0f;
    t.alpha[r] = 1.0f;
    return;
  }
  const float alpha = expf(t.m[r] - mx);  // 0 when m was -inf
  float sum = 0.0f;
  for (int j = 0; j < xq_tile; ++j) {
    const float p = s[j] == -INFINITY ? 0.0f : expf(s[j] - mx);
    s[j] = p;
    sum += p;
  }
  t.l[r] = t.l[r] * alpha + sum;
  t.m[r] = mx;
  t.alpha[r] = alpha;
}

// Item (j, c) of j < T, c < xq_vc: window channel c0 + c of Z_v's stream row s0 + j.
XCTX_HOST_DEVICE inline void xq_tile_zv_chunk(const xq_attn_args& a, const xq_tile_view& t, int c0, int j, int c) {
  const int wc = c0 + c;
  t.zc[j * t.pl.zc_stride + c] = (j < t.nt && wc < t.pl.wv) ? xq_element(a.zv, t.s0 + j, t.v_off + wc) : 0.0f;
}
// Item (r, c) of r < n_rows, c < min(xq_vc, wv - c0): U[r, c0 + c] = α U + Σ_j p_j z_j.
XCTX_HOST_DEVICE inline void xq_tile_u_update(const xq_tile_view& t, int c0, int r, int c) {
  float* u = t.u + (int64_t)r * t.pl.wv + c0 + c;
  float acc = *u * t.alpha[r];
  const float* p = t.s + r * xq_tile;
  for (int j = 0; j < t.nt; ++j) acc = xq_fma(p[j], t.zc[j * t.pl.zc_stride + c], acc);
  *u = acc;
}

// Item (r, c) of r < n_rows, c < wv: the block's partial, U / l and lse (empty row: 0, -inf).
XCTX_HOST_DEVICE inline void xq_tile_finish(const xq_attn_args& a, const xq_tile_view& t, int r, int c,
                                            float* u_out /*[n_q * n_head, wv]*/, float* lse_out /*[n_q * n_head]*/) {
  int64_t i;
  int h;
  xq_row_of(t, a.n_head / a.n_head_kv, r, i, h);
  const int64_t row = i * a.n_head + h;
  const bool empty = t.m[r] == -INFINITY;
  u_out[row * t.pl.wv + c] = empty ? 0.0f : t.u[(int64_t)r * t.pl.wv + c] / t.l[r];
  if (c == 0) lse_out[row] = empty ? -INFINITY : t.m[r] + logf(t.l[r]);
}

// ---- attention: projection ---------------------------------------------------------------------

// Output element e of row `row` (= i * n_head + h): u·M_v[:, kvh*hd + e] + b_v, or 0 for a row
// that saw nothing. u: the merged, normalized latent row [wv].
XCTX_HOST_DEVICE inline float xq_project_item(const xq_attn_args& a, const float* u /*[wv]*/, float lse, int64_t row,
                                              int e) {
  if (lse == -INFINITY) return 0.0f;
  const int h = (int)(row % a.n_head), kvh = h / (a.n_head / a.n_head_kv), c = kvh * a.head_dim + e;
  float acc = 0.0f;
  if (a.m_v != nullptr)
    for (int j = 0; j < a.zv.channels; ++j) acc = xq_fma(u[j], a.m_v[(int64_t)j * a.ld_mv + c], acc);
  else
    acc = u[e];
  return acc + (a.b_v != nullptr ? a.b_v[c] : 0.0f);
}

}  // namespace xctx::cuda
