// AVX2 row decoders of the quantized cache: 8 codes per step unpacked with one variable shift,
// LUT lookups as in-register permutes (16-entry tables: two permutes and a blend), one FMA.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/kvq_impl.h"

namespace xctx::cpu::impl::avx2 {
namespace {

// kWide: the 4 bytes at p are readable (not the row's last group), so 3-bit groups are one
// 4-byte load whose extra byte the mask drops; the last group assembles its 3 bytes from a 2-
// and a 1-byte load (a 3-byte memcpy measured 10x slower) so no row is read past its end.
template <int BITS, bool kWide = false>
inline __m256i unpack8(const uint8_t* p) {
  uint32_t w = 0;
  if constexpr (BITS == 3 && !kWide) {
    uint16_t lo;
    std::memcpy(&lo, p, 2);
    w = (uint32_t)lo | (uint32_t)p[2] << 16;
  } else {
    std::memcpy(&w, p, BITS == 3 ? 4 : BITS);
  }
  const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shifts), _mm256_set1_epi32((1 << BITS) - 1));
}

struct lut_regs {
  __m256 lo, hi;
};
inline lut_regs load_lut(const float* lut, int bits) {
  alignas(32) float t[16] = {};
  for (int i = 0; i < (1 << bits); ++i) t[i] = lut[i];
  return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}

template <int BITS, bool LUT>
inline __m256 level(__m256i codes, const lut_regs& L) {
  if constexpr (!LUT) {
    return _mm256_cvtepi32_ps(codes);
  } else if constexpr (BITS <= 3) {
    return _mm256_permutevar8x32_ps(L.lo, codes);
  } else {
    const __m256 lo = _mm256_permutevar8x32_ps(L.lo, codes);
    const __m256 hi = _mm256_permutevar8x32_ps(L.hi, codes);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
  }
}

template <int BITS, bool LUT>
void keys_t(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc, float* out) {
  const int C = v.channels();
  const size_t rb = kvq_row_bytes(C, BITS);
  const lut_regs L = LUT ? load_lut(v.lut_k, BITS) : lut_regs{};
  for (int r = 0; r < nt; ++r) {
    const uint8_t* row = v.k_codes + (size_t)(i0 + r) * rb;
    float* o = out + (size_t)r * C;
    int c = 0;
    for (; c + 8 < C; c += 8) {
      const __m256 x = level<BITS, LUT>(unpack8<BITS, true>(row + (size_t)c / 8 * BITS), L);
      _mm256_storeu_ps(o + c, _mm256_fmadd_ps(x, _mm256_loadu_ps(sc + c), _mm256_loadu_ps(zc + c)));
    }
    const __m256 x = level<BITS, LUT>(unpack8<BITS>(row + (size_t)c / 8 * BITS), L);
    _mm256_storeu_ps(o + c, _mm256_fmadd_ps(x, _mm256_loadu_ps(sc + c), _mm256_loadu_ps(zc + c)));
  }
}

template <int BITS, bool LUT>
void values_t(const kvq_layer_view& v, int64_t i0, int nt, float* out) {
  const int C = v.channels();
  const size_t rb = kvq_row_bytes(C, BITS);
  const lut_regs L = LUT ? load_lut(v.lut_v, BITS) : lut_regs{};
  const int group = LUT ? C : v.group;
  const int n_g = (C + group - 1) / group;
  for (int r = 0; r < nt; ++r) {
    const int64_t i = i0 + r;
    const uint8_t* row = v.v_codes + (size_t)i * rb;
    float* o = out + (size_t)r * C;
    for (int g = 0; g < n_g; ++g) {
      const kvq_affine p = LUT ? v.v_tok[i] : v.v_group[(size_t)i * n_g + g];
      const __m256 s = _mm256_set1_ps(fp16_to_fp32(p.scale)), z = _mm256_set1_ps(fp16_to_fp32(p.zero));
      const int c1 = g + 1 == n_g ? C : (g + 1) * group;
      for (int c = g * group; c < c1; c += 8) {  // groups are multiples of 8 (checked by the cache)
        const uint8_t* p = row + (size_t)c / 8 * BITS;
        const __m256 x = c + 8 < C ? level<BITS, LUT>(unpack8<BITS, true>(p), L) : level<BITS, LUT>(unpack8<BITS>(p), L);
        _mm256_storeu_ps(o + c, _mm256_fmadd_ps(x, s, z));
      }
    }
  }
}

template <bool LUT>
void keys_bits(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc, float* out) {
  switch (v.bits) {
    case 2: return keys_t<2, LUT>(v, i0, nt, sc, zc, out);
    case 3: return keys_t<3, LUT>(v, i0, nt, sc, zc, out);
    default: return keys_t<4, LUT>(v, i0, nt, sc, zc, out);
  }
}
template <bool LUT>
void values_bits(const kvq_layer_view& v, int64_t i0, int nt, float* out) {
  switch (v.bits) {
    case 2: return values_t<2, LUT>(v, i0, nt, out);
    case 3: return values_t<3, LUT>(v, i0, nt, out);
    default: return values_t<4, LUT>(v, i0, nt, out);
  }
}

template <int BITS>
void affine_row_t(const uint8_t* row, int C, const float* sc, const float* zc, float* out) {
  int c = 0;
  for (; c + 8 < C; c += 8) {
    const __m256 x = _mm256_cvtepi32_ps(unpack8<BITS, true>(row + (size_t)c / 8 * BITS));
    _mm256_storeu_ps(out + c, _mm256_add_ps(_mm256_mul_ps(x, _mm256_loadu_ps(sc + c)), _mm256_loadu_ps(zc + c)));
  }
  const __m256 x = _mm256_cvtepi32_ps(unpack8<BITS>(row + (size_t)c / 8 * BITS));
  _mm256_storeu_ps(out + c, _mm256_add_ps(_mm256_mul_ps(x, _mm256_loadu_ps(sc + c)), _mm256_loadu_ps(zc + c)));
}

}  // namespace

void affine_codes_row(const uint8_t* row, int C, int bits, const float* sc, const float* zc, float* out) {
  switch (bits) {
    case 1: return affine_row_t<1>(row, C, sc, zc, out);
    case 2: return affine_row_t<2>(row, C, sc, zc, out);
    case 3: return affine_row_t<3>(row, C, sc, zc, out);
    default: return affine_row_t<4>(row, C, sc, zc, out);
  }
}

void kvq_decode_keys(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc, float* out) {
  if (v.scheme == kvq_scheme::kvq_lut)
    keys_bits<true>(v, i0, nt, sc, zc, out);
  else
    keys_bits<false>(v, i0, nt, sc, zc, out);
}
void kvq_decode_values(const kvq_layer_view& v, int64_t i0, int nt, float* out) {
  if (v.scheme == kvq_scheme::kvq_lut)
    values_bits<true>(v, i0, nt, out);
  else
    values_bits<false>(v, i0, nt, out);
}

}  // namespace xctx::cpu::impl::avx2
