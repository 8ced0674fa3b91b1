// Attention partials (o normalized by its own softmax sum, lse in natural log) over f32/f16
// caches with causal positions and GQA, plus the merge of partials.
//
// Two kernels share the online-softmax bookkeeping (per row: running max m, sum l, output acc):
//   decode  (few (query, head) rows): every warp holds all rows of the block and walks its own
//           32-key tiles, lane = key; K rows and V rows are read straight from global memory, so
//           each cached byte is read once per block. Warps merge their partials in shared memory.
//   prefill (many rows): rows are split across warps (8 each); the block stages a 32-key K/V
//           tile in shared memory and every warp scores its rows against it.
// Both split the key axis over gridDim.z when the grid would otherwise not fill the device
// (flash-decoding); the splits' partials are merged by merge_kernel, which also serves the
// public merge_partials op. Key j is visible to row (i, h) iff kv_pos[j] <= q_pos[i]; since
// kv_pos is non-decreasing, a block stops at the first tile beyond its largest q_pos.
// SelfExtend (attention.cuh): the rows also hold their turned queries, and a key grouped for a
// row is scored against it turned by its own shift (decode: per lane in registers; prefill: a
// turned K tile beside the plain one). Tiles that no row sees grouped take the plain path only.
// Retrieval (attn_args::select): a row sees a key only when the key's unit is in the row's list
// (attention.cuh, attn_sel_view); a tile that no row of the block (decode: of the warp) lists
// is skipped before its K/V bytes are read.
#include <cuda_fp16.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/error.h"
#include "kernels/cuda/attention.cuh"
#include "common/cuda_check.h"
#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/kvq.cuh"  // kvq_rope_setup, kvq_rotate_pair, se_turned_query_pair
#include "kernels/cuda/scratch.h"
#include "kernels/softmax_acc.h"   // kAttnUnit

