// cpu::matmul, cpu::gemm_rows and cpu::get_rows: path choice (decode vs prefill), OpenMP
// threading, the row-invariant GEMM of the prefill path and the scalar fallbacks of the decode
// kernels (the AVX2 decode kernels are in matmul_avx2.cpp).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/cpu/workspace.h"

namespace xctx::cpu {

namespace detail {

namespace {

// Below this many weight bytes × tokens a matmul runs on the calling thread alone: waking the
// second thread costs more than it saves. Q4_1 192x576 (110 KiB, hot): 2.8 us on 1 thread, 3.1 us on 2.
// All 210 decode matmuls of SmolLM2-135M (cold weights, 2 threads) by threshold: 16 KiB
// 2.47-2.55 ms, 128 KiB 2.39-2.47 ms, 256 KiB 2.53-2.66 ms.
constexpr size_t k_min_parallel_bytes = 128 * 1024;

// Weights dequantized and packed per panel in prefill_split_rows: kMatmulPanelFloats (1 MiB). With
// OpenBLAS sgemm it measured (1 thread, n_tok = 512, Q4_1, GFLOP/s for 64K / 128K / 256K / 1M
// floats) 576x576 128 / 127 / 126 / 123, 576x1536 114 / 121 / 129 / 122; the own GEMM reads a
// 16-row strip at a time, so the panel only bounds the buffer and the dequantization batch.

template <typename F>
void run_rows(int64_t n_rows, size_t work_bytes, F&& body) {
  const int nth = omp_get_max_threads();
  if (nth <= 1 || work_bytes < k_min_parallel_bytes || n_rows < 32) {
    body(int64_t{0}, n_rows);
    return;
  }
#pragma omp parallel num_threads(nth)
  {
    int64_t r0 = 0, r1 = 0;
    thread_rows(n_rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    if (r0 < r1) body(r0, r1);
  }
}

}  // namespace

// Declared in matmul_impl.h (the integer prefill packing uses it too).
void block_codes(ggml_type type, const uint8_t* p, int32_t* q /*[32]*/, float* d, float* c) {
  constexpr int half = qk_small / 2;
  switch (type) {
    case ggml_type::ggml_q4_0: {
      const auto* b = (const block_q4_0*)p;
      *d = fp16_to_fp32(b->d);
      *c = -8.0f * *d;
      for (int j = 0; j < half; ++j) {
        q[j] = b->qs[j] & 0x0F;
        q[j + half] = b->qs[j] >> 4;
      }
      return;
    }
    case ggml_type::ggml_q4_1: {
      const auto* b = (const block_q4_1*)p;
      *d = fp16_to_fp32(b->d);
      *c = fp16_to_fp32(b->m);
      for (int j = 0; j < half; ++j) {
        q[j] = b->qs[j] & 0x0F;
        q[j + half] = b->qs[j] >> 4;
      }
      return;
    }
    case ggml_type::ggml_q5_0:
    case ggml_type::ggml_q5_1: {
      const uint8_t* qs;
      uint32_t qh;
      if (type == ggml_type::ggml_q5_0) {
        const auto* b = (const block_q5_0*)p;
        *d = fp16_to_fp32(b->d);
        *c = -16.0f * *d;
        qs = b->qs;
        std::memcpy(&qh, b->qh, 4);
      } else {
        const auto* b = (const block_q5_1*)p;
        *d = fp16_to_fp32(b->d);
        *c = fp16_to_fp32(b->m);
        qs = b->qs;
        std::memcpy(&qh, b->qh, 4);
      }
      for (int j = 0; j < half; ++j) {
        q[j] = (qs[j] & 0x0F) | (int32_t)(((qh >> j) & 1u) << 4);
        q[j + half] = (qs[j] >> 4) | (int32_t)(((qh >> (j + half)) & 1u) << 4);
      }
      return;
    }
    case ggml_type::ggml_q8_0: {
      const auto* b = (const block_q8_0*)p;
      *d = fp16_to_fp32(b->d);
      *c = 0.0f;
      for (int j = 0; j < qk_small; ++j) q[j] = b->qs[j];
      return;
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
  XCTX_ASSERT(false, "block_codes: not a legacy quant type: ", (uint32_t)type);
}

namespace {

float load_float(ggml_type type, const void* row, int64_t c) {
  if (type == ggml_type::ggml_f32) return ((const float*)row)[c];
  if (type == ggml_type::ggml_f16) return fp16_to_fp32(((const uint16_t*)row)[c]);
  return bf16_to_fp32(((const uint16_t*)row)[c]);
}

// Types that need the generic decode path make their reference dequantizer throw here, on
// the calling thread, rather than inside an OpenMP region (where an exception terminates).
void probe_dequantize(const weight_view& w) {
  if (is_legacy_quant(w.type) || is_float_type(w.type) || w.n_rows == 0) return;
  std::vector<float> row((size_t)w.n_cols);
  dequantize_row(w.type, w.data, row.data(), w.n_cols);
}

// ---- the row-invariant GEMM behind the prefill path and gemm_rows ---------------------------
//
// OpenBLAS cannot give row-invariant results. Measured with 0.3.21 (Debian, DYNAMIC_ARCH picks
// its Haswell kernels on this AMD EPYC), single-threaded, one row placed at each index of a
// fixed 64-row call: rows 0-5 of every 12-row group, rows 6-11 and the 4 tail rows get three
// different bit patterns (rows 6-11 sum k in two halves, 288 + 288 for K = 576); with the
// operands swapped (tokens on its packed-A side) rows 0-7 and 56-63 differ from 8-55. So a fixed
// call shape is not enough: a token's index inside its block still moves the last bits, and an
// index fixed per token would waste most of each block. The kernel below instead computes every
// element as ONE chain of fused multiply-adds over k = 0, 1, ..., k - 1 starting from 0 (plus C,
// added last, for beta = 1), in a vector lane or a scalar std::fma alike; tiling, panels and
// threads only choose which element is computed when, never how. The scalar fallback therefore
// gives the AVX2 kernel's bits too.

constexpr int k_strip = 16;      // output columns per packed strip of B: two AVX registers
constexpr int k_tile_rows = 6;   // rows per micro tile: 12 accumulators + 2 of B + 1 broadcast = 15 of 16 ymm
constexpr int64_t k_row_block = 64;  // rows of A kept in L2 while all strips of a panel pass over them

// c[i * 16 + j] = Σ_kk a[i * lda + kk] · b[kk * ldb + j], i < R, j < 16. Named accumulators, not
// arrays: GCC keeps arrays of __m256 on the stack and stores them every iteration (2x slower).
template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* a, int64_t lda, const float* b, int64_t ldb, int k,
                                                    float* c /*[R, 16]*/) {
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;
  __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  const float* a0 = a;
  const float* a1 = a + lda;
  const float* a2 = a + 2 * lda;
  const float* a3 = a + 3 * lda;
  const float* a4 = a + 4 * lda;
  const float* a5 = a + 5 * lda;
  for (int kk = 0; kk < k; ++kk, b += ldb) {
    const __m256 b0 = _mm256_loadu_ps(b);
    const __m256 b1 = _mm256_loadu_ps(b + 8);
    __m256 av = _mm256_broadcast_ss(a0 + kk);
    l0 = _mm256_fmadd_ps(av, b0, l0);
    h0 = _mm256_fmadd_ps(av, b1, h0);
    if constexpr (R > 1) {
      av = _mm256_broadcast_ss(a1 + kk);
      l1 = _mm256_fmadd_ps(av, b0, l1);
      h1 = _mm256_fmadd_ps(av, b1, h1);
    }
    if constexpr (R > 2) {
      av = _mm256_broadcast_ss(a2 + kk);
      l2 = _mm256_fmadd_ps(av, b0, l2);
      h2 = _mm256_fmadd_ps(av, b1, h2);
    }
    if constexpr (R > 3) {
      av = _mm256_broadcast_ss(a3 + kk);
      l3 = _mm256_fmadd_ps(av, b0, l3);
      h3 = _mm256_fmadd_ps(av, b1, h3);
    }
    if constexpr (R > 4) {
      av = _mm256_broadcast_ss(a4 + kk);
      l4 = _mm256_fmadd_ps(av, b0, l4);
      h4 = _mm256_fmadd_ps(av, b1, h4);
    }
    if constexpr (R > 5) {
      av = _mm256_broadcast_ss(a5 + kk);
      l5 = _mm256_fmadd_ps(av, b0, l5);
      h5 = _mm256_fmadd_ps(av, b1, h5);
    }
  }
  const __m256 lo[6] = {l0, l1, l2, l3, l4, l5}, hi[6] = {h0, h1, h2, h3, h4, h5};
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(c + i * k_strip, lo[i]);
    _mm256_storeu_ps(c + i * k_strip + 8, hi[i]);
  }
}

void tile_scalar(int rows, const float* a, int64_t lda, const float* b, int64_t ldb, int k, float* c /*[rows, 16]*/) {
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < k_strip; ++j) {
      float acc = 0.0f;
      for (int kk = 0; kk < k; ++kk) acc = std::fma(a[i * lda + kk], b[kk * ldb + j], acc);
      c[i * k_strip + j] = acc;
    }
  }
}

void run_tile(bool simd, int rows, const float* a, int64_t lda, const float* b, int64_t ldb, int k, float* c) {
  if (!simd) {
    tile_scalar(rows, a, lda, b, ldb, k, c);
    return;
  }
  switch (rows) {
    case 1: tile_avx2<1>(a, lda, b, ldb, k, c); return;
    case 2: tile_avx2<2>(a, lda, b, ldb, k, c); return;
    case 3: tile_avx2<3>(a, lda, b, ldb, k, c); return;
    case 4: tile_avx2<4>(a, lda, b, ldb, k, c); return;
    case 5: tile_avx2<5>(a, lda, b, ldb, k, c); return;
    case 6: tile_avx2<6>(a, lda, b, ldb, k, c); return;
  }
  XCTX_ASSERT(false, "run_tile: bad row count ", rows);
}

// One strip of B: `b` [k, ldb], its first min(16, columns left) columns are real.
struct strip_ref {
  const float* b;
  int64_t ldb;
};

// c[t, 16 s + j] (+)= row t of A times column j of strip s, for t < n and the real columns of
// strips [0, n_strips); strip(s) returns strip s, `n_cols` counts the real columns.
template <typename StripFn>
void rows_times_strips(bool simd, const float* a /*[n, lda]*/, int64_t n, int64_t lda, int k, int64_t n_strips,
                       StripFn&& strip, int64_t n_cols, bool add, float* c /*[n, ldc]*/, int64_t ldc) {
  alignas(32) float tile[k_tile_rows * k_strip];
  for (int64_t t0 = 0; t0 < n; t0 += k_row_block) {
    const int64_t t1 = std::min(n, t0 + k_row_block);
    for (int64_t s = 0; s < n_strips; ++s) {
      const strip_ref sr = strip(s);
      const int64_t j0 = s * k_strip;
      const int64_t nv = std::min<int64_t>(k_strip, n_cols - j0);
      for (int64_t i = t0; i < t1; i += k_tile_rows) {
        const int rows = (int)std::min<int64_t>(k_tile_rows, t1 - i);
        run_tile(simd, rows, a + i * lda, lda, sr.b, sr.ldb, k, tile);
        for (int r = 0; r < rows; ++r) {
          float* dst = c + (i + r) * ldc + j0;
          const float* src = tile + r * k_strip;
          if (add) {
            for (int64_t j = 0; j < nv; ++j) dst[j] += src[j];
          } else {
            std::memcpy(dst, src, (size_t)nv * sizeof(float));
          }
        }
      }
    }
  }
}

// Rows [r0, r0 + n) of W as strips [ceil(n / 16), n_cols, 16] (zero past row r0 + n).
void pack_weight_strips(const weight_view& w, int64_t r0, int64_t n, float* dst, std::vector<float>& row) {
  const int64_t n_cols = w.n_cols;
  const size_t row_bytes = w.row_bytes();
  const int64_t n_strips = (n + k_strip - 1) / k_strip;
  row.resize((size_t)n_cols);
  for (int64_t s = 0; s < n_strips; ++s) {
    float* sd = dst + s * n_cols * k_strip;
    for (int j = 0; j < k_strip; ++j) {
      const int64_t r = s * k_strip + j;
      if (r >= n) {
        for (int64_t kk = 0; kk < n_cols; ++kk) sd[kk * k_strip + j] = 0.0f;
        continue;
      }
      const void* src = (const uint8_t*)w.data + (size_t)(r0 + r) * row_bytes;
      const float* v = (const float*)src;
      if (w.type != ggml_type::ggml_f32) {
        dequantize_row(w.type, src, row.data(), n_cols);
        v = row.data();
      }
      for (int64_t kk = 0; kk < n_cols; ++kk) sd[kk * k_strip + j] = v[kk];
    }
  }
}

// y[:, r0 : r0 + n] for weight rows already packed by pack_weight_strips.
void prefill_panel(bool simd, const weight_view& w, const float* packed, int64_t r0, int64_t n, const float* x,
                   int64_t n_tok, float* y) {
  const int64_t n_cols = w.n_cols;
  rows_times_strips(
      simd, x, n_tok, n_cols, (int)n_cols, (n + k_strip - 1) / k_strip,
      [&](int64_t s) { return strip_ref{packed + s * n_cols * k_strip, k_strip}; }, n, false, y + r0, w.n_rows);
}

}  // namespace

bool is_legacy_quant(ggml_type type) {
  return type == ggml_type::ggml_q4_0 || type == ggml_type::ggml_q4_1 || type == ggml_type::ggml_q5_0 ||
         type == ggml_type::ggml_q5_1 || type == ggml_type::ggml_q8_0;
}

bool is_float_type(ggml_type type) {
  return type == ggml_type::ggml_f32 || type == ggml_type::ggml_f16 || type == ggml_type::ggml_bf16;
}

void thread_rows(int64_t n_rows, int ith, int nth, int64_t* r0, int64_t* r1) {
  constexpr int64_t align = 16;  // 16 floats = one 64-byte line of y
  const int64_t per = ((n_rows + nth - 1) / nth + align - 1) / align * align;
  *r0 = std::min(n_rows, per * ith);
  *r1 = std::min(n_rows, *r0 + per);
}

namespace {

template <typename Code>
void quantize_act_scalar_t(const float* x, int64_t n, Code* qs, float* d, float* s) {
  for (int64_t b = 0; b < n / qk_small; ++b) {
    const float* xb = x + b * qk_small;
    float amax = 0.0f;
    for (int j = 0; j < qk_small; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float db = amax / (float)int_act<Code>::levels;
    const float id = db != 0.0f ? 1.0f / db : 0.0f;
    int sum = 0;
    for (int j = 0; j < qk_small; ++j) {
      const int q = (int)std::nearbyint(xb[j] * id);  // round-half-even, as _mm256_round_ps
      qs[b * qk_small + j] = (Code)q;
      sum += q;
    }
    d[b] = db;
    s[b] = db * (float)sum;
  }
}

template <typename Code>
void dot_rows_q_scalar_t(const weight_view& w, int64_t r0, int64_t r1, const int_act<Code>& xq, int64_t n_tok,
                         float* y, int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  const size_t block_bytes = (size_t)ggml_traits(w.type).block_bytes;
  const int64_t nb = xq.n_blocks;
  std::vector<float> acc((size_t)n_tok), off((size_t)n_tok);  // [n_tok]
  int32_t q[qk_small];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(off.begin(), off.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      float d, c;
      block_codes(w.type, row + (size_t)b * block_bytes, q, &d, &c);
      for (int64_t t = 0; t < n_tok; ++t) {
        const Code* xb = xq.qs + (t * nb + b) * qk_small;
        int32_t isum = 0;
        for (int j = 0; j < qk_small; ++j) isum += q[j] * xb[j];
        acc[(size_t)t] += d * xq.d[t * nb + b] * (float)isum;
        off[(size_t)t] += c * xq.s[t * nb + b];
      }
    }
    for (int64_t t = 0; t < n_tok; ++t) y[t * ldy + r] = acc[(size_t)t] + off[(size_t)t];
  }
}

}  // namespace

void quantize_act_scalar(const float* x, int64_t n, int8_t* qs, float* d, float* s) {
  quantize_act_scalar_t(x, n, qs, d, s);
}
void quantize_act_scalar(const float* x, int64_t n, int16_t* qs, float* d, float* s) {
  quantize_act_scalar_t(x, n, qs, d, s);
}

void dot_rows_q_scalar(const weight_view& w, int64_t r0, int64_t r1, const q8_act& xq, int64_t n_tok, float* y,
                       int64_t ldy) {
  dot_rows_q_scalar_t(w, r0, r1, xq, n_tok, y, ldy);
}
void dot_rows_q_scalar(const weight_view& w, int64_t r0, int64_t r1, const q16_act& xq, int64_t n_tok, float* y,
                       int64_t ldy) {
  dot_rows_q_scalar_t(w, r0, r1, xq, n_tok, y, ldy);
}

void dot_rows_qf_scalar(const weight_view& w, int64_t r0, int64_t r1, const float* x, int64_t n_tok, float* y,
                        int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  const size_t block_bytes = (size_t)ggml_traits(w.type).block_bytes;
  const int64_t nb = w.n_cols / qk_small;
  std::vector<float> acc((size_t)n_tok);  // [n_tok]
  int32_t q[qk_small];
  float wb[qk_small];
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      float d, c;
      block_codes(w.type, row + (size_t)b * block_bytes, q, &d, &c);
      // The reference dequantizer's values: exact for Q4_0/Q5_0/Q8_0 (d·(q - 8) = d·q - 8d), one
      // rounding of d·q + m for Q4_1/Q5_1.
      for (int j = 0; j < qk_small; ++j) wb[j] = d * (float)q[j] + c;
      for (int64_t t = 0; t < n_tok; ++t) {
        const float* xb = x + t * w.n_cols + b * qk_small;
        float s = 0.0f;
        for (int j = 0; j < qk_small; ++j) s += wb[j] * xb[j];
        acc[(size_t)t] += s;
      }
    }
    for (int64_t t = 0; t < n_tok; ++t) y[t * ldy + r] = acc[(size_t)t];
  }
}

