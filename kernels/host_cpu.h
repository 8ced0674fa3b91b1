// What the parts above kernels/ take from the host CPU outside a backend: the feature queries and
// the roofline probe for reports (xctx doctor, bench) and the dequantization the X caches' factors
// are built from. The kernels-level face of kernels/cpu, so no part above includes a backend's
// own folder (docs/architecture.md, "Allowed arrows").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/quant_blocks.h"

namespace xctx {

// Which of the run-time dispatched CPU kernel families this CPU (and the XCTX_NO_* settings)
// selects, in words.
std::string host_cpu_kernels();
// Whether --prefill-act q8/q16 run as integer GEMMs on this CPU (AVX-512 VNNI), not as f32.
bool host_prefill_int_gemm();

// The machine's own limits, measured (the probe: kernels/cpu/simd/roofline.h).
struct host_roofline {
  int threads = 0;               // the "all threads" figures' thread count
  size_t read_bytes = 0;         // the buffer each read pass streams
  double read_gbs_1 = 0, read_gbs_all = 0;      // GB/s (1e9 bytes), best of several passes
  double fma_gflops_1 = 0, fma_gflops_all = 0;  // fp32, 2 flops per lane per fused multiply-add
  double int8_gops_1 = 0, int8_gops_all = 0;    // 2 ops per int8 multiply-add (u8 x s8 into s32)
  std::string read_isa, fma_isa, int8_isa;      // the instructions that measured each
};
// On the OpenMP default thread count, with the probe's default buffer and passes.
host_roofline measure_host_roofline();

// One row of n elements stored as `type`, to f32: the CPU backend's own dequantization (the same
// bits as its matmuls see).
void host_dequantize_row(ggml_type type, const void* src, float* dst, int64_t n);

}  // namespace xctx
