// CUDA kernels of the quantized KV cache: the encoder (codes, scales and outliers bit-identical to
// ref::kvq_encode) and the fused attention over one quantized layer.
//
// Encoder. Every value that decides a code goes through the kv_quant.h functions the reference
// calls (IEEE division and rintf; none of them has an a*b+c that FMA contraction could fuse), so
// the device computes the same floats. The build must not use -use_fast_math / -prec-div=false /
// -ftz=true for this file (nvcc defines no macro to check that here; the device tests would fail).
// Min/max follow std::min/std::max of the sequential reference: the first element (in channel or
// row order) among equal extremes wins, which decides the sign of a zero extreme.
//   uniform keys    block per slab of 128 channels: thread = channel, min/max down the rows
//   uniform values  block per row: warp per channel group, (value, channel) reduction
//   lut keys        block per row: thread = unit of 8 channels (one kvq_pack8), outliers
//                   compacted in channel order by a block-wide exclusive scan of unit counts
//   lut values      block per row: bitonic sort of (value, channel) keys in shared memory picks
//                   the v_out_side smallest and largest; then as lut keys
//
// Attention. Grid (row blocks, kv heads, slot splits); a block of 4 warps holds 8 or 32
// (query, head) rows of one kv head and walks its slots in tiles of 32: the whole block decodes
// a tile into shared memory (kvq.cuh phases: dense decode, sparse outliers, RoPE, one barrier
// each), then every warp scores its rows against it (lane = slot), updates the online softmax
// and accumulates p·v (lane = head_dim slice). Splits write (o, lse) partials that
// cuda::merge_partials combines. Only the compressed bytes are read from global memory.
#include <cuda_fp16.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/error.h"
#include "common/cuda_check.h"
#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/kvq.cuh"
#include "kernels/cuda/scratch.h"

namespace xctx::cuda {

namespace {

// ---- encoder ---------------------------------------------------------------------------------

// Exclusive prefix sum of v over the block; *total gets the block sum. s_warp: [kvq_warps].
template <typename T>
__device__ inline T block_exclusive_scan(T v, T* s_warp, T* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  T inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T n = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += n;
  }
  if (lane == 31) s_warp[warp] = inc;
  __syncthreads();
  T before = 0, sum = 0;
#pragma unroll
  for (int w = 0; w < kvq_warps; ++w) {
    before += w < warp ? s_warp[w] : 0;
    sum += s_warp[w];
  }
  __syncthreads();  // s_warp is reused by the next call
  *total = sum;
  return before + inc - v;
}

// Encodes one row: thread = unit of 8 channels (packed into `bits` bytes); the unit's outliers
// (is_out) go to out_idx/out_val (δ = delta_of(channel, code)) at the position the scan gives, so
// the row's outliers end up in ascending channel order. Returns the row's outlier count. Called
// by the whole block.
template <class CodeOf, class IsOut, class DeltaOf>
__device__ int encode_row(int C, int bits, const float* x /*[C]*/, uint8_t* codes /*[C*bits/8]*/, CodeOf code_of,
                          IsOut is_out, DeltaOf delta_of, uint16_t* out_idx /*[outliers] or null*/, uint16_t* out_val,
                          int* s_scan) {
  int base = 0;
  for (int c0 = 0; c0 < C; c0 += kvq_threads * 8) {
    const int c = c0 + (int)threadIdx.x * 8;
    unsigned mask = 0;
    uint8_t u[8];
    if (c < C) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        u[e] = code_of(c + e);
        if (is_out(c + e)) mask |= 1u << e;
      }
      kvq_pack8(u, bits, codes + (size_t)(c / 8) * bits);
    }
    int total = 0;
    int at = base + block_exclusive_scan(__popc(mask), s_scan, &total);
    if (out_idx != nullptr) {
      for (int e = 0; e < 8; ++e) {
        if (mask & (1u << e)) {
          out_idx[at] = (uint16_t)(c + e);
          out_val[at] = delta_of(c + e, u[e]);
          ++at;
        }
      }
    }
    base += total;
  }
  return base;
}