void dot_rows_f_scalar(const weight_view& w, int64_t r0, int64_t r1, const float* x, int64_t n_tok, float* y,
                       int64_t ldy) {
  const size_t row_bytes = w.row_bytes();
  for (int64_t r = r0; r < r1; ++r) {
    const void* row = (const uint8_t*)w.data + (size_t)r * row_bytes;
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* xt = x + t * w.n_cols;
      float acc = 0.0f;
      for (int64_t c = 0; c < w.n_cols; ++c) acc += load_float(w.type, row, c) * xt[c];
      y[t * ldy + r] = acc;
    }
  }
}

namespace {

// The integer decode path: each token's activations quantized to Code blocks once, then every
// thread's rows dotted against them. n_w products of the same x (q, k and v; gate and
// up) share the quantization and one parallel region over their concatenated rows; each row's
// kernel call is the one a single product would make, so the bits do not depend on the sharing.
template <typename Code>
void matmul_decode_int(const weight_view* w, float* const* y, int n_w, const float* x, int64_t n_tok, bool simd) {
  const int64_t n_cols = w[0].n_cols, nb = n_cols / qk_small;
  thread_local std::vector<Code> qs;     // [n_tok, n_cols]
  thread_local std::vector<float> d, s;  // [n_tok, nb]
  qs.resize((size_t)(n_tok * n_cols));
  d.resize((size_t)(n_tok * nb));
  s.resize((size_t)(n_tok * nb));
  for (int64_t t = 0; t < n_tok; ++t) {
    if (simd) {
      quantize_act_avx2(x + t * n_cols, n_cols, qs.data() + t * n_cols, d.data() + t * nb, s.data() + t * nb);
    } else {
      quantize_act_scalar(x + t * n_cols, n_cols, qs.data() + t * n_cols, d.data() + t * nb, s.data() + t * nb);
    }
  }
  // Built here: inside the region the thread_locals would name each thread's own (empty) vectors.
  const int_act<Code> xq{qs.data(), d.data(), s.data(), nb};
  const bool vnni512 = simd && has_avx512(), vnni256 = simd && !vnni512 && has_avx_vnni();
  int64_t n_rows = 0;
  size_t bytes = 0;
  for (int i = 0; i < n_w; ++i) {
    XCTX_ASSERT(is_legacy_quant(w[i].type) && w[i].n_cols == n_cols, "matmul_decode_int: weight ", i, " type ",
                (uint32_t)w[i].type, ", ", w[i].n_cols, " columns");
    n_rows += w[i].n_rows;
    bytes += w[i].bytes();
  }
  auto rows_of = [&](const weight_view& wi, float* yi, int64_t r0, int64_t r1) {
    // The VNNI kernels decline only if their scratch cannot be allocated (AVX-512): AVX2 then.
    if (vnni512 && dot_rows_q_avx512(wi, r0, r1, xq, n_tok, yi, wi.n_rows)) return;
    if (vnni256 && dot_rows_q_avxvnni(wi, r0, r1, xq, n_tok, yi, wi.n_rows)) return;
    if (simd) {
      dot_rows_q_avx2(wi, r0, r1, xq, n_tok, yi, wi.n_rows);
    } else {
      dot_rows_q_scalar(wi, r0, r1, xq, n_tok, yi, wi.n_rows);
    }
  };
  run_rows(n_rows, bytes * (size_t)n_tok, [&](int64_t r0, int64_t r1) {
    int64_t base = 0;  // first concatenated row of w[i]
    for (int i = 0; i < n_w; base += w[i].n_rows, ++i) {
      const int64_t a = std::max(r0, base) - base, b = std::min(r1, base + w[i].n_rows) - base;
      if (a < b) rows_of(w[i], y[i], a, b);
    }
  });
}

}  // namespace

