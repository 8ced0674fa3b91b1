// Run-time CPU feature checks deciding between the *_avx512.cpp, *_avxvnni.cpp, *_avx2.cpp
// kernels and the scalar fallbacks.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "kernels/cpu/simd/cpu_features.h"

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

// CPUID.(7,0):EDX bits 24 (AMX-TILE) and 25 (AMX-INT8); the OS enables the tile state in XCR0
// (bits 17 and 18) and, on Linux >= 5.16, grants its use per process on request.
bool detect_amx() {
  if (const char* env = std::getenv("XCTX_NO_AMX"); env != nullptr && env[0] != '\0' && env[0] != '0') {
    return false;
  }
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0 || (d >> 24 & 1u) == 0 || (d >> 25 & 1u) == 0) return false;
  if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c >> 27 & 1u) == 0) return false;  // OSXSAVE
  uint32_t lo = 0, hi = 0;
  asm volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo >> 17 & 3u) != 3u) return false;
  constexpr long k_arch_req_xcomp_perm = 0x1023, k_xfeature_xtiledata = 18;
  return syscall(SYS_arch_prctl, k_arch_req_xcomp_perm, k_xfeature_xtiledata) == 0;
}

std::atomic<bool> g_force_no_amx{false};
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

bool has_amx() {
  static const bool present = detect_amx();
  return present && has_avx512() && !g_force_no_amx.load(std::memory_order_relaxed);
}

void set_force_no_amx(bool on) { g_force_no_amx.store(on, std::memory_order_relaxed); }

}  // namespace xctx::cpu
