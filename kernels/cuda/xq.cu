// CUDA kernels of the X caches: the latent-stream encoder (codes and parameters bit-identical to
// ref::xq_encode) and the rebuild-attention with V absorbed (phases and layout in xq.cuh).
//
// Encoder. Every value that decides a code or a stored parameter goes through the x_quant.h /
// kv_quant.h functions the reference calls (IEEE division, rintf), except the calibration,
// whose z + (eta s) L nvcc would contract into an FMA: xq_calibrate_nc spells out the host's
// roundings. The build must not use -use_fast_math / -prec-div=false / -ftz=true for this file.
// Min/max keep the reference's first-of-equal rule (xq_pick_min / xq_pick_max).
//
// Attention. K is rebuilt per 32-row tile in shared memory by a small GEMM over chunks of 32
// latent channels, not by cuBLAS: the rebuilt tile of a decode step is 32 x hd outputs per
// block, far too small for a cuBLAS call each, and a cuBLAS rebuild of a whole block of rows
// would write and re-read 4 kv bytes per row in global memory where the cache reads
// C_k bits / 8, which is the traffic the X cache exists to avoid. The fused tile keeps the
// rebuilt K on chip; the cost is compute (2 C_k hd per row and kv head), which is the
// rebuild's inherent FLOP count.
#include <climits>
#include <cmath>
#include <cstdint>

#include "common/error.h"
#include "common/cuda_check.h"
#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/xq.cuh"
#include "kernels/cuda/scratch.h"

