// The one place that knows which backends and communicators were compiled in (registry.h).
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/sys.h"
#include "kernels/cuda/scratch.h"  // host code: the device scratch bound, in every build
#include "registry/registry.h"

#if XCTX_USE_CUDA
#include "comm/nccl.h"
#include "kernels/cuda/cuda_backend.h"
#endif

namespace xctx {

std::unique_ptr<backend> make_ref_backend();  // kernels/ref/ref_backend.cpp
std::unique_ptr<backend> make_cpu_backend(const backend_settings& settings);  // kernels/cpu/cpu_backend.cpp
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

backend_settings settings_with_environment(backend_settings s) {
  const auto set = [](const char* v) { return v != nullptr && *v != '\0'; };
  if (const char* v = std::getenv("XCTX_DECODE_ACT"); !s.decode && set(v))
    s.decode = parse_decode_activations(v, "XCTX_DECODE_ACT");
  if (const char* v = std::getenv("XCTX_PREFILL_ACT"); !s.prefill && set(v))
    s.prefill = parse_prefill_activations(v, "XCTX_PREFILL_ACT");
  // The switches: "0" turns one off, any other value leaves it on.
  const auto on_off = [&](std::optional<bool>& field, const char* v) {
    if (!field && set(v)) field = std::string(v) != "0";
  };
  on_off(s.attn_avx512_rows, std::getenv("XCTX_ATTN_AVX512"));
  on_off(s.kvq_key_lanes, std::getenv("XCTX_KVQ_KEY_LANES"));
  on_off(s.cuda_graphs, std::getenv("XCTX_CUDA_GRAPHS"));
  on_off(s.cuda_tf32, std::getenv("XCTX_CUDA_TF32"));
  return s;
}

std::unique_ptr<backend> make_backend(backend_kind kind, const backend_settings& settings) {
  switch (kind) {
    // Exact arithmetic: no activation rounding to choose.
    case backend_kind::backend_ref: return make_ref_backend();
    case backend_kind::backend_cpu: return make_cpu_backend(settings_with_environment(settings));
    case backend_kind::backend_cuda:
#if XCTX_USE_CUDA
      XCTX_CHECK(cuda::device_present(), "backend cuda: no CUDA device is visible to this process");
      return cuda::make_cuda_backend(settings_with_environment(settings));
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
    // The one growing device scratch (weight panels, split partials, selection lists): its
    // bound over every call of the shape (kernels/cuda/scratch.h).
    case backend_kind::backend_cuda: return cuda::scratch_bound(s);
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

std::string cuda_device_identity() {
#if XCTX_USE_CUDA
  if (!cuda::device_present()) return "";
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) std::snprintf(host, sizeof host, "?");
  return std::string(host) + "/" + cuda::bound_device_pci_bus_id();
#else
  return "";
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