void matmul_decode(const weight_view& w, const float* x, int64_t n_tok, float* y, decode_activations act) {
  const bool simd = has_avx2();
  const int64_t n_rows = w.n_rows, n_cols = w.n_cols;
  const int64_t nb = n_cols / qk_small;
  if (is_legacy_quant(w.type) && act == decode_activations::act_f32) {
    thread_local std::vector<float> x_sum;  // [n_tok, nb]
    if (simd) {
      x_sum.resize((size_t)(n_tok * nb));
      for (int64_t i = 0; i < n_tok * nb; ++i) {
        const float* xb = x + i * qk_small;
        float s = 0.0f;
        for (int j = 0; j < qk_small; ++j) s += xb[j];
        x_sum[(size_t)i] = s;
      }
    }
    const float* xs = x_sum.data();  // inside the region `x_sum` names each thread's own
    run_rows(n_rows, w.bytes() * (size_t)n_tok, [&](int64_t r0, int64_t r1) {
      if (simd) {
        dot_rows_qf_avx2(w, r0, r1, x, xs, n_tok, y, n_rows);
      } else {
        dot_rows_qf_scalar(w, r0, r1, x, n_tok, y, n_rows);
      }
    });
  } else if (is_legacy_quant(w.type) && act == decode_activations::act_q16) {
    matmul_decode_int<int16_t>(&w, &y, 1, x, n_tok, simd);
  } else if (is_legacy_quant(w.type)) {
    matmul_decode_int<int8_t>(&w, &y, 1, x, n_tok, simd);
  } else if (is_float_type(w.type)) {
    run_rows(n_rows, w.bytes() * (size_t)n_tok, [&](int64_t r0, int64_t r1) {
      (simd ? dot_rows_f_avx2 : dot_rows_f_scalar)(w, r0, r1, x, n_tok, y, n_rows);
    });
  } else {
    // K-quants: dequantize a row at a time and take the f32 dot.
    probe_dequantize(w);
    const size_t row_bytes = w.row_bytes();
    run_rows(n_rows, w.bytes() * (size_t)n_tok, [&](int64_t r0, int64_t r1) {
      thread_local std::vector<float> row;  // [n_cols]
      row.resize((size_t)n_cols);
      const weight_view one{ggml_type::ggml_f32, 1, n_cols, row.data()};
      for (int64_t r = r0; r < r1; ++r) {
        dequantize_row(w.type, (const uint8_t*)w.data + (size_t)r * row_bytes, row.data(), n_cols);
        (simd ? dot_rows_f_avx2 : dot_rows_f_scalar)(one, 0, 1, x, n_tok, y + r, n_rows);
      }
    });
  }
}

