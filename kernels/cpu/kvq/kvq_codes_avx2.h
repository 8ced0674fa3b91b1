// AVX2 unpacking of the quantized cache's packed codes (kernels/kv_quant.h bit streams), shared
// by the row decoders (kvq_avx2.cpp) and the fused one-query attention (kvq_fused_avx2.cpp).
// Include only from *_avx2.cpp files (compiled with -mavx2 -mfma -mf16c).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace xctx::cpu::impl::avx2 {
namespace {

// 8 codes of BITS bits starting at p, lane i = the stream shifted down by i*BITS and NOT masked
// (bits of later codes sit above code i). How the group's BITS bytes are read:
//   read_exact     just those bytes (3 bytes from a 2- and a 1-byte load: a 3-byte memcpy
//                  measured 10x slower)
//   read_forward   one 4-byte load at p: the row goes on for 4 - BITS more bytes (not its last group)
//   read_backward  one 4-byte load ending where the group ends: 4 - BITS bytes before p belong to
//                  the row (not its first group)
// so no read leaves the row. "Not the last (first) group" vouches for one more group of BITS
// bytes, which covers the 4 - BITS extra bytes only for BITS >= 2: 1-bit groups (one byte) are
// always read exactly, whatever R says (a forward read of the second-last 1-bit group read two
// bytes past the row: found by ASan at the end of a heap block; test_kvq.cpp's guard-page test).
enum class code_read : uint8_t { read_exact, read_forward, read_backward };

template <int BITS, code_read R>
inline __m256i codes8_shifted(const uint8_t* p) {
  uint32_t w = 0;
  int extra = 0;  // bits below the group in w
  if constexpr ((R == code_read::read_forward && BITS > 1) || BITS == 4) {
    std::memcpy(&w, p, 4);
  } else if constexpr (R == code_read::read_backward && BITS > 1) {
    std::memcpy(&w, p + BITS - 4, 4);
    extra = 8 * (4 - BITS);
  } else if constexpr (BITS == 3) {
    uint16_t lo;
    std::memcpy(&lo, p, 2);
    w = (uint32_t)lo | (uint32_t)p[2] << 16;
  } else {
    std::memcpy(&w, p, BITS);
  }
  const __m256i shifts = _mm256_add_epi32(
      _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS), _mm256_set1_epi32(extra));
  return _mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts);
}

// The codes themselves (masked to BITS bits).
template <int BITS, code_read R = code_read::read_exact>
inline __m256i unpack8(const uint8_t* p) {
  return _mm256_and_si256(codes8_shifted<BITS, R>(p), _mm256_set1_epi32((1 << BITS) - 1));
}

// A lookup table of up to 16 floats in two registers. Entries repeat with period 2^bits, so a
// permute that reads the low 3 bits of an unmasked lane still finds lut[code] (vpermps ignores
// the index bits above 3; for 2-bit codes bit 2 belongs to the next code). lut = null gives the
// identity (level = the code itself), how uniform codes of up to 3 bits are widened: one
// permute instead of a mask and a conversion, the same floats.
struct lut_regs {
  __m256 lo, hi;
};
inline lut_regs load_lut(const float* lut, int bits) {
  alignas(32) float t[16];
  const int n = 1 << bits;
  for (int i = 0; i < 16; ++i) t[i] = lut != nullptr ? lut[i % n] : (float)(i % n);
  return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}

// The level of each code: lut[code] (LUT) or the code as a float (uniform; L the identity).
// `shifted` lanes may carry higher bits (codes8_shifted); they are ignored or masked here.
template <int BITS, bool LUT>
inline __m256 level(__m256i shifted, const lut_regs& L) {
  if constexpr (!LUT && BITS == 4) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32((1 << BITS) - 1)));
  } else if constexpr (BITS <= 3) {
    return _mm256_permutevar8x32_ps(L.lo, shifted);
  } else {
    const __m256 lo = _mm256_permutevar8x32_ps(L.lo, shifted);
    const __m256 hi = _mm256_permutevar8x32_ps(L.hi, shifted);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(shifted, 28)));  // bit 3 -> sign
  }
}

}  // namespace
}  // namespace xctx::cpu::impl::avx2
