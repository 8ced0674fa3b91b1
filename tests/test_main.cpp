#include <gtest/gtest.h>

#include "common/sys.h"
#include "isa_coverage.h"
#include "require_gpu.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  xctx::init_logging(argv[0]);
  if (!GTEST_FLAG_GET(list_tests) && xctx::test::check_expected_isas() != 0) return 1;
  const int rc = RUN_ALL_TESTS();
  return xctx::test::fail_gpu_skips_when_required() != 0 ? 1 : rc;
}