void matmul_prefill(const weight_view& w, const float* x, int64_t n_tok, float* y, prefill_mode mode) {
  probe_dequantize(w);
  const bool simd = has_avx2();
  const int64_t n_rows = w.n_rows, n_cols = w.n_cols;
  switch (mode) {
    case prefill_mode::prefill_split_rows: {
      // Thread row ranges and panels are multiples of 16 rows, so strips never straddle them.
      const int64_t panel = std::max<int64_t>(k_strip, kMatmulPanelFloats / n_cols / k_strip * k_strip);
      run_rows(n_rows, w.bytes() * (size_t)n_tok, [&](int64_t r0, int64_t r1) {
        thread_local std::vector<float> buf, row;  // [panel / 16, n_cols, 16], [n_cols]
        buf.resize((size_t)(panel * n_cols));
        for (int64_t p = r0; p < r1; p += panel) {
          const int64_t n = std::min(panel, r1 - p);
          pack_weight_strips(w, p, n, buf.data(), row);
          prefill_panel(simd, w, buf.data(), p, n, x, n_tok, y);
        }
      });
      return;
    }
    case prefill_mode::prefill_whole_matrix: {
      const int64_t n_strips = (n_rows + k_strip - 1) / k_strip;
      thread_local std::vector<float> buf;  // [n_strips, n_cols, 16]
      buf.resize((size_t)(n_strips * n_cols * k_strip));
      float* all = buf.data();  // the caller's buffer: inside the regions `buf` names each thread's own
#pragma omp parallel for schedule(static)
      for (int64_t s = 0; s < n_strips; ++s) {
        thread_local std::vector<float> row;  // [n_cols]
        const int64_t r0 = s * k_strip;
        pack_weight_strips(w, r0, std::min<int64_t>(k_strip, n_rows - r0), all + s * n_cols * k_strip, row);
      }
      run_rows(n_rows, w.bytes() * (size_t)n_tok, [&](int64_t r0, int64_t r1) {
        prefill_panel(simd, w, all + r0 * n_cols, r0, r1 - r0, x, n_tok, y);
      });
      return;
    }
  }
}

