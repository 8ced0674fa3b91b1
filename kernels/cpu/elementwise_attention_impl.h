// Internal to the cpu elementwise and attention kernels: the instruction-set-specific pieces
// behind the dispatch in elementwise.cpp / attention.cpp. Exposed so the tests can run the
// scalar fallback on AVX2 machines and measure the fast exp directly.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/ops.h"

namespace xctx::cpu {
struct attention_switches;  // cpu_ops.h
}  // namespace xctx::cpu

namespace xctx::cpu::impl {

enum class isa : uint8_t { isa_scalar, isa_avx2 };
isa best_isa();  // isa_avx2 iff cpu::has_avx2()
const char* isa_name(isa v);

// The cpu_ops.h kernels with the instruction set chosen by the caller (isa_avx2 only if
// best_isa() says so; shapes the AVX2 path does not cover fall back to scalar inside).
void rms_norm(isa v, const float* x /*[n_tok, dim]*/, const float* weight /*[dim]*/, int64_t n_tok, int64_t dim,
              float eps, float* y /*[n_tok, dim]*/);
void rope(isa v, float* x /*[n_tok, n_head, head_dim]*/, const int32_t* pos /*[n_tok]*/, int64_t n_tok, int n_head,
          const rope_config& cfg);
void swiglu(isa v, const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/);
void attention_partial(isa v, const attn_args& a);  // default attention_switches
void attention_partial(isa v, const attn_args& a, const attention_switches& s);
void merge_partials(isa v, const float* o_parts /*[n_part, n_row, head_dim]*/, const float* lse_parts /*[n_part, n_row]*/,
                    int n_part, int64_t n_row, int head_dim, float* o /*[n_row, head_dim]*/, float* lse /*[n_row]*/);

// The fast exp (avx2::exp_fast, and inside swiglu and the attention softmax): accurate on
// [kFastExpLo, kFastExpHi] (results stay normal floats there); below it returns exactly 0,
// above it +inf. Degree-6 polynomial on |r| <= ln2/2 after Cody-Waite reduction; the fit
// itself is good to 3.6e-9, the rest is float rounding. Every float in the range was checked
// once against double exp (max 8.29e-8 = 0.70 FLT_EPSILON at x = 5.1995); the tests re-check a
// dense sample against this bound.
inline constexpr float kFastExpLo = -87.33f;
inline constexpr float kFastExpHi = 88.37f;
inline constexpr double kFastExpMaxRelErr = 9e-8;

// Attention tile sizes (keys per tile in the decode kernel; queries x keys per prefill tile).
inline constexpr int kDecodeTile = 32;
inline constexpr int kPrefillQTile = 64;
inline constexpr int kPrefillKTile = 256;

// One decode work item: keys [j0, j1) of n_kvh consecutive kv heads, against R query rows
// (already multiplied by the softmax scale) grouped by kv head: rows [h*R/n_kvh, (h+1)*R/n_kvh)
// read kv head h. Row r sees keys j < row_end[r] (causality as a prefix length). Produces the
// normalized partial o and its natural-log lse; rows that see nothing get o = 0, lse = -inf.
// All heads of a token are read together, so the item streams one contiguous slab of the cache.
struct decode_job {
  const float* q = nullptr;          // [R, hd]
  const int64_t* row_end = nullptr;  // [R]
  int R = 0;
  int n_kvh = 1;
  int hd = 0;
  const void* k = nullptr;  // token 0, kv head 0 of this item; token j, head h at (j * ld + h * hd) elements
  const void* v = nullptr;  // same layout as k, unless the v_* fields below say otherwise
  kv_dtype type = kv_dtype::kv_f32;
  int64_t ld = 0;  // elements between consecutive tokens (n_head_kv * head_dim)
  int64_t j0 = 0, j1 = 0;
  // Values laid out unlike the keys (f32 only): xquant's absorbed V, where every query head
  // accumulates a token's whole latent row. Token j, kv head h's value row at
  // v + j * v_ld + h * v_head_stride, v_width elements.
  int v_width = 0;             // 0: hd
  int64_t v_ld = 0;            // 0: ld
  int64_t v_head_stride = -1;  // -1: hd; 0: all heads read the same row
  float* o = nullptr;    // [R, v_width]
  float* lse = nullptr;  // [R]
  float* scratch = nullptr;  // [decode_scratch_floats(R, hd)]
  bool avx512_rows = true;   // the AVX-512 many-row kernel may take the job (attention_switches)
};
// Covers the kernels: scalar (f16 K/V tiles converted to f32, scores, m, l), AVX2 (scores of a
// 3-row block with row stride kDecodeTile + 8, m, l) and AVX-512 (a transposed key tile and an
// f32 value tile in place of the scalar's two, 64-byte aligned: 16 floats to spare).
inline int64_t decode_scratch_floats(int R, int hd) {
  return 2 * (int64_t)kDecodeTile * hd + 3 * (kDecodeTile + 8) + 2 * R + 16;
}

// Runs one decode work item (AVX2 when v says so and hd and v_width are multiples of 8, else scalar;
// on AVX-512 CPUs jobs with many rows per kv head take the AVX-512 kernel, same bits as AVX2).
void decode_block(isa v, const decode_job& job);
// Up to this many queries the attention kernels take the decode path.
inline constexpr int64_t kDecodeMaxQueries = 8;

// Key j is visible to query i iff kv_pos[j] <= q_pos[i]; kv_pos being sorted, that is the prefix
// [0, q_end[i]). Fills q_end [n_q] and returns the longest prefix. When it is 0 no query sees a
// key, and the (o, lse) partials of the n_q * n_head rows are written empty here (o 0, lse -inf).
int64_t visible_prefixes(const int32_t* q_pos, int64_t n_q, const int32_t* kv_pos, int64_t n_kv, int n_head,
                         int head_dim, float* o, float* lse, std::vector<int64_t>& q_end);

// Attention of many queries over a shard streamed tile by tile (the compressed caches decode a
// tile to f32, then add() it): each tile's partial is merged into the running one by lse.
class streamed_attention {
 public:
  // `queries` gives q, q_pos, n_q, n_head, n_head_kv, head_dim, scale; its k/v/o/lse are unused.
  streamed_attention(isa v, const attn_args& queries);
  void add(const float* k /*[n_kv, n_head_kv, head_dim]*/, const float* v /*[same]*/,
           const int32_t* kv_pos /*[n_kv]*/, int64_t n_kv);
  void finish(float* o /*[n_q, n_head, head_dim]*/, float* lse /*[n_q, n_head]*/) const;

