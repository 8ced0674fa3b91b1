// AVX-512 VNNI kernels for the integer decode path (legacy block quants against int8 or int16
// activation blocks; compiled with the *_avx512.cpp flags, entered after cpu::has_avx512()).
//
// Two 32-element blocks share one 512-bit register, laid out [block b: 8 lanes | block b+1: 8
// lanes] as int32 sums of 4 products each:
//   act_q8:  the codes as 64 unsigned bytes (Q8_0: |w|, its sign moved onto x), one VPDPBUSD
//            (u8 x s8, four products summed into each int32 lane) per token and pair;
//   act_q16: Q4_x/Q5_x: the activations split into bytes, two chained VPDPBUSD (act_mode below);
//            Q8_0: the codes widened to int16, one VPDPWSSD per token and block, the two
//            blocks' halves folded into the layout above.
// Every lane is an exact integer below 2^24 (at most 4 * 128 * 32767), so its conversion to float
// is exact, and each pair costs one float FMA with [d_w d_x of block b (x8) | of b+1 (x8)]. The
// weight offset (Q4_1/Q5_1: m; Q4_0: -8 d; Q5_0: -16 d) adds c · s_x per block, s_x being the
// activation block's d · Σq. The AVX2 kernels (matmul_avx2.cpp) do the same per block with
// maddubs/madd; against them this halves the float work per block and, for act_q8, replaces two
// integer multiplies and an add by one instruction. Results differ from the AVX2 and scalar
// kernels only by float summation order (the integer sums are the same).
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which -Wmaybe-uninitialized
// reports once inlined; the values are always fully written.
#if defined(__GNUC__) && !defined(__clang__)  // clang has no -Wmaybe-uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdlib>
#include <cstring>

#include "kernels/cpu/matmul/matmul_impl.h"

// No error reporting in here (the caller checks the result): the string building it needs
// would leave AVX-512-compiled copies of inline library functions that the linker may pick for
// every caller, including those on CPUs without AVX-512.

namespace xctx::cpu::detail {

namespace {

inline int load_i32(const void* p) {
  int v;
  std::memcpy(&v, p, 4);
  return v;
}

// Per-format decoding: scales() gives [d_b, c_b, d_b1, c_b1] (w_j = d code_j + c), codes8() the
// pair's codes as bytes (Q8_0: signed, the others unsigned), codes16() one block's codes as int16.
template <ggml_type T>
struct vfmt;

// The signed-offset formats: [d0, k d0, d1, k d1] from the two fp16 scales.
inline __m128 scales_d(uint16_t d0, uint16_t d1, float k) {
  const __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)d0 | (uint32_t)d1 << 16)));  // [d0, d1, 0, 0]
  return _mm_unpacklo_ps(d, _mm_mul_ps(d, _mm_set1_ps(k)));
}
// Q4_1/Q5_1: d and m are adjacent fp16s, so the pair converts at once to [d0, m0, d1, m1].
inline __m128 scales_dm(const void* b0, const void* b1) {
  return _mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(load_i32(b0)), _mm_cvtsi32_si128(load_i32(b1))));
}

// Two blocks' 16 nibble bytes -> 64 bytes [b0 elements 0..31 | b1 elements 0..31].
inline __m512i nibbles_pair(const uint8_t* qs0, const uint8_t* qs1) {
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)qs0)),
                                               _mm_loadu_si128((const __m128i*)qs1), 1);
  const __m512i z = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(both));
  return _mm512_and_si512(_mm512_srlv_epi64(z, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)), _mm512_set1_epi8(0x0F));
}
// One block's 16 nibble bytes -> 32 int16 codes in element order.
inline __m512i nibbles16(const uint8_t* qs) {
  const __m512i z = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)qs)));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_and_si512(_mm512_srlv_epi16(z, shift), _mm512_set1_epi16(0x0F));
}
// The fifth bits: bit j of qh sets 16 in element j.
inline __m512i add_high_pair(__m512i codes, const uint8_t* qh0, const uint8_t* qh1) {
  const __mmask64 k = (uint64_t)(uint32_t)load_i32(qh0) | (uint64_t)(uint32_t)load_i32(qh1) << 32;
  return _mm512_mask_add_epi8(codes, k, codes, _mm512_set1_epi8(16));
}
inline __m512i add_high16(__m512i codes, const uint8_t* qh) {
  return _mm512_mask_add_epi16(codes, (__mmask32)(uint32_t)load_i32(qh), codes, _mm512_set1_epi16(16));
}