__global__ void __launch_bounds__(kvq_threads) uniform_keys_kernel(const kvq_encode_job j) {
  __shared__ kvq_affine s_aff[kvq_threads];
  const int C = j.channels, c_base = (int)blockIdx.x * kvq_threads, c = c_base + (int)threadIdx.x;
  if (c < C) {
    float lo = kvq_input(j, c), hi = lo;
    for (int64_t t = 1; t < j.n; ++t) {
      const float v = kvq_input(j, t * C + c);
      lo = v < lo ? v : lo;  // std::min(lo, v)
      hi = hi < v ? v : hi;  // std::max(hi, v)
    }
    const kvq_affine p = kvq_uniform_params(lo, hi, j.bits);
    s_aff[threadIdx.x] = p;
    j.affine[c] = p;
  }
  __syncthreads();
  const int units = min(kvq_threads, C - c_base) / 8;  // C and c_base are multiples of 8
  const size_t rb = kvq_row_bytes(C, j.bits);
  for (int64_t it = threadIdx.x; it < j.n * units; it += kvq_threads) {
    const int64_t t = it / units;
    const int u = (int)(it % units), c0 = c_base + 8 * u;
    uint8_t codes[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) codes[e] = kvq_uniform_encode(kvq_input(j, t * C + c0 + e), s_aff[8 * u + e], j.bits);
    kvq_pack8(codes, j.bits, j.codes + t * rb + (size_t)(c0 / 8) * j.bits);
  }
}

// (value, index) of the first minimum / first maximum: the lexicographic extreme, index INT_MAX =
// no element. Associative and commutative, so any reduction order gives the sequential result.
struct extreme {
  float v;
  int i;
};
__device__ inline extreme pick_min(extreme a, extreme b) {
  if (b.i == INT_MAX) return a;
  if (a.i == INT_MAX) return b;
  return (b.v < a.v || (b.v == a.v && b.i < a.i)) ? b : a;
}
__device__ inline extreme pick_max(extreme a, extreme b) {
  if (b.i == INT_MAX) return a;
  if (a.i == INT_MAX) return b;
  return (a.v < b.v || (b.v == a.v && b.i < a.i)) ? b : a;
}
__device__ inline extreme shfl_xor(extreme e, int o) {
  return {__shfl_xor_sync(0xffffffffu, e.v, o), __shfl_xor_sync(0xffffffffu, e.i, o)};
}

__global__ void __launch_bounds__(kvq_threads) uniform_values_kernel(const kvq_encode_job j) {
  const int C = j.channels, G = j.group, n_g = (C + G - 1) / G;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const size_t rb = kvq_row_bytes(C, j.bits);
  for (int64_t t = blockIdx.x; t < j.n; t += gridDim.x) {
    const int64_t x = t * C;  // the row's first element (kvq_input: f32 or fp16 rows)
    kvq_affine* aff = j.affine + t * n_g;
    for (int g = warp; g < n_g; g += kvq_warps) {
      const int c0 = g * G, c1 = min(C, c0 + G);
      extreme lo{0.0f, INT_MAX}, hi{0.0f, INT_MAX};
      for (int c = c0 + lane; c < c1; c += 32) {
        const extreme e{kvq_input(j, x + c), c};
        lo = pick_min(lo, e);
        hi = pick_max(hi, e);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        lo = pick_min(lo, shfl_xor(lo, o));
        hi = pick_max(hi, shfl_xor(hi, o));
      }
      if (lane == 0) aff[g] = kvq_uniform_params(lo.v, hi.v, j.bits);
    }
    __syncthreads();  // the block's global writes to aff are visible to the block after this
    for (int c0 = (int)threadIdx.x * 8; c0 < C; c0 += kvq_threads * 8) {
      uint8_t codes[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) codes[e] = kvq_uniform_encode(kvq_input(j, x + c0 + e), aff[(c0 + e) / G], j.bits);
      kvq_pack8(codes, j.bits, j.codes + t * rb + (size_t)(c0 / 8) * j.bits);
    }
  }
}

__global__ void __launch_bounds__(kvq_threads) lut_keys_kernel(const kvq_encode_job j) {
  __shared__ float s_lut[kKvqMaxLut];
  __shared__ int s_scan[kvq_warps];
  const int C = j.channels, n_lut = 1 << j.bits;
  if ((int)threadIdx.x < n_lut) s_lut[threadIdx.x] = j.lut[threadIdx.x];
  __syncthreads();
  const size_t rb = kvq_row_bytes(C, j.bits);
  const bool thresholds = j.ch_lo != nullptr;
  for (int64_t t = blockIdx.x; t < j.n; t += gridDim.x) {
    const float* x = j.x + t * C;
    const int n_out = encode_row(
        C, j.bits, x, j.codes + t * rb,
        [&](int c) { return kvq_lut_encode(kvq_normalize(x[c], j.ch_scale[c], j.ch_zero[c]), s_lut, n_lut); },
        [&](int c) { return thresholds && (x[c] < j.ch_lo[c] || x[c] > j.ch_hi[c]); },
        [&](int c, uint32_t code) { return kvq_outlier_delta(x[c], s_lut, code, j.ch_scale[c], j.ch_zero[c]); },
        thresholds ? j.out_idx + t * C : nullptr, thresholds ? j.out_val + t * C : nullptr, s_scan);
    if (threadIdx.x == 0 && j.out_count != nullptr) j.out_count[t] = (uint32_t)n_out;
  }
}

