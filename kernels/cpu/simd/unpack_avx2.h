// Unpacking of legacy quant blocks into byte codes, shared by the AVX2 dequantizers and matmul
// kernels. Include only from *_avx2.cpp files (compiled with -mavx2).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace xctx::cpu::detail {

// 16 bytes of packed nibbles -> 32 bytes in element order: byte j (< 16) holds the low nibble of
// qs[j] (element j), byte 16 + j the high nibble (element j + 16).
inline __m256i unpack_nibbles(const uint8_t* qs) {
  const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)qs));
  const __m256i shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
  return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F));
}

// The 32 fifth bits of a Q5 block -> 0x10 in byte j where bit j of qh is set.
inline __m256i unpack_high_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  // Byte j takes byte j/8 of the word, then every bit but (j%8) is forced on: the byte is all
  // ones exactly when bit j was set.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)bits), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                                     2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i probe = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
  const __m256i set = _mm256_cmpeq_epi8(probe, _mm256_set1_epi8(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

}  // namespace xctx::cpu::detail
