// AVX2/FMA/F16C matmul kernels (this file is compiled with -mavx2 -mfma -mf16c and only entered
// after cpu::has_avx2()).
//
// Float-activation path for legacy block quants (act_f32, the default): see dot_row_qf below.
//
// Integer paths (legacy block quants against int8 activations, act_q8, or int16, act_q16).
// act_q8, per 32-element block:
//   weight codes as 32 bytes: unsigned 0..15 / 0..31 for Q4_x / Q5_x, signed for Q8_0;
//   maddubs (u8 x s8 -> pairs summed to s16; at most 2*31*127 or 2*128*127, no saturation),
//   madd with ones -> 8 x s32, converted to float and FMA'd with d_w * d_x into the token's
//   accumulator. The weight's offset (Q4_1/Q5_1: + m; Q4_0: -8 d; Q5_0: -16 d) contributes
//   offset * (d_x * sum q_x), the block sum precomputed with the activations.
// act_q16: the codes are widened to 2 x 16 int16 once per block (for all tokens), then per token
//   two madds (int16 x int16, pairs summed to s32) added: 8 x s32 of 4 products each (< 2^24,
//   so the conversion to float is exact), scaled and offset as above.
// Each weight row is unpacked once per group of up to 4 tokens, so for n_tok <= 4 the weights
// are read from memory exactly once and further groups re-read the row from L1.
// The integer kernels live in matmul_int_avx2.h, shared with matmul_avxvnni.cpp.
#include <immintrin.h>

#include <cstring>

#include "common/error.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/cpu/matmul/matmul_int_avx2.h"
#include "kernels/cpu/simd/unpack_avx2.h"

namespace xctx::cpu::detail {

namespace {

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// ---- legacy quants against float activations (act_f32) ------------------------------------
//
// Per 32-element block the codes are widened to 4 x 8 int32 (pmovzx/pmovsx straight from the
// block: the 16 nibble bytes give elements j and j + 16 from the same lane), converted to float
// and FMA'd with x. The scale is applied once per block: y += d · Σ q x. The signed formats
// (Q4_0: q - 8, Q5_0: q - 16) subtract the offset in the integers, which is exact and keeps the
// error relative to Σ|w x|; Q4_1/Q5_1 add m · Σx with the block sums of x computed once per call.

template <ggml_type T>
struct ffmt;

inline void widen_nibbles(const uint8_t* qs, __m256i* v /*[4]*/) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)qs));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8)));
  const __m256i mask = _mm256_set1_epi32(0x0F);
  v[0] = _mm256_and_si256(lo, mask);  // elements 0..7
  v[1] = _mm256_and_si256(hi, mask);  // 8..15
  v[2] = _mm256_srli_epi32(lo, 4);    // 16..23
  v[3] = _mm256_srli_epi32(hi, 4);    // 24..31
}

// Adds the fifth bit (bit j of qh, as 16) to element j's code.
inline void add_high_bits(const uint8_t* qh, __m256i* v /*[4]*/) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  // Lane j of vector i shifts bit 8i + j down to bit 4; bits 0..27 come from bits << 4 (so no
  // shift goes negative), bits 28..31 from bits itself.
  const __m256i h4 = _mm256_set1_epi32((int)(bits << 4));
  const __m256i h = _mm256_set1_epi32((int)bits);
  const __m256i sixteen = _mm256_set1_epi32(16);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int i = 0; i < 3; ++i) {
    const __m256i sh = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * i));
    v[i] = _mm256_or_si256(v[i], _mm256_and_si256(_mm256_srlv_epi32(h4, sh), sixteen));
  }
  const __m256i sh3 = _mm256_add_epi32(lane, _mm256_set1_epi32(20));
  v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srlv_epi32(h, sh3), sixteen));
}

inline void to_float(const __m256i* v, __m256* f, int offset) {
  const __m256i o = _mm256_set1_epi32(offset);
  for (int i = 0; i < 4; ++i) f[i] = _mm256_cvtepi32_ps(offset ? _mm256_sub_epi32(v[i], o) : v[i]);
}

inline void load_dm(const void* dm_pair, float* d, float* m) {
  int dm;
  std::memcpy(&dm, dm_pair, 4);  // d and m are adjacent fp16s: convert both at once
  const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
  *d = _mm_cvtss_f32(f);
  *m = _mm_cvtss_f32(_mm_movehdup_ps(f));
}

