// The integer decode kernels of legacy block quants against int8 / int16 activations, one
// 32-element block per 256-bit register, shared by matmul_avx2.cpp (maddubs / madd) and
// matmul_avxvnni.cpp (AVX-VNNI's VPDPBUSD / VPDPWSSD, which sum the same products in one
// instruction). The integer sums are exact either way (maddubs' int16 pairs stay below 2^15:
// at most 2 * 128 * 127), so both files give the same bits. Include only from *_avx2.cpp and
// *_avxvnni.cpp files; everything here is internal to each includer (anonymous namespace).
// (matmul_avx2.cpp explains the per-format decoding and the offsets.)
#pragma once

#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/cpu/simd/unpack_avx2.h"

namespace xctx::cpu::detail {
namespace {

// 8 int32 lanes, each the sum of 4 adjacent products u8 x s8.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 8 int32 lanes, each a0 b0 + a1 b1 summed over adjacent int16 pairs (4 products).
inline __m256i dot_s16_pair(__m256i a0, __m256i b0, __m256i a1, __m256i b1) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(_mm256_setzero_si256(), a0, b0), a1, b1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(a0, b0), _mm256_madd_epi16(a1, b1));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float load_f16(const uint16_t& h) { return _cvtsh_ss(h); }

// Per-format block decoding for the integer path: codes (unsigned, except Q8_0), scale d and the
// offset c such that w_j = d * code_j + c.
template <ggml_type T>
struct qfmt;

template <>
struct qfmt<ggml_type::ggml_q4_0> {
  using block = block_q4_0;
  static constexpr bool has_offset = true;
  static void scale_offset(const block* b, float* d, float* c) {
    *d = load_f16(b->d);
    *c = -8.0f * *d;
  }
  static __m256i codes(const block* b, float* d, float* c) {
    scale_offset(b, d, c);
    return unpack_nibbles(b->qs);
  }
};
template <>
struct qfmt<ggml_type::ggml_q4_1> {
  using block = block_q4_1;
  static constexpr bool has_offset = true;
  static void scale_offset(const block* b, float* d, float* c) {
    int dm;
    std::memcpy(&dm, &b->d, 4);  // d and m are adjacent fp16s: convert both at once
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    *d = _mm_cvtss_f32(f);
    *c = _mm_cvtss_f32(_mm_movehdup_ps(f));
  }
  static __m256i codes(const block* b, float* d, float* c) {
    scale_offset(b, d, c);
    return unpack_nibbles(b->qs);
  }
};
template <>
struct qfmt<ggml_type::ggml_q5_0> {
  using block = block_q5_0;
  static constexpr bool has_offset = true;
  static __m256i codes(const block* b, float* d, float* c) {
    *d = load_f16(b->d);
    *c = -16.0f * *d;
    return _mm256_or_si256(unpack_nibbles(b->qs), unpack_high_bits(b->qh));
  }
};
template <>
struct qfmt<ggml_type::ggml_q5_1> {
  using block = block_q5_1;
  static constexpr bool has_offset = true;
  static __m256i codes(const block* b, float* d, float* c) {
    int dm;
    std::memcpy(&dm, &b->d, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    *d = _mm_cvtss_f32(f);
    *c = _mm_cvtss_f32(_mm_movehdup_ps(f));
    return _mm256_or_si256(unpack_nibbles(b->qs), unpack_high_bits(b->qh));
  }
};
template <>
struct qfmt<ggml_type::ggml_q8_0> {
  using block = block_q8_0;
  static constexpr bool has_offset = false;
  static __m256i codes(const block* b, float* d, float* c) {
    *d = load_f16(b->d);
    *c = 0.0f;
    return _mm256_loadu_si256((const __m256i*)b->qs);
  }
};

// The 32 codes of a block as two vectors of 16 int16 (elements 0..15, 16..31) for act_q16:
// straight from the block for Q4_x (one widening of the 16 nibble bytes, then mask / shift) and
// Q8_0 (two sign-extending loads); Q5_x widen their byte codes.
template <ggml_type T>
inline void codes16(const typename qfmt<T>::block* b, float* d, float* c, __m256i* lo, __m256i* hi) {
  if constexpr (T == ggml_type::ggml_q4_0 || T == ggml_type::ggml_q4_1) {
    qfmt<T>::scale_offset(b, d, c);
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)b->qs));
    *lo = _mm256_and_si256(both, _mm256_set1_epi16(0x0F));
    *hi = _mm256_srli_epi16(both, 4);
  } else if constexpr (T == ggml_type::ggml_q8_0) {
    *d = load_f16(b->d);
    *c = 0.0f;
    *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)b->qs));
    *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b->qs + 16)));
  } else {
    const __m256i q = qfmt<T>::codes(b, d, c);
    *lo = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(q));
    *hi = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(q, 1));
  }
}