int64_t prefill_min_tokens(ggml_type type, decode_activations act) {
  // Where the dequantize + sgemm path overtakes the fused decode path, single thread (both
  // paths split rows the same way over threads), microseconds decode / prefill.
  // act_q8 (integer dots):
  //   Q4_1 1536x576: n_tok 16: 289 / 392, 24: 421 / 471, 32: 562 / 596, 40: 711 / 711,
  //                  64: 1129 / 1021, 96: 1726 / 1475
  //   Q8_0 1536x576: n_tok 24: 368 / 471, 40: 625 / 713, 64: 971 / 999
  //        49152x576 (output): n_tok 32: 33.4 / 38.3 ms, 64: 49.0 / 51.7 ms, 96: 78.1 / 72.0 ms
  // act_f32 (codes widened to float; ~4 conversions + 4 FMAs per block and token, so it loses
  // to sgemm much earlier; busy machine, chrt -f 50, bench_matmul BM_crossover):
  //   Q4_1 1536x576: n_tok 8: 230 / 457, 12: 358 / 378, 16: 664 / 442, 32: 988 / 672,
  //                  64: 2271 / 1129
  //   Q8_0 49152x576: n_tok 8: 5.5 / 10.1 ms, 12: 9.2 / 12.7 ms, 16: 15.1 / 20.8 ms,
  //                   24: 28.3 / 18.7 ms, 32: 41.3 / 21.4 ms
  // Q4_0/Q5_0/Q5_1 were not measured separately; they share Q4_1's per-block work up to the
  // fifth-bit unpacking, so they take its crossovers.
  //   F32  1536x576: n_tok 4: 107 / 185, 8: 209 / 238, 16: 461 / 323
  //   F16  1536x576: n_tok 8: 194 / 287, 16: 403 / 384
  // K-quants dequantize each row once in either path, so they cross over like F32.
  // act_q16 (codes widened to int16 once per block; AMD EPYC, AVX2, bench_matmul BM_crossover):
  //   Q4_1 1536x576: n_tok 16: 1366 / 2167, 24: 1959 / 2414, 32: 2681 / 2731, 40: 3380 / 3093
  //   Q8_0 49152x576: n_tok 24: 59.3 / 79.1 ms, 32: 80.3 / 88.8 ms, 40: 100.8 / 101.9 ms,
  //                   64: 161.4 / 137.2 ms
  // Every threshold stays <= 64, the shortest batch prefill hands the matmuls (batch_bounds).
  const bool f32 = act == decode_activations::act_f32;
  const bool q16 = act == decode_activations::act_q16;
  switch (type) {
    case ggml_type::ggml_q4_0:
    case ggml_type::ggml_q4_1:
    case ggml_type::ggml_q5_0:
    case ggml_type::ggml_q5_1: return f32 ? 12 : q16 ? 32 : 40;
    case ggml_type::ggml_q8_0: return f32 ? 20 : q16 ? 40 : 64;
    case ggml_type::ggml_f16:
    case ggml_type::ggml_bf16: return 16;
    case ggml_type::ggml_f32:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k:
    case ggml_type::ggml_q8_k: return 8;
  }
  return 8;
}

}  // namespace detail

