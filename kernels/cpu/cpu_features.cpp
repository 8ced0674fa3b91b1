// Run-time CPU feature checks deciding between the *_avx512.cpp, *_avxvnni.cpp, *_avx2.cpp
// kernels and the scalar fallbacks.
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

bool detect_avx512() {
  if (const char* env = std::getenv("XCTX_NO_AVX512"); env != nullptr && env[0] != '\0' && env[0] != '0') {
    return false;
  }
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vnni");
}

bool detect_avx_vnni() {
  if (const char* env = std::getenv("XCTX_NO_AVXVNNI"); env != nullptr && env[0] != '\0' && env[0] != '0') {
    return false;
  }
  __builtin_cpu_init();
  return __builtin_cpu_supports("avxvnni");
}

std::atomic<bool> g_force_scalar{false};
std::atomic<bool> g_force_avx2{false};
std::atomic<bool> g_force_avx_vnni{false};

}  // namespace

bool has_avx2() {
  static const bool present = detect_avx2();
  return present && !g_force_scalar.load(std::memory_order_relaxed);
}

void set_force_scalar(bool on) { g_force_scalar.store(on, std::memory_order_relaxed); }

bool has_avx512() {
  static const bool present = detect_avx512();
  return present && has_avx2() && !g_force_avx2.load(std::memory_order_relaxed) &&
         !g_force_avx_vnni.load(std::memory_order_relaxed);
}

void set_force_avx2(bool on) { g_force_avx2.store(on, std::memory_order_relaxed); }

bool has_avx_vnni() {
  static const bool present = detect_avx_vnni();
  return present && has_avx2() && !g_force_avx2.load(std::memory_order_relaxed);
}

void set_force_avx_vnni(bool on) { g_force_avx_vnni.store(on, std::memory_order_relaxed); }

}  // namespace xctx::cpu
