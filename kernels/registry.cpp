// The one place that knows which backends were compiled in.
#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/sys.h"
#include "kernels/ops.h"

#include "comm/communicator.h"

#if XCTX_USE_CUDA
#include "comm/nccl.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace xctx {

std::unique_ptr<backend> make_ref_backend();  // kernels/ref/ref_backend.cpp
std::unique_ptr<backend> make_cpu_backend();  // kernels/cpu/cpu_backend.cpp

const char* backend_name(backend_kind kind) {
  switch (kind) {
    case backend_kind::backend_ref: return "ref";
    case backend_kind::backend_cpu: return "cpu";
    case backend_kind::backend_cuda: return "cuda";
  }
  return "?";
}

bool backend_available(backend_kind kind) {
  switch (kind) {
    case backend_kind::backend_ref:
    case backend_kind::backend_cpu: return true;
    case backend_kind::backend_cuda:
#if XCTX_USE_CUDA
      return cuda::device_present();
#else
      return false;
#endif
  }
  return false;
}

std::unique_ptr<backend> make_backend(backend_kind kind) {
  switch (kind) {
    case backend_kind::backend_ref: return make_ref_backend();
    case backend_kind::backend_cpu: return make_cpu_backend();
    case backend_kind::backend_cuda:
#if XCTX_USE_CUDA
      XCTX_CHECK(cuda::device_present(), "backend cuda: no CUDA device is visible to this process");
      return cuda::make_cuda_backend();
#else
      fail("backend cuda: this xctx was built without CUDA (configure with -DXCTX_CUDA=ON)");
#endif
  }
  fail("unknown backend kind ", (int)kind);
}

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

cuda_probe probe_cuda() {
#if XCTX_USE_CUDA
  cuda_probe p = cuda::probe_runtime();
  p.nccl_version = nccl_version();
  return p;
#else
  cuda_probe p;
  p.error = "this xctx was built without CUDA (configure with -DXCTX_CUDA=ON)";
  return p;
#endif
}

bool nccl_available() {
#if XCTX_USE_CUDA
  return cuda::device_present();
#else
  return false;
#endif
}

std::unique_ptr<communicator> make_nccl_communicator_or_fail(communicator& bootstrap) {
#if XCTX_USE_CUDA
  XCTX_CHECK(cuda::device_present(), "nccl: no CUDA device is visible to rank ", bootstrap.rank());
  return make_nccl_communicator(bootstrap);
#else
  fail("nccl: this xctx was built without CUDA (configure with -DXCTX_CUDA=ON)");
#endif
}

}  // namespace xctx
