// A planted forbidden arrow for the link checks (cmake/xctx_parts.cmake): an object linked with
// xctx_kernels' closure that calls into model/, a part above kernels. The link of
// link_check_planted must fail with an undefined reference; the test
// arrows_link_check_refuses_a_planted_upward_call builds it and requires that.
#include <cstdio>

#include "model/gguf.h"

int main() {
  std::puts(xctx::gguf_value_to_string(xctx::gguf_value{}).c_str());
  return 0;
}