namespace xctx::cuda {

static_assert(attn_unit == kAttnUnit, "the device selection's unit must be the host's");

attn_scratch attention_scratch(context& ctx, size_t part_bytes, const attn_selection* select, int64_t n_q,
                               int n_head_kv, const char* who) {
  attn_scratch out;
  size_t sel_bytes = 0, units_at = 0;
  if (select != nullptr) {
    check_selection(*select, n_q, n_head_kv, who);
    units_at = select->offsets.size() * sizeof(int64_t);
    sel_bytes = selection_list_bytes(select->offsets.size(), select->units.size());
  }
  // The request as the fit check bounds it (kernels/cuda/scratch.h): lists from an aligned byte.
  const size_t request = scratch_request(part_bytes, sel_bytes);
  if (request == 0) return out;
  const size_t parts_end = request - sel_bytes;
  char* base = static_cast<char*>(ctx.scratch(request));
  if (part_bytes > 0) out.parts = reinterpret_cast<float*>(base);
  if (select != nullptr) {
    char* lists = base + parts_end;
    // Pageable sources: the copy is staged before cudaMemcpyAsync returns, so the host lists may go.
    CUDA_CHECK(cudaMemcpyAsync(lists, select->offsets.data(), units_at, cudaMemcpyHostToDevice, ctx.stream));
    if (!select->units.empty())
      CUDA_CHECK(cudaMemcpyAsync(lists + units_at, select->units.data(), sel_bytes - units_at,
                                 cudaMemcpyHostToDevice, ctx.stream));
    out.sel.offsets = reinterpret_cast<const int64_t*>(lists);
    out.sel.units = reinterpret_cast<const int64_t*>(lists + units_at);
    out.sel.lists_per_query = select->lists_per_query;
  }
  return out;
}

namespace {

constexpr int kThreads = attn_warps * 32;

struct attn_params {
  const float* q;         // [n_q, n_head, head_dim]
  const int32_t* q_pos;   // [n_q]
  const void* k;          // [n_kv, n_head_kv, head_dim]
  const void* v;          // [n_kv, n_head_kv, head_dim]
  const int32_t* kv_pos;  // [n_kv]
  int64_t n_kv;
  int64_t rows_total;     // n_q * group
  int n_head, n_head_kv, group, head_dim, d4;
  int k_stride;           // prefill kernel's smem K row stride
  float scale;
  int64_t chunk;          // keys per split
  float* o;               // [n_split][n_q, n_head, head_dim]
  float* lse;             // [n_split][n_q, n_head]
  int64_t o_split_stride, lse_split_stride;
  bool kv_vec;            // head_dim % 4 == 0 and K/V 16-byte (f32) / 8-byte (f16) aligned
  int* err;
  // SelfExtend: off when se_group <= 1. Pairs [0, n_pair) rotate at ((shift / pos_div) · w).
  int se_group, se_window, n_pair;
  double pos_div;
  double w[attn_max_head_dim / 2];
  attn_sel_view sel;  // retrieval: the rows' unit lists (off when lists_per_query == 0)
};

__device__ inline bool se_on(const attn_params& p) { return p.se_group > 1; }

template <bool F16>
__device__ inline float kv_load(const void* base, int64_t idx) {
  if constexpr (F16)
    return __half2float(__ushort_as_half(static_cast<const unsigned short*>(base)[idx]));  // exact
  else
    return static_cast<const float*>(base)[idx];
}
template <bool F16>
__device__ inline float4 kv_load4(const void* base, int64_t idx /*multiple of 4*/) {
  if constexpr (F16) {
    const uint2 u = *reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(base) + idx);
    const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    return make_float4(a.x, a.y, b.x, b.y);
  } else {
    return *reinterpret_cast<const float4*>(static_cast<const float*>(base) + idx);
  }
}

__device__ inline float dot4(float acc, float4 a, float4 b) {
  acc = fmaf(a.x, b.x, acc);
  acc = fmaf(a.y, b.y, acc);
  acc = fmaf(a.z, b.z, acc);
  return fmaf(a.w, b.w, acc);
}

// Row r of the block -> (query i, head h), and the row's position (INT_MIN: padding row that
// sees nothing).
struct row_ref {
  int64_t i;
  int h;
  int pos;
  bool valid;
};
__device__ inline row_ref resolve_row(const attn_params& p, int64_t rho, int g) {
  row_ref rr{0, 0, INT_MIN, false};
  if (rho < p.rows_total) {
    rr.i = rho / p.group;
    rr.h = g * p.group + (int)(rho % p.group);
    rr.pos = p.q_pos[rr.i];
    rr.valid = true;
  }
  return rr;
}

// q rows of the block into smem, pre-multiplied by the scale, zero padded to d4 columns.
__device__ inline void load_q_tile(const attn_params& p, float* qs /*[R][d4]*/, int R, int64_t r0, int g) {
  for (int idx = threadIdx.x; idx < R * p.d4; idx += kThreads) {
    const int r = idx / p.d4, d = idx % p.d4;
    const int64_t rho = r0 + r;
    float val = 0.0f;
    if (rho < p.rows_total && d < p.head_dim) {
      const int64_t i = rho / p.group;
      const int h = g * p.group + (int)(rho % p.group);
      val = p.q[(i * p.n_head + h) * (int64_t)p.head_dim + d] * p.scale;
    }
    qs[idx] = val;
  }
}

// The rows' queries turned by their SelfExtend shift (pre-multiplied by the scale, zero padded).
__device__ inline void load_turned_q_tile(const attn_params& p, float* qf /*[R][d4]*/, int R, int64_t r0, int g) {
  const int half = p.d4 / 2;
  for (int idx = threadIdx.x; idx < R * half; idx += kThreads) {
    const int r = idx / half, d = 2 * (idx % half);
    const int64_t rho = r0 + r;
    float x[2] = {0.0f, 0.0f};
    if (rho < p.rows_total) {
      const int64_t i = rho / p.group;
      const int h = g * p.group + (int)(rho % p.group);
      se_turned_query_pair(p.q + (i * p.n_head + h) * (int64_t)p.head_dim, p.head_dim, p.scale, p.n_pair, p.w,
                           (double)se_query_shift(p.q_pos[i], p.se_group, p.se_window) / p.pos_div, d, x);
    }
    qf[r * p.d4 + d] = x[0];
    qf[r * p.d4 + d + 1] = x[1];
  }
}

// Warp-level check that the tile's kv_pos does not decrease (the early exit relies on it).
__device__ inline void check_kv_order(const attn_params& p, int64_t j0, int nt, int kvp, int& prev_last) {
  const int lane = threadIdx.x % 32;
  const int next = __shfl_down_sync(0xffffffffu, kvp, 1);
  if (lane + 1 < nt && kvp > next)
    report_device_error(p.err, device_error::device_error_kv_order, (int)(j0 + lane), kvp, next);
  if (lane == 0 && prev_last > kvp)
    report_device_error(p.err, device_error::device_error_kv_order, (int)(j0 - 1), prev_last, kvp);
  prev_last = __shfl_sync(0xffffffffu, kvp, nt - 1);
}

// Online-softmax step for one row over one tile: s is this lane's score (already -inf when the
// key is invisible). Returns the lane's probability; rescales l and acc.
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

// ---- decode kernel ----------------------------------------------------------------------

template <int KD, bool F16>
__global__ void __launch_bounds__(kThreads) attn_decode_kernel(const __grid_constant__ attn_params p) {
  constexpr int R = attn_decode_rows;
  extern __shared__ float4 smem4[];
  const bool se = se_on(p);
  float* qs = reinterpret_cast<float*>(smem4);  // [R][d4]
  float* qf = qs + R * p.d4;                    // [R][d4] turned rows (SelfExtend only)
  float* sacc = qf + (se ? R * p.d4 : 0);       // [warps][R][d4]
  __shared__ float sm_m[attn_warps][R], sm_l[attn_warps][R];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = blockIdx.y;
  const int64_t r0 = (int64_t)blockIdx.x * R;
  const int n_rows = (int)min((int64_t)R, p.rows_total - r0);  // valid rows in this block
  load_q_tile(p, qs, R, r0, g);
  if (se) load_turned_q_tile(p, qf, R, r0, g);

  const bool sel = sel_on(p.sel);
  int qpos[R];
  int64_t qlist[R];  // retrieval: each row's unit list
  int max_pos = INT_MIN;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const row_ref rr = resolve_row(p, r0 + r, g);
    qpos[r] = r < n_rows ? rr.pos : INT_MIN;
    qlist[r] = sel && r < n_rows ? sel_list(p.sel, rr.i, g) : 0;
    max_pos = max(max_pos, qpos[r]);
  }
  __syncthreads();

