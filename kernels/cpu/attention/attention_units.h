// Attention whose result does not depend on how the keys are split (across ranks, ring steps,
// threads or prefill chunks): one partial per *unit* of kAttnUnit absolute positions, each
// computed by the same decode kernel with the same per-row arithmetic (one query per call, or
// blocks of queries whose rows the kernel never mixes), deposited into an exact
// softmax_acc (kernels/softmax_acc.h). A unit's partial depends only on the query and the
// unit's visible keys, and the accumulator's sum only on the set of deposits, so any split of
// the keys along unit boundaries gives bitwise the same o and lse.
//
// Callers must not split a unit between two caches: shard plans align rank boundaries to
// kAttnUnit (cache_alignment). A unit cut short by causality (a query's own prefix) is fine:
// every split sees the same visible keys of it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/ops.h"
#include "kernels/softmax_acc.h"

namespace xctx::cpu {

// Keys (RoPE applied) and values of one unit's slots: row j of K at k + j * ld elements.
struct unit_kv {
  const void* k = nullptr;
  const void* v = nullptr;
  kv_dtype type = kv_dtype::kv_f32;
  int64_t ld = 0;
};

// An (o, lse) call with SelfExtend on (what a backend without the exact accumulator asks of
// the CPU kernels: tests/device_space_backend.h): grouped positions live on the unit path, so
// the call runs there into an accumulator of its own rows and o, lse come from the exact sum.
// `attend` is the kernel itself, called again with args.acc set.
template <typename Args, typename Attend>
void attend_via_accumulator(const Args& a, int64_t rows, int width, Attend&& attend) {
  softmax_acc acc(rows, width);
  Args with_acc = a;
  with_acc.acc = &acc;
  attend(with_acc);
  acc.finish(a.o, a.lse);
}

// Produces a unit's K/V, either pointing into the cache or decoded into the f32 buffers given
// (kbuf, vbuf: [n, channels] each). One loader per thread, so it may keep state.
class unit_loader {
 public:
  virtual ~unit_loader() = default;
  virtual unit_kv load(int64_t s0, int n, float* kbuf, float* vbuf) = 0;
  // The same slots with keys rotated to SelfExtend's grouped positions (rope_config::se_group),
  // decoded to f32 into the buffers. Only called when the queries' rope has SelfExtend on.
  virtual unit_kv load_grouped(int64_t s0, int n, float* kbuf, float* vbuf) = 0;
  // Called with the next unit before the current one runs: a loader reading a stream from
  // memory can request its first rows early (the decode kernel prefetches only inside a unit).
  virtual void prefetch(int64_t /*s0*/, int /*n*/) {}
};

struct unit_queries {
  const float* q = nullptr;        // [n_q, n_head, head_dim], RoPE applied
  const int32_t* q_pos = nullptr;  // [n_q]
  int64_t n_q = 0;
  int n_head = 0, n_head_kv = 0, head_dim = 0;
  float scale = 0.0f;
  // The keys' rope. With SelfExtend on (self_extend_on), a query's keys at or before
  // self_extend_last_grouped are attended through the loaders' grouped keys and the query
  // turned to its grouped position (kernels/ops.h), the rest as usual: up to two deposits per
  // (query, unit), each a function of the query and the unit alone, so invariance holds.
  const rope_config* rope = nullptr;
  // Retrieval: query i sees only the units select->sees(i, unit) lists (attn_args::select);
  // with one list per KV head, a unit is computed for every head of the query and deposited
  // only for the heads whose list holds it.
  const attn_selection* select = nullptr;
  bool avx512_rows = true;  // decode jobs may take the AVX-512 many-row kernel (attention_switches)
};

// Which cached slots each query sees, and on which side: everything near unless the rope has
// SelfExtend on, when slots at positions <= self_extend_last_grouped(q_pos) are on the
// grouped side (keys at grouped positions, the query turned: q_far).
struct query_ranges {
  std::vector<int64_t> end;    // [n_q] visible slots are [0, end)
  std::vector<int64_t> split;  // [n_q] slots [0, split) are on the grouped side, [split, end) near
  int64_t kv_len = 0;          // max end
  bool grouped = false;        // SelfExtend on
  std::vector<float> q_far;    // [n_q, n_head, head_dim] grouped-side queries times the scale
  const int32_t* kv_pos = nullptr;
  const attn_selection* select = nullptr;  // retrieval: units outside query i's list are empty for it

