// The AVX-512 VNNI kernel of the integer prefill GEMM (compiled with the *_avx512.cpp flags,
// entered after cpu::has_avx512()). Sixteen weight rows share a register, one int32 lane each:
// per 4 columns one VPDPBUSD adds u[row, 4 columns] · x[token, 4 columns] (the token's 4
// activation bytes broadcast), so a 32-element block is 8 VPDPBUSD per token, after which the
// block's integer sums become floats and two FMAs apply d_w d_x and c_w s_x. T tokens (up to 12;
// q16 8) share each weight load; every output is the same chain of float operations as
// gemm_q8_strips_scalar, in block order, whatever T, strip or thread computes it.
// No error reporting or library containers here (see matmul_avx512.cpp).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "kernels/cpu/matmul/matmul_impl.h"

namespace xctx::cpu::detail {

namespace {

inline int load_i32(const void* p) {
  int v;
  std::memcpy(&v, p, 4);
  return v;
}

// Tokens [t0, t0 + T) against one strip (nb blocks); `live` masks the strip's real rows.
template <int T>
__attribute__((always_inline)) inline void strip_tokens(const uint8_t* strip, int64_t nb, const q8_act& xq,
                                                        int64_t t0, float* y, int64_t ldy, __mmask16 live) {
  const int64_t n_cols = nb * qk_small;
  const int8_t* x = xq.qs + t0 * n_cols;
  const float* xd = xq.d + t0 * nb;
  const float* xs = xq.s + t0 * nb;
  __m512 acc[T];
#pragma GCC unroll 12
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = strip + (size_t)b * k_q8_block_bytes;
    __m512i sum[T];
#pragma GCC unroll 12
    for (int t = 0; t < T; ++t) sum[t] = _mm512_setzero_si512();
#pragma GCC unroll 12
    for (int g = 0; g < 8; ++g) {
      const __m512i u = _mm512_loadu_si512(blk + 64 * g);
#pragma GCC unroll 12
      for (int t = 0; t < T; ++t) {
        sum[t] = _mm512_dpbusd_epi32(sum[t], u, _mm512_set1_epi32(load_i32(x + t * n_cols + b * qk_small + 4 * g)));
      }
    }
    const __m512 dw = _mm512_loadu_ps(blk + 8 * 16 * 4);
    const __m512 cw = _mm512_loadu_ps(blk + 8 * 16 * 4 + 64);
#pragma GCC unroll 12
    for (int t = 0; t < T; ++t) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[t * nb + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), scale, acc[t]);
      acc[t] = _mm512_fmadd_ps(cw, _mm512_set1_ps(xs[t * nb + b]), acc[t]);
    }
  }
#pragma GCC unroll 12
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy, live, acc[t]);
}

constexpr int k_tokens = 12;

// q16: per 4 columns VPDPBUSD(u, hi) and VPDPBUSD(lo, u) (codes <= 127 read as signed bytes),
// Σ u x = 256 Σ u hi + Σ u lo; three registers per token, so 8 tokens per weight load.
template <int T>
__attribute__((always_inline)) inline void strip_tokens_q16(const uint8_t* strip, int64_t nb, const q16_planes& xp,
                                                            int64_t t0, float* y, int64_t ldy, __mmask16 live) {
  const int64_t n_cols = nb * qk_small;
  const int8_t* hi = xp.hi + t0 * n_cols;
  const uint8_t* lo = xp.lo + t0 * n_cols;
  const float* xd = xp.d + t0 * nb;
  const float* xs = xp.s + t0 * nb;
  __m512 acc[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = strip + (size_t)b * k_q8_block_bytes;
    __m512i sum_hi[T], sum_lo[T];
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) sum_hi[t] = sum_lo[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i u = _mm512_loadu_si512(blk + 64 * g);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const int64_t off = t * n_cols + b * qk_small + 4 * g;
        sum_hi[t] = _mm512_dpbusd_epi32(sum_hi[t], u, _mm512_set1_epi32(load_i32(hi + off)));
        sum_lo[t] = _mm512_dpbusd_epi32(sum_lo[t], _mm512_set1_epi32(load_i32(lo + off)), u);
      }
    }
    const __m512 dw = _mm512_loadu_ps(blk + 8 * 16 * 4);
    const __m512 cw = _mm512_loadu_ps(blk + 8 * 16 * 4 + 64);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(sum_hi[t], 8), sum_lo[t]);
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[t * nb + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[t]);
      acc[t] = _mm512_fmadd_ps(cw, _mm512_set1_ps(xs[t * nb + b]), acc[t]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (t0 + t) * ldy, live, acc[t]);
}

// body(strip, its first output column, mask of its real rows) for each 16-row strip of n rows.
template <typename Body>
void each_strip(const uint8_t* packed, int64_t n, int64_t nb, float* y, Body&& body) {
  for (int64_t s = 0; s * k_q8_strip < n; ++s) {
    const int64_t rows = n - s * k_q8_strip;
    const __mmask16 live = rows >= k_q8_strip ? (__mmask16)0xFFFF : (__mmask16)((1u << rows) - 1);
    body(packed + (size_t)(s * nb) * k_q8_block_bytes, y + s * k_q8_strip, live);
  }
}

// kernel(integral_constant<int, T>, t0) over tokens in groups of Max, then one group of the rest.
template <int N, typename Kernel>
void token_tail(int64_t rest, int64_t t0, Kernel& kernel) {
  if constexpr (N > 0) {
    if (rest == N) {
      kernel(std::integral_constant<int, N>{}, t0);
    } else {
      token_tail<N - 1>(rest, t0, kernel);
    }
  }
}
template <int Max, typename Kernel>
void token_groups(int64_t n_tok, Kernel&& kernel) {
  int64_t t = 0;
  for (; t + Max <= n_tok; t += Max) kernel(std::integral_constant<int, Max>{}, t);
  token_tail<Max - 1>(n_tok - t, t, kernel);
}

}  // namespace

void gemm_q16_strips_avx512(const uint8_t* packed, int64_t n, int64_t nb, const q16_planes& xp, int64_t n_tok,
                            float* y, int64_t ldy) {
  each_strip(packed, n, nb, y, [&](const uint8_t* strip, float* ys, __mmask16 live) {
    token_groups<8>(n_tok, [&](auto tokens, int64_t t) {
      strip_tokens_q16<decltype(tokens)::value>(strip, nb, xp, t, ys, ldy, live);
    });
  });
}

void gemm_q8_strips_avx512(const uint8_t* packed, int64_t n, int64_t nb, const q8_act& xq, int64_t n_tok, float* y,
                           int64_t ldy) {
  each_strip(packed, n, nb, y, [&](const uint8_t* strip, float* ys, __mmask16 live) {
    token_groups<k_tokens>(n_tok, [&](auto tokens, int64_t t) {
      strip_tokens<decltype(tokens)::value>(strip, nb, xq, t, ys, ldy, live);
    });
  });
}

}  // namespace xctx::cpu::detail
