#include <immintrin.h>

#include "kernels/cpu/simd/roofline_kernels.h"

namespace xctx::cpu::roofline_kernels {

float fma_avx512(int64_t iters) {
  __m512 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_set1_ps(1.0f + 0.01f * (float)c);
  const __m512 mul = _mm512_set1_ps(0.999f), add = _mm512_set1_ps(0.001f);  // stays near 1
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], mul, add);
  __m512 s = acc[0];
  for (int c = 1; c < kFmaChains; ++c) s = _mm512_add_ps(s, acc[c]);
  alignas(64) float out[16];  // stored, not _mm512_reduce_add_ps (gcc 12 warns on its undefined lanes)
  _mm512_store_ps(out, s);
  float sum = 0;
  for (float v : out) sum += v;
  return sum;
}

int32_t dot_avx512(int64_t iters) {
  __m512i acc[kDotChains];
  for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_set1_epi32(c);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kDotChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
  __m512i s = acc[0];
  for (int c = 1; c < kDotChains; ++c) s = _mm512_add_epi32(s, acc[c]);
  alignas(64) int32_t out[16];
  _mm512_store_si512(out, s);
  return wrapping_sum(out, 16);
}

}  // namespace xctx::cpu::roofline_kernels
