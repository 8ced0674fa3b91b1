// AVX2 row decoders of the quantized cache: 8 codes per step unpacked with one variable shift,
// LUT lookups as in-register permutes (16-entry tables: two permutes and a blend), one FMA.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/kvq/kvq_codes_avx2.h"
#include "kernels/cpu/kvq/kvq_impl.h"

namespace xctx::cpu::impl::avx2 {
namespace {

template <int BITS, bool LUT>
void keys_t(const kvq_layer_view& v, int64_t i0, int nt, const float* sc, const float* zc, float* out) {
  const int C = v.channels();
  const size_t rb = kvq_row_bytes(C, BITS);
  const lut_regs L = load_lut(LUT ? v.lut_k : nullptr, BITS);
  for (int r = 0; r < nt; ++r) {
    const uint8_t* row = v.k_codes + (size_t)(i0 + r) * rb;
    float* o = out + (size_t)r * C;
    int c = 0;
    for (; c + 8 < C; c += 8) {
      const __m256 x = level<BITS, LUT>(unpack8<BITS, code_read::read_forward>(row + (size_t)c / 8 * BITS), L);
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
  const lut_regs L = load_lut(LUT ? v.lut_v : nullptr, BITS);
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
        const __m256 x = c + 8 < C ? level<BITS, LUT>(unpack8<BITS, code_read::read_forward>(p), L) : level<BITS, LUT>(unpack8<BITS>(p), L);
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

// code·scale rounded, then + zero rounded: gcc fuses a mul_ps feeding an add_ps into one FMA
// under -mfma (-ffp-contract=fast), so the empty asm hides the product from that fusion and the
// result stays bitwise the scalar decoder's (a guard-page test in test_kvq.cpp compares them).
inline __m256 product_then_sum(__m256 x, const float* sc, const float* zc) {
  __m256 prod = _mm256_mul_ps(x, _mm256_loadu_ps(sc));
  asm("" : "+x"(prod));
  return _mm256_add_ps(prod, _mm256_loadu_ps(zc));
}

template <int BITS>
void affine_row_t(const uint8_t* row, int C, const float* sc, const float* zc, float* out) {
  int c = 0;
  for (; c + 8 < C; c += 8) {
    const __m256 x = _mm256_cvtepi32_ps(unpack8<BITS, code_read::read_forward>(row + (size_t)c / 8 * BITS));
    _mm256_storeu_ps(out + c, product_then_sum(x, sc + c, zc + c));
  }
  const __m256 x = _mm256_cvtepi32_ps(unpack8<BITS>(row + (size_t)c / 8 * BITS));
  _mm256_storeu_ps(out + c, product_then_sum(x, sc + c, zc + c));
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