  float m[R], l[R], acc[R][KD];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) acc[r][kk] = 0.0f;
  }

  const int64_t j_begin = (int64_t)blockIdx.z * p.chunk;
  const int64_t j_end = min(p.n_kv, j_begin + p.chunk);
  const int64_t kv_row = (int64_t)p.n_head_kv * p.head_dim;  // elements between consecutive keys
  const int64_t kv_off = (int64_t)g * p.head_dim;
  for (int64_t j0 = j_begin + (int64_t)warp * attn_tile; j0 < j_end; j0 += (int64_t)attn_warps * attn_tile) {
    if (p.kv_pos[j0] > max_pos) break;  // warp-uniform; later tiles are invisible too
    const int nt = (int)min((int64_t)attn_tile, j_end - j0);
    const int kvp = lane < nt ? p.kv_pos[j0 + lane] : INT_MAX;
    int no_prev = INT_MIN;  // a warp's tiles are not adjacent: only the order inside a tile is checked
    check_kv_order(p, j0, nt, kvp, no_prev);
    const unsigned seen = rows_seeing<R>(p.sel, sel, qpos, qlist, n_rows, lane < nt, kvp);
    if (sel && !__any_sync(0xffffffffu, seen != 0u)) continue;  // warp-uniform: no row lists the tile

    // Scores: lane = key j0 + lane (clamped to a real key; masked below).
    const int64_t kbase = (j0 + min(lane, nt - 1)) * kv_row + kv_off;
    // SelfExtend: which sides this warp's tile needs (a row sees a key grouped or at its place).
    bool any_grouped = false, any_near = !se;
    if (se && lane < nt) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if ((seen >> r) & 1u) (se_grouped(qpos[r], kvp, p.se_window) ? any_grouped : any_near) = true;
    }
    const bool tile_grouped = se && __any_sync(0xffffffffu, any_grouped);
    const bool tile_near = !se || __any_sync(0xffffffffu, any_near);
    float s[R], sg[R];
#pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.0f, sg[r] = 0.0f;
    if (tile_grouped) {  // the lane's key turned by its shift, pair by pair, against the turned rows
      const double shift = (double)se_key_shift(p.kv_pos[j0 + min(lane, nt - 1)], p.se_group) / p.pos_div;
      for (int d = 0; d < p.head_dim; d += 2) {
        float x[2] = {kv_load<F16>(p.k, kbase + d), d + 1 < p.head_dim ? kv_load<F16>(p.k, kbase + d + 1) : 0.0f};
        if (d / 2 < p.n_pair) kvq_rotate_pair(x, shift * p.w[d / 2]);
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (r < n_rows) sg[r] = fmaf(qf[r * p.d4 + d + 1], x[1], fmaf(qf[r * p.d4 + d], x[0], sg[r]));
      }
    }
    if (!tile_near) {
      // every visible key of the tile is grouped for every row: the plain scores are not needed
    } else if (p.kv_vec) {
      for (int d = 0; d < p.head_dim; d += 4) {
        const float4 k4 = kv_load4<F16>(p.k, kbase + d);
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (r < n_rows) s[r] = dot4(s[r], *reinterpret_cast<const float4*>(qs + r * p.d4 + d), k4);
      }
    } else {
      for (int d = 0; d < p.head_dim; ++d) {
        const float kd = kv_load<F16>(p.k, kbase + d);
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (r < n_rows) s[r] = fmaf(qs[r * p.d4 + d], kd, s[r]);
      }
    }
    float pr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      pr[r] = 0.0f;
      if (r < n_rows) {
        const bool vis = (seen >> r) & 1u;
        const float sc = se && se_grouped(qpos[r], kvp, p.se_window) ? sg[r] : s[r];
        pr[r] = softmax_step<KD>(vis ? sc : -INFINITY, m[r], l[r], acc[r]);
      }
    }
    // acc[r][d] += Σ_j p[r][j] · V[j][d], lane = d slice; V rows are contiguous: coalesced.
    for (int jj = 0; jj < nt; ++jj) {
      const int64_t vbase = (j0 + jj) * kv_row + kv_off;
      float vv[KD];
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        const int d = lane + 32 * kk;
        vv[kk] = d < p.head_dim ? kv_load<F16>(p.v, vbase + d) : 0.0f;
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (r < n_rows) {
          const float pj = __shfl_sync(0xffffffffu, pr[r], jj);
#pragma unroll
          for (int kk = 0; kk < KD; ++kk) acc[r][kk] = fmaf(pj, vv[kk], acc[r][kk]);
        }
      }
    }
  }

  // Cross-warp merge of the four partial states.
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r < n_rows) {
      if (lane == 0) {
        sm_m[warp][r] = m[r];
        sm_l[warp][r] = l[r];
      }
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        const int d = lane + 32 * kk;
        if (d < p.head_dim) sacc[(warp * R + r) * p.d4 + d] = acc[r][kk];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < n_rows * p.head_dim; idx += kThreads) {
    const int r = idx / p.head_dim, d = idx % p.head_dim;
    const row_ref rr = resolve_row(p, r0 + r, g);
    float mm = -INFINITY;
    for (int w = 0; w < attn_warps; ++w) mm = fmaxf(mm, sm_m[w][r]);
    float* orow = p.o + (int64_t)blockIdx.z * p.o_split_stride + (rr.i * p.n_head + rr.h) * (int64_t)p.head_dim;
    float* lrow = p.lse + (int64_t)blockIdx.z * p.lse_split_stride + rr.i * p.n_head + rr.h;
    if (mm == -INFINITY) {
      orow[d] = 0.0f;
      if (d == 0) *lrow = -INFINITY;
      continue;
    }
    float ll = 0.0f, oo = 0.0f;
    for (int w = 0; w < attn_warps; ++w) {
      if (sm_m[w][r] == -INFINITY) continue;
      const float f = expf(sm_m[w][r] - mm);
      ll = fmaf(sm_l[w][r], f, ll);
      oo = fmaf(sacc[(w * R + r) * p.d4 + d], f, oo);
    }
    orow[d] = oo / ll;
    if (d == 0) *lrow = mm + logf(ll);
  }
}

// ---- prefill kernel ---------------------------------------------------------------------