template <>
struct ffmt<ggml_type::ggml_q4_0> {
  using block = block_q4_0;
  static constexpr bool has_min = false;
  static void expand(const block* b, __m256* f, float* d, float* m) {
    __m256i v[4];
    widen_nibbles(b->qs, v);
    to_float(v, f, 8);
    *d = load_f16(b->d);
    *m = 0.0f;
  }
};
template <>
struct ffmt<ggml_type::ggml_q4_1> {
  using block = block_q4_1;
  static constexpr bool has_min = true;
  static void expand(const block* b, __m256* f, float* d, float* m) {
    __m256i v[4];
    widen_nibbles(b->qs, v);
    to_float(v, f, 0);
    load_dm(&b->d, d, m);
  }
};
template <>
struct ffmt<ggml_type::ggml_q5_0> {
  using block = block_q5_0;
  static constexpr bool has_min = false;
  static void expand(const block* b, __m256* f, float* d, float* m) {
    __m256i v[4];
    widen_nibbles(b->qs, v);
    add_high_bits(b->qh, v);
    to_float(v, f, 16);
    *d = load_f16(b->d);
    *m = 0.0f;
  }
};
template <>
struct ffmt<ggml_type::ggml_q5_1> {
  using block = block_q5_1;
  static constexpr bool has_min = true;
  static void expand(const block* b, __m256* f, float* d, float* m) {
    __m256i v[4];
    widen_nibbles(b->qs, v);
    add_high_bits(b->qh, v);
    to_float(v, f, 0);
    load_dm(&b->d, d, m);
  }
};
template <>
struct ffmt<ggml_type::ggml_q8_0> {
  using block = block_q8_0;
  static constexpr bool has_min = false;
  static void expand(const block* b, __m256* f, float* d, float* m) {
    for (int i = 0; i < 4; ++i) {
      f[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b->qs + 8 * i))));
    }
    *d = load_f16(b->d);
    *m = 0.0f;
  }
};

// One weight row against NT activation rows; U accumulator sets as in dot_row_q.
template <ggml_type T, int NT, int U>
void dot_row_qf(const void* row, int64_t nb, const float* const* x /*[NT]*/, const float* const* xs /*[NT]*/,
                float* out /*[NT]*/) {
  using F = ffmt<T>;
  const auto* blk = (const typename F::block*)row;
  __m256 acc[U][NT];
  float off[U][NT];
  for (int u = 0; u < U; ++u) {
    for (int t = 0; t < NT; ++t) {
      acc[u][t] = _mm256_setzero_ps();
      off[u][t] = 0.0f;
    }
  }
  auto step = [&](int64_t b, int u) __attribute__((always_inline)) {
    __m256 f[4];
    float d, m;
    F::expand(blk + b, f, &d, &m);
    const __m256 dv = _mm256_set1_ps(d);
    for (int t = 0; t < NT; ++t) {
      const float* xb = x[t] + b * qk_small;
      __m256 p = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
      p = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), p);
      p = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), p);
      p = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), p);
      acc[u][t] = _mm256_fmadd_ps(p, dv, acc[u][t]);
      if constexpr (F::has_min) off[u][t] += m * xs[t][b];
    }
  };
  int64_t b = 0;
  for (; b + U <= nb; b += U) {
    for (int u = 0; u < U; ++u) step(b + u, u);
  }
  for (; b < nb; ++b) step(b, 0);
  for (int t = 0; t < NT; ++t) {
    __m256 a = acc[0][t];
    float o = off[0][t];
    for (int u = 1; u < U; ++u) {
      a = _mm256_add_ps(a, acc[u][t]);
      o += off[u][t];
    }
    out[t] = hsum(a) + o;
  }
}

template <ggml_type T, int NT>
void dot_row_qf_group(const void* row, int64_t nb, const float* x, const float* x_sum, int64_t t0, float* y,
                      int64_t ldy, int64_t r) {
  const float* xt[NT];
  const float* st[NT];
  for (int t = 0; t < NT; ++t) {
    xt[t] = x + (t0 + t) * nb * qk_small;
    st[t] = x_sum + (t0 + t) * nb;
  }
  float out[NT];
  dot_row_qf<T, NT, (NT == 1 ? 2 : 1)>(row, nb, xt, st, out);
  for (int t = 0; t < NT; ++t) y[(t0 + t) * ldy + r] = out[t];
}

