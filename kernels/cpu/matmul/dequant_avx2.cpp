// AVX2 dequantizers for the weight formats the prefill path unpacks most (compiled with
// -mavx2 -mfma -mf16c). They evaluate exactly the reference formulas in the same order
// (Q4_0: (q - 8) * d; Q4_1: q * d + m; Q5_0: (q - 16) * d; Q5_1: q * d + m; Q8_0: q * d), so
// the results are bit-identical to ref::dequantize_row.
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/cpu/simd/unpack_avx2.h"

namespace xctx::cpu::detail {

namespace {

// Keeps the compiler from fusing a multiply and a following add into one FMA (it does so for
// intrinsics under -ffp-contract=fast): the reference rounds the product before adding.
inline __m256 rounded(__m256 v) {
  asm("" : "+x"(v));
  return v;
}

// 32 byte codes (signed if `is_signed`) minus `bias`, times d, plus m (when has_min), stored.
template <bool is_signed, bool has_min>
inline void store_block(__m256i codes, int bias, float d, float m, float* dst) {
  const __m256 dv = _mm256_set1_ps(d);
  const __m256 mv = _mm256_set1_ps(m);
  const __m256i biasv = _mm256_set1_epi32(bias);
  for (int i = 0; i < 4; ++i) {
    const __m128i part = i < 2 ? _mm256_castsi256_si128(codes) : _mm256_extracti128_si256(codes, 1);
    const __m128i eight = (i & 1) ? _mm_srli_si128(part, 8) : part;
    __m256i q = is_signed ? _mm256_cvtepi8_epi32(eight) : _mm256_cvtepu8_epi32(eight);
    q = _mm256_sub_epi32(q, biasv);
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), dv);
    if constexpr (has_min) v = _mm256_add_ps(rounded(v), mv);
    _mm256_storeu_ps(dst + 8 * i, v);
  }
}

}  // namespace

bool dequantize_row_avx2(ggml_type type, const void* src, float* dst, int64_t n) {
  const int64_t nb = n / qk_small;
  switch (type) {
    case ggml_type::ggml_q4_0: {
      const auto* b = (const block_q4_0*)src;
      for (int64_t i = 0; i < nb; ++i) {
        store_block<false, false>(unpack_nibbles(b[i].qs), 8, _cvtsh_ss(b[i].d), 0.0f, dst + i * qk_small);
      }
      return true;
    }
    case ggml_type::ggml_q4_1: {
      const auto* b = (const block_q4_1*)src;
      for (int64_t i = 0; i < nb; ++i) {
        store_block<false, true>(unpack_nibbles(b[i].qs), 0, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].m), dst + i * qk_small);
      }
      return true;
    }
    case ggml_type::ggml_q5_0: {
      const auto* b = (const block_q5_0*)src;
      for (int64_t i = 0; i < nb; ++i) {
        const __m256i q = _mm256_or_si256(unpack_nibbles(b[i].qs), unpack_high_bits(b[i].qh));
        store_block<false, false>(q, 16, _cvtsh_ss(b[i].d), 0.0f, dst + i * qk_small);
      }
      return true;
    }
    case ggml_type::ggml_q5_1: {
      const auto* b = (const block_q5_1*)src;
      for (int64_t i = 0; i < nb; ++i) {
        const __m256i q = _mm256_or_si256(unpack_nibbles(b[i].qs), unpack_high_bits(b[i].qh));
        store_block<false, true>(q, 0, _cvtsh_ss(b[i].d), _cvtsh_ss(b[i].m), dst + i * qk_small);
      }
      return true;
    }
    case ggml_type::ggml_q8_0: {
      const auto* b = (const block_q8_0*)src;
      for (int64_t i = 0; i < nb; ++i) {
        store_block<true, false>(_mm256_loadu_si256((const __m256i*)b[i].qs), 0, _cvtsh_ss(b[i].d), 0.0f,
                                 dst + i * qk_small);
      }
      return true;
    }
    case ggml_type::ggml_f16: {
      const auto* h = (const uint16_t*)src;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + i))));
      for (; i < n; ++i) dst[i] = _cvtsh_ss(h[i]);
      return true;
    }
    case ggml_type::ggml_bf16: {
      const auto* h = (const uint16_t*)src;
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(h + i)));
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
      for (; i < n; ++i) dst[i] = bf16_to_fp32(h[i]);
      return true;
    }
    case ggml_type::ggml_f32:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k:
    case ggml_type::ggml_q8_k: return false;
  }
  return false;
}

}  // namespace xctx::cpu::detail