namespace xctx::cuda {

namespace {

constexpr int kWarps = xq_threads / 32;

// ---- encoder ---------------------------------------------------------------------------------

__device__ inline xq_extreme shfl_xor(xq_extreme e, int o) {
  return {__shfl_xor_sync(0xffffffffu, e.v, o), __shfl_xor_sync(0xffffffffu, e.i, o)};
}

__global__ void __launch_bounds__(xq_threads) per_token_kernel(const xq_encode_job j) {
  extern __shared__ kvq_affine s_par[];  // [n_g] the parameters the codes are computed against
  const int C = j.channels, G = j.group, n_g = (C + G - 1) / G;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t rb = kvq_row_bytes(C, j.bits);
  for (int64_t t = blockIdx.x; t < j.n; t += gridDim.x) {
    if (j.ch0 != nullptr && threadIdx.x == 0) j.ch0[t] = xq_encode_ch0(j, t);
    for (int g = warp; g < n_g; g += kWarps) {
      const int c0 = g * G, c1 = min(C, c0 + G);
      xq_extreme lo{0.0f, -1}, hi{0.0f, -1};
      for (int c = c0 + lane; c < c1; c += 32) {
        const xq_extreme e{xq_encode_input(j, t, c), c};
        lo = xq_pick_min(lo, e);
        hi = xq_pick_max(hi, e);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        lo = xq_pick_min(lo, shfl_xor(lo, o));
        hi = xq_pick_max(hi, shfl_xor(hi, o));
      }
      if (lane == 0) {
        const kvq_affine p = kvq_uniform_params(lo.v, hi.v, j.bits);
        s_par[g] = p;
        j.params[t * n_g + g] = xq_calibrate_nc(p, j.bits, j.eta);
      }
    }
    __syncthreads();
    if (j.codes != nullptr) {
      for (int c0 = (int)threadIdx.x * 8; c0 < C; c0 += xq_threads * 8) {
        uint8_t codes[8];
#pragma unroll
        for (int e = 0; e < 8; ++e)
          codes[e] = kvq_uniform_encode(xq_encode_input(j, t, c0 + e), s_par[(c0 + e) / G], j.bits);
        kvq_pack8(codes, j.bits, j.codes + t * rb + (size_t)(c0 / 8) * j.bits);
      }
    }
    __syncthreads();  // s_par is rewritten for the next row
  }
}

__global__ void __launch_bounds__(xq_threads) per_channel_kernel(const xq_encode_job j) {
  __shared__ kvq_affine s_par[xq_threads];
  const int C = j.channels, G = j.group, c_base = (int)blockIdx.x * xq_threads, c = c_base + (int)threadIdx.x;
  const int units = min(xq_threads, C - c_base) / 8;  // C and c_base are multiples of 8
  const size_t rb = kvq_row_bytes(C, j.bits);
  for (int64_t g = blockIdx.y; g < j.n / G; g += gridDim.y) {
    const int64_t t0 = g * G;
    if (j.ch0 != nullptr && blockIdx.x == 0)
      for (int t = (int)threadIdx.x; t < G; t += xq_threads) j.ch0[t0 + t] = xq_encode_ch0(j, t0 + t);
    if (c < C) {
      float lo = xq_encode_input(j, t0, c), hi = lo;
      for (int t = 1; t < G; ++t) {
        const float v = xq_encode_input(j, t0 + t, c);
        lo = v < lo ? v : lo;  // std::min(lo, v)
        hi = hi < v ? v : hi;  // std::max(hi, v)
      }
      const kvq_affine p = kvq_uniform_params(lo, hi, j.bits);
      s_par[threadIdx.x] = p;
      j.params[g * C + c] = xq_calibrate_nc(p, j.bits, j.eta);
    }
    __syncthreads();
    if (j.codes != nullptr) {
      for (int64_t it = threadIdx.x; it < (int64_t)G * units; it += xq_threads) {
        const int64_t t = it / units;
        const int u = (int)(it % units), c0 = c_base + 8 * u;
        uint8_t codes[8];
#pragma unroll
        for (int e = 0; e < 8; ++e)
          codes[e] = kvq_uniform_encode(xq_encode_input(j, t0 + t, c0 + e), s_par[8 * u + e], j.bits);
        kvq_pack8(codes, j.bits, j.codes + (g * G + t) * rb + (size_t)(c0 / 8) * j.bits);
      }
    }
    __syncthreads();
  }
}

// ---- row products: latents x·U of new rows, and acc += z·Uᵀ ----------------------------------

// out[t, j] (+)= Σ_k a[t, k] B(k, j) for t < n, j < N, with B(k, j) = b[k * b_k + j * b_j] (U for
// the latents, Uᵀ for xquant-cl's accumulator update). Tiles of xq_lat_tile rows x xq_lat_tile
// columns; thread (tx, ty) owns column tx of rows ty, ty + 8, ... Each output is one FMA chain
// over k in order (then added to out when accumulating), so its bits depend on its own row only
// (not on how many rows share the call: rank-count invariance), unlike a cuBLAS call whose
// algorithm may change with n.
constexpr int xq_lat_tile = 32, xq_lat_ty = 8;

__global__ void __launch_bounds__(xq_lat_tile* xq_lat_ty)
    xq_rows_kernel(const float* __restrict__ a, int64_t n, int K, const float* __restrict__ b, int64_t b_k,
                   int64_t b_j, int N, float* __restrict__ out, bool accumulate) {
  __shared__ float as[xq_lat_tile][xq_lat_tile + 1], bs[xq_lat_tile][xq_lat_tile + 1];
  const int tx = (int)threadIdx.x, ty = (int)threadIdx.y;
  const int64_t t0 = (int64_t)blockIdx.x * xq_lat_tile;
  const int j = (int)blockIdx.y * xq_lat_tile + tx;
  float acc[xq_lat_tile / xq_lat_ty] = {};
  for (int k0 = 0; k0 < K; k0 += xq_lat_tile) {
    for (int r = ty; r < xq_lat_tile; r += xq_lat_ty) {
      const int64_t t = t0 + r;
      as[r][tx] = (t < n && k0 + tx < K) ? a[t * K + k0 + tx] : 0.0f;
      bs[r][tx] = (k0 + r < K && j < N) ? b[(int64_t)(k0 + r) * b_k + (int64_t)j * b_j] : 0.0f;
    }
    __syncthreads();
    const int m = min(xq_lat_tile, K - k0);  // padding never enters a chain
#pragma unroll
    for (int q = 0; q < xq_lat_tile / xq_lat_ty; ++q)
      for (int k = 0; k < m; ++k) acc[q] = fmaf(as[ty + q * xq_lat_ty][k], bs[k][tx], acc[q]);
    __syncthreads();
  }
  if (j >= N) return;
#pragma unroll
  for (int q = 0; q < xq_lat_tile / xq_lat_ty; ++q) {
    const int64_t t = t0 + ty + q * xq_lat_ty;
    if (t < n) out[t * N + j] = accumulate ? out[t * N + j] + acc[q] : acc[q];
  }
}

void launch_rows(context& ctx, const float* a, int64_t n, int K, const float* b, int64_t b_k, int64_t b_j, int N,
                 float* out, bool accumulate, const char* what) {
  XCTX_CHECK(n >= 0 && K > 0 && N > 0, "cuda ", what, ": bad sizes n=", n, " K=", K, " N=", N);
  if (n == 0) return;
  const int64_t row_tiles = (n + xq_lat_tile - 1) / xq_lat_tile;
  XCTX_CHECK(row_tiles <= INT_MAX && (N + xq_lat_tile - 1) / xq_lat_tile <= 65535, "cuda ", what, ": ", n,
             " rows of ", N, " columns exceed one launch");
  const dim3 grid((unsigned)row_tiles, (unsigned)((N + xq_lat_tile - 1) / xq_lat_tile));
  xq_rows_kernel<<<grid, dim3(xq_lat_tile, xq_lat_ty), 0, ctx.stream>>>(a, n, K, b, b_k, b_j, N, out, accumulate);
  CUDA_CHECK_LAUNCH();
}

// Element e of rows [t0, t0 + nt): xq_element, the per-element function the host decodes with.
__global__ void __launch_bounds__(xq_threads)
    xq_decode_kernel(const xq_stream s, int64_t t0, int64_t nt, float* __restrict__ out) {
  const int64_t total = nt * s.channels;
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (int64_t)gridDim.x * blockDim.x)
    out[e] = xq_element(s, t0 + e / s.channels, (int)(e % s.channels));
}

void check_encode_job(const xq_encode_job& j) {
  XCTX_CHECK(j.bits >= 1 && j.bits <= kXqMaxBits, "cuda xq_encode: bits must be 1..", kXqMaxBits, ", got ", j.bits);
  XCTX_CHECK(j.channels > 0 && j.channels % 8 == 0 && j.channels <= xq_max_channels,
             "cuda xq_encode: channels must be a positive multiple of 8 up to ", xq_max_channels, ", got ",
             j.channels);
  XCTX_CHECK(j.group > 0 && j.n >= 0, "cuda xq_encode: group ", j.group, " / rows ", j.n, " invalid");
  XCTX_CHECK(j.eta >= 0.0f && j.eta < 0.5f, "cuda xq_encode: calibration eta must be in [0, 0.5), got ", j.eta);
  XCTX_CHECK(j.axis != xq_axis::xq_per_channel || j.n % j.group == 0, "cuda xq_encode: per-channel rows ", j.n,
             " are not whole groups of ", j.group);
  XCTX_CHECK(j.n == 0 || ((j.x != nullptr) != (j.x16 != nullptr) && j.params != nullptr),
             "cuda xq_encode: exactly one of x / x16, and params, must be given");
}

// ---- attention -------------------------------------------------------------------------------

struct attn_params {
  xq_attn_args a;
  xq_attn_plan plan;
  double pos_div;
  float* u_out;    // [n_split][n_q * n_head, wv]
  float* lse_out;  // [n_split][n_q * n_head]
  int64_t u_split_stride, lse_split_stride;
  double w[kvq_max_pairs];
  attn_sel_view sel;  // retrieval: the rows' unit lists (off when lists_per_query == 0)
};
static_assert(sizeof(attn_params) <= 4096, "kernel parameters must fit the 4 KiB every architecture accepts");

__global__ void __launch_bounds__(xq_threads) xq_attn_kernel(const __grid_constant__ attn_params p) {
  extern __shared__ float4 smem4[];
  const xq_attn_args& a = p.a;
  const xq_attn_plan& pl = p.plan;
  xq_tile_view t = xq_bind_tile(pl, reinterpret_cast<char*>(smem4), (int)blockIdx.y, (int64_t)blockIdx.x);
  t.v_off = a.m_v != nullptr ? 0 : t.g * pl.hd;
  t.sel = p.sel;
  t.group = a.n_head / a.n_head_kv;
  const int tid = threadIdx.x, hd = pl.hd;
  __shared__ int s_maxpos;

  const bool se = pl.self_extend;
  const int se_window = se ? a.rope.se_window : -1;
  kvq_for_items(tid, xq_threads, pl.R, hd, [&](int r, int d) { xq_setup_q(a, t, r, d); });
  if (se) kvq_for_items(tid, xq_threads, pl.R, (hd + 1) / 2, [&](int r, int c) { xq_setup_qf(a, t, p.w, p.pos_div, r, c); });
  for (int idx = tid; idx < xq_setup_items(pl); idx += xq_threads) xq_setup_misc(a, t, p.w, idx);
  __syncthreads();
  if (tid == 0) {
    int mp = INT_MIN;
    for (int r = 0; r < t.n_rows; ++r) mp = max(mp, t.row_pos[r]);
    s_maxpos = mp;
  }
  __syncthreads();
  const int max_pos = s_maxpos;

  const int64_t j_begin = (int64_t)blockIdx.z * pl.chunk;
  const int64_t j_end = min(a.n, j_begin + pl.chunk);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += xq_tile) {
    if (a.pos[j0] > max_pos) break;  // block-uniform; positions ascend
    const int nt = (int)min((int64_t)xq_tile, j_end - j0);
    if (sel_on(t.sel)) {  // retrieval: a tile no row lists is neither decoded nor rebuilt
      bool any = false;
      for (int idx = tid; idx < t.n_rows * nt && !any; idx += xq_threads)
        any = xq_row_sees(t, idx / nt, a.pos[j0 + idx % nt]);
      if (!__syncthreads_or(any)) continue;  // block-uniform
    }
    t.s0 = j0;
    t.nt = nt;
    if (tid < t.nt) xq_tile_meta(a, t, p.pos_div, tid);
    kvq_for_items(tid, xq_threads, t.nt, hd, [&](int j, int d) { xq_tile_k_init(a, t, j, d); });
    if (a.m_k != nullptr) {
      for (int c0 = 0; c0 < a.zk.channels; c0 += xq_kc) {
        __syncthreads();  // the previous chunk is no longer read
        kvq_for_items(tid, xq_threads, xq_tile, xq_kc, [&](int j, int c) { xq_tile_zk_chunk(a, t, c0, j, c); });
        kvq_for_items(tid, xq_threads, xq_kc, hd, [&](int c, int d) { xq_tile_mk_chunk(a, t, c0, c, d); });
        __syncthreads();
        kvq_for_items(tid, xq_threads, t.nt, hd, [&](int j, int d) { xq_tile_k_rebuild(t, j, d); });
      }
    }
    __syncthreads();
    // SelfExtend, block-uniform: the tile's first slot W behind the block's latest row.
    if (se && (int64_t)max_pos - a.pos[j0] >= se_window) {
      kvq_for_items(tid, xq_threads, t.nt, (hd + 1) / 2,
                    [&](int j, int c) { xq_tile_rope_grouped(t, a.rope.se_group, p.pos_div, j, c); });
      __syncthreads();
    } else if (pl.n_pair > 0) {
      kvq_for_items(tid, xq_threads, t.nt, pl.n_pair, [&](int j, int i) { xq_tile_rope(t, j, i); });
      __syncthreads();
    }
    kvq_for_items(tid, xq_threads, t.n_rows, xq_tile, [&](int r, int j) { xq_tile_score(t, r, j, se_window); });
    __syncthreads();
    if (tid < t.n_rows) xq_tile_softmax(t, tid);
    for (int c0 = 0; c0 < pl.wv; c0 += xq_vc) {
      __syncthreads();  // softmax done / the previous chunk is no longer read
      kvq_for_items(tid, xq_threads, xq_tile, xq_vc, [&](int j, int c) { xq_tile_zv_chunk(a, t, c0, j, c); });
      __syncthreads();
      const int cw = min(xq_vc, pl.wv - c0);
      kvq_for_items(tid, xq_threads, t.n_rows, cw, [&](int r, int c) { xq_tile_u_update(t, c0, r, c); });
    }
    __syncthreads();  // the next tile overwrites k, s and zc
  }
  float* u_out = p.u_out + (int64_t)blockIdx.z * p.u_split_stride;
  float* lse_out = p.lse_out + (int64_t)blockIdx.z * p.lse_split_stride;
  kvq_for_items(tid, xq_threads, t.n_rows, pl.wv, [&](int r, int c) { xq_tile_finish(a, t, r, c, u_out, lse_out); });
}

