// The device-binding rule (kernels/device.h).
#include "kernels/device.h"

#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/sys.h"

namespace xctx {

int cuda_device_for_process(int count, std::string* why) {
  XCTX_CHECK(count > 0, "cuda_device_for_process: no device to choose from (count ", count, ")");
  if (const char* env = std::getenv("XCTX_CUDA_DEVICE"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    XCTX_CHECK(*end == '\0' && v >= 0 && v < count, "XCTX_CUDA_DEVICE='", env, "' but ", count,
               " CUDA device(s) are visible on ", where_am_i(), " (valid: 0..", count - 1, ")");
    if (why != nullptr) *why = "XCTX_CUDA_DEVICE";
    return (int)v;
  }
  std::string source;
  const int local = node_local_rank(&source);
  if (local >= 0) {
    if (why != nullptr) *why = source + "=" + std::to_string(local) + " mod " + std::to_string(count);
    return local % count;
  }
  if (why != nullptr) *why = "no launcher: device 0";
  return 0;
}

}  // namespace xctx
