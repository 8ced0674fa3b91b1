// Reference matmul and embedding lookup: each weight row dequantized with the reference
// dequantizer, dot products accumulated in double. Slow and obviously correct.
#include <vector>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::ref {

namespace {

void check_weight(const weight_view& w, const char* op) {
  const ggml_type_traits tr = ggml_traits(w.type);
  XCTX_CHECK(tr.name != nullptr, op, ": unsupported weight type id ", (uint32_t)w.type);
  XCTX_CHECK(w.n_rows >= 0 && w.n_cols > 0, op, ": bad weight shape ", w.n_rows, "x", w.n_cols);
  XCTX_CHECK(w.n_cols % tr.block_elems == 0, op, ": ", tr.name, " row length ", w.n_cols,
             " is not a multiple of the block size ", tr.block_elems);
  XCTX_CHECK(w.data != nullptr || w.n_rows == 0, op, ": weight data is null");
}

}  // namespace

void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y) {
  check_weight(w, "ref::matmul");
  XCTX_CHECK(n_tok >= 0, "ref::matmul: negative n_tok ", n_tok);
  const size_t row_bytes = w.row_bytes();
  std::vector<float> row((size_t)w.n_cols);  // [n_cols]
  for (int64_t r = 0; r < w.n_rows; ++r) {
    dequantize_row(w.type, (const uint8_t*)w.data + (size_t)r * row_bytes, row.data(), w.n_cols);
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* xt = x + t * w.n_cols;
      double acc = 0.0;
      for (int64_t c = 0; c < w.n_cols; ++c) acc += (double)row[(size_t)c] * (double)xt[c];
      y[t * w.n_rows + r] = (float)acc;
    }
  }
}

void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out) {
  check_weight(w, "ref::get_rows");
  const size_t row_bytes = w.row_bytes();
  for (int64_t i = 0; i < n; ++i) {
    XCTX_CHECK(ids[i] >= 0 && ids[i] < w.n_rows, "ref::get_rows: row id ", ids[i], " at position ", i,
               " is outside [0, ", w.n_rows, ")");
    dequantize_row(w.type, (const uint8_t*)w.data + (size_t)ids[i] * row_bytes, out + i * w.n_cols, w.n_cols);
  }
}

}  // namespace xctx::ref