// Block per row: the merged latent row staged in shared memory, thread per output element.
__global__ void __launch_bounds__(xq_threads)
    xq_project_kernel(const xq_attn_args a, int wv, const float* u /*[n_row, wv]*/, int64_t n_row) {
  extern __shared__ float s_u[];  // [wv]
  for (int64_t row = blockIdx.x; row < n_row; row += gridDim.x) {
    __syncthreads();
    for (int c = threadIdx.x; c < wv; c += xq_threads) s_u[c] = u[row * wv + c];
    __syncthreads();
    const float lse = a.lse[row];
    for (int e = threadIdx.x; e < a.head_dim; e += xq_threads)
      a.o[row * a.head_dim + e] = xq_project_item(a, s_u, lse, row, e);
  }
}

void check_stream(const xq_stream& s, int64_t n, const char* what) {
  XCTX_CHECK(s.channels > 0 && s.channels % 8 == 0 && s.channels <= xq_max_channels, "cuda attention_xq: ", what,
             " stream of ", s.channels, " channels (need a positive multiple of 8 up to ", xq_max_channels, ")");
  if (s.dense != nullptr || n == 0) return;
  XCTX_CHECK(s.bits >= 1 && s.bits <= kXqMaxBits && s.group > 0 && s.nq >= 0 && s.nq <= n &&
                 (s.axis != xq_axis::xq_per_channel || s.nq % s.group == 0),
             "cuda attention_xq: bad ", what, " stream (bits ", s.bits, ", group ", s.group, ", nq ", s.nq, ", n ",
             n, ")");
  XCTX_CHECK(s.nq == 0 || (s.codes != nullptr && s.params != nullptr), "cuda attention_xq: ", what,
             " stream has quantized rows but null codes or params");
  XCTX_CHECK(s.nq == n || s.tail != nullptr, "cuda attention_xq: ", what, " stream has fp16 rows but a null tail");
}

