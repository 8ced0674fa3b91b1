#include "cache/slot_positions.h"

#include <algorithm>
#include <climits>

#include "common/error.h"

namespace xctx {

void store_slot_positions(int32_t* pos, int64_t& n_written, int layer, int64_t at, const layer_input& in) {
  for (int64_t i = 0; i < in.n; ++i) {
    const int32_t prev = i > 0 ? in.pos[i - 1] : (at > 0 ? pos[at - 1] : INT32_MIN);
    XCTX_CHECK(in.pos[i] > prev, "cache append to layer ", layer, ": position ", in.pos[i], " does not follow ", prev,
               " (positions must increase)");
  }
  for (int64_t i = 0; i < in.n; ++i) {
    if (at + i >= n_written) pos[at + i] = in.pos[i];
    XCTX_ASSERT(pos[at + i] == in.pos[i], "layer ", layer, " appends position ", in.pos[i], " at slot ", at + i,
                " where another layer stored ", pos[at + i]);
  }
  n_written = std::max(n_written, at + in.n);
}

void restore_slot_positions(int32_t* pos, int64_t& n_written, int layer, const int32_t* layer_pos, int64_t n) {
  for (int64_t i = 0; i < std::min(n, n_written); ++i)
    XCTX_CHECK(pos[i] == layer_pos[i], "cache snapshot: layer ", layer, " holds position ", layer_pos[i], " at slot ", i,
               " where an earlier layer holds ", pos[i]);
  layer_input in;
  in.pos = layer_pos, in.n = n;
  store_slot_positions(pos, n_written, layer, 0, in);
}

slot_position_store::slot_position_store(backend& be, int64_t capacity)
    : be_(be), host_mem_(be.host_memory()), host_((size_t)capacity), dev_(be), qpos_(be) {
  if (!host_mem_) dev_.reserve((size_t)capacity * sizeof(int32_t));
}

void slot_position_store::upload_from(int64_t written) {
  if (!host_mem_ && n_written_ > written)
    be_.upload(dev_.as<int32_t>() + written, host_.data() + written, (size_t)(n_written_ - written) * sizeof(int32_t));
}

void slot_position_store::store(int layer, int64_t at, const layer_input& in) {
  const int64_t written = n_written_;
  store_slot_positions(host_.data(), n_written_, layer, at, in);
  upload_from(written);
}

void slot_position_store::restore(int layer, const int32_t* layer_pos, int64_t n) {
  const int64_t written = n_written_;
  restore_slot_positions(host_.data(), n_written_, layer, layer_pos, n);
  upload_from(written);
}

const int32_t* slot_position_store::queries_on_backend(const int32_t* q_pos, int64_t n_q) {
  if (host_mem_) return q_pos;
  if ((int64_t)qhost_.size() != n_q || !std::equal(q_pos, q_pos + n_q, qhost_.begin())) {
    qhost_.assign(q_pos, q_pos + n_q);
    be_.upload(qpos_.reserve_as<int32_t>(std::max<int64_t>(n_q, 1)), q_pos, (size_t)n_q * sizeof(int32_t));
  }
  return qpos_.as<int32_t>();
}

}  // namespace xctx
