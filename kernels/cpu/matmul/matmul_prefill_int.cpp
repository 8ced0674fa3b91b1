// The integer prefill GEMMs (prefill_activations::pre_q8 / pre_q16): activations rounded to 8- or
// 16-bit blocks once per call (16-bit ones also split into byte planes), weight rows packed per
// thread panel into strips (matmul_impl.h), then the AMX kernels (matmul_prefill_int_amx.cpp),
// the AVX-512 VNNI ones (matmul_prefill_int_avx512.cpp) or their scalar reference here. The
// setting itself (XCTX_PREFILL_ACT) lives here too.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"

namespace xctx::cpu {

namespace detail {

namespace {

// Byte offset of row i, column j in a packed block's codes.
int code_at(q8_layout layout, int i, int j) {
  return layout == q8_layout::amx ? i * qk_small + j : ((j / 4) * k_q8_strip + i) * 4 + j % 4;
}

}  // namespace

void pack_q8_strips(const weight_view& w, int64_t r0, int64_t n, uint8_t* dst, q8_layout layout) {
  XCTX_ASSERT(is_legacy_quant(w.type), "pack_q8_strips: not a legacy quant: ", (uint32_t)w.type);
  const int64_t nb = w.n_cols / qk_small;
  const size_t row_bytes = w.row_bytes(), block_bytes = row_bytes / (size_t)nb;
  const int64_t n_strips = (n + k_q8_strip - 1) / k_q8_strip;
  const bool signed_codes = w.type == ggml_type::ggml_q8_0;
  int32_t q[qk_small];
  for (int64_t s = 0; s < n_strips; ++s) {
    uint8_t* sd = dst + (size_t)(s * nb) * k_q8_block_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* codes = sd + (size_t)b * k_q8_block_bytes;
      float* dw = (float*)(codes + 8 * 16 * 4);
      float* cw = dw + k_q8_strip;
      for (int i = 0; i < k_q8_strip; ++i) {
        const int64_t r = s * k_q8_strip + i;
        if (r >= n) {
          for (int j = 0; j < qk_small; ++j) codes[code_at(layout, i, j)] = 0;
          dw[i] = cw[i] = 0.0f;
          continue;
        }
        float d, c;
        block_codes(w.type, (const uint8_t*)w.data + (size_t)(r0 + r) * row_bytes + (size_t)b * block_bytes, q, &d,
                    &c);
        if (signed_codes) {  // u = q + 128 in [0, 255]: w = d q = d u - 128 d
          for (int j = 0; j < qk_small; ++j) q[j] += 128;
          c = -128.0f * d;
        }
        for (int j = 0; j < qk_small; ++j) codes[code_at(layout, i, j)] = (uint8_t)q[j];
        dw[i] = d;
        cw[i] = c;
      }
    }
  }
}

namespace {

template <typename Code>
void gemm_strips_scalar(const uint8_t* packed, int64_t n, int64_t nb, const int_act<Code>& xq, int64_t n_tok, float* y,
                        int64_t ldy) {
  const int64_t n_cols = nb * qk_small;
  for (int64_t s = 0; s * k_q8_strip < n; ++s) {
    const uint8_t* strip = packed + (size_t)(s * nb) * k_q8_block_bytes;
    const int rows = (int)std::min<int64_t>(k_q8_strip, n - s * k_q8_strip);
    for (int64_t t = 0; t < n_tok; ++t) {
      const Code* x = xq.qs + t * n_cols;
      for (int i = 0; i < rows; ++i) {
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* codes = strip + (size_t)b * k_q8_block_bytes;
          const float* dw = (const float*)(codes + 8 * 16 * 4);
          int32_t sum = 0;  // exact: |Σ| <= 32 * 255 * 32767 < 2^31
          for (int j = 0; j < qk_small; ++j) sum += (int32_t)codes[code_at(q8_layout::vnni, i, j)] * x[b * qk_small + j];
          acc = std::fma((float)sum, dw[i] * xq.d[t * nb + b], acc);
          acc = std::fma(dw[k_q8_strip + i], xq.s[t * nb + b], acc);
        }
        y[t * ldy + s * k_q8_strip + i] = acc;
      }
    }
  }
}

}  // namespace