template <int KD, bool F16>
__global__ void __launch_bounds__(kThreads) attn_prefill_kernel(const __grid_constant__ attn_params p) {
  constexpr int R = attn_prefill_rows;
  constexpr int RW = R / attn_warps;  // rows per warp: warp w owns rows w, w+4, ...
  extern __shared__ float4 smem4[];
  const bool se = se_on(p);
  const int q_sets = se ? 2 : 1;
  float* qs = reinterpret_cast<float*>(smem4);  // [R][d4]
  float* qf = qs + R * p.d4;                    // [R][d4] turned rows (SelfExtend only)
  float* ks = qs + q_sets * R * p.d4;           // [tile][k_stride]
  float* kf = ks + attn_tile * p.k_stride;      // [tile][k_stride] turned keys (SelfExtend only)
  float* vs = ks + q_sets * attn_tile * p.k_stride;  // [tile][d4]
  __shared__ int sm_maxpos[attn_warps], sm_minpos[attn_warps];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = blockIdx.y;
  const int64_t r0 = (int64_t)blockIdx.x * R;
  load_q_tile(p, qs, R, r0, g);
  if (se) load_turned_q_tile(p, qf, R, r0, g);
  // Zero K's padding columns once: tiles only overwrite [0, head_dim).
  for (int idx = threadIdx.x; idx < attn_tile * (p.k_stride - p.head_dim); idx += kThreads) {
    const int j = idx / (p.k_stride - p.head_dim), d = p.head_dim + idx % (p.k_stride - p.head_dim);
    ks[j * p.k_stride + d] = 0.0f;
    if (se) kf[j * p.k_stride + d] = 0.0f;
  }

  const bool sel = sel_on(p.sel);
  row_ref rows[RW];
  int row_pos[RW];
  int64_t row_list[RW];  // retrieval: each row's unit list
  int n_valid = 0;       // rows w, w + 4, ... are valid up to a point
  int max_pos = INT_MIN, min_pos = INT_MAX;
#pragma unroll
  for (int k = 0; k < RW; ++k) {
    rows[k] = resolve_row(p, r0 + warp + attn_warps * k, g);
    row_pos[k] = rows[k].pos;
    row_list[k] = sel && rows[k].valid ? sel_list(p.sel, rows[k].i, g) : 0;
    n_valid += rows[k].valid ? 1 : 0;
    max_pos = max(max_pos, rows[k].pos);
    if (rows[k].valid) min_pos = min(min_pos, rows[k].pos);
  }
  if (lane == 0) sm_maxpos[warp] = max_pos, sm_minpos[warp] = min_pos;  // a warp's rows: the same in every lane
  __syncthreads();
  max_pos = max(max(sm_maxpos[0], sm_maxpos[1]), max(sm_maxpos[2], sm_maxpos[3]));
  min_pos = min(min(sm_minpos[0], sm_minpos[1]), min(sm_minpos[2], sm_minpos[3]));

  float m[RW], l[RW], acc[RW][KD];
#pragma unroll
  for (int k = 0; k < RW; ++k) {
    m[k] = -INFINITY;
    l[k] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) acc[k][kk] = 0.0f;
  }

  const int64_t j_begin = (int64_t)blockIdx.z * p.chunk;
  const int64_t j_end = min(p.n_kv, j_begin + p.chunk);
  const int64_t kv_row = (int64_t)p.n_head_kv * p.head_dim;
  const int64_t kv_off = (int64_t)g * p.head_dim;
  int prev_last = INT_MIN;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += attn_tile) {
    if (p.kv_pos[j0] > max_pos) break;  // block-uniform
    const int nt = (int)min((int64_t)attn_tile, j_end - j0);
    const int kvp = lane < nt ? p.kv_pos[j0 + lane] : INT_MAX;
    const unsigned seen = rows_seeing<RW>(p.sel, sel, row_pos, row_list, n_valid, lane < nt, kvp);
    // The previous tile is no longer read; with a selection, a tile no row lists is not staged.
    if (sel) {
      if (!__syncthreads_or(seen != 0u)) continue;
    } else {
      __syncthreads();
    }
    if (p.kv_vec) {
      const int d4n = p.head_dim / 4;
      for (int idx = threadIdx.x; idx < nt * d4n; idx += kThreads) {
        const int j = idx / d4n, d = 4 * (idx % d4n);
        const int64_t src = (j0 + j) * kv_row + kv_off + d;
        *reinterpret_cast<float4*>(ks + j * p.k_stride + d) = kv_load4<F16>(p.k, src);
        *reinterpret_cast<float4*>(vs + j * p.d4 + d) = kv_load4<F16>(p.v, src);
      }
    } else {
      for (int idx = threadIdx.x; idx < nt * p.head_dim; idx += kThreads) {
        const int j = idx / p.head_dim, d = idx % p.head_dim;
        const int64_t src = (j0 + j) * kv_row + kv_off + d;
        ks[j * p.k_stride + d] = kv_load<F16>(p.k, src);
        vs[j * p.d4 + d] = kv_load<F16>(p.v, src);
      }
    }
    // SelfExtend, block-uniform: some row sees a key of the tile grouped (the tile's first key,
    // W behind the latest row), or at its place (its last key within W of the earliest row).
    const bool tile_grouped = se && (int64_t)max_pos - p.kv_pos[j0] >= p.se_window;
    const bool tile_near = !se || (int64_t)p.kv_pos[j0 + nt - 1] > (int64_t)min_pos - p.se_window;
    if (tile_grouped) {  // K turned by each key's shift, pair by pair (re-read: L2 holds the tile)
      const int half = (p.head_dim + 1) / 2;
      for (int idx = threadIdx.x; idx < nt * half; idx += kThreads) {
        const int j = idx / half, d = 2 * (idx % half);
        const int64_t src = (j0 + j) * kv_row + kv_off + d;
        float x[2] = {kv_load<F16>(p.k, src), d + 1 < p.head_dim ? kv_load<F16>(p.k, src + 1) : 0.0f};
        if (d / 2 < p.n_pair)
          kvq_rotate_pair(x, (double)se_key_shift(p.kv_pos[j0 + j], p.se_group) / p.pos_div * p.w[d / 2]);
        kf[j * p.k_stride + d] = x[0];
        if (d + 1 < p.head_dim) kf[j * p.k_stride + d + 1] = x[1];
      }
    }
    if (warp == 0 && blockIdx.x == 0) check_kv_order(p, j0, nt, kvp, prev_last);
    __syncthreads();

    float s[RW], sg[RW];
#pragma unroll
    for (int k = 0; k < RW; ++k) s[k] = 0.0f, sg[k] = 0.0f;
    // One side's scores (inlined per call, so each array stays in registers). Rows >= nt of
    // the tiles hold stale data: masked below.
    const auto score = [&](const float* ktile, const float* qrows, float(&out)[RW]) {
      const float* krow = ktile + lane * p.k_stride;
      for (int d = 0; d < p.d4; d += 4) {
        const float4 k4 = *reinterpret_cast<const float4*>(krow + d);
#pragma unroll
        for (int k = 0; k < RW; ++k)
          if (rows[k].valid)
            out[k] = dot4(out[k], *reinterpret_cast<const float4*>(qrows + (warp + attn_warps * k) * p.d4 + d), k4);
      }
    };
    if (tile_near) score(ks, qs, s);
    if (tile_grouped) score(kf, qf, sg);
    float pr[RW];
#pragma unroll
    for (int k = 0; k < RW; ++k) {
      pr[k] = 0.0f;
      if (rows[k].valid) {
        const bool vis = (seen >> k) & 1u;
        const float sc = se && se_grouped(rows[k].pos, kvp, p.se_window) ? sg[k] : s[k];
        pr[k] = softmax_step<KD>(vis ? sc : -INFINITY, m[k], l[k], acc[k]);
      }
    }
    for (int jj = 0; jj < nt; ++jj) {
      float vv[KD];
#pragma unroll
      for (int kk = 0; kk < KD; ++kk) {
        const int d = lane + 32 * kk;
        vv[kk] = d < p.head_dim ? vs[jj * p.d4 + d] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < RW; ++k) {
        if (rows[k].valid) {
          const float pj = __shfl_sync(0xffffffffu, pr[k], jj);
#pragma unroll
          for (int kk = 0; kk < KD; ++kk) acc[k][kk] = fmaf(pj, vv[kk], acc[k][kk]);
        }
      }
    }
  }

