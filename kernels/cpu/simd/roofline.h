// The machine's own limits, measured: streaming read bandwidth, the fp32 FMA peak and the int8
// dot-product peak, on one thread and on all. Speed figures are reported as fractions of these
// (benchmarks/roofline.py, `xctx doctor --probe`): ratios against fp16 or another engine move
// with the microarchitecture, the limits do not.
#pragma once

#include <cstddef>

#include "kernels/host_cpu.h"

namespace xctx::cpu {

using roofline = host_roofline;  // the figures, declared at the kernels level for the tools

// Measures on `threads` OpenMP threads (0: the OpenMP default), reading a buffer of read_bytes
// (allocated once; an allocation that fails is reported naming the size). Each figure is the best
// of `passes` runs of about `seconds` each.
roofline measure_roofline(int threads = 0, size_t read_bytes = size_t(512) << 20, double seconds = 0.2, int passes = 3);

}  // namespace xctx::cpu