// Decode path below prefill_min_tokens (crossover table there), prefill path above. Measured
// on this 2-core machine, SmolLM2-135M shapes, hot cache, 1 / 2 threads (bench_matmul):
//   n_tok = 1, act_q8 (first run; a later, busier run in brackets):
//                Q4_1 576x576 8.6 / 5.7 us [10.6 / 7.6], 192x576 3.0 us [3.3], 1536x576 22.5 /
//                12.9 us [25.0 / 16.3], 576x1536 21.5 / 12.6 us [23.7 / 14.4],
//                Q8_0 49152x576 762 / 349 us [1198 / 428] (39 / 86 GB/s of weights)
//   n_tok = 1, act_f32 (the busier run): Q4_1 576x576 16.8 / 10.3 us, 192x576 5.3 us,
//                1536x576 50.2 / 24.6 us, 576x1536 43.1 / 23.7 us, Q8_0 49152x576 1500 / 733 us
//                (the per-block float conversions make it compute bound: ~1.6-2x act_q8 hot;
//                one token's matmuls from these: ~3.9 ms act_f32 vs ~2.5 ms act_q8, 2 threads)
//   n_tok = 512: Q4_1 576x576 2.80 / 1.56 ms, 1536x576 7.56 / 3.94 ms, 576x1536 7.79 / 4.11 ms
// All decode matmuls of one token (96 MB of weights, cold): 3.9 ms / 2.4 ms.
// Later, on an AVX2-only AMD EPYC (2026-11-26), n_tok = 1, 1 thread, f32 / q16 / q8:
//   Q4_1 576x576 70.7 / 43.3 / 42.3 us, 1536x576 181 / 119 / 112 us, 576x1536 165 / 109 / 105 us,
//   Q8_0 49152x576 5793 / 4541 / 4502 us.
namespace {
void check_matmul_args(const weight_view& w, int64_t n_tok) {
  const ggml_type_traits tr = ggml_traits(w.type);
  XCTX_CHECK(tr.name != nullptr, "cpu::matmul: unsupported weight type id ", (uint32_t)w.type);
  XCTX_CHECK(w.n_rows >= 0 && w.n_cols > 0, "cpu::matmul: bad ", tr.name, " weight shape ", w.n_rows, "x", w.n_cols);
  XCTX_CHECK(w.n_cols % tr.block_elems == 0, "cpu::matmul: ", tr.name, " row length ", w.n_cols,
             " is not a multiple of the block size ", tr.block_elems);
  XCTX_CHECK(n_tok >= 0, "cpu::matmul: negative n_tok ", n_tok);
}
}  // namespace