#pragma unroll
  for (int k = 0; k < RW; ++k) {
    if (!rows[k].valid) continue;
    const bool empty = m[k] == -INFINITY;
    const float inv = empty ? 0.0f : 1.0f / l[k];
    float* orow =
        p.o + (int64_t)blockIdx.z * p.o_split_stride + (rows[k].i * p.n_head + rows[k].h) * (int64_t)p.head_dim;
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
      const int d = lane + 32 * kk;
      if (d < p.head_dim) orow[d] = acc[k][kk] * inv;
    }
    if (lane == 0)
      p.lse[(int64_t)blockIdx.z * p.lse_split_stride + rows[k].i * p.n_head + rows[k].h] =
          empty ? -INFINITY : m[k] + logf(l[k]);
  }
}

// ---- merge ------------------------------------------------------------------------------

// One warp per row. o/lse may alias part 0: each lane reads every part of its own columns
// before writing them, and lse is written only after the whole warp has read the lse column.
__global__ void __launch_bounds__(kThreads)
    merge_kernel(const float* o_parts /*[n_part, n_row, head_dim]*/, const float* lse_parts /*[n_part, n_row]*/,
                 int n_part, int64_t n_row, int head_dim, float* o /*[n_row, head_dim]*/, float* lse /*[n_row]*/) {
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t)blockIdx.x * attn_warps + threadIdx.x / 32;
  if (row >= n_row) return;
  float mm = -INFINITY;
  for (int pt = lane; pt < n_part; pt += 32) mm = fmaxf(mm, lse_parts[(int64_t)pt * n_row + row]);
  mm = warp_max(mm);
  float* orow = o + row * (int64_t)head_dim;
  if (mm == -INFINITY) {
    for (int d = lane; d < head_dim; d += 32) orow[d] = 0.0f;
    if (lane == 0) lse[row] = -INFINITY;
    return;
  }
  float ll = 0.0f;
  for (int pt = lane; pt < n_part; pt += 32) {
    const float lp = lse_parts[(int64_t)pt * n_row + row];
    if (lp != -INFINITY) ll += expf(lp - mm);
  }
  ll = warp_sum(ll);
  const float inv = 1.0f / ll;
  for (int d = lane; d < head_dim; d += 32) {
    float acc = 0.0f;
    for (int pt = 0; pt < n_part; ++pt) {
      const float lp = lse_parts[(int64_t)pt * n_row + row];
      if (lp == -INFINITY) continue;  // empty part: its o is 0 by contract, skip any garbage
      acc = fmaf(expf(lp - mm), o_parts[((int64_t)pt * n_row + row) * head_dim + d], acc);
    }
    orow[d] = acc * inv;
  }
  __syncwarp();
  if (lane == 0) lse[row] = mm + logf(ll);
}