// One weight row against NT activation rows of Code (int8: maddubs + madd; int16: the codes
// widened once per block, then two madds per token). U independent accumulator sets hide the
// FMA latency when a single token gives too little independent work.
template <ggml_type T, typename Code, int NT, int U>
void dot_row_q(const void* row, int64_t nb, const Code* const* xq /*[NT]*/, const float* const* xd /*[NT]*/,
               const float* const* xs /*[NT]*/, float* out /*[NT]*/) {
  using F = qfmt<T>;
  constexpr bool wide = sizeof(Code) == 2;
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
    float d, c;
    __m256i q, q_lo, q_hi, q_unsigned;
    if constexpr (wide) {
      codes16<T>(blk + b, &d, &c, &q_lo, &q_hi);
    } else {
      q = F::codes(blk + b, &d, &c);
      q_unsigned = q;
      if constexpr (T == ggml_type::ggml_q8_0) q_unsigned = _mm256_sign_epi8(q, q);  // |q|, sign moved to x
    }
    for (int t = 0; t < NT; ++t) {
      const Code* xb = xq[t] + b * qk_small;
      __m256i p32;
      if constexpr (wide) {  // 8 lanes of 4 products each: |sum| <= 4 * 128 * 32767 < 2^24
        p32 = dot_s16_pair(q_lo, _mm256_loadu_si256((const __m256i*)xb), q_hi,
                           _mm256_loadu_si256((const __m256i*)(xb + 16)));
      } else {
        __m256i x = _mm256_loadu_si256((const __m256i*)xb);
        if constexpr (T == ggml_type::ggml_q8_0) x = _mm256_sign_epi8(x, q);
        p32 = dot_u8s8(q_unsigned, x);
      }
      acc[u][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(d * xd[t][b]), acc[u][t]);
      if constexpr (F::has_offset) off[u][t] += c * xs[t][b];
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

template <ggml_type T, typename Code, int NT>
void dot_row_q_group(const void* row, int64_t nb, const int_act<Code>& xq, int64_t t0, float* y, int64_t ldy,
                     int64_t r) {
  const Code* qs[NT];
  const float* d[NT];
  const float* s[NT];
  for (int t = 0; t < NT; ++t) {
    qs[t] = xq.qs + (t0 + t) * nb * qk_small;
    d[t] = xq.d + (t0 + t) * nb;
    s[t] = xq.s + (t0 + t) * nb;
  }
  float out[NT];
  dot_row_q<T, Code, NT, (NT == 1 ? 2 : 1)>(row, nb, qs, d, s, out);
  for (int t = 0; t < NT; ++t) y[(t0 + t) * ldy + r] = out[t];
}

template <ggml_type T, typename Code>
void dot_rows_q(const weight_view& w, int64_t r0, int64_t r1, const int_act<Code>& xq, int64_t n_tok, float* y,
                int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  const int64_t nb = xq.n_blocks;
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    int64_t t = 0;
    for (; t + 4 <= n_tok; t += 4) dot_row_q_group<T, Code, 4>(row, nb, xq, t, y, ldy, r);
    switch (n_tok - t) {
      case 3: dot_row_q_group<T, Code, 3>(row, nb, xq, t, y, ldy, r); break;
      case 2: dot_row_q_group<T, Code, 2>(row, nb, xq, t, y, ldy, r); break;
      case 1: dot_row_q_group<T, Code, 1>(row, nb, xq, t, y, ldy, r); break;
      case 0: break;
    }
  }
}

// Rows [r0, r1) of w against the activations (dot_rows_q_avx2's contract); false if w is not a
// legacy quant.
template <typename Code>
bool dot_rows_legacy(const weight_view& w, int64_t r0, int64_t r1, const int_act<Code>& xq, int64_t n_tok, float* y,
                     int64_t ldy) {
  switch (w.type) {
    case ggml_type::ggml_q4_0: dot_rows_q<ggml_type::ggml_q4_0>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q4_1: dot_rows_q<ggml_type::ggml_q4_1>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q5_0: dot_rows_q<ggml_type::ggml_q5_0>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q5_1: dot_rows_q<ggml_type::ggml_q5_1>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q8_0: dot_rows_q<ggml_type::ggml_q8_0>(w, r0, r1, xq, n_tok, y, ldy); return true;
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
  return false;
}

}  // namespace
}  // namespace xctx::cpu::detail
