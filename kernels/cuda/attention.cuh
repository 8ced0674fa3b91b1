// Launch planning of the CUDA attention kernels and the SelfExtend position arithmetic: host
// code or host-device, free of CUDA headers, so the test binary checks the plans (coverage of
// the cache, shared-memory budget) and the grouped-position turns without a GPU.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/half.h"  // XCTX_HOST_DEVICE

namespace xctx::cuda {

// ---- SelfExtend on post-RoPE (f32/f16) caches ---------------------------------------------
// rope_config (kernels/ops.h): a key at p that is W or more positions behind the query at i is
// attended at grouped positions, the key at floor(p / G) and the query at
// floor(i / G) + W - floor(W / G). The cache holds R(p) k and the query arrives as R(i) q, so
// the kernels score (R(a) q')·(R(b) k') with the query's shift a = qg(i) - i and the key's
// b = floor(p / G) - p: equal to ref::rope_score's q'·R(b - a) k' (R is orthogonal), with each
// factor turned once per row or key instead of per pair of them.
XCTX_HOST_DEVICE inline int64_t se_floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
XCTX_HOST_DEVICE inline int64_t se_key_shift(int64_t p, int G) { return se_floor_div(p, G) - p; }
XCTX_HOST_DEVICE inline int64_t se_query_shift(int64_t i, int G, int W) { return se_floor_div(i, G) + W - W / G - i; }
XCTX_HOST_DEVICE inline bool se_grouped(int64_t q_pos, int64_t k_pos, int W) { return q_pos - k_pos >= W; }

// ---- retrieval attention's selection (kernels/ops.h attn_selection) in device memory --------
// The kernels see a (query, KV head) pair's key only when its unit (attn_unit positions) is in
// the pair's list: lists_per_query lists per query (1: shared by every head; n_head_kv: one per
// KV head), units ascending per list. A tile whose keys no row of the block lists is skipped
// before its K/V bytes are read, so a step reads what the selection names plus the unit lists.
constexpr int attn_unit = 256;  // kAttnUnit (kernels/softmax_acc.h; checked equal where both are seen)
struct attn_sel_view {
  const int64_t* offsets = nullptr;  // [n_q * lists_per_query + 1]
  const int64_t* units = nullptr;
  int lists_per_query = 0;  // 0: no selection, every causal key is seen
};
XCTX_HOST_DEVICE inline bool sel_on(const attn_sel_view& s) { return s.lists_per_query > 0; }
XCTX_HOST_DEVICE inline int64_t sel_list(const attn_sel_view& s, int64_t i, int kvh) {
  return i * s.lists_per_query + (s.lists_per_query == 1 ? 0 : kvh);
}
// Whether list `list` holds the unit of position pos (binary search; lists are short).
XCTX_HOST_DEVICE inline bool sel_listed(const attn_sel_view& s, int64_t list, int64_t pos) {
  const int64_t unit = se_floor_div(pos, attn_unit);
  int64_t lo = s.offsets[list], hi = s.offsets[list + 1];
  const int64_t end = hi;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (s.units[mid] < unit) lo = mid + 1;
    else hi = mid;
  }
  return lo < end && s.units[lo] == unit;
}

// Bit r set: row r (of the first n_rows) sees a lane's key at position kvp: a real key, causal,
// and listed when selecting. Rows of one query share a list, so a row reuses the previous row's
// lookup. (N <= 32 rows.)
template <int N>
XCTX_HOST_DEVICE inline unsigned rows_seeing(const attn_sel_view& s, bool sel, const int (&pos)[N], const int64_t (&list)[N],
                                       int n_rows, bool real_key, int kvp) {
  unsigned seen = 0;
  int64_t last_list = -1;
  bool last_listed = false;
  for (int r = 0; r < N; ++r) {
    if (r >= n_rows || !real_key || kvp > pos[r]) continue;
    if (sel && list[r] != last_list) last_list = list[r], last_listed = sel_listed(s, list[r], kvp);
    if (!sel || last_listed) seen |= 1u << r;
  }
  return seen;
}

