// The machine's own limits, measured: streaming read bandwidth, the fp32 FMA peak and the int8
// dot-product peak, on one thread and on all. Speed figures are reported as fractions of these
// (benchmarks/roofline.py, `xctx doctor --probe`): ratios against fp16 or another engine move
// with the microarchitecture, the limits do not.
#pragma once

#include <cstddef>
#include <string>

namespace xctx::cpu {

struct roofline {
  int threads = 0;               // the "all threads" figures' thread count
  size_t read_bytes = 0;         // the buffer each read pass streams
  double read_gbs_1 = 0, read_gbs_all = 0;      // GB/s (1e9 bytes), best of several passes
  double fma_gflops_1 = 0, fma_gflops_all = 0;  // fp32, 2 flops per lane per fused multiply-add
  double int8_gops_1 = 0, int8_gops_all = 0;    // 2 ops per int8 multiply-add (u8 x s8 into s32)
  std::string read_isa, fma_isa, int8_isa;      // the instructions that measured each
};

// Measures on `threads` OpenMP threads (0: the OpenMP default), reading a buffer of read_bytes
// (allocated once; an allocation that fails is reported naming the size). Each figure is the best
// of `passes` runs of about `seconds` each.
roofline measure_roofline(int threads = 0, size_t read_bytes = size_t(512) << 20, double seconds = 0.2, int passes = 3);

}  // namespace xctx::cpu
