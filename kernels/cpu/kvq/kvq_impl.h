// Internal to the cpu quantized-cache kernels (kvq.cpp drivers, kvq_avx2.cpp row decoders).
#pragma once

#include <cstdint>

#include "kernels/kv_quant.h"
#include "kernels/softmax_acc.h"

namespace xctx::cpu::impl {

// Dense rows of a quantized layer decoded to f32 (no outliers, no RoPE). Rows are indices
// among the quantized rows: [i0, i0 + nt).
//   keys:   out[r, c] = deq(code) * sc[c] + zc[c]   (sc/zc: the channel scales of the row's group)
//   values: per row, the row's own scale/zero over channel groups
void kvq_decode_keys_scalar(const kvq_layer_view& v, int64_t i0, int nt, const float* sc /*[C]*/,
                            const float* zc /*[C]*/, float* out /*[nt, C]*/);
void kvq_decode_values_scalar(const kvq_layer_view& v, int64_t i0, int nt, float* out /*[nt, C]*/);

// ---- the fused one-query kernel (kvq_fused_avx2.cpp) ----------------------------------------
inline constexpr int kFusedTile = 64;              // slots per softmax tile
inline constexpr int kFusedMaxHeadsPerBlock = 4;   // query heads of a kv head sharing each decoded vector
inline constexpr int kFusedMaxKvHeads = 64;
// Uniform key groups' scales kept converted: every group a tile touches needs its own slot (a tile
// of kFusedTile rows spans at most kFusedTile / 8 + 1 groups of >= 8 rows).
inline constexpr int kScaleSlots = kFusedTile / 8 + 1;
inline constexpr int kFusedScoreStride = kFusedTile + 16;  // a score row, with room for whole vector stores
// Per query row, running sums kept as vector lanes across a unit's tiles and added up once at
// its end: lanes [0, 16) the softmax denominator, [16, 32) Σ p·z_j (nuq values' zero points; the
// AVX-512 kernel). Paths that sum per tile use lane 0 alone.
inline constexpr int kFusedSumLanes = 32;
// The head loop's work area: every query row's scores, one block's folded weights, value params.
inline size_t kvq_fused_work_floats(int n_head) {
  return (size_t)(n_head + kFusedMaxHeadsPerBlock) * kFusedScoreStride + 2 * kFusedTile;
}

// Row stride of the pair-major unit tables: a row of kAttnUnit floats is 1 KiB, so 16 keys' angles
// of every pair would sit in 4 of the L1's 64 sets and evict each other (measured: the hottest
// loads of the keys-in-lanes scores); 17 lines per row spreads them over distinct sets.
inline constexpr int kUnitAngleStride = kAttnUnit + 16;

struct kvq_fused_args {
  const kvq_layer_view* kv = nullptr;
  const float* q = nullptr;  // [n_head, head_dim] RoPE applied, multiplied by the softmax scale
  int n_head = 0;
  int n_rot = 0;                 // rotated dims (RoPE config; the kernel needs n_rot = head_dim)
  int64_t s0 = 0, n = 0;         // slots [s0, s0 + n) of one attention unit, all visible to the query
  // Keys rotated to grouped_key_pos(pos, pos_group, pos_period) (kernels/types.h): SelfExtend's or
  // retrieval's grouped side (q is then turned to the grouped query position); 1 = the slots' own
  // positions.
  int pos_group = 1;
  int pos_period = 0;
  // Rotation by an offset j < kAttnUnit from the unit's first position (rope_table::unit_cos2).
  const float* off_cos2 = nullptr;  // [kAttnUnit, head_dim]
  const float* off_sin2 = nullptr;
  // The same angles pair-major (rope_table::unit_cos_t/unit_sin_t: [head_dim / 2, kUnitAngleStride],
  // cos and +sin); null: the kernel scores keys one at a time.
  const float* off_cos_t = nullptr;
  const float* off_sin_t = nullptr;
  // cos/sin of pos·θ_i for every pair, a function of pos alone (rope_angles) and its table.
  void (*angles)(const void* table, int64_t pos, double* c /*[n_rot/2]*/, double* s /*[n_rot/2]*/) = nullptr;
  const void* angle_table = nullptr;
  float* scratch = nullptr;         // [kvq_fused_scratch_floats(...)]
  double* angle_scratch = nullptr;  // [head_dim]
  // Where the ISA can, score nuq keys 16 at a time in lanes (attention_switches::kvq_key_lanes;
  // false: one key at a time, the A/B baseline).
  bool keys_in_lanes = true;
  float* o = nullptr;    // [n_head, head_dim] normalised partial
  float* lse = nullptr;  // [n_head] natural log; -inf (and o = 0) when n == 0
};
inline size_t kvq_fused_scratch_floats(int n_head, int head_dim, int channels) {
  return (size_t)n_head * head_dim + 2 * (size_t)head_dim +
         2 * (size_t)kScaleSlots * channels + (size_t)n_head * (1 + kFusedSumLanes) + 2 * kFusedTile +
         kvq_fused_work_floats(n_head) +
         (size_t)kFusedTile * channels / 4 +  // uniform value parameters (groups of >= 8 channels)
         (size_t)kFusedTile * channels + 8 +  // the row of each key outlier of a tile (int32)
         2 * (size_t)n_head * head_dim +      // the query rows turned by a shared key rotation (twice)
         4 * (size_t)n_head + 2 +             // their zero sums, rotations and scale pointers
         16 * (size_t)channels + 16;          // per channel its 16 scaled levels (AVX-512, nuq), 64-byte aligned
}
// The code widths the fused kernel is instantiated for (keys, values): 2..4 bits alike (the KV
// formats; nuq or uniform), and uniform 1 or 2 bits in any mix (clkv's per-layer widths).
inline bool kvq_fused_widths(const kvq_layer_view& v) {
  const int kb = v.bits, vb = v.value_bits();
  if (!kvq_widths_ok(v)) return false;
  return (kb == vb && kb >= 2) || (v.scheme == kvq_scheme::kvq_uniform && kb <= 2 && vb <= 2);
}

// The shapes the fused kernel takes (else the caller uses the tile path): whole-head rotary
// (n_rot = head_dim) and head_dim 16, 32, 64 or 128 (its channel vectors unroll at compile time).
inline bool kvq_fused_supported(const kvq_layer_view& v, int n_head, int n_rot) {
  const bool hd_ok = v.head_dim == 16 || v.head_dim == 32 || v.head_dim == 64 || v.head_dim == 128;
  return kvq_fused_widths(v) && hd_ok && n_rot == v.head_dim && v.n_head_kv > 0 &&
         v.n_head_kv <= kFusedMaxKvHeads && n_head % v.n_head_kv == 0 &&
         (v.scheme == kvq_scheme::kvq_lut || (v.group > 0 && v.group % 8 == 0));
}

// The AVX-512 kernel also needs uniform value groups of whole 16-lane vectors.
inline bool kvq_fused_avx512_supported(const kvq_layer_view& v) {
  return v.scheme == kvq_scheme::kvq_lut || v.group % 16 == 0;
}

namespace avx2 {  // bits 2..4, C % 8 == 0
void kvq_decode_keys(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc, float* out);
void kvq_decode_values(const kvq_layer_view& v, int64_t i0, int nt, float* out);
// One row of C uniform codes (bits 1..4): out[c] = (float)code * sc[c] + zc[c], a product then a
// sum (no FMA), bitwise what the scalar X-cache decoder computes.
void affine_codes_row(const uint8_t* row, int C, int bits, const float* sc, const float* zc, float* out);
// One query over a quantized layer's slots, decode fused into the attention (kvq_fused_avx2.cpp).
// Only for kvq_fused_supported shapes.
void kvq_attend_fused(const kvq_fused_args& a);
}  // namespace avx2

namespace avx512 {  // cpu::has_avx512() only
void kvq_attend_fused(const kvq_fused_args& a);  // kvq_fused_supported and kvq_fused_avx512_supported
}  // namespace avx512

}  // namespace xctx::cpu::impl