template <ggml_type T>
void dot_rows_qf(const weight_view& w, int64_t r0, int64_t r1, const float* x, const float* x_sum, int64_t n_tok,
                 float* y, int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  const int64_t nb = w.n_cols / qk_small;
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    int64_t t = 0;
    for (; t + 4 <= n_tok; t += 4) dot_row_qf_group<T, 4>(row, nb, x, x_sum, t, y, ldy, r);
    switch (n_tok - t) {
      case 3: dot_row_qf_group<T, 3>(row, nb, x, x_sum, t, y, ldy, r); break;
      case 2: dot_row_qf_group<T, 2>(row, nb, x, x_sum, t, y, ldy, r); break;
      case 1: dot_row_qf_group<T, 1>(row, nb, x, x_sum, t, y, ldy, r); break;
      case 0: break;
    }
  }
}

// ---- float weights -------------------------------------------------------------------------

template <ggml_type T>
inline __m256 load8(const void* row, int64_t c) {
  if constexpr (T == ggml_type::ggml_f32) {
    return _mm256_loadu_ps((const float*)row + c);
  } else if constexpr (T == ggml_type::ggml_f16) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + c)));
  } else {  // bf16: the upper half of an fp32
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + c)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
}

template <ggml_type T>
inline float load1(const void* row, int64_t c) {
  if constexpr (T == ggml_type::ggml_f32) {
    return ((const float*)row)[c];
  } else if constexpr (T == ggml_type::ggml_f16) {
    return load_f16(((const uint16_t*)row)[c]);
  } else {
    return bf16_to_fp32(((const uint16_t*)row)[c]);
  }
}

template <ggml_type T, int NT, int U>
void dot_row_f(const void* row, int64_t n, const float* const* x /*[NT]*/, float* out /*[NT]*/) {
  __m256 acc[U][NT];
  for (int u = 0; u < U; ++u) {
    for (int t = 0; t < NT; ++t) acc[u][t] = _mm256_setzero_ps();
  }
  int64_t c = 0;
  for (; c + 8 * U <= n; c += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m256 wv = load8<T>(row, c + 8 * u);
      for (int t = 0; t < NT; ++t) acc[u][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + c + 8 * u), acc[u][t]);
    }
  }
  for (; c + 8 <= n; c += 8) {
    const __m256 wv = load8<T>(row, c);
    for (int t = 0; t < NT; ++t) acc[0][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x[t] + c), acc[0][t]);
  }
  for (int t = 0; t < NT; ++t) {
    __m256 a = acc[0][t];
    for (int u = 1; u < U; ++u) a = _mm256_add_ps(a, acc[u][t]);
    float sum = hsum(a);
    for (int64_t k = c; k < n; ++k) sum += load1<T>(row, k) * x[t][k];
    out[t] = sum;
  }
}

template <ggml_type T, int NT>
void dot_row_f_group(const void* row, int64_t n, const float* x, int64_t t0, float* y, int64_t ldy, int64_t r) {
  const float* xt[NT];
  for (int t = 0; t < NT; ++t) xt[t] = x + (t0 + t) * n;
  float out[NT];
  dot_row_f<T, NT, (NT == 1 ? 4 : NT == 2 ? 2 : 1)>(row, n, xt, out);
  for (int t = 0; t < NT; ++t) y[(t0 + t) * ldy + r] = out[t];
}

template <ggml_type T>
void dot_rows_f(const weight_view& w, int64_t r0, int64_t r1, const float* x, int64_t n_tok, float* y, int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    int64_t t = 0;
    for (; t + 4 <= n_tok; t += 4) dot_row_f_group<T, 4>(row, w.n_cols, x, t, y, ldy, r);
    switch (n_tok - t) {
      case 3: dot_row_f_group<T, 3>(row, w.n_cols, x, t, y, ldy, r); break;
      case 2: dot_row_f_group<T, 2>(row, w.n_cols, x, t, y, ldy, r); break;
      case 1: dot_row_f_group<T, 1>(row, w.n_cols, x, t, y, ldy, r); break;
      case 0: break;
    }
  }
}

}  // namespace

