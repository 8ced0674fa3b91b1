#include "kernels/host_cpu.h"

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/simd/cpu_features.h"
#include "kernels/cpu/simd/roofline.h"

namespace xctx {

std::string host_cpu_kernels() {
  if (cpu::has_amx()) {
    return "AVX-512 (fused quantized-cache decode, VNNI decode matvecs, --prefill-act q8 GEMMs) + AMX (the q8 GEMM's "
           "tiles) + AVX2";
  }
  if (cpu::has_avx512()) {
    return "AVX-512 (fused quantized-cache decode, VNNI decode matvecs, --prefill-act q8 GEMMs) + AVX2";
  }
  if (cpu::has_avx_vnni()) return "AVX2 + AVX-VNNI decode matvecs";
  if (cpu::has_avx2()) return "AVX2/FMA/F16C";
  return "scalar fallbacks (no AVX2+FMA+F16C)";
}

bool host_prefill_int_gemm() { return cpu::prefill_q8_supported(); }

void host_dequantize_row(ggml_type type, const void* src, float* dst, int64_t n) { cpu::dequantize_row(type, src, dst, n); }

host_roofline measure_host_roofline() { return cpu::measure_roofline(); }

}  // namespace xctx
