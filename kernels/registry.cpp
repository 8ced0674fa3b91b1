// The one place that knows which backends were compiled in.
#include "common/error.h"
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