  query_ranges(const unit_queries& qs, const int32_t* kv_pos /*[n_kv] ascending*/, int64_t n_kv);
  // Whether query i may see the unit starting at slot s0 (every unit, without a selection).
  bool selected(int64_t i, int64_t s0) const {
    return select == nullptr || select->sees(i, attn_unit_of(kv_pos[s0]));
  }
  // Query i's near / grouped slots in the unit [s0, s0 + n), relative to s0 (empty when b >= e).
  // Whether the heads of KV head kvh of query i see the unit at slot s0, given selected(i, s0).
  bool head_sees(int64_t i, int kvh, int64_t s0) const {
    return select == nullptr || select->shared() || select->sees(i, kvh, attn_unit_of(kv_pos[s0]));
  }
  std::pair<int64_t, int64_t> near(int64_t i, int64_t s0, int n) const {
    if (!selected(i, s0)) return {0, 0};
    return {std::max<int64_t>(split[i] - s0, 0), std::min<int64_t>(end[i] - s0, n)};
  }
  std::pair<int64_t, int64_t> far(int64_t i, int64_t s0, int n) const {
    if (!selected(i, s0)) return {0, 0};
    return {0, std::min<int64_t>(std::min(split[i], end[i]) - s0, n)};
  }
  // Indices u of the units [ub[u], ub[u + 1]) some query may see: all of them without a
  // selection. The decode paths split these among threads, not every unit of a long shard.
  std::vector<int64_t> visible_units(const std::vector<int64_t>& ub) const;
  bool any_near(int64_t s0, int n) const;  // some query needs the unit's keys
  bool any_far(int64_t s0, int n) const;   // ... its grouped keys
};

// Slot ranges of the units of slots [0, n) with ascending positions pos: a new unit starts
// wherever pos / kAttnUnit changes. Returns the n_unit + 1 boundaries.
std::vector<int64_t> unit_bounds(const int32_t* pos /*[n]*/, int64_t n);

// Computes one query's partial over a unit straight from a cache's storage (no f32 unit buffer):
// the fused decode-step kernels. One per thread, so it may keep scratch.
class unit_kernel {
 public:
  virtual ~unit_kernel() = default;
  // Partial of q ([n_head, head_dim], multiplied by the softmax scale) over slots [s0, s0 + n),
  // all visible, inside one unit: o [n_head, head_dim] normalised, lse [n_head] natural log.
  // grouped: keys at SelfExtend's grouped positions (q is then the grouped-side query).
  virtual void attend(const float* q, int64_t s0, int n, bool grouped, float* o, float* lse) = 0;
};

// Deposits into acc rows i * n_head + h (acc must have n_q * n_head rows of width head_dim) the
// partial of every (query, unit) pair with a visible key. kv_pos: [n_kv] ascending.
void attend_units(const unit_queries& qs, const int32_t* kv_pos, int64_t n_kv,
                  const std::function<std::unique_ptr<unit_loader>()>& make_loader, softmax_acc& acc);

// The same deposits for one query (qs.n_q == 1) from a unit_kernel: threads split the units in
// contiguous ranges. The kernel's rounding is its own, so callers choose it by phase (a decode
// step), never by the number of queries in a call.
void attend_units_one_query(const unit_queries& qs, const int32_t* kv_pos, int64_t n_kv,
                            const std::function<std::unique_ptr<unit_kernel>()>& make_kernel, softmax_acc& acc);

}  // namespace xctx::cpu