void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y, const matmul_settings& s) {
  check_matmul_args(w, n_tok);
  if (n_tok == 0 || w.n_rows == 0) return;
  const decode_activations act = s.decode;
  if (n_tok >= detail::prefill_min_tokens(w.type, act)) {
    if (const prefill_activations pre = s.prefill; detail::prefill_int_applies(w.type, pre)) {
      detail::matmul_prefill_int(w, x, n_tok, y, pre, true);
    } else {
      detail::matmul_prefill(w, x, n_tok, y);
    }
  } else {
    detail::matmul_decode(w, x, n_tok, y, act);
  }
}

void matmul_n(const weight_view* w, int n_w, const float* x, int64_t n_tok, float* const* y,
              const matmul_settings& s) {
  XCTX_CHECK(n_w >= 0, "cpu::matmul_n: ", n_w, " weights");
  const decode_activations act = s.decode;
  bool shared = act != decode_activations::act_f32 && n_tok > 0 && n_w > 1;
  for (int i = 0; shared && i < n_w; ++i) {
    shared = w[i].n_rows > 0 && w[i].n_cols == w[0].n_cols && detail::is_legacy_quant(w[i].type) &&
             n_tok < detail::prefill_min_tokens(w[i].type, act);
  }
  if (!shared) {
    for (int i = 0; i < n_w; ++i) matmul(w[i], x, n_tok, y[i], s);
    return;
  }
  for (int i = 0; i < n_w; ++i) check_matmul_args(w[i], n_tok);
  if (act == decode_activations::act_q16) {
    detail::matmul_decode_int<int16_t>(w, y, n_w, x, n_tok, has_avx2());
  } else {
    detail::matmul_decode_int<int8_t>(w, y, n_w, x, n_tok, has_avx2());
  }
}

