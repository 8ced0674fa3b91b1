// Ring blocks (export_layer's bytes, host memory) attended on a backend with memory of its own:
// the whole block goes up once and the views parsed from the host bytes move to the copy, each
// array at its offset.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/ops.h"

namespace xctx {

// The block where `be` reads it: block_on_backend when the caller uploaded it already (the ring
// uploads a received block once per layer, not once per query chunk), else one upload into buf.
// Only for backends without host memory.
inline const void* block_on(backend& be, backend_buffer& buf, const void* block, size_t bytes,
                            const void* block_on_backend) {
  if (block_on_backend != nullptr) return block_on_backend;
  void* dev = buf.reserve(bytes);
  be.upload(dev, block, bytes);
  return dev;
}

// p, a pointer into the host block at `host` (or null), moved to the same offset in its copy at
// `dev` (views of a block are read-only).
template <typename T>
void rebase_into(const T*& p, const void* host, const void* dev) {
  if (p != nullptr)
    p = reinterpret_cast<const T*>(static_cast<const uint8_t*>(dev) +
                                   (reinterpret_cast<const uint8_t*>(p) - static_cast<const uint8_t*>(host)));
}

}  // namespace xctx
