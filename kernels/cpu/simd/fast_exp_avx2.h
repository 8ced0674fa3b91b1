// AVX2/FMA/F16C inline helpers shared by the *_avx2.cpp kernels. Include only from files
// compiled with -mavx2 -mfma -mf16c (the *_avx2.cpp naming rule in CMakeLists.txt).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/elementwise_attention_impl.h"

namespace xctx::cpu::impl::avx2 {
namespace {

// e^x, see kFastExp* in elementwise_attention_impl.h. x = n ln2 + r with n = round(x log2e),
// r by Cody-Waite with ln2 split into float(ln2) and its remainder; e^r = 1 + r + r^2 q(r)
// with q a degree-4 relative-error least-squares fit on Chebyshev nodes of [-ln2/2, ln2/2];
// 2^n is built in the exponent field (n stays in [-126, 127] inside the accurate range).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kFastExpLo);
  const __m256 hi = _mm256_set1_ps(kFastExpHi);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269502e+00f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(6.93147182e-01f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-1.904654323e-09f), r);
  __m256 p = _mm256_set1_ps(1.375140739e-03f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.368915878e-03f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166953266e-02f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666651815e-01f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.999998808e-01f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_andnot_ps(under, y);
  return _mm256_blendv_ps(y, _mm256_set1_ps(__builtin_inff()), over);
}

#if defined(__AVX512F__)
// exp8's arithmetic on 16 lanes (same constants and operation order: the same bits per lane),
// for the AVX-512 files that include this header.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(kFastExpLo);
  const __m512 hi = _mm512_set1_ps(kFastExpHi);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __mmask16 over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269502e+00f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(6.93147182e-01f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-1.904654323e-09f), r);
  __m512 p = _mm512_set1_ps(1.375140739e-03f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.368915878e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166953266e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666651815e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999998808e-01f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 y = _mm512_maskz_mul_ps((__mmask16)~under, p, _mm512_castsi512_ps(e));
  return _mm512_mask_mov_ps(y, over, _mm512_set1_ps(__builtin_inff()));
}
#endif

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 load_f16x8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

}  // namespace
}  // namespace xctx::cpu::impl::avx2
