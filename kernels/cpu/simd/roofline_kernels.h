// The roofline probe's inner loops (kernels/cpu/simd/roofline.h), one per instruction set; each file
// is compiled for its ISA and entered only where the CPU has it. Every loop keeps enough
// independent accumulators to cover the instruction's latency on two pipes (FMA latency 4 -> at
// least 8 in flight), and returns a value that depends on all of them so nothing is dropped.
#pragma once

#include <cstddef>
#include <cstdint>

namespace xctx::cpu::roofline_kernels {

// Sum of n floats (n a multiple of 64, p 64-byte aligned): streaming loads.
float read_avx2(const float* p, size_t n);
float read_scalar(const float* p, size_t n);

// `iters` rounds of kFmaChains independent vector FMAs (x <- x * 0.999 + 0.001, chain c from
// 1 + 0.01 c). Flops = iters * chains * lanes * 2. Each returns the sum over chains and lanes:
// lanes x fma_scalar(iters), the scalar reference, up to rounding.
constexpr int kFmaChains = 12;
float fma_avx2(int64_t iters);    // 8 lanes
float fma_avx512(int64_t iters);  // 16 lanes
float fma_scalar(int64_t iters);  // 1 lane

// `iters` rounds of kDotChains independent u8 x s8 dot products into s32 lanes (chain c from c).
// Multiply-adds per round per chain: 32 (256-bit) or 64 (512-bit); ops = 2 x multiply-adds. Each
// returns the wrapping sum over chains and lanes, which dot_scalar computes lane by lane.
constexpr int kDotChains = 12;
// The scalar reference: `lanes` lanes of the VNNI recurrence (acc += 4 x 3 x -2 per round) or,
// avx2_feedback, of dot_avx2's (acc += the pairwise-saturated products of acc's own bytes and -2).
int32_t dot_scalar(int64_t iters, int lanes, bool avx2_feedback);

// The wrapping sum of n 32-bit lanes (as the lanes themselves wrap): what the dot loops return.
inline int32_t wrapping_sum(const int32_t* lanes, int n) {
  uint32_t sum = 0;
  for (int i = 0; i < n; ++i) sum += (uint32_t)lanes[i];
  return (int32_t)sum;
}
int32_t dot_avx2(int64_t iters);     // vpmaddubsw + vpmaddwd + vpaddd: 32 multiply-adds, 3 instructions
int32_t dot_avxvnni(int64_t iters);  // vpdpbusd ymm: 32 multiply-adds
int32_t dot_avx512(int64_t iters);   // vpdpbusd zmm: 64 multiply-adds

}  // namespace xctx::cpu::roofline_kernels