template <>
struct vfmt<ggml_type::ggml_q4_0> {
  using block = block_q4_0;
  static __m128 scales(const block* a, const block* b) { return scales_d(a->d, b->d, -8.0f); }
  static __m512i codes8(const block* a, const block* b) { return nibbles_pair(a->qs, b->qs); }
  static __m512i codes16(const block* a) { return nibbles16(a->qs); }
};
template <>
struct vfmt<ggml_type::ggml_q4_1> {
  using block = block_q4_1;
  static __m128 scales(const block* a, const block* b) { return scales_dm(&a->d, &b->d); }
  static __m512i codes8(const block* a, const block* b) { return nibbles_pair(a->qs, b->qs); }
  static __m512i codes16(const block* a) { return nibbles16(a->qs); }
};
template <>
struct vfmt<ggml_type::ggml_q5_0> {
  using block = block_q5_0;
  static __m128 scales(const block* a, const block* b) { return scales_d(a->d, b->d, -16.0f); }
  static __m512i codes8(const block* a, const block* b) {
    return add_high_pair(nibbles_pair(a->qs, b->qs), a->qh, b->qh);
  }
  static __m512i codes16(const block* a) { return add_high16(nibbles16(a->qs), a->qh); }
};
template <>
struct vfmt<ggml_type::ggml_q5_1> {
  using block = block_q5_1;
  static __m128 scales(const block* a, const block* b) { return scales_dm(&a->d, &b->d); }
  static __m512i codes8(const block* a, const block* b) {
    return add_high_pair(nibbles_pair(a->qs, b->qs), a->qh, b->qh);
  }
  static __m512i codes16(const block* a) { return add_high16(nibbles16(a->qs), a->qh); }
};
template <>
struct vfmt<ggml_type::ggml_q8_0> {
  using block = block_q8_0;
  static __m128 scales(const block* a, const block* b) { return scales_d(a->d, b->d, 0.0f); }
  static __m512i codes8(const block* a, const block* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a->qs)),
                              _mm256_loadu_si256((const __m256i*)b->qs), 1);
  }
  static __m512i codes16(const block* a) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)a->qs));
  }
};

// How a kernel reads the activations (xa, xb below):
//   q8:        xa = int8 codes;
//   q16_split: int16 codes split into bytes, x = 256 hi + lo, with xa = hi (signed) and xb = lo
//              (unsigned): Σ c x = 256 Σ c hi + Σ lo c is two VPDPBUSD, the first with the
//              codes as its unsigned operand, the second with lo (codes <= 31 are valid signed
//              bytes too), chained through one shift. Per token and pair that replaces 2 x
//              (widen + VPDPWSSD) and the fold of the wide form.
//   q16_wide:  xa = int16 codes, multiplied with the codes widened to int16 (VPDPWSSD); Q8_0,
//              whose signed codes do not fit the split form.
enum class act_mode { q8, q16_split, q16_wide };

