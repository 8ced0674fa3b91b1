// Run-time CPU feature check deciding between the *_avx2.cpp kernels and the scalar fallbacks.
#include <atomic>
#include <cstdlib>

#include "kernels/cpu/cpu_ops.h"

namespace xctx::cpu {

namespace {

bool detect_avx2() {
  if (const char* env = std::getenv("XCTX_NO_AVX2"); env != nullptr && env[0] != '\0' && env[0] != '0') {
    return false;
  }
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

std::atomic<bool> g_force_scalar{false};

}  // namespace

bool has_avx2() {
  static const bool present = detect_avx2();
  return present && !g_force_scalar.load(std::memory_order_relaxed);
}

void set_force_scalar(bool on) { g_force_scalar.store(on, std::memory_order_relaxed); }

}  // namespace xctx::cpu