__global__ void __launch_bounds__(kvq_threads) lut_values_kernel(const kvq_encode_job j, int sort_n) {
  extern __shared__ uint64_t s_keys[];                            // [sort_n]
  uint8_t* s_flag = reinterpret_cast<uint8_t*>(s_keys + sort_n);  // [C] outlier channels
  __shared__ float s_lut[kKvqMaxLut];
  __shared__ int s_scan[kvq_warps];
  const int C = j.channels, n_lut = 1 << j.bits, side = j.v_out_side;
  if ((int)threadIdx.x < n_lut) s_lut[threadIdx.x] = j.lut[threadIdx.x];
  const size_t rb = kvq_row_bytes(C, j.bits);
  for (int64_t t = blockIdx.x; t < j.n; t += gridDim.x) {
    const float* x = j.x + t * C;
    for (int i = threadIdx.x; i < sort_n; i += kvq_threads) {
      s_keys[i] = i < C ? kvq_order_key(x[i], i) : kvq_order_pad;
      if (i < C) s_flag[i] = 0;
    }
    __syncthreads();
    for (int k = 2; k <= sort_n; k <<= 1) {
      for (int jj = k >> 1; jj > 0; jj >>= 1) {
        for (int i = threadIdx.x; i < sort_n; i += kvq_threads) kvq_bitonic_step(s_keys, k, jj, i);
        __syncthreads();
      }
    }
    // The reference's order[side] and order[C - 1 - side], read back as the stored floats.
    const kvq_affine p = kvq_midrange_params(x[kvq_order_channel(s_keys[side])],
                                             x[kvq_order_channel(s_keys[C - 1 - side])]);
    for (int e = threadIdx.x; e < side; e += kvq_threads) {
      s_flag[kvq_order_channel(s_keys[e])] = 1;
      s_flag[kvq_order_channel(s_keys[C - 1 - e])] = 1;
    }
    if (threadIdx.x == 0) j.affine[t] = p;
    const float scale = fp16_to_fp32(p.scale), zero = fp16_to_fp32(p.zero);
    __syncthreads();
    encode_row(
        C, j.bits, x, j.codes + t * rb,
        [&](int c) { return kvq_lut_encode(kvq_normalize(x[c], scale, zero), s_lut, n_lut); },
        [&](int c) { return s_flag[c] != 0; },
        [&](int c, uint32_t code) { return kvq_outlier_delta(x[c], s_lut, code, scale, zero); },
        side > 0 ? j.out_idx + t * 2 * side : nullptr,
        side > 0 ? j.out_val + t * 2 * side : nullptr, s_scan);
    __syncthreads();  // s_keys and s_flag are rewritten for the next row
  }
}

void check_encode_job(const kvq_encode_job& j) {
  XCTX_CHECK(j.bits >= 2 && j.bits <= kKvqMaxBits, "cuda kvq_encode: bits must be 2..", kKvqMaxBits, ", got ",
             j.bits);
  XCTX_CHECK(j.channels > 0 && j.channels % 8 == 0 && j.channels <= 65536,
             "cuda kvq_encode: channels must be a positive multiple of 8 up to 65536, got ", j.channels);
  XCTX_CHECK(j.n >= 0, "cuda kvq_encode: negative row count ", j.n);
  switch (j.tensor) {
    case kvq_tensor::kvq_uniform_keys:
      XCTX_CHECK(j.n == j.group, "cuda kvq_encode: uniform keys are encoded one full group at a time (n=", j.n,
                 ", group=", j.group, ")");
      break;
    case kvq_tensor::kvq_uniform_values:
      XCTX_CHECK(j.group > 0, "cuda kvq_encode: group must be positive, got ", j.group);
      break;
    case kvq_tensor::kvq_lut_keys:
      XCTX_CHECK(j.lut != nullptr && j.ch_scale != nullptr && j.ch_zero != nullptr,
                 "cuda kvq_encode: lut keys need lut, ch_scale and ch_zero");
      XCTX_CHECK(j.ch_lo == nullptr || (j.ch_hi != nullptr && j.out_idx != nullptr && j.out_val != nullptr),
                 "cuda kvq_encode: lut key outlier thresholds need ch_hi, out_idx and out_val");
      break;
    case kvq_tensor::kvq_lut_values:
      XCTX_CHECK(j.lut != nullptr, "cuda kvq_encode: lut values need a lut");
      XCTX_CHECK(j.v_out_side >= 0 && 2 * j.v_out_side < j.channels, "cuda kvq_encode: ", j.v_out_side,
                 " outliers per side leave nothing of a row of ", j.channels);
      XCTX_CHECK(j.v_out_side == 0 || (j.out_idx != nullptr && j.out_val != nullptr),
                 "cuda kvq_encode: value outliers need out_idx and out_val");
      break;
  }
  const bool uniform = j.tensor == kvq_tensor::kvq_uniform_keys || j.tensor == kvq_tensor::kvq_uniform_values;
  XCTX_CHECK(j.x16 == nullptr || uniform, "cuda kvq_encode: fp16 input rows (x16) are for the uniform tensors only");
  XCTX_CHECK(j.n == 0 || ((j.x != nullptr || j.x16 != nullptr) && j.codes != nullptr && j.affine != nullptr),
             "cuda kvq_encode: null x, codes or affine");
}