void check_attn_args(const xq_attn_args& a) {
  XCTX_CHECK(a.n >= 0 && a.n_q >= 0, "cuda attention_xq: negative sizes n=", a.n, " n_q=", a.n_q);
  XCTX_CHECK(a.rope.se_period == 0, "cuda attention_xq: retrieval's ordered far positions (se_period) are not implemented on CUDA; use --far-positions fixed");
  XCTX_CHECK(a.n_head_kv > 0 && a.n_head > 0 && a.n_head % a.n_head_kv == 0 && a.n_head_kv <= 65535,
             "cuda attention_xq: bad heads n_head=", a.n_head, " n_head_kv=", a.n_head_kv);
  XCTX_CHECK(a.head_dim > 0 && a.head_dim <= xq_max_head_dim, "cuda attention_xq: head_dim ", a.head_dim,
             " outside [1, ", xq_max_head_dim, "]");
  check_stream(a.zk, a.n, "key");
  check_stream(a.zv, a.n, "value");
  const int kv = a.n_head_kv * a.head_dim;
  XCTX_CHECK((a.m_k != nullptr || a.zk.channels == kv) && (a.m_v != nullptr || a.zv.channels == kv),
             "cuda attention_xq: identity rebuild needs ", kv, " channels, streams have ", a.zk.channels, " / ",
             a.zv.channels);
  XCTX_CHECK(a.m_k == nullptr || a.ld_mk >= kv, "cuda attention_xq: ld_mk ", a.ld_mk, " < ", kv);
  XCTX_CHECK(a.m_v == nullptr || a.ld_mv >= kv, "cuda attention_xq: ld_mv ", a.ld_mv, " < ", kv);
  const rope_config& r = a.rope;
  XCTX_CHECK(r.head_dim == a.head_dim && r.n_rot >= 0 && r.n_rot <= r.head_dim && r.n_rot % 2 == 0,
             "cuda attention_xq: rope head_dim ", r.head_dim, " / n_rot ", r.n_rot, " do not fit head_dim ",
             a.head_dim);
  XCTX_CHECK(r.freq_base > 0.0f && r.scaling_factor > 0.0f, "cuda attention_xq: rope freq_base ", r.freq_base,
             " and scaling_factor ", r.scaling_factor, " must be positive");
  XCTX_CHECK(r.scaling != rope_scaling::rope_scaling_ntk || r.n_rot > 2,
             "cuda attention_xq: NTK scaling needs n_rot > 2, got ", r.n_rot);
  XCTX_CHECK(!self_extend_on(r) || r.se_window >= 0, "cuda attention_xq: SelfExtend window ", r.se_window,
             " is negative");
  if (a.n_q > 0)
    XCTX_CHECK(a.q != nullptr && a.q_pos != nullptr && a.o != nullptr && a.lse != nullptr,
               "cuda attention_xq: null q, q_pos, o or lse");
  if (a.n > 0) XCTX_CHECK(a.pos != nullptr, "cuda attention_xq: null pos");
}

}  // namespace

