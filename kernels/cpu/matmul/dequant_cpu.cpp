// cpu::dequantize_row: the AVX2 dequantizers where there is one, the reference one otherwise
// (the K-quants, which the default model does not use).
#include <cstring>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/ref/ref_ops.h"

namespace xctx::cpu {

void dequantize_row(ggml_type type, const void* src, float* dst, int64_t n) {
  if (type == ggml_type::ggml_f32) {
    std::memcpy(dst, src, (size_t)n * sizeof(float));
    return;
  }
  const ggml_type_traits tr = ggml_traits(type);
  XCTX_CHECK(tr.name != nullptr, "cpu::dequantize_row: unsupported type id ", (uint32_t)type);
  XCTX_CHECK(n % tr.block_elems == 0, "cpu::dequantize_row: ", tr.name, " length ", n,
             " is not a multiple of the block size ", tr.block_elems);
  if (has_avx2() && detail::dequantize_row_avx2(type, src, dst, n)) return;
  ref::dequantize_row(type, src, dst, n);
}

}  // namespace xctx::cpu