// ---- attention -------------------------------------------------------------------------------

struct attn_params {
  kvq_layer_view kv;
  kvq_attn_plan plan;
  const float* q;        // [n_q, n_head, head_dim]
  const int32_t* q_pos;  // [n_q]
  int n_head, group;
  float scale;
  double pos_div;
  float* o;    // [n_split][n_q, n_head, head_dim]
  float* lse;  // [n_split][n_q, n_head]
  int64_t o_split_stride, lse_split_stride;
  int se_group, se_window;  // SelfExtend when se_group > 1 (plan.self_extend)
  double w[kvq_max_pairs];  // RoPE frequency per pair
  attn_sel_view sel;        // retrieval: the rows' unit lists (off when lists_per_query == 0)
};
static_assert(sizeof(attn_params) <= 4096, "kernel parameters must fit the 4 KiB every architecture accepts");

__device__ inline float dot4(float acc, float4 a, float4 b) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Online-softmax step for one row over one tile (s = this lane's score, -inf when invisible).
// Returns the lane's probability; rescales l and acc.
template <int KD>
__device__ inline float softmax_step(float s, float& m, float& l, float (&acc)[KD]) {
  const float m_new = fmaxf(m, warp_max(s));
  if (m_new == -INFINITY) return 0.0f;  // nothing visible yet: exp(-inf - -inf) would be NaN
  const float alpha = expf(m - m_new);  // 0 when m was -inf
  const float pr = s == -INFINITY ? 0.0f : expf(s - m_new);
  l = l * alpha + warp_sum(pr);
#pragma unroll
  for (int kk = 0; kk < KD; ++kk) acc[kk] *= alpha;
  m = m_new;
  return pr;
}

template <int RW, int KD>
__global__ void __launch_bounds__(kvq_threads) kvq_attn_kernel(const __grid_constant__ attn_params p) {
  constexpr int R = RW * kvq_warps;  // rows of the block; warp w owns rows w, w + 4, ...
  extern __shared__ float4 smem4[];
  char* sm = reinterpret_cast<char*>(smem4);
  const kvq_layer_view& L = p.kv;
  const kvq_attn_plan& pl = p.plan;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hd = L.head_dim, d4 = pl.d4, g = blockIdx.y;
  const int64_t r0 = (int64_t)blockIdx.x * R;

  kvq_tile_view t = kvq_bind_tile(pl, sm, g);
  float* qs = reinterpret_cast<float*>(sm + pl.off_q);  // [R, d4] pre-scaled, zero padded
  __shared__ int sm_maxpos[kvq_warps], sm_minpos[kvq_warps];

  for (int idx = threadIdx.x; idx < R * d4; idx += kvq_threads) {
    const int r = idx / d4, d = idx % d4;
    const int64_t rho = r0 + r;
    float val = 0.0f;
    if (rho < pl.rows_total && d < hd) {
      const int64_t i = rho / p.group;
      const int h = g * p.group + (int)(rho % p.group);
      val = p.q[(i * p.n_head + h) * (int64_t)hd + d] * p.scale;
    }
    qs[idx] = val;
  }
  const bool se = pl.self_extend;
  float* qf = reinterpret_cast<float*>(sm + pl.off_qf);  // [R, d4] SelfExtend: rows turned by their shift
  if (se) {
    for (int idx = threadIdx.x; idx < R * d4 / 2; idx += kvq_threads) {
      const int r = idx / (d4 / 2), d = 2 * (idx % (d4 / 2));
      const int64_t rho = r0 + r;
      float x[2] = {0.0f, 0.0f};
      if (rho < pl.rows_total) {
        const int64_t i = rho / p.group;
        const int h = g * p.group + (int)(rho % p.group);
        se_turned_query_pair(p.q + (i * p.n_head + h) * (int64_t)hd, hd, p.scale, pl.n_pair, p.w,
                             (double)se_query_shift(p.q_pos[i], p.se_group, p.se_window) / p.pos_div, d, x);
      }
      qf[r * d4 + d] = x[0];
      qf[r * d4 + d + 1] = x[1];
    }
  }
  // K columns [hd, d4) meet q's zero padding in the float4 dot: they must be finite, so zero
  // them once (tiles write [0, hd) only).
  for (int idx = threadIdx.x; idx < kvq_tile * (d4 - hd); idx += kvq_threads) {
    const size_t at = (size_t)(idx / (d4 - hd)) * pl.k_stride + hd + idx % (d4 - hd);
    t.k[at] = 0.0f;
    if (se) t.kf[at] = 0.0f;
  }
  for (int idx = threadIdx.x; idx < kvq_setup_items(L, pl.n_pair); idx += kvq_threads)
    kvq_tile_setup(L, t, p.w, pl.n_pair, idx);

  const bool sel = sel_on(p.sel);
  int64_t row_i[RW], row_list[RW];  // row_list: retrieval, each row's unit list
  int row_h[RW], row_pos[RW];
  bool row_ok[RW];
  int n_valid = 0;  // rows w, w + 4, ... are valid up to a point
  int max_pos = INT_MIN, min_pos = INT_MAX;
#pragma unroll
  for (int k = 0; k < RW; ++k) {
    const int64_t rho = r0 + warp + kvq_warps * k;
    row_ok[k] = rho < pl.rows_total;
    row_i[k] = row_ok[k] ? rho / p.group : 0;
    row_h[k] = g * p.group + (int)(rho % p.group);
    row_pos[k] = row_ok[k] ? p.q_pos[row_i[k]] : INT_MIN;
    row_list[k] = sel && row_ok[k] ? sel_list(p.sel, row_i[k], g) : 0;
    n_valid += row_ok[k] ? 1 : 0;
    max_pos = max(max_pos, row_pos[k]);
    if (row_ok[k]) min_pos = min(min_pos, row_pos[k]);
  }
  if (lane == 0) sm_maxpos[warp] = max_pos, sm_minpos[warp] = min_pos;  // a warp's rows: the same in every lane
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kvq_warps; ++w) max_pos = max(max_pos, sm_maxpos[w]), min_pos = min(min_pos, sm_minpos[w]);

  float m[RW], l[RW], acc[RW][KD];
#pragma unroll
  for (int k = 0; k < RW; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) acc[k][kk] = 0.0f;
  }

  const bool outliers = L.k_out_off != nullptr || L.v_out_per_tok > 0;
  const int64_t j_begin = (int64_t)blockIdx.z * pl.chunk;
  const int64_t j_end = min(L.n, j_begin + pl.chunk);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kvq_tile) {
    if (L.pos[j0] > max_pos) break;  // block-uniform; positions ascend, later tiles are invisible too
    const int nt = (int)min((int64_t)kvq_tile, j_end - j0);
    // Retrieval: bit k, row k sees the lane's slot; a tile no row of the block lists is not decoded.
    unsigned seen = 0;
    if (sel) {
      const int kvp_sel = lane < nt ? L.pos[j0 + lane] : INT_MAX;
      seen = rows_seeing<RW>(p.sel, true, row_pos, row_list, n_valid, lane < nt, kvp_sel);
      if (!__syncthreads_or(seen != 0u)) continue;  // block-uniform; also the barrier below
    }
    t.s0 = j0;
    __syncthreads();  // the previous tile is no longer read
    if ((int)threadIdx.x < nt) kvq_tile_meta(L, t, p.pos_div, threadIdx.x);
    __syncthreads();
    kvq_for_items(threadIdx.x, kvq_threads, nt, hd, [&](int j, int d) { kvq_tile_dense(L, t, j, d); });
    __syncthreads();
    if (outliers) {
      for (int j = warp; j < nt; j += kvq_warps) kvq_tile_outliers(L, t, j, lane, 32);
      __syncthreads();
    }
    // SelfExtend, block-uniform: some row sees a slot of the tile grouped (the tile's first slot
    // W behind the latest row), or at its place (its last slot within W of the earliest row).
    const bool tile_grouped = se && (int64_t)max_pos - L.pos[j0] >= p.se_window;
    const bool tile_near = !se || (int64_t)L.pos[j0 + nt - 1] > (int64_t)min_pos - p.se_window;
    if (tile_grouped) {
      kvq_for_items(threadIdx.x, kvq_threads, nt, (hd + 1) / 2, [&](int j, int c) {
        kvq_tile_rope_grouped(t, j, c, hd, pl.n_pair, p.se_group, p.pos_div);
      });
      __syncthreads();
    } else if (pl.n_pair > 0) {
      kvq_for_items(threadIdx.x, kvq_threads, nt, pl.n_pair, [&](int j, int i) { kvq_tile_rope(t, j, i); });
      __syncthreads();
    }

    const int kvp = lane < nt ? t.pos[lane] : INT_MAX;
    float s[RW], sg[RW];
#pragma unroll
    for (int k = 0; k < RW; ++k) s[k] = 0.0f, sg[k] = 0.0f;
    // One side's scores (inlined per call, so each array stays in registers). Rows >= nt of the
    // tiles hold stale data: masked below.
    const auto score = [&](const float* ktile, const float* qrows, float(&out)[RW]) {
      const float* krow = ktile + lane * pl.k_stride;
      for (int d = 0; d < d4; d += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(krow + d);
#pragma unroll
        for (int k = 0; k < RW; ++k)
          if (row_ok[k])
            out[k] = dot4(out[k], *reinterpret_cast<const float4*>(qrows + (warp + kvq_warps * k) * d4 + d), k4);
      }
    };
    if (tile_near) score(t.k, qs, s);
    if (tile_grouped) score(t.kf, qf, sg);
    float pr[RW];
#pragma unroll
    for (int k = 0; k < RW; ++k) {
      pr[k] = 0.0f;
      if (row_ok[k]) {
        const bool vis = lane < nt && kvp <= row_pos[k] && (!sel || ((seen >> k) & 1u));
        const float sc = se && se_grouped(row_pos[k], kvp, p.se_window) ? sg[k] : s[k];
        pr[k] = softmax_step<KD>(vis ? sc : -INFINITY, m[k], l[k], acc[k]);
      }
    }
    for (int jj = 0; jj < nt; ++jj) {
      float vv[KD];
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        const int d = lane + 32 * kk;
        vv[kk] = d < hd ? t.v[jj * d4 + d] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < RW; ++k) {
        if (row_ok[k]) {
          const float pj = __shfl_sync(0xffffffffu, pr[k], jj);
#pragma unroll
          for (int kk = 0; kk < KD; ++kk) acc[k][kk] = fmaf(pj, vv[kk], acc[k][kk]);
        }
      }
    }
  }

