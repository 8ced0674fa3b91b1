// The one place that knows which backends and communicators were compiled in (registry.h).
#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/sys.h"
#include "registry/registry.h"

#if XCTX_USE_CUDA
#include "comm/nccl.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace xctx {

std::unique_ptr<backend> make_ref_backend();  // kernels/ref/ref_backend.cpp
std::unique_ptr<backend> make_cpu_backend();  // kernels/cpu/cpu_backend.cpp
size_t cpu_workspace_bytes(const workspace_shape& s);  // kernels/cpu/cpu_backend.cpp

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

size_t kernel_workspace_bytes(backend_kind kind, const workspace_shape& s) {
  switch (kind) {
    case backend_kind::backend_cpu: return cpu_workspace_bytes(s);
    // The scalar oracle allocates per call and frees before it returns.
    case backend_kind::backend_ref: return 0;
    // Not yet counted: the CUDA backend keeps one growing device scratch (context::scratch,
    // kernels/cuda/cuda_backend.cu) whose high-water mark follows its split plans; bounding it
    // here is an open part of issue 54.
    case backend_kind::backend_cuda: return 0;
  }
  fail("unknown backend kind ", (int)kind);
}

backend_kind choose_backend(const std::string& flag) {
  const char* env = std::getenv("XCTX_BACKEND");
  const bool from_flag = !flag.empty();
  if (!from_flag && (env == nullptr || *env == '\0')) return backend_kind::backend_cpu;
  const char* what = from_flag ? "--backend" : "XCTX_BACKEND";
  const backend_kind kind = parse_backend_kind(from_flag ? flag : std::string(env), what);
  if (kind == backend_kind::backend_cuda) {
#if XCTX_USE_CUDA
    if (!cuda::device_present()) {
      const cuda_probe p = probe_cuda();
      fail(what, " cuda: no usable CUDA device on ", where_am_i(), ": ",
           p.error.empty() ? std::string("the device this rank binds to cannot run this build's kernels") : p.error,
           " (`xctx doctor` shows what each rank sees; --backend cpu runs on the CPU)");
    }
#else
    fail(what, " cuda: this xctx was built without CUDA; rebuild with launch/build --cuda (XCTX_CUDA=ON), "
               "or run with --backend cpu");
#endif
  }
  return kind;
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
