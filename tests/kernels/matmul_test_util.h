// Shared by the matmul tests: CPU matmul settings with one choice changed from the backend's
// defaults (cpu::matmul_settings, kernels/cpu/cpu_ops.h), and the weights and activations they
// multiply.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::test {

inline cpu::matmul_settings with_decode(decode_activations act) {
  cpu::matmul_settings s;
  s.decode = act;
  return s;
}
inline cpu::matmul_settings with_prefill(prefill_activations pre) {
  cpu::matmul_settings s;
  s.prefill = pre;
  return s;
}

// Weights as a file would hold them: seeded normal values (a few rows scaled up, as real
// matrices have outlier rows) quantized by the reference quantizer.
inline std::vector<uint8_t> quantized_weights(ggml_type type, int64_t n_rows, int64_t n_cols, std::mt19937& rng) {
  const size_t row_bytes = ggml_row_bytes(type, n_cols);
  std::vector<uint8_t> data(row_bytes * (size_t)n_rows);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> row((size_t)n_cols);  // [n_cols]
  for (int64_t r = 0; r < n_rows; ++r) {
    const float scale = (r % 7 == 3) ? 8.0f : 1.0f;
    for (auto& v : row) v = nd(rng) * scale;
    ref::quantize_row(type, row.data(), data.data() + (size_t)r * row_bytes, n_cols);
  }
  return data;
}

// Activations: uniform in [-a, a] with a per token spanning 4 decades, plus an outlier or two per
// row so some blocks have a coarse grid.
inline std::vector<float> random_activations(int64_t n_tok, int64_t n_cols, std::mt19937& rng) {
  std::vector<float> x((size_t)(n_tok * n_cols));
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  for (int64_t t = 0; t < n_tok; ++t) {
    const float a = std::pow(10.0f, (float)(t % 5) - 2.0f);
    for (int64_t c = 0; c < n_cols; ++c) x[(size_t)(t * n_cols + c)] = a * ud(rng);
    x[(size_t)(t * n_cols + (t * 13) % n_cols)] = 20.0f * a;
  }
  return x;
}

}  // namespace xctx::test