// One weight row against NT activation rows; U independent accumulator sets for NT = 1, whose
// single FMA chain per pair would otherwise wait on its own latency.
template <ggml_type T, act_mode M, int NT, int U>
void dot_row_vnni(const void* row, int64_t nb, const void* const* xa /*[NT]*/, const int8_t* const* xb /*[NT]*/,
                  const float* const* xd /*[NT]*/, const float* const* xs /*[NT]*/, float* out /*[NT]*/) {
  using F = vfmt<T>;
  constexpr bool signed_codes = T == ggml_type::ggml_q8_0;
  static_assert(!(signed_codes && M == act_mode::q16_split), "the split form needs unsigned codes");
  const auto* blk = (const typename F::block*)row;
  // Broadcasts lane 0 (d_w d_x of the pair's first block) to lanes 0..7, lane 2 to 8..15.
  const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  __m512 acc[U][NT];
  __m128 off[U][NT];  // lanes 1 and 3 collect c · s_x; 0 and 2 are unused
  for (int u = 0; u < U; ++u) {
    for (int t = 0; t < NT; ++t) {
      acc[u][t] = _mm512_setzero_ps();
      off[u][t] = _mm_setzero_ps();
    }
  }
  // Blocks b and b + 1; with two == false only b (the row's odd last block): its partner's
  // codes are b's again, met by zeroed activations and a zero scale (its lanes stay finite).
  auto step = [&](int64_t b, bool two, int u) __attribute__((always_inline)) {
    const auto* b0 = blk + b;
    const auto* b1 = two ? b0 + 1 : b0;
    const __m128 sc = F::scales(b0, b1);
    __m512i c8 = _mm512_setzero_si512(), c16_0 = c8, c16_1 = c8;
    __mmask64 negative = 0;
    if constexpr (M == act_mode::q16_wide) {
      c16_0 = F::codes16(b0);
      if (two) c16_1 = F::codes16(b1);
    } else {
      c8 = F::codes8(b0, b1);
      if constexpr (signed_codes) {
        negative = _mm512_movepi8_mask(c8);
        c8 = _mm512_abs_epi8(c8);  // -128 -> 0x80, read as unsigned 128
      }
    }
    const __mmask64 live = two ? ~0ull : 0xFFFFFFFFull;  // bytes of the blocks present
    for (int t = 0; t < NT; ++t) {
      __m512i p;
      if constexpr (M == act_mode::q16_wide) {
        const int16_t* x = (const int16_t*)xa[t] + b * qk_small;
        const __m512i p0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), c16_0, _mm512_loadu_si512(x));
        const __m512i p1 = two ? _mm512_dpwssd_epi32(_mm512_setzero_si512(), c16_1, _mm512_loadu_si512(x + qk_small))
                               : _mm512_setzero_si512();
        // Lanes j and j + 8 of each block's 16 (2 products each) summed: [p0 | p1] x 8 lanes.
        p = _mm512_add_epi32(_mm512_permutex2var_epi64(p0, _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), p1),
                             _mm512_permutex2var_epi64(p0, _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15), p1));
      } else {
        __m512i x = _mm512_maskz_loadu_epi8(live, (const int8_t*)xa[t] + b * qk_small);
        // Activations are within [-127, 127], so negating them never overflows.
        if constexpr (signed_codes) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
        p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c8, x);
        if constexpr (M == act_mode::q16_split) {  // lanes: 256 Σ c hi + Σ lo c, |.| < 4 * 31 * 32768
          const __m512i lo = _mm512_maskz_loadu_epi8(live, xb[t] + b * qk_small);
          p = _mm512_dpbusd_epi32(_mm512_slli_epi32(p, 8), lo, c8);
        }
      }
      // [d0 dx0, c0 sx0, d1 dx1, c1 sx1]; the lone block's partner gets zeros.
      // (movq loads: two floats need not be 8-byte aligned)
      __m128 xds = two ? _mm_unpacklo_ps(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xd[t] + b))),
                                         _mm_castsi128_ps(_mm_loadl_epi64((const __m128i*)(xs[t] + b))))
                       : _mm_unpacklo_ps(_mm_load_ss(xd[t] + b), _mm_load_ss(xs[t] + b));
      const __m128 prod = _mm_mul_ps(sc, xds);
      off[u][t] = _mm_add_ps(off[u][t], prod);
      const __m512 scale = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(prod));
      acc[u][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale, acc[u][t]);
    }
  };
  int64_t b = 0;
  for (; b + 2 * U <= nb; b += 2 * U) {
    for (int u = 0; u < U; ++u) step(b + 2 * u, true, u);
  }
  for (; b + 2 <= nb; b += 2) step(b, true, 0);
  if (b < nb) step(b, false, 0);
  for (int t = 0; t < NT; ++t) {
    __m512 a = acc[0][t];
    __m128 o = off[0][t];
    for (int u = 1; u < U; ++u) {
      a = _mm512_add_ps(a, acc[u][t]);
      o = _mm_add_ps(o, off[u][t]);
    }
    out[t] = _mm512_reduce_add_ps(a) + (_mm_cvtss_f32(_mm_shuffle_ps(o, o, 1)) + _mm_cvtss_f32(_mm_shuffle_ps(o, o, 3)));
  }
}

// The activations of one call as the kernels read them: xa / xb planes of [n_tok, n_cols]
// elements (see act_mode), scales and sums as in int_act.
struct vnni_act {
  const void* xa = nullptr;
  const int8_t* xb = nullptr;
  size_t xa_elem = 1;  // bytes per element of xa
  const float* d = nullptr;
  const float* s = nullptr;
  int64_t n_blocks = 0;
};