void gemm_q8_strips_scalar(const uint8_t* packed, int64_t n, int64_t nb, const q8_act& xq, int64_t n_tok, float* y,
                           int64_t ldy) {
  gemm_strips_scalar(packed, n, nb, xq, n_tok, y, ldy);
}

void gemm_q8_strips_scalar(const uint8_t* packed, int64_t n, int64_t nb, const q16_act& xq, int64_t n_tok, float* y,
                           int64_t ldy) {
  gemm_strips_scalar(packed, n, nb, xq, n_tok, y, ldy);
}

q16_planes split_q16_planes(const q16_act& xq, int64_t n_tok, std::vector<int8_t>& storage) {
  const size_t n = (size_t)(n_tok * xq.n_blocks * qk_small);
  storage.resize(2 * n);
  int8_t* hi = storage.data();
  auto* lo = (uint8_t*)(storage.data() + n);
  for (size_t i = 0; i < n; ++i) {
    hi[i] = (int8_t)(xq.qs[i] >> 8);  // arithmetic: x = 256 hi + lo, lo in [0, 255]
    lo[i] = (uint8_t)(xq.qs[i] & 0xFF);
  }
  return {hi, lo, xq.d, xq.s, xq.n_blocks};
}

q8_tiles make_q8_tiles(const q8_act& xq, int64_t n_tok, q8_tiles_storage& st) {
  return make_byte_tiles(xq.qs, xq.d, xq.s, xq.n_blocks, n_tok, st);
}

q8_tiles make_byte_tiles(const void* plane, const float* d, const float* s, int64_t nb, int64_t n_tok,
                         q8_tiles_storage& st) {
  const int64_t n_cols = nb * qk_small, ntp = (n_tok + 15) / 16 * 16;
  const auto* bytes = (const int8_t*)plane;
  st.b.assign((size_t)(ntp * n_cols), 0);
  st.d.assign((size_t)(nb * ntp), 0.0f);
  st.s.assign((size_t)(nb * ntp), 0.0f);
  for (int64_t t = 0; t < n_tok; ++t) {
    const int64_t g = t / 16, lane = t % 16;
    for (int64_t b = 0; b < nb; ++b) {
      int8_t* tile = st.b.data() + (size_t)((g * nb + b) * 512);
      for (int kk = 0; kk < 8; ++kk) std::memcpy(tile + kk * 64 + lane * 4, bytes + t * n_cols + b * qk_small + kk * 4, 4);
      st.d[(size_t)(b * ntp + t)] = d[t * nb + b];
      st.s[(size_t)(b * ntp + t)] = s[t * nb + b];
    }
  }
  return {st.b.data(), st.d.data(), st.s.data(), ntp};
}

namespace {

// Packed strips per thread panel: 96 strips (1,536 rows) of SmolLM2's 18 blocks are 1.1 MB,
// about the L2 share of one core on the hosts measured; the panel is re-read by every token.
constexpr int64_t k_q8_panel_rows = 96 * k_q8_strip;

}  // namespace

