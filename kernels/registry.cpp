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

backend_kind parse_backend_kind(const std::string& name, const char* what) {
  if (name == "cpu") return backend_kind::backend_cpu;
  if (name == "cuda") return backend_kind::backend_cuda;
  if (name == "ref") return backend_kind::backend_ref;
  fail(what, ": unknown backend '", name, "' (cpu, cuda; ref is the scalar oracle)");
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