#pragma unroll
  for (int k = 0; k < RW; ++k) {
    if (!row_ok[k]) continue;
    const bool empty = m[k] == -INFINITY;
    const float inv = empty ? 0.0f : 1.0f / l[k];
    const int64_t row = row_i[k] * p.n_head + row_h[k];
    float* orow = p.o + (int64_t)blockIdx.z * p.o_split_stride + row * hd;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      const int d = lane + 32 * kk;
      if (d < hd) orow[d] = acc[k][kk] * inv;
    }
    if (lane == 0) p.lse[(int64_t)blockIdx.z * p.lse_split_stride + row] = empty ? -INFINITY : m[k] + logf(l[k]);
  }
}

void check_attn_args(const kvq_attn_args& a) {
  const kvq_layer_view& L = a.kv;
  XCTX_CHECK(L.bits >= 2 && L.bits <= kKvqMaxBits && L.value_bits() == L.bits, "cuda attention_kvq: bits must be 2..",
             kKvqMaxBits, " for keys and values alike, got ", L.bits, "/", L.value_bits());
  XCTX_CHECK(a.n_q >= 0, "cuda attention_kvq: negative n_q ", a.n_q);
  XCTX_CHECK(L.n_head_kv > 0 && a.n_head > 0 && a.n_head % L.n_head_kv == 0, "cuda attention_kvq: n_head=",
             a.n_head, " must be a positive multiple of n_head_kv=", L.n_head_kv);
  XCTX_CHECK(L.n_head_kv <= 65535, "cuda attention_kvq: n_head_kv ", L.n_head_kv, " exceeds the grid's y limit");
  XCTX_CHECK(L.head_dim > 0 && L.head_dim <= kvq_max_head_dim, "cuda attention_kvq: head_dim ", L.head_dim,
             " outside the supported range [1, ", kvq_max_head_dim, "]");
  XCTX_CHECK(L.channels() % 8 == 0, "cuda attention_kvq: a row of ", L.channels(), " channels is not whole bytes");
  XCTX_CHECK(0 <= L.n_sink && L.n_sink <= L.q_end && L.q_end <= L.n, "cuda attention_kvq: bad slot split n_sink=",
             L.n_sink, " q_end=", L.q_end, " n=", L.n);
  const rope_config& r = a.rope;
  XCTX_CHECK(r.head_dim == L.head_dim && r.n_rot >= 0 && r.n_rot <= r.head_dim && r.n_rot % 2 == 0,
             "cuda attention_kvq: rope head_dim ", r.head_dim, " / n_rot ", r.n_rot, " do not fit head_dim ",
             L.head_dim);
  XCTX_CHECK(r.freq_base > 0.0f && r.scaling_factor > 0.0f, "cuda attention_kvq: rope freq_base ", r.freq_base,
             " and scaling_factor ", r.scaling_factor, " must be positive");
  XCTX_CHECK(r.scaling != rope_scaling::rope_scaling_ntk || r.n_rot > 2,
             "cuda attention_kvq: NTK scaling needs n_rot > 2, got ", r.n_rot);
  if (a.n_q > 0)
    XCTX_CHECK(a.q != nullptr && a.q_pos != nullptr && a.o != nullptr && a.lse != nullptr,
               "cuda attention_kvq: null q, q_pos, o or lse");
  if (L.n > 0) XCTX_CHECK(L.pos != nullptr, "cuda attention_kvq: null pos");
  if (L.n_sink > 0) XCTX_CHECK(L.k_sink && L.v_sink, "cuda attention_kvq: null sink rows");
  if (L.n > L.q_end) XCTX_CHECK(L.k_tail && L.v_tail, "cuda attention_kvq: null tail rows");
  if (L.n_quant() == 0) return;
  XCTX_CHECK(L.k_codes && L.v_codes, "cuda attention_kvq: null codes");
  switch (L.scheme) {
    case kvq_scheme::kvq_uniform:
      XCTX_CHECK(L.group > 0 && L.k_group && L.v_group, "cuda attention_kvq: uniform layer needs group > 0 (got ",
                 L.group, "), k_group and v_group");
      break;
    case kvq_scheme::kvq_lut:
      XCTX_CHECK(L.lut_k && L.lut_v && L.k_ch_scale && L.k_ch_zero && L.v_tok,
                 "cuda attention_kvq: lut layer needs lut_k, lut_v, k_ch_scale, k_ch_zero and v_tok");
      break;
  }
  XCTX_CHECK(L.v_out_per_tok >= 0 && (L.v_out_per_tok == 0 || (L.v_out_idx && L.v_out_val)),
             "cuda attention_kvq: ", L.v_out_per_tok, " value outliers per row need v_out_idx and v_out_val");
}