namespace {

// The activations of one call: quantized, and for the 16-bit codes also split into byte planes;
// for AMX also laid out as B tiles.
template <typename Code>
struct call_acts {
  int_act<Code> xq;
  q16_planes planes;         // Code = int16_t only
  q8_tiles tiles, tiles_lo;  // AMX only (tiles_lo: q16's low plane)
};

template <typename Code>
void matmul_prefill_codes(const weight_view& w, const float* x, int64_t n_tok, float* y, bool simd) {
  constexpr bool q16 = sizeof(Code) == 2;
  const int64_t n_cols = w.n_cols, nb = n_cols / qk_small, n_rows = w.n_rows;
  thread_local std::vector<Code> qs;     // [n_tok, n_cols]
  thread_local std::vector<float> d, s;  // [n_tok, nb]
  qs.resize((size_t)(n_tok * n_cols));
  d.resize((size_t)(n_tok * nb));
  s.resize((size_t)(n_tok * nb));
  Code* qp = qs.data();
  float* dp = d.data();
  float* sp = s.data();
  const bool avx2 = has_avx2();
#pragma omp parallel for schedule(static) if (n_tok * n_cols >= (int64_t{1} << 16))
  for (int64_t t = 0; t < n_tok; ++t) {
    if (avx2) {
      quantize_act_avx2(x + t * n_cols, n_cols, qp + t * n_cols, dp + t * nb, sp + t * nb);
    } else {
      quantize_act_scalar(x + t * n_cols, n_cols, qp + t * n_cols, dp + t * nb, sp + t * nb);
    }
  }
  call_acts<Code> a{{qp, dp, sp, nb}, {}, {}, {}};
  const bool vnni = simd && has_avx512(), amx = simd && has_amx();
  XCTX_ASSERT(!(q16 && vnni && !amx && w.type == ggml_type::ggml_q8_0),
              "matmul_prefill_int: q16 Q8_0 needs AMX (VPDPBUSD cannot take its unsigned codes twice)");
  thread_local std::vector<int8_t> plane_storage;
  thread_local q8_tiles_storage tiles_storage, tiles_lo_storage;
  if constexpr (q16) {
    if (vnni) a.planes = split_q16_planes(a.xq, n_tok, plane_storage);
    if (amx) {
      a.tiles = make_byte_tiles(a.planes.hi, dp, sp, nb, n_tok, tiles_storage);
      a.tiles_lo = make_byte_tiles(a.planes.lo, dp, sp, nb, n_tok, tiles_lo_storage);
    }
  } else if (amx) {
    a.tiles = make_byte_tiles(qp, dp, sp, nb, n_tok, tiles_storage);
  }
  const q8_layout layout = amx ? q8_layout::amx : q8_layout::vnni;
  const int nth = n_rows >= 2 * k_q8_strip ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(nth)
  {
    int64_t r0 = 0, r1 = 0;
    thread_rows(n_rows, omp_get_thread_num(), omp_get_num_threads(), &r0, &r1);
    thread_local std::vector<uint8_t> panel;
    if (r0 < r1) panel.resize((size_t)(std::min(k_q8_panel_rows, r1 - r0) / k_q8_strip + 1) * (size_t)nb *
                              k_q8_block_bytes);
    for (int64_t p = r0; p < r1; p += k_q8_panel_rows) {
      const int64_t n = std::min(k_q8_panel_rows, r1 - p);
      pack_q8_strips(w, p, n, panel.data(), layout);
      float* yp = y + p;
      if constexpr (q16) {
        if (amx) {
          gemm_q16_strips_amx(panel.data(), n, nb, a.tiles, a.tiles_lo, n_tok, yp, n_rows);
        } else if (vnni) {
          gemm_q16_strips_avx512(panel.data(), n, nb, a.planes, n_tok, yp, n_rows);
        } else {
          gemm_q8_strips_scalar(panel.data(), n, nb, a.xq, n_tok, yp, n_rows);
        }
      } else {
        if (amx) {
          gemm_q8_strips_amx(panel.data(), n, nb, a.tiles, n_tok, yp, n_rows);
        } else if (vnni) {
          gemm_q8_strips_avx512(panel.data(), n, nb, a.xq, n_tok, yp, n_rows);
        } else {
          gemm_q8_strips_scalar(panel.data(), n, nb, a.xq, n_tok, yp, n_rows);
        }
      }
    }
  }
}

}  // namespace

bool prefill_int_applies(ggml_type type, prefill_activations act) {
  if (act == prefill_activations::pre_f32 || !is_legacy_quant(type) || !has_avx512()) return false;
  return act == prefill_activations::pre_q8 || type != ggml_type::ggml_q8_0 || has_amx();
}

void matmul_prefill_int(const weight_view& w, const float* x, int64_t n_tok, float* y, prefill_activations act,
                        bool simd) {
  XCTX_ASSERT(is_legacy_quant(w.type), "matmul_prefill_int: not a legacy quant: ", (uint32_t)w.type);
  if (act == prefill_activations::pre_q16) {
    matmul_prefill_codes<int16_t>(w, x, n_tok, y, simd);
  } else {
    matmul_prefill_codes<int8_t>(w, x, n_tok, y, simd);
  }
}

}  // namespace detail

// q16 where the integer GEMM runs (AVX-512 VNNI): perplexity unchanged within the paired noise and
// 1.1-1.5x the whole prefill (benchmarks/results/prefill_int*.md); f32 elsewhere, where the
// setting would change nothing but the name.
prefill_activations default_prefill_activations() {
  return prefill_q8_supported() ? prefill_activations::pre_q16 : prefill_activations::pre_f32;
}

bool prefill_q8_supported() { return has_avx512(); }

}  // namespace xctx::cpu
