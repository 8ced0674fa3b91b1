// The CUDA device tests' skip, and the rule that makes it fatal. XCTX_REQUIRE_CUDA() skips a
// test where the CUDA backend cannot run, saying why once per process (no CUDA in this build, no
// device, or a driver older than the toolkit: CUDA 13 needs a >= 580 driver, and many clusters
// run 535-570, where every device test would otherwise skip without a word). XCTX_REQUIRE_GPU=1
// (the device check, launch/device-check, sets it): on a machine meant to have a GPU, a test
// skipped for want of a usable CUDA device is a missing result, not a pass. The test mains call
// fail_gpu_skips_when_required after RUN_ALL_TESTS; it names every such test and returns 1.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/device.h"
#include "registry/registry.h"

namespace xctx::test {

// Why the CUDA backend cannot run in this process ("" when it can); probed once, printed once.
inline const std::string& cuda_unavailable_reason() {
  static const std::string why = [] {
    if (backend_available(backend_kind::backend_cuda)) return std::string();
    const cuda_probe p = probe_cuda();
    std::string s = !p.compiled ? "xctx built without CUDA" : !p.error.empty() ? p.error : "no device is visible";
    if (p.compiled && p.driver_version > 0 && p.driver_version < p.runtime_version)
      s += " (the driver supports CUDA " + std::to_string(p.driver_version / 1000) + "." +
           std::to_string(p.driver_version % 1000 / 10) + ", this build's runtime is " +
           std::to_string(p.runtime_version / 1000) + "." + std::to_string(p.runtime_version % 1000 / 10) +
           ": update the driver)";
    std::fprintf(stderr, "CUDA device tests skip here: %s\n", s.c_str());
    return s;
  }();
  return why;
}

#define XCTX_REQUIRE_CUDA()                                                                   \
  if (const std::string& xctx_cuda_why_ = ::xctx::test::cuda_unavailable_reason(); !xctx_cuda_why_.empty()) \
  GTEST_SKIP() << "no usable CUDA device: " << xctx_cuda_why_

inline int fail_gpu_skips_when_required() {
  const char* on = std::getenv("XCTX_REQUIRE_GPU");
  if (!on || std::strcmp(on, "1") != 0) return 0;
  const testing::UnitTest& ut = *testing::UnitTest::GetInstance();
  int n = 0;
  for (int i = 0; i < ut.total_test_suite_count(); ++i) {
    const testing::TestSuite& suite = *ut.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const testing::TestResult& r = *suite.GetTestInfo(j)->result();
      if (!r.Skipped()) continue;
      for (int k = 0; k < r.total_part_count(); ++k) {
        const std::string msg = r.GetTestPartResult(k).message();
        if (r.GetTestPartResult(k).skipped() && msg.find("CUDA") != std::string::npos) {
          std::fprintf(stderr, "XCTX_REQUIRE_GPU=1: %s.%s skipped: %s\n", suite.name(), suite.GetTestInfo(j)->name(),
                       msg.c_str());
          ++n;
          break;
        }
      }
    }
  }
  if (n > 0) std::fprintf(stderr, "XCTX_REQUIRE_GPU=1: %d test(s) skipped for want of a CUDA device\n", n);
  return n > 0 ? 1 : 0;
}

}  // namespace xctx::test
