// The attention of one query chunk summed over everything it sees -- caches, ring blocks, other
// ranks -- in one of two modes chosen by the backend:
//   exact    (backend::exact_accumulator: cpu, ref) per-unit deposits into a host softmax_acc;
//            the sum is bitwise the same however the keys are split over calls and ranks.
//   partials (cuda) (o, lse) partials in the backend's memory, merged with merge_partials in
//            the order they were added; across ranks, every rank merges all ranks' partials in
//            rank order, so every rank gets the same bits. The float merge rounds differently
//            for another split, so results match the exact mode to float tolerance, not bitwise
//            (docs/engine.md, "Backends").
#pragma once

#include <cstdint>
#include <vector>

#include "cache/cache.h"
#include "comm/communicator.h"

namespace xctx {

class attention_sum {
 public:
  explicit attention_sum(backend& be);
  bool exact() const { return exact_; }

  // Starts a sum for n_q queries of n_head heads (rows n_q * n_head of width head_dim).
  void begin(int64_t n_q, int n_head, int head_dim);
  // Adds the attention of the queries (backend memory; positions on the host) over a cache's
  // own tokens, or over a block export_layer produced (host memory).
  // select: retrieval attention's units per query (null: every causal key).
  void add(kv_cache& c, int layer, const float* q, const int32_t* q_pos, int64_t n_q, attend_path path,
           const attn_selection* select = nullptr);
  // block_on_backend: the same bytes in backend memory, when the caller holds them there.
  void add_exported(kv_cache& c, int layer, const void* block, size_t bytes, const float* q, const int32_t* q_pos,
                    int64_t n_q, attend_path path, const void* block_on_backend = nullptr);
  // Collective: adds every rank's sum to every rank's. Returns the bytes this rank contributed.
  // partials mode: with device_comm (collectives on backend memory: NCCL) the partials are
  // gathered where they lie; without, through the host and comm.
  size_t all_reduce(communicator& comm, communicator* device_comm = nullptr);
  // The softmax-normalised result into o (backend memory, [rows, head_dim]).
  void finish(float* o);

 private:
  // partials mode: the slot the next partial goes to (at most two are held: a third merges the
  // first two into slot 0 first).
  int next_slot();
  // Where the next call's attention goes: the exact sum, or the next partials slot.
  attend_sink next_sink();

  backend& be_;
  const bool exact_;
  int64_t rows_ = 0;
  int width_ = 0;
  softmax_acc acc_;                         // exact mode
  std::vector<uint8_t> packed_, gathered_;  // host images for the collective
  backend_buffer o_parts_, lse_parts_;      // partials mode: [2, rows, width], [2, rows]
  int n_parts_ = 0;
  backend_buffer o_all_, lse_all_;          // partials mode after all_reduce: [n_rank, rows, ...]
  int n_all_ = 0;
};

}  // namespace xctx
