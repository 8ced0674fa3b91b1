// The positions of a cache's token slots: one array shared by the layers.
#pragma once

#include <cstdint>

#include "cache/cache.h"

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

}  // namespace xctx
