// AVX2/FMA elementwise kernels; entered only after cpu::has_avx2() (see elementwise.cpp).
// Raw pointers only: no std containers here, so no AVX2-compiled template copies can be picked
// by the linker for the portable files.
#include <immintrin.h>

#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/cpu/simd/fast_exp_avx2.h"

namespace xctx::cpu::impl::avx2 {

void exp_fast(const float* x /*[n]*/, int64_t n, float* y /*[n]*/) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t = i; t < n; ++t) buf[t - i] = x[t];
    _mm256_store_ps(buf, exp8(_mm256_load_ps(buf)));
    for (int64_t t = i; t < n; ++t) y[t] = buf[t - i];
  }
}

float sum_squares(const float* x /*[n]*/, int64_t n) {
  // Four independent accumulators: hides FMA latency and shortens each summation chain 32x.
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
    a2 = _mm256_fmadd_ps(x2, x2, a2);
    a3 = _mm256_fmadd_ps(x3, x3, a3);
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + i);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
  }
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

void scale_mul(const float* x /*[n]*/, const float* w /*[n]*/, float s, int64_t n, float* y /*[n]*/) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = x[i] * s * w[i];
}

void rope_rotate(float* x /*[n_rot]*/, const float* cos2 /*[n_rot]*/, const float* sin2 /*[n_rot]*/, int n_rot) {
  int i = 0;
  for (; i + 8 <= n_rot; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // (x1, x0) in each pair
    // (x0 c - x1 s, x1 c + x0 s)
    _mm256_storeu_ps(x + i, _mm256_fmadd_ps(v, _mm256_loadu_ps(cos2 + i), _mm256_mul_ps(swapped, _mm256_loadu_ps(sin2 + i))));
  }
  for (; i < n_rot; i += 2) {
    const float x0 = x[i], x1 = x[i + 1];
    x[i] = x0 * cos2[i] + x1 * sin2[i];
    x[i + 1] = x1 * cos2[i + 1] + x0 * sin2[i + 1];
  }
}

void rope_tile_tokens(float* k, int nt, int n_kvh, int hd, int n_rot, const float* bc, const float* bs,
                      const float* off_cos, const float* off_sin) {
  const int np = n_rot / 2;
  alignas(32) float cos2[1024], sin2[1024];
  for (int j = 0; j < nt; ++j) {
    const float* oc = off_cos + (size_t)j * np;
    const float* os = off_sin + (size_t)j * np;
    for (int i = 0; i < np; i += 8) {
      const __m256 b_c = _mm256_loadu_ps(bc + i), b_s = _mm256_loadu_ps(bs + i);
      const __m256 o_c = _mm256_loadu_ps(oc + i), o_s = _mm256_loadu_ps(os + i);
      // angle(base + j) = angle(base) + angle(j): one complex product per pair
      const __m256 c = _mm256_fmsub_ps(b_c, o_c, _mm256_mul_ps(b_s, o_s));
      const __m256 sn = _mm256_fmadd_ps(b_s, o_c, _mm256_mul_ps(b_c, o_s));
      const __m256 neg = _mm256_xor_ps(sn, _mm256_set1_ps(-0.0f));
      // Pairs (2i, 2i+1) share an angle: duplicate into element order, sin2 = (-s, +s).
      const __m256 c_lo = _mm256_unpacklo_ps(c, c), c_hi = _mm256_unpackhi_ps(c, c);
      const __m256 s_lo = _mm256_unpacklo_ps(neg, sn), s_hi = _mm256_unpackhi_ps(neg, sn);
      _mm256_store_ps(cos2 + 2 * i, _mm256_permute2f128_ps(c_lo, c_hi, 0x20));
      _mm256_store_ps(cos2 + 2 * i + 8, _mm256_permute2f128_ps(c_lo, c_hi, 0x31));
      _mm256_store_ps(sin2 + 2 * i, _mm256_permute2f128_ps(s_lo, s_hi, 0x20));
      _mm256_store_ps(sin2 + 2 * i + 8, _mm256_permute2f128_ps(s_lo, s_hi, 0x31));
    }
    for (int h = 0; h < n_kvh; ++h) rope_rotate(k + ((size_t)j * n_kvh + h) * hd, cos2, sin2, n_rot);
  }
}

void swiglu(const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp8(_mm256_xor_ps(g, sign));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {
    alignas(32) float g[8] = {0, 0, 0, 0, 0, 0, 0, 0}, u[8] = {0, 0, 0, 0, 0, 0, 0, 0}, r[8];
    for (int64_t t = i; t < n; ++t) g[t - i] = gate[t], u[t - i] = up[t];
    swiglu(g, u, 8, r);
    for (int64_t t = i; t < n; ++t) out[t] = r[t - i];
  }
}

}  // namespace xctx::cpu::impl::avx2