constexpr int attn_max_head_dim = 256;  // per-lane accumulators cover head_dim in 32-wide slices
constexpr int attn_warps = 4;
constexpr int attn_tile = 32;                    // keys per tile: one per lane
constexpr int attn_decode_rows = 8;              // (query, head) rows per block, decode kernel
constexpr int attn_prefill_rows = 32;            // rows per block, prefill kernel (8 per warp)
constexpr int64_t attn_min_split_keys = 256;     // below this a split costs more than it brings
constexpr size_t attn_scratch_cap = 256u << 20;  // split partials; bounds n_split for huge n_q

// Rows are (query i, head h) pairs that share kv head g, flattened as i * group + (h - g*group):
// consecutive rows reuse the same cached keys, so a block of rows reads each key once.
struct attn_plan {
  bool decode = true;        // decode kernel: keys split across warps; prefill: rows split, K/V tiles shared
  int rows_per_block = attn_decode_rows;
  int kd = 2;                // 32-wide head_dim slices per lane: 2, 4 or 8
  int d4 = 0;                // head_dim rounded up to a multiple of 4 (smem row length, zero padded)
  int k_stride = 0;          // prefill smem K row stride (floats), chosen for conflict-free 16-byte reads
  int64_t rows_total = 0;    // n_q * group, per kv head
  int64_t row_blocks = 0;
  int n_split = 1;           // blocks along the key axis; > 1 means partials + a merge
  int64_t chunk = attn_tile; // keys per split, a multiple of attn_tile
  size_t smem_bytes = 0;     // dynamic shared memory per block
};

// self_extend: the rows' turned queries (both kernels) and a tile of turned keys (prefill) too.
inline attn_plan plan_attention(int64_t n_q, int64_t n_kv, int n_head, int n_head_kv, int head_dim, int n_sm,
                                bool self_extend = false) {
  attn_plan p;
  const int group = n_head / n_head_kv;
  p.rows_total = n_q * group;
  p.decode = p.rows_total <= 4 * attn_decode_rows;
  p.rows_per_block = p.decode ? attn_decode_rows : attn_prefill_rows;
  p.kd = head_dim <= 64 ? 2 : (head_dim <= 128 ? 4 : 8);
  p.d4 = (head_dim + 3) / 4 * 4;
  p.k_stride = p.d4 % 8 == 0 ? p.d4 + 4 : p.d4;  // ≡ 4 (mod 8): 8 lanes of a 16-byte phase hit distinct banks
  p.row_blocks = (p.rows_total + p.rows_per_block - 1) / p.rows_per_block;
  const size_t R = (size_t)p.rows_per_block, q_sets = self_extend ? 2 : 1;
  if (p.decode)  // q rows (and turned ones) + one accumulator set per warp for the final cross-warp merge
    p.smem_bytes = (q_sets * R * p.d4 + (size_t)attn_warps * R * p.d4) * sizeof(float);
  else  // q rows + a K tile (each also turned) + a V tile
    p.smem_bytes = (q_sets * (R * p.d4 + (size_t)attn_tile * p.k_stride) + (size_t)attn_tile * p.d4) * sizeof(float);

  const int64_t tiles = std::max<int64_t>(1, (n_kv + attn_tile - 1) / attn_tile);
  const int64_t base_blocks = std::max<int64_t>(1, p.row_blocks * n_head_kv);
  const int64_t target = 2 * (int64_t)std::max(1, n_sm);
  const int64_t min_tiles = attn_min_split_keys / attn_tile;
  int64_t n_split = 1;
  if (base_blocks < target && tiles > min_tiles) {
    n_split = std::min((target + base_blocks - 1) / base_blocks, (tiles + min_tiles - 1) / min_tiles);
    const size_t per_split = (size_t)std::max<int64_t>(1, n_q * n_head) * ((size_t)head_dim + 1) * sizeof(float);
    n_split = std::max<int64_t>(1, std::min<int64_t>(n_split, (int64_t)(attn_scratch_cap / per_split)));
  }
  const int64_t chunk_tiles = (tiles + n_split - 1) / n_split;
  p.chunk = chunk_tiles * attn_tile;
  p.n_split = (int)((tiles + chunk_tiles - 1) / chunk_tiles);  // no split starts past the cache
  return p;
}

}  // namespace xctx::cuda