void matmul2(const weight_view& a, const weight_view& b, const float* x, int64_t n_tok, float* ya, float* yb,
             const matmul_settings& s) {
  const weight_view w[2] = {a, b};
  float* const y[2] = {ya, yb};
  matmul_n(w, 2, x, n_tok, y, s);
}

void gemm_rows(const float* a, int64_t n, int k, const float* b, bool b_transposed, int n_out, float beta, float* c,
               int64_t ldc) {
  XCTX_CHECK(beta == 0.0f || beta == 1.0f, "cpu::gemm_rows: beta must be 0 or 1, not ", beta);
  XCTX_CHECK(n >= 0 && k >= 0 && n_out >= 0 && ldc >= n_out, "cpu::gemm_rows: bad shape n ", n, " k ", k,
             " n_out ", n_out, " ldc ", ldc);
  if (n == 0 || n_out == 0) return;
  using namespace detail;
  const bool simd = has_avx2();
  const int64_t n_strips = (n_out + k_strip - 1) / k_strip;
  const int64_t n_full = n_out / k_strip;
  // Bᵀ is packed into strips; plain B is read in place except for a partial last strip.
  thread_local std::vector<float> pack;  // [strips packed, k, 16]
  const int64_t first_packed = b_transposed ? 0 : n_full;
  pack.resize((size_t)((n_strips - first_packed) * k * k_strip));
  for (int64_t s = first_packed; s < n_strips; ++s) {
    float* sd = pack.data() + (s - first_packed) * k * k_strip;
    for (int j = 0; j < k_strip; ++j) {
      const int64_t col = s * k_strip + j;
      for (int kk = 0; kk < k; ++kk) {
        float v = 0.0f;
        if (col < n_out) v = b_transposed ? b[col * k + kk] : b[(int64_t)kk * n_out + col];
        sd[kk * k_strip + j] = v;
      }
    }
  }
  const float* packed = pack.data();
  rows_times_strips(
      simd, a, n, k, k, n_strips,
      [&](int64_t s) {
        if (s < first_packed) return strip_ref{b + s * k_strip, n_out};
        return strip_ref{packed + (s - first_packed) * k * k_strip, k_strip};
      },
      n_out, beta != 0.0f, c, ldc);
}

void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out) {
  const ggml_type_traits tr = ggml_traits(w.type);
  XCTX_CHECK(tr.name != nullptr, "cpu::get_rows: unsupported weight type id ", (uint32_t)w.type);
  for (int64_t i = 0; i < n; ++i) {
    XCTX_CHECK(ids[i] >= 0 && ids[i] < w.n_rows, "cpu::get_rows: row id ", ids[i], " at position ", i,
               " is outside [0, ", w.n_rows, ")");
  }
  if (n == 0) return;
  detail::probe_dequantize(w);
  const size_t row_bytes = w.row_bytes();
#pragma omp parallel for schedule(static) if (n >= 64)
  for (int64_t i = 0; i < n; ++i) {
    dequantize_row(w.type, (const uint8_t*)w.data + (size_t)ids[i] * row_bytes, out + i * w.n_cols, w.n_cols);
  }
}

}  // namespace xctx::cpu