void xq_encode(context& ctx, const xq_encode_job& j) {
  check_encode_job(j);
  const xq_encode_plan plan = plan_xq_encode(j.axis, j.channels, j.group, j.n, ctx.n_sm);
  if (plan.blocks_x == 0) return;
  switch (j.axis) {
    case xq_axis::xq_per_token:
      XCTX_CHECK(plan.smem_bytes <= (48u << 10), "cuda xq_encode: ", j.channels / j.group,
                 " channel groups per row exceed the shared-memory parameter table");
      prepare_shared_memory(ctx, reinterpret_cast<const void*>(per_token_kernel), plan.smem_bytes, "cuda xq_encode");
      per_token_kernel<<<plan.blocks_x, xq_threads, plan.smem_bytes, ctx.stream>>>(j);
      break;
    case xq_axis::xq_per_channel:
      per_channel_kernel<<<dim3(plan.blocks_x, plan.blocks_y), xq_threads, 0, ctx.stream>>>(j);
      break;
  }
  CUDA_CHECK_LAUNCH();
}

void attention_xq(context& ctx, const xq_attn_args& a) {
  check_attn_args(a);
  if (a.n_q == 0) return;
  const bool se = self_extend_on(a.rope);
  const int wv = a.m_v != nullptr ? a.zv.channels : a.head_dim;
  attn_params prm{};
  prm.a = a;
  prm.plan = plan_xq_attention(a.n_q, a.n, a.n_head, a.n_head_kv, a.head_dim, a.rope.n_rot, wv, ctx.n_sm,
                               ctx.smem_optin, se);
  const xq_attn_plan& pl = prm.plan;
  XCTX_CHECK(pl.smem_bytes <= ctx.smem_optin, "cuda attention_xq: a latent window of ", wv,
             " channels with head_dim ", a.head_dim, " needs ", pl.smem_bytes,
             " bytes of shared memory per block, the device allows ", ctx.smem_optin);
  XCTX_CHECK(pl.row_blocks <= INT_MAX, "cuda attention_xq: too many query rows ", pl.rows_total);
  kvq_rope_setup(a.rope, prm.w, prm.pos_div);

  const int64_t n_row = a.n_q * a.n_head;
  // Scratch: the split partials (or the single partial) of U, then their lse when split.
  const size_t u_elems = (size_t)pl.n_split * n_row * wv;
  const attn_scratch scr = attention_scratch(ctx, xq_partial_bytes(pl.n_split, n_row, wv), a.select,
                                             a.n_q, a.n_head_kv, "cuda attention_xq");
  float* scratch = scr.parts;
  prm.sel = scr.sel;
  prm.u_out = scratch;
  prm.u_split_stride = n_row * wv;
  if (pl.n_split == 1) {
    prm.lse_out = a.lse;
  } else {
    prm.lse_out = scratch + u_elems;
    prm.lse_split_stride = n_row;
  }
  prepare_shared_memory(ctx, reinterpret_cast<const void*>(xq_attn_kernel), pl.smem_bytes, "cuda attention_xq");
  const dim3 grid((unsigned)pl.row_blocks, (unsigned)a.n_head_kv, (unsigned)pl.n_split);
  xq_attn_kernel<<<grid, xq_threads, pl.smem_bytes, ctx.stream>>>(prm);
  CUDA_CHECK_LAUNCH();
  // The merge is linear in U with weights summing to 1, so merging the latent rows and then
  // projecting equals projecting each split (b_v included): one projection per query row.
  if (pl.n_split > 1) merge_partials(ctx, prm.u_out, prm.lse_out, pl.n_split, n_row, wv, prm.u_out, a.lse);

  const size_t proj_smem = (size_t)wv * sizeof(float);
  XCTX_CHECK(proj_smem <= ctx.smem_optin, "cuda attention_xq: latent rows of ", wv, " channels exceed shared memory");
  prepare_shared_memory(ctx, reinterpret_cast<const void*>(xq_project_kernel), proj_smem, "cuda xq_project");
  const unsigned blocks = (unsigned)std::min<int64_t>(n_row, 32 * (int64_t)ctx.n_sm);
  xq_project_kernel<<<blocks, xq_threads, proj_smem, ctx.stream>>>(a, wv, prm.u_out, n_row);
  CUDA_CHECK_LAUNCH();
}

void xq_project(context& ctx, const float* x, const float* u, int64_t n, int d, int r, float* out) {
  launch_rows(ctx, x, n, d, u, r, 1, r, out, false, "xq_project");
}

void xq_add_projected(context& ctx, const float* z, const float* u, int64_t n, int r, int d, float* acc) {
  launch_rows(ctx, z, n, r, u, 1, r, d, acc, true, "xq_add_projected");
}

void xq_decode_rows(context& ctx, const xq_stream& s, int64_t t0, int64_t nt, float* out) {
  XCTX_CHECK(t0 >= 0 && nt >= 0 && s.channels > 0, "cuda xq_decode_rows: bad rows ", t0, " + ", nt, " of ",
             s.channels, " channels");
  if (nt == 0) return;
  const int64_t total = nt * s.channels;
  const unsigned blocks = (unsigned)std::min<int64_t>((total + xq_threads - 1) / xq_threads, 8 * (int64_t)ctx.n_sm);
  xq_decode_kernel<<<blocks, xq_threads, 0, ctx.stream>>>(s, t0, nt, out);
  CUDA_CHECK_LAUNCH();
}

}  // namespace xctx::cuda