void launch_merge(context& ctx, const float* o_parts, const float* lse_parts, int n_part, int64_t n_row,
                  int head_dim, float* o, float* lse) {
  const int64_t blocks = (n_row + attn_warps - 1) / attn_warps;
  XCTX_CHECK(blocks <= INT_MAX, "cuda merge: too many rows ", n_row);
  merge_kernel<<<(unsigned)blocks, kThreads, 0, ctx.stream>>>(o_parts, lse_parts, n_part, n_row, head_dim, o, lse);
  CUDA_CHECK_LAUNCH();
}

template <int KD, bool F16>
void launch_attention(context& ctx, const attn_plan& plan, const attn_params& prm, int n_head_kv) {
  const dim3 grid((unsigned)plan.row_blocks, (unsigned)n_head_kv, (unsigned)plan.n_split);
  const auto kernel = plan.decode ? attn_decode_kernel<KD, F16> : attn_prefill_kernel<KD, F16>;
  prepare_shared_memory(ctx, reinterpret_cast<const void*>(kernel), plan.smem_bytes, "cuda attention");
  kernel<<<grid, kThreads, plan.smem_bytes, ctx.stream>>>(prm);
  CUDA_CHECK_LAUNCH();
}

void check_args(const attn_args& a) {
  XCTX_CHECK(a.n_q >= 0 && a.n_kv >= 0, "cuda attention: negative sizes n_q=", a.n_q, " n_kv=", a.n_kv);
  XCTX_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0, "cuda attention: n_head=", a.n_head,
             " must be a positive multiple of n_head_kv=", a.n_head_kv);
  XCTX_CHECK(a.head_dim > 0 && a.head_dim <= attn_max_head_dim, "cuda attention: head_dim ", a.head_dim,
             " outside the supported range [1, ", attn_max_head_dim, "]");
  XCTX_CHECK(a.n_head_kv <= 65535, "cuda attention: n_head_kv ", a.n_head_kv, " exceeds the grid's y limit");
}

}  // namespace

