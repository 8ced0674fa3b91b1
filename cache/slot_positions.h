// The positions of a cache's token slots: one array shared by the layers.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/cache.h"
#include "kernels/ops.h"

namespace xctx {

// Records the positions of in.n tokens appended to `layer` at slot `at`. They must increase
// (attention finds a query's visible keys by binary search: a clear error otherwise), and a slot
// another layer already wrote must agree (positions are stored once for all layers).
void store_slot_positions(int32_t* pos /*[capacity]*/, int64_t& n_written, int layer, int64_t at,
                          const layer_input& in);

// The positions of a layer restored from a snapshot (n of them, from slot 0): as
// store_slot_positions, but a disagreement with another layer's is bad input (a damaged
// snapshot), so it throws instead of asserting.
void restore_slot_positions(int32_t* pos /*[capacity]*/, int64_t& n_written, int layer, const int32_t* layer_pos,
                            int64_t n);

// A cache's slot positions (one array shared by its layers) where its backend's kernels read
// them, checked and kept on the host as well. On a device backend a slot is uploaded once, by the
// first layer to reach it, and a step's query positions once, by the first layer to ask (every
// layer of a step asks with the same): no upload per layer.
class slot_position_store {
 public:
  slot_position_store(backend& be, int64_t capacity);
  slot_position_store(const slot_position_store&) = delete;
  slot_position_store& operator=(const slot_position_store&) = delete;

  const int32_t* on_backend() const { return host_mem_ ? host_.data() : dev_.as<int32_t>(); }  // [capacity]
  const int32_t* host() const { return host_.data(); }
  int64_t n_written() const { return n_written_; }
  // store_slot_positions / restore_slot_positions, then the new slots uploaded.
  void store(int layer, int64_t at, const layer_input& in);
  void restore(int layer, const int32_t* layer_pos, int64_t n);
  void clear() { n_written_ = 0; }
  // q_pos [n_q] (host) where the backend reads them.
  const int32_t* queries_on_backend(const int32_t* q_pos, int64_t n_q);
  // Backend bytes: the slot array (the query positions' buffer is scratch).
  size_t bytes() const { return host_.size() * sizeof(int32_t); }

 private:
  void upload_from(int64_t written);

  backend& be_;
  bool host_mem_;
  std::vector<int32_t> host_;  // [capacity]: the array itself on host-memory backends
  int64_t n_written_ = 0;
  backend_buffer dev_, qpos_;    // device backends: the slots, the last query positions
  std::vector<int32_t> qhost_;  // what qpos_ holds
};

}  // namespace xctx
