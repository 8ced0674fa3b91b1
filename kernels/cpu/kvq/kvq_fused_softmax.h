// Internal to the fused one-query attention kernels: the per-head steps that work on memory --
// the online softmax of a tile, the value-scale fold, the zero-point sums, the value segments.
// 16 lanes where the includer is compiled for AVX-512, else 8. Include only from kvq_fused_impl.h.
#pragma once

#include <immintrin.h>

#include <cmath>

#include "kernels/cpu/simd/fast_exp_avx2.h"
#include "kernels/cpu/kvq/kvq_fused_tile.h"

namespace xctx::cpu::impl::fused {
namespace {

// ---- per-head steps on memory (s: [RB, kSS] scores, then probabilities; o: [RB, hd]) ----------

// Online softmax over the tile's nt scores of RB rows: s becomes the probabilities, m and l are
// updated, o (hd wide) rescaled -- unless the running maximum held (alpha = 1, most tiles after
// the first few): multiplying by 1 changes no bit, so the pass over o is skipped.
// With AVX-512 (the *_avx512.cpp includer) 16 lanes with masked tails, else 8 lanes.
#if defined(__AVX512F__)
inline __mmask16 first_lanes(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

// The tile's maximum of row u's scores and the factor alpha = exp(m_old − m_new) the row's running
// sums take; m[u] becomes m_new. A maximum that held gives alpha = 1 without the call (the most
// common case after a unit's first tiles; exp(0) is 1 exactly).
inline float tile_max_update(const float* su, int nt, float& m, float& m_new) {
  __m512 mv = _mm512_set1_ps(-__builtin_inff());
  for (int j = 0; j < nt; j += 16) {
    const __mmask16 k = first_lanes(nt - j);
    mv = _mm512_mask_max_ps(mv, k, mv, _mm512_maskz_loadu_ps(k, su + j));
  }
  const float mt = _mm512_reduce_max_ps(mv);
  m_new = mt > m ? mt : m;
  const float alpha = m_new == m ? 1.0f : std::exp(m - m_new);  // 0 on the first tile (m = -inf)
  m = m_new;
  return alpha;
}

inline void scale_row(float* o, int hd, float alpha) {
  const __m512 a = _mm512_set1_ps(alpha);
  for (int d = 0; d < hd; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), a));
}

// Online softmax over the tile's nt scores of RB rows: s becomes the probabilities, m and the
// denominator lanes of l (lanes [0, 16) of each row's kFusedSumLanes) are updated, o (hd wide)
// rescaled -- unless the running maximum held (alpha = 1): multiplying by 1 changes no bit.
template <int RB>
inline void softmax_update(float* s, int nt, float* m, float* l, float* o, int hd) {
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    float m_new;
    const float alpha = tile_max_update(su, nt, m[u], m_new);
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nt; j += 16) {
      const __mmask16 k = first_lanes(nt - j);
      const __m512 p = _mm512_maskz_mov_ps(k, avx2::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, su + j), mn)));
      _mm512_mask_storeu_ps(su + j, k, p);
      sum = _mm512_add_ps(sum, p);
    }
    float* lu = l + u * kFusedSumLanes;
    _mm512_storeu_ps(lu, _mm512_fmadd_ps(_mm512_loadu_ps(lu), _mm512_set1_ps(alpha), sum));
    if (alpha != 1.0f) scale_row(o + u * hd, hd, alpha);
  }
}

// The softmax update and the value-scale fold in one pass, for values with one (scale, zero) per
// row (nuq): s becomes p (the value outliers' weights), w = p·s_j, and Σ_j p_j·z_j is kept in
// lanes [16, 32) of l, rescaled with the row's other sums and added to o once per unit
// (attend_unit) instead of once per tile.
template <int RB>
inline void softmax_fold(float* s, const float* ps /*[kT]*/, const float* pz /*[kT]*/, int nt, float* m, float* l,
                         float* o, int hd, float* w) {
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    float m_new;
    const float alpha = tile_max_update(su, nt, m[u], m_new);
    const __m512 mn = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps(), zs = _mm512_setzero_ps();
    for (int j = 0; j < nt; j += 16) {
      const __mmask16 k = first_lanes(nt - j);
      const __m512 p = _mm512_maskz_mov_ps(k, avx2::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, su + j), mn)));
      _mm512_mask_storeu_ps(su + j, k, p);
      _mm512_mask_storeu_ps(w + u * kSS + j, k, _mm512_mul_ps(p, _mm512_maskz_loadu_ps(k, ps + j)));
      sum = _mm512_add_ps(sum, p);
      zs = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(k, pz + j), zs);
    }
    float* lu = l + u * kFusedSumLanes;
    const __m512 a = _mm512_set1_ps(alpha);
    _mm512_storeu_ps(lu, _mm512_fmadd_ps(_mm512_loadu_ps(lu), a, sum));
    _mm512_storeu_ps(lu + 16, _mm512_fmadd_ps(_mm512_loadu_ps(lu + 16), a, zs));
    if (alpha != 1.0f) scale_row(o + u * hd, hd, alpha);
  }
}