namespace {

template <typename Code>
void quantize_act_avx2_t(const float* x, int64_t n, Code* qs, float* d, float* s) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t b = 0; b < n / qk_small; ++b) {
    const float* xb = x + b * qk_small;
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                             _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    // Same scalar operations as quantize_act_scalar, so both produce identical bits.
    const float db = amax / (float)int_act<Code>::levels;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(r);
    }
    const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    // packs work within 128-bit lanes; the permutes restore element order.
    const __m256i p16a = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p16b = _mm256_packs_epi32(q[2], q[3]);
    if constexpr (sizeof(Code) == 1) {
      __m256i p8 = _mm256_packs_epi16(p16a, p16b);
      p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256((__m256i*)(qs + b * qk_small), p8);
    } else {
      _mm256_storeu_si256((__m256i*)(qs + b * qk_small), _mm256_permute4x64_epi64(p16a, _MM_SHUFFLE(3, 1, 2, 0)));
      _mm256_storeu_si256((__m256i*)(qs + b * qk_small + 16), _mm256_permute4x64_epi64(p16b, _MM_SHUFFLE(3, 1, 2, 0)));
    }
    d[b] = db;
    s[b] = db * (float)sum;
  }
}

template <typename Code>
void dot_rows_q_avx2_t(const weight_view& w, int64_t r0, int64_t r1, const int_act<Code>& xq, int64_t n_tok,
                       float* y, int64_t ldy) {
  XCTX_ASSERT(dot_rows_legacy(w, r0, r1, xq, n_tok, y, ldy), "dot_rows_q_avx2: not a legacy quant type: ",
              (uint32_t)w.type);
}

}  // namespace

void quantize_act_avx2(const float* x, int64_t n, int8_t* qs, float* d, float* s) {
  quantize_act_avx2_t(x, n, qs, d, s);
}
void quantize_act_avx2(const float* x, int64_t n, int16_t* qs, float* d, float* s) {
  quantize_act_avx2_t(x, n, qs, d, s);
}

void dot_rows_q_avx2(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok, float* y,
                     int64_t ldy) {
  dot_rows_q_avx2_t(w, r0, r1, xq, n_tok, y, ldy);
}
void dot_rows_q_avx2(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                     int64_t ldy) {
  dot_rows_q_avx2_t(w, r0, r1, xq, n_tok, y, ldy);
}

void dot_rows_qf_avx2(const weight_view& w, int64_t r0, int64_t r1, const float* x, const float* x_sum,
                      int64_t n_tok, float* y, int64_t ldy) {
  switch (w.type) {
    case ggml_type::ggml_q4_0: return dot_rows_qf<ggml_type::ggml_q4_0>(w, r0, r1, x, x_sum, n_tok, y, ldy);
    case ggml_type::ggml_q4_1: return dot_rows_qf<ggml_type::ggml_q4_1>(w, r0, r1, x, x_sum, n_tok, y, ldy);
    case ggml_type::ggml_q5_0: return dot_rows_qf<ggml_type::ggml_q5_0>(w, r0, r1, x, x_sum, n_tok, y, ldy);
    case ggml_type::ggml_q5_1: return dot_rows_qf<ggml_type::ggml_q5_1>(w, r0, r1, x, x_sum, n_tok, y, ldy);
    case ggml_type::ggml_q8_0: return dot_rows_qf<ggml_type::ggml_q8_0>(w, r0, r1, x, x_sum, n_tok, y, ldy);
    case ggml_type::ggml_f32:
    case ggml_type::ggml_f16:
    case ggml_type::ggml_bf16:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k:
    case ggml_type::ggml_q8_k: break;
  }
  XCTX_ASSERT(false, "dot_rows_qf_avx2: not a legacy quant type: ", (uint32_t)w.type);
}

void dot_rows_f_avx2(const weight_view& w, int64_t r0, int64_t r1, const float* x, int64_t n_tok, float* y,
                     int64_t ldy) {
  switch (w.type) {
    case ggml_type::ggml_f32: return dot_rows_f<ggml_type::ggml_f32>(w, r0, r1, x, n_tok, y, ldy);
    case ggml_type::ggml_f16: return dot_rows_f<ggml_type::ggml_f16>(w, r0, r1, x, n_tok, y, ldy);
    case ggml_type::ggml_bf16: return dot_rows_f<ggml_type::ggml_bf16>(w, r0, r1, x, n_tok, y, ldy);
    case ggml_type::ggml_q4_0:
    case ggml_type::ggml_q4_1:
    case ggml_type::ggml_q5_0:
    case ggml_type::ggml_q5_1:
    case ggml_type::ggml_q8_0:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k:
    case ggml_type::ggml_q8_k: break;
  }
  XCTX_ASSERT(false, "dot_rows_f_avx2: not a float type: ", (uint32_t)w.type);
}

}  // namespace xctx::cpu::detail
