// The CPU kernels' own buffers, sized here so the memory plan (worker/memory_plan.cpp) counts
// what the kernels allocate: the constants are the kernels' tile sizes, not estimates.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/softmax_acc.h"

namespace xctx::cpu {

// matmul.cpp: floats of the packed weight panel each thread keeps (prefill GEMM).
inline constexpr int64_t kMatmulPanelFloats = 256 * 1024;
// attention_units.cpp: units decoded to f32 together on the many-query (prefill) path, each
// thread then running its queries over all of them: enough to amortize the barrier, few enough
// to stay near L2 (4 x 256 x 192 x 2 x 4 B).
inline constexpr int kUnitBatch = 4;

// Bytes the kernels hold at most while a rank prefills chunks of n_batch tokens and decodes:
// per thread a weight panel and the decode path's near + grouped unit tiles (K and V, f32, kept
// between calls), and per prefill call the shared f32 tiles of kUnitBatch units (both sides) and
// the scaled queries. kv_dim: key channels of a token; q_dim: query channels.
inline size_t kernel_workspace_bytes(int n_threads, int64_t n_batch, int64_t kv_dim, int64_t q_dim) {
  const size_t unit = (size_t)kAttnUnit * (size_t)kv_dim * sizeof(float);
  const size_t per_thread = (size_t)kMatmulPanelFloats * sizeof(float) + 2 * 2 * unit;
  return (size_t)n_threads * per_thread + 2 * 2 * (size_t)kUnitBatch * unit + (size_t)n_batch * q_dim * sizeof(float);
}

}  // namespace xctx::cpu
