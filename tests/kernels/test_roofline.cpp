// The roofline probe (kernels/cpu/simd/roofline.h): each ISA's inner loop computes exactly what its
// scalar reference does, so the operation counts the peaks divide by were executed; the measured
// figures are positive and name the instructions that measured them.
#include <gtest/gtest.h>

#include <cmath>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/simd/roofline.h"
#include "kernels/cpu/simd/roofline_kernels.h"

namespace xctx {
namespace {

namespace rk = cpu::roofline_kernels;

TEST(roofline_kernels, fma_loops_equal_the_scalar_recurrence) {
  for (const int64_t iters : {1, 7, 1000}) {
    const double ref = rk::fma_scalar(iters);
    // The reference rounds twice per step where an FMA rounds once: at most 2 half-ulps of
    // values below 1.2 per step and lane, which the recurrence (x 0.999) does not amplify. The
    // bound sums that over steps, chains and lanes; measured at 1000 steps: 0.19 of it.
    const auto bound = [&](int lanes) {
      return lanes * rk::kFmaChains * (double)iters * 2 * 1.2 * std::ldexp(1.0, -24) + 1e-4;
    };
    if (cpu::has_avx2()) {
      EXPECT_NEAR(rk::fma_avx2(iters), 8 * ref, bound(8)) << iters;
    }
    if (cpu::has_avx512()) {
      EXPECT_NEAR(rk::fma_avx512(iters), 16 * ref, bound(16)) << iters;
    }
  }
  EXPECT_NEAR(rk::fma_scalar(100000), 12.0, 1e-3);  // every chain converges to the fixed point 1
}

TEST(roofline_kernels, dot_loops_equal_the_scalar_recurrence) {
  if (!cpu::has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  for (const int64_t iters : {1, 5, 3000}) {
    EXPECT_EQ(rk::dot_avx2(iters), rk::dot_scalar(iters, 8, true)) << iters;
    if (cpu::has_avx_vnni()) {
      EXPECT_EQ(rk::dot_avxvnni(iters), rk::dot_scalar(iters, 8, false)) << iters;
    }
    if (cpu::has_avx512()) {
      EXPECT_EQ(rk::dot_avx512(iters), rk::dot_scalar(iters, 16, false)) << iters;
    }
  }
}

TEST(roofline_kernels, read_sums_every_element) {
  constexpr size_t n = 64 * 5;
  alignas(64) static float buf[n];
  double exact = 0;
  for (size_t i = 0; i < n; ++i) exact += buf[i] = (float)(i % 7);
  EXPECT_EQ(rk::read_scalar(buf, n), (float)exact);  // small integers: every partial sum exact
  if (cpu::has_avx2()) {
    EXPECT_EQ(rk::read_avx2(buf, n), (float)exact);
  }
}

TEST(roofline, measures_positive_limits_with_the_isa_it_used) {
  const cpu::roofline r = cpu::measure_roofline(2, size_t(16) << 20, 0.02, 1);
  EXPECT_EQ(r.threads, 2);
  EXPECT_EQ(r.read_bytes % (64 * sizeof(float) * 2), 0u);
  for (const double x : {r.read_gbs_1, r.read_gbs_all, r.fma_gflops_1, r.fma_gflops_all})
    EXPECT_TRUE(std::isfinite(x) && x > 0) << x;
  EXPECT_EQ(r.fma_isa, cpu::has_avx512() ? "avx512f" : cpu::has_avx2() ? "avx2+fma" : "scalar");
  if (cpu::has_avx2()) {
    EXPECT_GT(r.int8_gops_1, 0);
    EXPECT_EQ(r.int8_isa, cpu::has_avx512() ? "avx512-vnni" : cpu::has_avx_vnni() ? "avx-vnni" : "avx2 (maddubs+madd+add)");
  }
  std::printf("[roofline] read %.1f / %.1f GB/s, fma %.1f / %.1f GFLOP/s (%s), int8 %.1f / %.1f GOP/s (%s)\n",
              r.read_gbs_1, r.read_gbs_all, r.fma_gflops_1, r.fma_gflops_all, r.fma_isa.c_str(), r.int8_gops_1,
              r.int8_gops_all, r.int8_isa.c_str());
}

}  // namespace
}  // namespace xctx