void attention_partial(context& ctx, const attn_args& a) {
  check_args(a);
  if (a.n_q == 0) return;
  XCTX_CHECK(a.q && a.q_pos && a.o && a.lse && (a.n_kv == 0 || (a.k && a.v && a.kv_pos)),
             "cuda attention: null pointer among q/q_pos/k/v/kv_pos/o/lse");
  XCTX_CHECK(a.rope.se_period == 0, "cuda attention: retrieval's ordered far positions (se_period) are not implemented on CUDA; use --far-positions fixed");
  const bool se = self_extend_on(a.rope);
  if (se)
    XCTX_CHECK(a.rope.n_rot >= 0 && a.rope.n_rot <= a.head_dim && a.rope.n_rot % 2 == 0 && a.rope.se_window >= 0,
               "cuda attention: SelfExtend rope n_rot=", a.rope.n_rot, " window=", a.rope.se_window,
               " do not fit head_dim=", a.head_dim);
  const attn_plan plan = plan_attention(a.n_q, a.n_kv, a.n_head, a.n_head_kv, a.head_dim, ctx.n_sm, se);
  XCTX_CHECK(plan.row_blocks <= INT_MAX, "cuda attention: too many query rows ", plan.rows_total);
  XCTX_CHECK(plan.smem_bytes <= ctx.smem_optin, "cuda attention: head_dim ", a.head_dim, " needs ", plan.smem_bytes,
             " bytes of shared memory per block, the device allows ", ctx.smem_optin);

  const bool f16 = a.kv_type == kv_dtype::kv_f16;
  const uintptr_t kv_align = f16 ? 7u : 15u;
  attn_params prm{};
  prm.q = a.q;
  prm.q_pos = a.q_pos;
  prm.k = a.k;
  prm.v = a.v;
  prm.kv_pos = a.kv_pos;
  prm.n_kv = a.n_kv;
  prm.rows_total = plan.rows_total;
  prm.n_head = a.n_head;
  prm.n_head_kv = a.n_head_kv;
  prm.group = a.n_head / a.n_head_kv;
  prm.head_dim = a.head_dim;
  prm.d4 = plan.d4;
  prm.k_stride = plan.k_stride;
  prm.scale = a.scale;
  prm.chunk = plan.chunk;
  prm.kv_vec = a.head_dim % 4 == 0 && ((uintptr_t)a.k & kv_align) == 0 && ((uintptr_t)a.v & kv_align) == 0;
  prm.err = ctx.err;
  prm.se_group = 1;
  if (se) {
    prm.se_group = a.rope.se_group;
    prm.se_window = a.rope.se_window;
    prm.n_pair = a.rope.n_rot / 2;
    kvq_rope_setup(a.rope, prm.w, prm.pos_div);
  }

  const int64_t n_row = a.n_q * a.n_head;
  const size_t o_elems = plan.n_split == 1 ? 0 : (size_t)plan.n_split * n_row * a.head_dim;
  const size_t part_bytes = split_partial_bytes(plan.n_split, n_row, a.head_dim);  // o, then lse
  const attn_scratch scr = attention_scratch(ctx, part_bytes, a.select, a.n_q, a.n_head_kv, "cuda attention");
  prm.sel = scr.sel;
  if (plan.n_split == 1) {
    prm.o = a.o;
    prm.lse = a.lse;
  } else {
    float* parts = scr.parts;
    prm.o = parts;                 // [n_split, n_row, head_dim]
    prm.lse = parts + o_elems;     // [n_split, n_row]
    prm.o_split_stride = n_row * a.head_dim;
    prm.lse_split_stride = n_row;
  }

  auto run = [&](auto kd_tag) {
    constexpr int KD = decltype(kd_tag)::value;
    if (f16) launch_attention<KD, true>(ctx, plan, prm, a.n_head_kv);
    else launch_attention<KD, false>(ctx, plan, prm, a.n_head_kv);
  };
  if (plan.kd == 2) run(std::integral_constant<int, 2>{});
  else if (plan.kd == 4) run(std::integral_constant<int, 4>{});
  else run(std::integral_constant<int, 8>{});

  if (plan.n_split > 1)
    launch_merge(ctx, prm.o, prm.lse, plan.n_split, n_row, a.head_dim, a.o, a.lse);
}

void merge_partials(context& ctx, const float* o_parts, const float* lse_parts, int n_part, int64_t n_row,
                    int head_dim, float* o, float* lse) {
  XCTX_CHECK(n_part > 0, "cuda merge_partials: need at least one part, got ", n_part);
  XCTX_CHECK(head_dim > 0 && n_row >= 0, "cuda merge_partials: bad shape n_row=", n_row, " head_dim=", head_dim);
  if (n_row == 0) return;
  launch_merge(ctx, o_parts, lse_parts, n_part, n_row, head_dim, o, lse);
}

}  // namespace xctx::cuda
