// The kernels' value types that model/ and cache/ need without the backend interface
// (kernels/ops.h): a weight matrix as stored, and the rotary embedding's configuration with the
// position maps of SelfExtend and retrieval attention.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/quant_blocks.h"

namespace xctx {

// A weight matrix as stored in the model file: n_rows output rows, each of n_cols input
// elements packed as blocks of `type`. y = W·x means y[r] = dot(row r, x).
struct weight_view {
  ggml_type type = ggml_type::ggml_f32;
  int64_t n_rows = 0;
  int64_t n_cols = 0;
  const void* data = nullptr;  // [n_rows, row_bytes]
  size_t row_bytes() const { return ggml_row_bytes(type, n_cols); }
  size_t bytes() const { return row_bytes() * (size_t)n_rows; }
};

enum class rope_scaling : uint8_t {
  rope_scaling_none,
  rope_scaling_linear,  // positions divided by factor (Chen et al. 2023, "position interpolation")
  rope_scaling_ntk,     // NTK-aware: base' = base * factor^(d / (d - 2)) (bloc97, 2023)
};

// Rotary embedding as Llama GGUFs use it: pairs are adjacent elements (2i, 2i+1) of each head
// ("normal" GGML rope; HF's rotate_half layout is permuted into this by the converters).
struct rope_config {
  int head_dim = 64;
  int n_rot = 64;                  // rotated dimensions (<= head_dim); the rest pass through
  float freq_base = 10000.0f;
  rope_scaling scaling = rope_scaling::rope_scaling_none;
  float scaling_factor = 1.0f;     // > 1 stretches the usable context
  // theta_i(pos) = pos_eff * base_eff^(-2i / n_rot); see rope_theta() in kernels/ref.

  // SelfExtend (Jin et al. 2024, "LLM Maybe LongLM"), applied at attention time only: a key
  // fewer than se_window positions behind the query is attended at the exact positions; a
  // farther one at grouped positions, the key at floor(p / G) and the query at
  // floor(i / G) + W - floor(W / G) (the shift keeps relative distances continuous at the
  // window's edge). se_group 1 = off. Caches keep their keys as they are (pre-RoPE codes are
  // rotated where they are decoded; post-RoPE fp keys are turned by floor(p / G) - p), so
  // nothing is re-encoded. Composes with the scalings above (they change theta, this the
  // positions).
  int se_group = 1;   // G
  int se_window = 0;  // W, in positions
  // Retrieval only (with kFixedDistanceGroup; 0 = off): on the grouped side a key also keeps its
  // offset within its aligned span of P positions, and the query moves P further, so a retrieved
  // block's keys keep their order at distances W + 1 .. W + P instead of all sitting at W.
  int se_period = 0;  // P, a multiple of kAttnUnit (the retrieval block)
};

inline bool self_extend_on(const rope_config& c) { return c.se_group > 1; }
inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }
// Where a key at position p is rotated to on the grouped side.
// The one definition of the grouped-side key map (G, P as in rope_config), shared with the fused
// kernels that carry G and P rather than the config.
inline int64_t grouped_key_pos(int64_t p, int group, int period) {
  return floor_div(p, group) + (period > 0 ? p - floor_div(p, period) * period : 0);
}
inline int64_t self_extend_key_pos(const rope_config& c, int64_t p) {
  return grouped_key_pos(p, c.se_group, c.se_period);
}
// Where a query at position i is rotated to on the grouped side.
inline int64_t self_extend_query_pos(const rope_config& c, int64_t i) {
  return floor_div(i, c.se_group) + c.se_window - c.se_window / c.se_group + c.se_period;
}
// Keys at positions <= this are attended on the grouped side by the query at i (i - p >= W).
inline int64_t self_extend_last_grouped(const rope_config& c, int64_t i) { return i - c.se_window; }

// Retrieval attention's positions (InfLLM, Xiao et al. 2024, §2.2): keys fewer than W positions
// behind the query keep their exact positions; every other attended key -- the sink and the
// retrieved blocks -- sits at the one distance W from the query. That is SelfExtend with a group
// larger than any position: keys at floor(p / G) = 0, the query at floor(i / G) + W - 0 = W. So
// the retrieval rope is the SelfExtend rope with this group, and every kernel and cache that
// takes SelfExtend takes it unchanged. (InfLLM turns the query by n_local - 1; the distance W
// here continues the local window's last distance W - 1.) With a period P (retrieval's
// --far-positions ordered; a departure from InfLLM) a far key sits at p mod P and the query at
// W + P: a block's keys keep their order, at distances W + 1 .. W + P.
inline constexpr int kFixedDistanceGroup = 1 << 30;
inline rope_config with_fixed_distance(rope_config r, int window, int period = 0) {
  r.se_group = kFixedDistanceGroup;
  r.se_window = window;
  r.se_period = period;
  return r;
}
inline bool fixed_distance_on(const rope_config& c) { return c.se_group == kFixedDistanceGroup; }

}  // namespace xctx