 private:
  isa isa_;
  attn_args a_;
  int64_t n_row_ = 0;
  std::vector<float> o_parts_, lse_parts_;  // [running | tile] x [n_row, head_dim], [n_row]
};

// Row helpers the prefill path (sgemm tiles) runs per score row.
struct row_ops {
  void (*f16_to_f32)(const uint16_t* src /*[n]*/, int64_t n, float* dst /*[n]*/);
  float (*max)(const float* x /*[n]*/, int64_t n);                 // -inf for n == 0
  float (*exp_sub_sum)(float* x /*[n]*/, int64_t n, float m);      // x = exp(x - m); returns the sum
  void (*scale)(float* x /*[n]*/, int64_t n, float a);             // x *= a
};

namespace avx2 {  // only callable when best_isa() == isa_avx2; head_dim % 8 == 0 where it matters
void exp_fast(const float* x /*[n]*/, int64_t n, float* y /*[n]*/);
float sum_squares(const float* x /*[n]*/, int64_t n);
void scale_mul(const float* x /*[n]*/, const float* w /*[n]*/, float s, int64_t n, float* y /*[n]*/);  // y = x*s*w
// x[2i], x[2i+1] rotated by the angle whose cos is cos2[2i] (= cos2[2i+1]); sin2 = [-sin, +sin].
void rope_rotate(float* x /*[n_rot]*/, const float* cos2 /*[n_rot]*/, const float* sin2 /*[n_rot]*/, int n_rot);
// Rotates nt consecutive tokens [nt, n_kvh, hd] of a tile whose first token's angles are
// (bc, bs) [n_rot / 2], token j by angle(base) + angle(j) from off_cos/off_sin [j, n_rot / 2]
// (rope_tile.h). n_rot % 16 == 0, n_rot <= 1024.
void rope_tile_tokens(float* k, int nt, int n_kvh, int hd, int n_rot, const float* bc, const float* bs,
                      const float* off_cos, const float* off_sin);
void swiglu(const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/);
void decode_block(const decode_job& job);
const row_ops& prefill_row_ops();
// o = sum_p coef[p] * parts[p * part_stride + d]; o may alias parts (part 0).
void merge_row(const float* parts, int64_t part_stride, const float* coef /*[n_part]*/, int n_part, int hd,
               float* o /*[hd]*/);
}  // namespace avx2

// decode_block for many rows per kv head, bitwise avx2::decode_block's results
// (attention_avx512.cpp); only callable when cpu::has_avx512().
namespace avx512 {
bool decode_block_supported(const decode_job& job);  // plain value layout, hd 32, 64 or 128
void decode_block(const decode_job& job);
}  // namespace avx512

}  // namespace xctx::cpu::impl
