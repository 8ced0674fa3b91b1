#include <immintrin.h>

#include "kernels/cpu/simd/roofline_kernels.h"

namespace xctx::cpu::roofline_kernels {

float read_avx2(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (size_t i = 0; i < n; i += 64) {  // one 256-byte stretch: four cache lines
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
    a4 = _mm256_add_ps(a4, _mm256_load_ps(p + i + 32));
    a5 = _mm256_add_ps(a5, _mm256_load_ps(p + i + 40));
    a6 = _mm256_add_ps(a6, _mm256_load_ps(p + i + 48));
    a7 = _mm256_add_ps(a7, _mm256_load_ps(p + i + 56));
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                 _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

float fma_avx2(int64_t iters) {
  __m256 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_set1_ps(1.0f + 0.01f * (float)c);
  // x * 0.999 + 0.001 stays near 1: no overflow, no denormals, over any number of rounds.
  const __m256 mul = _mm256_set1_ps(0.999f), add = _mm256_set1_ps(0.001f);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], mul, add);
  __m256 s = acc[0];
  for (int c = 1; c < kFmaChains; ++c) s = _mm256_add_ps(s, acc[c]);
  alignas(32) float out[8];
  _mm256_store_ps(out, s);
  return out[0] + out[1] + out[2] + out[3] + out[4] + out[5] + out[6] + out[7];
}

int32_t dot_avx2(int64_t iters) {
  __m256i acc[kDotChains];
  for (int c = 0; c < kDotChains; ++c) acc[c] = _mm256_set1_epi32(c);
  // The unsigned operand is the accumulator's own bytes: each product depends on the chain, so
  // no multiply is hoisted out of the loop or shared between chains.
  const __m256i b = _mm256_set1_epi8(-2), ones = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kDotChains; ++c)
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(acc[c], b), ones));
  __m256i s = acc[0];
  for (int c = 1; c < kDotChains; ++c) s = _mm256_add_epi32(s, acc[c]);
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
  return wrapping_sum(out, 8);
}

}  // namespace xctx::cpu::roofline_kernels
