#include <immintrin.h>

#include "kernels/cpu/simd/roofline_kernels.h"

namespace xctx::cpu::roofline_kernels {

int32_t dot_avxvnni(int64_t iters) {
  __m256i acc[kDotChains];
  for (int c = 0; c < kDotChains; ++c) acc[c] = _mm256_set1_epi32(c);
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kDotChains; ++c) acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
  __m256i s = acc[0];
  for (int c = 1; c < kDotChains; ++c) s = _mm256_add_epi32(s, acc[c]);
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), s);
  return wrapping_sum(out, 8);
}

}  // namespace xctx::cpu::roofline_kernels