// The value-scale fold: w = p·s_j per row, and the returned Σ_j p_j·z_j per row (zsum [RB]).
template <int RB>
inline void fold_value_scales(const float* s, const float* ps /*[kT]*/, const float* pz /*[kT]*/, int nt, float* w,
                              float* zsum) {
  for (int u = 0; u < RB; ++u) {
    __m512 zs = _mm512_setzero_ps();
    for (int j = 0; j < nt; j += 16) {
      const __mmask16 k = first_lanes(nt - j);
      const __m512 p = _mm512_maskz_loadu_ps(k, s + u * kSS + j);
      _mm512_mask_storeu_ps(w + u * kSS + j, k, _mm512_mul_ps(p, _mm512_maskz_loadu_ps(k, ps + j)));
      zs = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(k, pz + j), zs);
    }
    zsum[u] = _mm512_reduce_add_ps(zs);
  }
}
#else
template <int RB>
inline void softmax_update(float* s, int nt, float* m, float* l, float* o, int hd) {
  for (int u = 0; u < RB; ++u) {
    float* su = s + u * kSS;
    __m256 mv = _mm256_set1_ps(-__builtin_inff());
    int j = 0;
    for (; j + 8 <= nt; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(su + j));
    float mt = avx2::hmax8(mv);
    for (; j < nt; ++j) mt = su[j] > mt ? su[j] : mt;
    const float m_new = mt > m[u] ? mt : m[u];
    const float alpha = m_new == m[u] ? 1.0f : std::exp(m[u] - m_new);  // 0 on the first tile (m = -inf)
    m[u] = m_new;
    const __m256 mn = _mm256_set1_ps(m_new);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= nt; j += 8) {
      const __m256 p = avx2::exp8(_mm256_sub_ps(_mm256_loadu_ps(su + j), mn));
      _mm256_storeu_ps(su + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    if (j < nt) {  // the tile's last partial group of 8: lanes past nt give exp(-inf) = 0
      alignas(32) float buf[8];
      for (int e = 0; e < 8; ++e) buf[e] = j + e < nt ? su[j + e] - m_new : -__builtin_inff();
      const __m256 p = avx2::exp8(_mm256_load_ps(buf));
      sum = _mm256_add_ps(sum, p);
      _mm256_store_ps(buf, p);
      for (int e = 0; j + e < nt; ++e) su[j + e] = buf[e];
    }
    l[u * kFusedSumLanes] = l[u * kFusedSumLanes] * alpha + avx2::hsum8(sum);
    if (alpha == 1.0f) continue;
    const __m256 a = _mm256_set1_ps(alpha);
    for (int d = 0; d < hd; d += 8) _mm256_storeu_ps(o + u * hd + d, _mm256_mul_ps(_mm256_loadu_ps(o + u * hd + d), a));
  }
}

// The value-scale fold: w = p·s_j per row, and the returned Σ_j p_j·z_j per row (zsum [RB]).
template <int RB>
inline void fold_value_scales(const float* s, const float* ps /*[kT]*/, const float* pz /*[kT]*/, int nt, float* w,
                              float* zsum) {
  for (int u = 0; u < RB; ++u) {
    __m256 zs = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= nt; j += 8) {
      const __m256 p = _mm256_loadu_ps(s + u * kSS + j);
      _mm256_storeu_ps(w + u * kSS + j, _mm256_mul_ps(p, _mm256_loadu_ps(ps + j)));
      zs = _mm256_fmadd_ps(p, _mm256_loadu_ps(pz + j), zs);
    }
    float zt = 0.0f;
    for (; j < nt; ++j) w[u * kSS + j] = s[u * kSS + j] * ps[j], zt += s[u * kSS + j] * pz[j];
    zsum[u] = avx2::hsum8(zs) + zt;
  }
}
#endif

// o_u[8 da, 8 db) += zsum_u: the zero points' share, once per tile.
template <int RB>
inline void add_zero_sums(const float* zsum, int da, int db, float* o, int hd) {
  for (int u = 0; u < RB; ++u) {
    const __m256 z = _mm256_set1_ps(zsum[u]);
    for (int d = da; d < db; ++d) _mm256_storeu_ps(o + u * hd + 8 * d, _mm256_add_ps(_mm256_loadu_ps(o + u * hd + 8 * d), z));
  }
}

// The channel-vector segments (8-wide) of head h sharing one value parameter group, in turn:
// calls f(da, db, ps, pz) with the rows' scale/zero for it (nuq: one segment, the per-row
// parameters; uniform: value groups narrower than the head split it). sj, zj: [kT] scratch.
template <bool LUT, class F>
inline void for_value_segments(const tile_ctx& t, int h, float* sj, float* zj, F&& f) {
  const int nv = t.hd / 8;
  for (int da = 0; da < nv;) {
    int db = nv;
    const float *ps = t.v_scale, *pz = t.v_zero;
    if constexpr (!LUT) {
      const int grp = (h * t.hd + 8 * da) / t.L->group;
      while ((h * t.hd + 8 * (db - 1)) / t.L->group != grp) --db;
      for (int j = 0; j < t.nt; ++j)
        sj[j] = t.vg[((size_t)j * t.n_vg + grp) * 2], zj[j] = t.vg[((size_t)j * t.n_vg + grp) * 2 + 1];
      ps = sj, pz = zj;
    }
    f(da, db, ps, pz);
    da = db;
  }
}

}  // namespace
}  // namespace xctx::cpu::impl::fused
