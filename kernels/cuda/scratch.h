// The CUDA backend's one device scratch buffer (context::scratch, cuda_backend.cu): what each
// kernel family asks of it, in the formulas the launch code itself uses, and the bound on its
// high-water mark that the fit check counts (kernel_workspace_bytes, registry/registry.h). Host
// code free of CUDA headers, so every build checks the bound against the plans (tests/kernels/
// test_cuda_scratch.cpp).
//
// Users of the scratch, one call at a time on the backend's stream (the buffer only grows, to
// the largest request rounded to a MiB; it is freed before it is regrown):
//   matmul_gemm      a panel of whole weight rows dequantized to f32 (prefill GEMMs)
//   attention        the (o, lse) partials of every split when the key axis is split, then the
//   attention_kvq    retrieval lists behind them (offsets, units; 256-byte aligned)
//   attention_xq     the U partials of every split (also unsplit), their lse, the lists
// Each attention family caps its split count so that the partials of a split call stay within
// its cap (attn_/kvq_/xq_scratch_cap); an unsplit xq call holds n_row x (wv + 1) floats.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/kvq.cuh"
#include "kernels/cuda/xq.cuh"
#include "kernels/ops.h"  // workspace_shape

namespace xctx::cuda {

constexpr size_t matmul_panel_bytes = 64u << 20;  // f32 scratch for one dequantized weight panel
constexpr size_t scratch_granule = 1u << 20;      // context::scratch rounds requests up to this
constexpr size_t selection_alignment = 256;       // the lists start this aligned behind the partials

// matmul_gemm over a quantized [n_rows, n_cols] weight: whole rows, at least one.
inline size_t matmul_panel_request(int64_t n_rows, int64_t n_cols) {
  const size_t row = (size_t)std::max<int64_t>(1, n_cols) * sizeof(float);
  const int64_t panel = std::clamp<int64_t>((int64_t)(matmul_panel_bytes / row), 1, std::max<int64_t>(1, n_rows));
  return (size_t)panel * row;
}

// The (o, lse) partials of a split attention or attention_kvq call (none when unsplit: the
// kernel writes the output directly).
inline size_t split_partial_bytes(int n_split, int64_t n_row, int head_dim) {
  return n_split <= 1 ? 0 : (size_t)n_split * (size_t)n_row * ((size_t)head_dim + 1) * sizeof(float);
}

// attention_xq's U partials (wv latent channels or head_dim values per row) and their lse, for
// every split including the only one.
inline size_t xq_partial_bytes(int n_split, int64_t n_row, int wv) {
  return (size_t)std::max(1, n_split) * (size_t)n_row * ((size_t)wv + 1) * sizeof(float);
}

// A retrieval selection's lists as the device holds them: offsets then units, int64 each.
inline size_t selection_list_bytes(size_t n_offsets, size_t n_units) { return (n_offsets + n_units) * sizeof(int64_t); }

// One call's request: the partials, then the lists from the next aligned byte.
inline size_t scratch_request(size_t part_bytes, size_t list_bytes) {
  if (part_bytes + list_bytes == 0) return 0;
  return (part_bytes + selection_alignment - 1) / selection_alignment * selection_alignment + list_bytes;
}

// What context::scratch allocates for a request.
inline size_t scratch_allocation(size_t request) {
  return (request + scratch_granule - 1) / scratch_granule * scratch_granule;
}

// The high-water mark of the scratch over every call a sequence of shape `s` makes: the larger
// of the widest weight panel and the largest partials with the fullest selection behind them
// (every query's lists naming every unit of the shard), rounded as context::scratch rounds.
inline size_t scratch_bound(const workspace_shape& s) {
  const int64_t n_q = std::max<int64_t>(1, s.n_batch);
  const size_t panel = std::max(matmul_panel_bytes, (size_t)std::max<int64_t>(1, s.max_weight_cols) * sizeof(float));
  const int wv = std::max(s.n_embd, s.head_dim);  // xq: latent channels (<= n_embd) or head_dim values
  const int64_t n_row = n_q * std::max(1, s.n_head);
  const size_t parts = std::max({attn_scratch_cap, kvq_scratch_cap, xq_scratch_cap, xq_partial_bytes(1, n_row, wv)});
  const size_t lists_per_call = (size_t)n_q * (size_t)std::max(1, s.n_head_kv);  // per-KV-head lists at most
  // Units a shard's keys fall in: its tokens over whole units, plus a partial unit where each of
  // its pieces (zigzag: two, and the tail's tokens) starts or ends mid-unit.
  const size_t units = (size_t)(std::max<int64_t>(0, s.capacity) / attn_unit + 6);
  const size_t lists = selection_list_bytes(lists_per_call + 1, lists_per_call * units);
  return scratch_allocation(std::max(panel, scratch_request(parts, lists)));
}

}  // namespace xctx::cuda