template <ggml_type T, act_mode M, int NT>
void dot_row_vnni_group(const void* row, const vnni_act& xq, int64_t t0, float* y, int64_t ldy, int64_t r) {
  const int64_t nb = xq.n_blocks, n_cols = nb * qk_small;
  const void* xa[NT];
  const int8_t* xb[NT];
  const float* d[NT];
  const float* s[NT];
  for (int t = 0; t < NT; ++t) {
    xa[t] = (const uint8_t*)xq.xa + (size_t)((t0 + t) * n_cols) * xq.xa_elem;
    xb[t] = xq.xb != nullptr ? xq.xb + (t0 + t) * n_cols : nullptr;
    d[t] = xq.d + (t0 + t) * nb;
    s[t] = xq.s + (t0 + t) * nb;
  }
  float out[NT];
  dot_row_vnni<T, M, NT, (NT == 1 ? 2 : 1)>(row, nb, xa, xb, d, s, out);
  for (int t = 0; t < NT; ++t) y[(t0 + t) * ldy + r] = out[t];
}

template <ggml_type T, act_mode M>
void dot_rows_vnni(const weight_view& w, int64_t r0, int64_t r1, const vnni_act& xq, int64_t n_tok, float* y,
                   int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    int64_t t = 0;
    for (; t + 4 <= n_tok; t += 4) dot_row_vnni_group<T, M, 4>(row, xq, t, y, ldy, r);
    switch (n_tok - t) {
      case 3: dot_row_vnni_group<T, M, 3>(row, xq, t, y, ldy, r); break;
      case 2: dot_row_vnni_group<T, M, 2>(row, xq, t, y, ldy, r); break;
      case 1: dot_row_vnni_group<T, M, 1>(row, xq, t, y, ldy, r); break;
      case 0: break;
    }
  }
}

template <act_mode M>
bool dot_rows_mode(const weight_view& w, int64_t r0, int64_t r1, const vnni_act& xq, int64_t n_tok, float* y,
                   int64_t ldy) {
  switch (w.type) {
    case ggml_type::ggml_q4_0: dot_rows_vnni<ggml_type::ggml_q4_0, M>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q4_1: dot_rows_vnni<ggml_type::ggml_q4_1, M>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q5_0: dot_rows_vnni<ggml_type::ggml_q5_0, M>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q5_1: dot_rows_vnni<ggml_type::ggml_q5_1, M>(w, r0, r1, xq, n_tok, y, ldy); return true;
    case ggml_type::ggml_q8_0:
      if constexpr (M == act_mode::q16_split) return false;  // the caller picks q16_wide for Q8_0
      else {
        dot_rows_vnni<ggml_type::ggml_q8_0, M>(w, r0, r1, xq, n_tok, y, ldy);
        return true;
      }
    case ggml_type::ggml_f32:
    case ggml_type::ggml_f16:
    case ggml_type::ggml_bf16:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k:
    case ggml_type::ggml_q8_k: break;
  }
  return false;
}

// int16 codes -> the split planes: hi = x >> 8 (arithmetic), lo = x & 0xFF (the truncation).
void split_q16(const int16_t* x, int64_t n /*multiple of 32*/, int8_t* hi, int8_t* lo) {
  for (int64_t i = 0; i < n; i += 32) {
    const __m512i v = _mm512_loadu_si512(x + i);
    _mm256_storeu_si256((__m256i*)(hi + i), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
    _mm256_storeu_si256((__m256i*)(lo + i), _mm512_cvtepi16_epi8(v));
  }
}

}  // namespace

bool dot_rows_q_avx512(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok, float* y,
                       int64_t ldy) {
  const vnni_act a{xq.qs, nullptr, 1, xq.d, xq.s, xq.n_blocks};
  return dot_rows_mode<act_mode::q8>(w, r0, r1, a, n_tok, y, ldy);
}

bool dot_rows_q_avx512(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                       int64_t ldy) {
  if (w.type == ggml_type::ggml_q8_0) {
    const vnni_act a{xq.qs, nullptr, 2, xq.d, xq.s, xq.n_blocks};
    return dot_rows_mode<act_mode::q16_wide>(w, r0, r1, a, n_tok, y, ldy);
  }
  // Each calling thread splits the (few) activation rows for itself: n_tok x n_cols bytes twice,
  // against its share of n_rows x n_cols weights. malloc, not a container: see the note above.
  const size_t n = (size_t)(n_tok * xq.n_blocks * qk_small);
  auto* planes = (int8_t*)std::malloc(2 * n);
  if (planes == nullptr) return false;
  split_q16(xq.qs, (int64_t)n, planes, planes + n);
  const vnni_act a{planes, planes + n, 1, xq.d, xq.s, xq.n_blocks};
  const bool ok = dot_rows_mode<act_mode::q16_split>(w, r0, r1, a, n_tok, y, ldy);
  std::free(planes);
  return ok;
}

}  // namespace xctx::cpu::detail
