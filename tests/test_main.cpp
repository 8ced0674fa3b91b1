#include <gtest/gtest.h>

#include "common/sys.h"

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  xctx::init_logging(argv[0]);
  return RUN_ALL_TESTS();
}