template <int RW, int KD>
void launch_attention(context& ctx, const attn_params& prm, int n_head_kv) {
  const kvq_attn_plan& pl = prm.plan;
  const auto kernel = kvq_attn_kernel<RW, KD>;
  prepare_shared_memory(ctx, reinterpret_cast<const void*>(kernel), pl.smem_bytes, "cuda attention_kvq");
  const dim3 grid((unsigned)pl.row_blocks, (unsigned)n_head_kv, (unsigned)pl.n_split);
  kernel<<<grid, kvq_threads, pl.smem_bytes, ctx.stream>>>(prm);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

// Offsets of an outlier append (kvq_outlier_append): one block scans the counts a tile of
// kvq_threads rows at a time, carrying the running total between tiles. An append is at most a
// prefill chunk of rows, so one block is enough; the copy below carries the bandwidth.
__global__ void __launch_bounds__(kvq_threads) outlier_offsets_kernel(const kvq_outlier_append a) {
  __shared__ uint32_t s_warp[kvq_warps];
  uint32_t carry = a.off[0];  // every thread keeps the running total
  for (int64_t t0 = 0; t0 < a.n; t0 += kvq_threads) {
    const int64_t t = t0 + threadIdx.x;
    const uint32_t c = t < a.n ? a.count[t] : 0u;
    uint32_t tile = 0;
    const uint32_t before = block_exclusive_scan(c, s_warp, &tile);
    if (t < a.n) a.off[t + 1] = carry + before + c;
    carry += tile;
  }
}

// The entries, one row per block at a time, its threads over the row's entries.
__global__ void __launch_bounds__(kvq_threads) outlier_copy_kernel(const kvq_outlier_append a) {
  for (int64_t i = blockIdx.x; i < a.n; i += gridDim.x)
    for (uint32_t e = threadIdx.x; e < a.count[i]; e += kvq_threads) kvq_append_outlier_entry(a, i, e);
}

void kvq_encode(context& ctx, const kvq_encode_job& j) {
  check_encode_job(j);
  const kvq_encode_plan plan = plan_kvq_encode(j.tensor, j.channels, j.n, ctx.n_sm);
  if (plan.blocks == 0) return;
  switch (j.tensor) {
    case kvq_tensor::kvq_uniform_keys:
      uniform_keys_kernel<<<plan.blocks, kvq_threads, 0, ctx.stream>>>(j);
      break;
    case kvq_tensor::kvq_uniform_values:
      uniform_values_kernel<<<plan.blocks, kvq_threads, 0, ctx.stream>>>(j);
      break;
    case kvq_tensor::kvq_lut_keys:
      lut_keys_kernel<<<plan.blocks, kvq_threads, 0, ctx.stream>>>(j);
      break;
    case kvq_tensor::kvq_lut_values:
      XCTX_CHECK(plan.smem_bytes <= ctx.smem_optin, "cuda kvq_encode: lut values rows of ", j.channels,
                 " channels need ", plan.smem_bytes, " bytes of shared memory per block, the device allows ",
                 ctx.smem_optin);
      prepare_shared_memory(ctx, reinterpret_cast<const void*>(lut_values_kernel), plan.smem_bytes,
                            "cuda kvq_encode (lut values)");
      lut_values_kernel<<<plan.blocks, kvq_threads, plan.smem_bytes, ctx.stream>>>(j, plan.sort_n);
      break;
  }
  CUDA_CHECK_LAUNCH();
}

void kvq_append_outliers(context& ctx, const kvq_outlier_append& a) {
  XCTX_CHECK(a.n >= 0 && a.channels > 0 && a.count != nullptr && a.row_idx != nullptr && a.row_val != nullptr &&
                 a.off != nullptr && (a.capacity == 0 || (a.idx != nullptr && a.val != nullptr)),
             "cuda kvq_append_outliers: ", a.n, " rows of ", a.channels, " channels with missing arrays");
  if (a.n == 0) return;
  outlier_offsets_kernel<<<1, kvq_threads, 0, ctx.stream>>>(a);
  CUDA_CHECK_LAUNCH();
  outlier_copy_kernel<<<kvq_outlier_copy_blocks(a.n, ctx.n_sm), kvq_threads, 0, ctx.stream>>>(a);
  CUDA_CHECK_LAUNCH();
}

void attention_kvq(context& ctx, const kvq_attn_args& a) {
  check_attn_args(a);
  if (a.n_q == 0) return;
  const kvq_layer_view& L = a.kv;
  attn_params prm{};
  const bool se = self_extend_on(a.rope);
  XCTX_CHECK(!se || a.rope.se_window >= 0, "cuda attention_kvq: SelfExtend window ", a.rope.se_window, " is negative");
  XCTX_CHECK(a.rope.se_period == 0, "cuda attention_kvq: retrieval's ordered far positions (se_period) are not implemented on CUDA; use --far-positions fixed");
  prm.plan = plan_kvq_attention(a.n_q, L.n, a.n_head, L.n_head_kv, L.head_dim, a.rope.n_rot, ctx.n_sm, se);
  const kvq_attn_plan& pl = prm.plan;
  XCTX_CHECK(pl.row_blocks <= INT_MAX, "cuda attention_kvq: too many query rows ", pl.rows_total);
  XCTX_CHECK(pl.smem_bytes <= ctx.smem_optin, "cuda attention_kvq: head_dim ", L.head_dim, " needs ",
             pl.smem_bytes, " bytes of shared memory per block, the device allows ", ctx.smem_optin);
  prm.kv = L;
  prm.q = a.q;
  prm.q_pos = a.q_pos;
  prm.n_head = a.n_head;
  prm.group = a.n_head / L.n_head_kv;
  prm.scale = a.scale;
  kvq_rope_setup(a.rope, prm.w, prm.pos_div);
  prm.se_group = se ? a.rope.se_group : 1;
  prm.se_window = se ? a.rope.se_window : 0;

  const int64_t n_row = a.n_q * a.n_head;
  const size_t o_elems = pl.n_split == 1 ? 0 : (size_t)pl.n_split * n_row * L.head_dim;
  const size_t part_bytes = split_partial_bytes(pl.n_split, n_row, L.head_dim);  // o, then lse
  const attn_scratch scr = attention_scratch(ctx, part_bytes, a.select, a.n_q, L.n_head_kv, "cuda attention_kvq");
  prm.sel = scr.sel;
  if (pl.n_split == 1) {
    prm.o = a.o;
    prm.lse = a.lse;
  } else {
    float* parts = scr.parts;
    prm.o = parts;              // [n_split, n_row, head_dim]
    prm.lse = parts + o_elems;  // [n_split, n_row]
    prm.o_split_stride = n_row * L.head_dim;
    prm.lse_split_stride = n_row;
  }

  auto run = [&](auto rw_tag, auto kd_tag) {
    launch_attention<decltype(rw_tag)::value, decltype(kd_tag)::value>(ctx, prm, L.n_head_kv);
  };
  auto with_kd = [&](auto rw_tag) {
    if (pl.kd == 2) run(rw_tag, std::integral_constant<int, 2>{});
    else if (pl.kd == 4) run(rw_tag, std::integral_constant<int, 4>{});
    else run(rw_tag, std::integral_constant<int, 8>{});
  };
  if (pl.rows_per_warp == kvq_decode_rows_per_warp) with_kd(std::integral_constant<int, kvq_decode_rows_per_warp>{});
  else with_kd(std::integral_constant<int, kvq_prefill_rows_per_warp>{});

  if (pl.n_split > 1) merge_partials(ctx, prm.o, prm.lse, pl.n_split, n_row, L.head_dim, a.o, a.lse);
}

}  // namespace xctx::cuda
