#include "kernels/cpu/simd/roofline.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <new>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/simd/roofline_kernels.h"

namespace xctx::cpu {

namespace roofline_kernels {

float read_scalar(const float* p, size_t n) {
  float s[8] = {};
  for (size_t i = 0; i < n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += p[i + j];
  return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

float fma_scalar(int64_t iters) {
  float acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = 1.0f + 0.01f * (float)c;
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kFmaChains; ++c) acc[c] = acc[c] * 0.999f + 0.001f;
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

int32_t dot_scalar(int64_t iters, int lanes, bool avx2_feedback) {
  uint32_t total = 0;
  for (int c = 0; c < kDotChains; ++c) {
    uint32_t acc = (uint32_t)c;  // every lane of a chain runs the same recurrence
    for (int64_t i = 0; i < iters; ++i) {
      if (!avx2_feedback) {
        acc += (uint32_t)(4 * 3 * -2);
        continue;
      }
      int32_t sum = 0;
      for (int pair = 0; pair < 2; ++pair) {  // maddubs: u8 x s8, adjacent pairs, saturated to s16
        const int32_t lo = (int32_t)((acc >> (16 * pair)) & 0xff), hi = (int32_t)((acc >> (16 * pair + 8)) & 0xff);
        sum += std::clamp(lo * -2 + hi * -2, -32768, 32767);  // then madd with ones: the two s16 summed
      }
      acc += (uint32_t)sum;
    }
    total += acc * (uint32_t)lanes;
  }
  return (int32_t)total;
}

}  // namespace roofline_kernels

namespace {

namespace rk = roofline_kernels;
using clock_type = std::chrono::steady_clock;

volatile float g_float_sink;  // the probes' results land here, so no loop is dropped
volatile int32_t g_int_sink;

// Best rate over `passes` runs of `body(thread, work)` on `threads` threads, `work` grown until
// one run takes about `seconds`. amount(work) is the units one thread does per run.
double best_rate(int threads, double seconds, int passes, const std::function<void(int64_t)>& body,
                 const std::function<double(int64_t)>& amount, int64_t work) {
  const auto run = [&](int64_t w) {
    const auto t0 = clock_type::now();
#pragma omp parallel num_threads(threads)
    body(w);
    return std::chrono::duration<double>(clock_type::now() - t0).count();
  };
  while (run(work) < seconds / 4 && work < (int64_t(1) << 40)) work *= 2;
  work = (int64_t)((double)work * seconds / std::max(run(work), 1e-6)) + 1;
  double best = 0;
  for (int p = 0; p < passes; ++p) best = std::max(best, amount(work) * threads / run(work));
  return best;
}

}  // namespace

roofline measure_roofline(int threads, size_t read_bytes, double seconds, int passes) {
  roofline r;
  r.threads = threads > 0 ? threads : omp_get_max_threads();
  XCTX_CHECK(seconds > 0 && passes > 0, "roofline: seconds and passes must be positive");
  const bool avx2 = has_avx2(), avx512 = has_avx512(), avx_vnni = has_avx_vnni();

  // Read bandwidth: every thread streams its own slice of one buffer (first touched by the thread
  // that reads it, so each slice lives on that thread's memory node).
  const size_t n = std::max<size_t>(read_bytes / sizeof(float) / (64 * (size_t)r.threads), 1) * 64 * (size_t)r.threads;
  r.read_bytes = n * sizeof(float);
  std::unique_ptr<float, decltype(&std::free)> buf(static_cast<float*>(std::aligned_alloc(64, r.read_bytes)), &std::free);
  XCTX_CHECK(buf != nullptr, "roofline: cannot allocate the ", r.read_bytes >> 20, " MiB read buffer");
  const auto read = [&](int n_threads, int64_t reps) {
    const size_t slice = n / (size_t)n_threads;
    const float* p = buf.get() + (size_t)omp_get_thread_num() * slice;
    float s = 0;
    for (int64_t k = 0; k < reps; ++k) s += avx2 ? rk::read_avx2(p, slice) : rk::read_scalar(p, slice);
    g_float_sink = s;
  };
#pragma omp parallel num_threads(r.threads)
  {
    const size_t slice = n / (size_t)r.threads;
    float* p = buf.get() + (size_t)omp_get_thread_num() * slice;
    for (size_t i = 0; i < slice; ++i) p[i] = (float)(i & 7);
  }
  r.read_isa = avx2 ? "avx2" : "scalar";
  for (const int t : {1, r.threads}) {
    // One thread reads the whole buffer; all threads read a slice each.
    const double bytes_per_rep = (double)r.read_bytes / t;
    const double gbs = best_rate(
                           t, seconds, passes, [&](int64_t reps) { read(t, reps); },
                           [&](int64_t reps) { return bytes_per_rep * (double)reps; }, 1) /
                       1e9;
    (t == 1 ? r.read_gbs_1 : r.read_gbs_all) = gbs;
    if (r.threads == 1) r.read_gbs_all = gbs;
  }

  // fp32 FMA peak: the widest FMA the CPU has.
  const int lanes = avx512 ? 16 : avx2 ? 8 : 1;
  r.fma_isa = avx512 ? "avx512f" : avx2 ? "avx2+fma" : "scalar";
  const auto fma = [&](int64_t iters) {
    g_float_sink = avx512 ? rk::fma_avx512(iters) : avx2 ? rk::fma_avx2(iters) : rk::fma_scalar(iters);
  };
  const auto flops = [&](int64_t iters) { return (double)iters * rk::kFmaChains * lanes * 2.0; };
  // A compute peak on one thread and on all (in units of 1e9 per second).
  const auto peaks = [&](const std::function<void(int64_t)>& body, const std::function<double(int64_t)>& amount,
                         double& one, double& all) {
    one = best_rate(1, seconds, passes, body, amount, 1 << 16) / 1e9;
    all = r.threads == 1 ? one : best_rate(r.threads, seconds, passes, body, amount, 1 << 16) / 1e9;
  };
  peaks(fma, flops, r.fma_gflops_1, r.fma_gflops_all);

  // int8 dot-product peak: VNNI where present, else AVX2's three-instruction sequence.
  if (avx2) {
    const int macs = avx512 ? 64 : 32;
    r.int8_isa = avx512 ? "avx512-vnni" : avx_vnni ? "avx-vnni" : "avx2 (maddubs+madd+add)";
    const auto dot = [&](int64_t iters) {
      g_int_sink = avx512 ? rk::dot_avx512(iters) : avx_vnni ? rk::dot_avxvnni(iters) : rk::dot_avx2(iters);
    };
    const auto ops = [&](int64_t iters) { return (double)iters * rk::kDotChains * macs * 2.0; };
    peaks(dot, ops, r.int8_gops_1, r.int8_gops_all);
  } else {
    r.int8_isa = "none (no AVX2)";
  }
  return r;
}

}  // namespace xctx::cpu
