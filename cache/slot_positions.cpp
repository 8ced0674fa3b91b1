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

}  // namespace xctx
