// Which CPU kernel ISAs a test process covers. Kernel tests for AVX2, AVX-512, AVX-VNNI and AMX run
// only where cpu::has_*() says the CPU has them and skip (or are not instantiated) elsewhere, so
// a suite's pass holds for the ISAs detected here only. XCTX_EXPECT_ISA (a comma list of avx2,
// avx512, avx_vnni, amx; launch/run-tests sets it from /proc/cpuinfo) names the ISAs the runner has:
// a process that would skip one of them fails instead, so CI cannot go green on a runner whose
// AVX-512 suite silently did not run (a detection bug, an XCTX_NO_* left in the environment).
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>

#include "kernels/cpu/simd/cpu_features.h"

namespace xctx::test {

// 0 when every expected ISA is detected; otherwise prints why to stderr and returns 1.
inline int check_expected_isas() {
  const struct {
    const char* name;
    bool detected;
  } isas[] = {{"avx2", cpu::has_avx2()}, {"avx512", cpu::has_avx512()}, {"avx_vnni", cpu::has_avx_vnni()},
               {"amx", cpu::has_amx()}};
  const char* env = std::getenv("XCTX_EXPECT_ISA");
  std::string missing;
  for (const auto& i : isas)
    if (!i.detected) missing += std::string(missing.empty() ? "" : ", ") + i.name;
  if (env == nullptr || env[0] == '\0') {
    if (!missing.empty())
      std::fprintf(stderr, "[isa] not on this CPU (their kernel cases skip): %s\n", missing.c_str());
    return 0;
  }
  std::stringstream list(env);
  std::string want;
  int bad = 0;
  while (std::getline(list, want, ',')) {
    if (want.empty()) continue;
    bool known = false;
    for (const auto& i : isas) {
      if (want != i.name) continue;
      known = true;
      if (!i.detected) {
        std::fprintf(stderr,
                     "[isa] XCTX_EXPECT_ISA names %s but this process does not detect it (XCTX_NO_* set, or "
                     "detection disagrees with the CPU): its kernel tests would skip\n",
                     i.name);
        bad = 1;
      }
    }
    if (!known) {
      std::fprintf(stderr, "[isa] XCTX_EXPECT_ISA: unknown ISA '%s' (known: avx2, avx512, avx_vnni, amx)\n", want.c_str());
      bad = 1;
    }
  }
  return bad;
}

}  // namespace xctx::test
