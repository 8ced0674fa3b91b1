// The CUDA backend: device memory, one stream per backend instance, cuBLAS for prefill GEMMs.
//
// Device choice: cuda_device_for_process (kernels/device.h): XCTX_CUDA_DEVICE if set, else the
// launcher's node-local rank modulo the device count, else 0, so ranks sharing a node spread
// over its GPUs without any configuration.
// XCTX_CUDA_TF32=0 makes prefill GEMMs exact fp32 instead of TF32 tensor-core math.
// XCTX_CUDA_GRAPHS=0 runs decode segments eagerly instead of replaying CUDA graphs (run_segment).
//
// Every op is enqueued on the backend's stream and returns at once; upload, download and
// synchronize wait for the stream, and are where device-side input errors (out-of-range ids,
// decreasing kv positions) and asynchronous faults are reported as xctx::Error.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/error.h"
#include "common/sys.h"
#include "kernels/cuda/cuda_backend.h"
#include "common/cuda_check.h"
#include "kernels/cuda/kernels.cuh"
#include "kernels/cuda/kvq.cuh"
#include "kernels/cuda/xq.cuh"
#include "kernels/cuda/scratch.h"
#include "kernels/device.h"

namespace xctx::cuda {

namespace {

constexpr const char* kNoAccumulator =
    "cuda backend: exact per-unit attention accumulation (softmax_acc) runs on the CPU backend only; "
    "the CUDA kernels produce (o, lse) partials";

// Probed by device_present(): fails with "no kernel image" on GPUs older than the compiled
// architectures (sm_80 SASS + PTX), which would otherwise fail at the first real launch.
__global__ void probe_kernel() {}

void* device_malloc(size_t bytes, int device) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));  // non-null even for 0 bytes, as ref
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky: clear it so the next call does not report it
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) (void)cudaGetLastError();
    fail("cuda backend: out of device memory allocating ", bytes, " bytes on device ", device, " (", free_b, " of ",
         total_b, " bytes free) on ", where_am_i());
  }
  CUDA_CHECK(e);
  return p;
}

}  // namespace

void prepare_shared_memory(context& ctx, const void* kernel, size_t dynamic, const char* who) {
  size_t stat = 0;
  bool known = false;
  for (const auto& [k, bytes] : ctx.static_smem)
    if (k == kernel) stat = bytes, known = true;
  if (!known) {
    cudaFuncAttributes attr{};
    CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    stat = attr.sharedSizeBytes;
    ctx.static_smem.emplace_back(kernel, stat);
  }
  XCTX_CHECK(stat + dynamic <= ctx.smem_optin, who, ": ", dynamic, " bytes of dynamic and ", stat,
             " of static shared memory per block; the device allows ", ctx.smem_optin);
  if (stat + dynamic > (48u << 10))
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)dynamic));
}

void* context::scratch(size_t bytes) {
  if (bytes <= scratch_bytes) return scratch_ptr;
  if (scratch_ptr != nullptr) {
    CUDA_CHECK(cudaStreamSynchronize(stream));  // queued kernels may still use the old buffer
    CUDA_CHECK(cudaFree(scratch_ptr));
    scratch_ptr = nullptr;
    scratch_bytes = 0;
  }
  const size_t want = scratch_allocation(bytes);  // whole MiB: fewer regrowths
  scratch_ptr = device_malloc(want, device);
  scratch_bytes = want;
  return scratch_ptr;
}

namespace {

class cuda_backend final : public backend {
 public:
  cuda_backend(int device, const backend_settings& settings) {
    try {
      init(device, settings);
    } catch (...) {
      release();
      throw;
    }
  }
  ~cuda_backend() override { release(); }
  cuda_backend(const cuda_backend&) = delete;
  cuda_backend& operator=(const cuda_backend&) = delete;

  std::string name() const override { return "cuda"; }
  std::string arithmetic() const override {
    return ctx_.tf32 ? "prefill GEMMs in TF32, 10-bit mantissas (XCTX_CUDA_TF32=0: fp32)" : "GEMMs in fp32";
  }
  backend_settings settings() const override {
    backend_settings s;
    s.cuda_graphs = graphs_enabled_;
    s.cuda_tf32 = ctx_.tf32;
    return s;
  }
  bool has_device_collectives() const override { return true; }  // NCCL (comm/nccl.h)
  size_t memory_share_bytes() const override {
    size_t free_b = 0, total_b = 0;
    int n_dev = 0;
    CUDA_CHECK(cudaSetDevice(ctx_.device));
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    CUDA_CHECK(cudaGetDeviceCount(&n_dev));
    // Ranks bind to node-local rank mod the device count: this many share a device at most.
    const int sharing = std::max(1, (node_local_ranks() + std::max(n_dev, 1) - 1) / std::max(n_dev, 1));
    return free_b / (size_t)sharing;
  }

  void* alloc(size_t bytes) override {
    use_device();
    return device_malloc(bytes, ctx_.device);
  }
  // Never throws: free() is typically reached from destructors. A failure here means the
  // context is already broken, which the next checked call reports. Queued kernels may still
  // use p, so the stream drains first.
  void free(void* p) override {
    if (p == nullptr) return;
    if (cudaSetDevice(ctx_.device) != cudaSuccess || cudaStreamSynchronize(ctx_.stream) != cudaSuccess ||
        cudaFree(p) != cudaSuccess) {
      const cudaError_t e = cudaGetLastError();
      std::fprintf(stderr, "xctx cuda: cudaFree(%p) failed: %s on %s\n", p, cudaGetErrorString(e),
                   where_am_i().c_str());
    }
  }
  void upload(void* dst, const void* src_host, size_t bytes) override {
    if (bytes == 0) return;
    use_device();
    // cudaMemcpyDefault (UVA) also accepts device sources; waiting makes src reusable at return
    // even when it is pinned memory.
    CUDA_CHECK(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyDefault, ctx_.stream));
    synchronize();
  }
  void download(void* dst_host, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use_device();
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDefault, ctx_.stream));
    synchronize();
  }
  void synchronize() override {
    use_device();
    CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    raise_device_errors();
  }

  void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y) override {
    use_device();
    cuda::matmul(ctx_, w, x, n_tok, y);
  }
  void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out) override {
    use_device();
    const ggml_type_traits tr = ggml_traits(w.type);
    XCTX_CHECK(tr.name != nullptr, "cuda::get_rows: unsupported weight type id ", (uint32_t)w.type);
    XCTX_CHECK(w.n_rows >= 0 && w.n_cols > 0 && w.n_cols % tr.block_elems == 0, "cuda::get_rows: bad ", tr.name,
               " weight shape ", w.n_rows, "x", w.n_cols);
    XCTX_CHECK(n >= 0, "cuda::get_rows: negative n ", n);
    if (n == 0) return;
    XCTX_CHECK(w.data != nullptr && ids != nullptr && out != nullptr, "cuda::get_rows: null pointer");
    dequant_rows(ctx_, w, ids, 0, n, out);
  }
  void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y) override {
    use_device();
    cuda::rms_norm(ctx_, x, weight, n_tok, dim, eps, y);
  }
  void rope(float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg) override {
    use_device();
    cuda::rope(ctx_, x, pos, n_tok, n_head, cfg);
  }
  void swiglu(const float* gate, const float* up, int64_t n, float* out) override {
    use_device();
    cuda::swiglu(ctx_, gate, up, n, out);
  }
  void add(float* y, const float* x, int64_t n) override {
    use_device();
    cuda::add(ctx_, y, x, n);
  }
  void add_rows(float* y, const float* b, int64_t n_tok, int64_t dim) override {
    use_device();
    cuda::add_rows(ctx_, y, b, n_tok, dim);
  }
  void convert_rows(void* dst, kv_dtype type, const float* src, int64_t n) override {
    use_device();
    cuda::convert_rows(ctx_, dst, type, src, n);
  }
  void attention_partial(const attn_args& a) override {
    XCTX_CHECK(a.acc == nullptr, kNoAccumulator);
    use_device();
    cuda::attention_partial(ctx_, a);
  }
  void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim,
                      float* o, float* lse) override {
    use_device();
    cuda::merge_partials(ctx_, o_parts, lse_parts, n_part, n_row, head_dim, o, lse);
  }
  void kvq_encode(const kvq_encode_job& job) override {
    use_device();
    cuda::kvq_encode(ctx_, job);
  }
  void kvq_append_outliers(const kvq_outlier_append& a) override {
    use_device();
    cuda::kvq_append_outliers(ctx_, a);
  }
  void attention_kvq(const kvq_attn_args& a) override {
    XCTX_CHECK(a.acc == nullptr, kNoAccumulator);
    use_device();
    cuda::attention_kvq(ctx_, a);
  }
  void xq_encode(const xq_encode_job& job) override {
    use_device();
    cuda::xq_encode(ctx_, job);
  }
  void xq_project(const float* x, const float* u, int64_t n, int d, int r, float* out) override {
    use_device();
    cuda::xq_project(ctx_, x, u, n, d, r, out);
  }
  void attention_xq(const xq_attn_args& a) override {
    XCTX_CHECK(a.acc == nullptr, kNoAccumulator);
    use_device();
    cuda::attention_xq(ctx_, a);
  }
  void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out) override {
    use_device();
    cuda::xq_decode_rows(ctx_, s, t0, nt, out);
  }
  void xq_add_projected(const float* z, const float* u, int64_t n, int r, int d, float* acc) override {
    use_device();
    cuda::xq_add_projected(ctx_, z, u, n, r, d, acc);
  }
  void sub(float* y, const float* a, const float* b, int64_t n) override {
    use_device();
    cuda::sub(ctx_, y, a, b, n);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    use_device();
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx_.stream));
  }

  // CUDA graphs for decode segments: eager at a key's first use, captured at its second (the
  // launch parameters of a step are fixed by then), replayed from the third. A capture that
  // fails (f did something a graph cannot hold) leaves the key eager for good, with one note.
  void run_segment(uint64_t key, const std::function<void()>& f) override {
    if (!graphs_enabled_) {
      f();
      return;
    }
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      if (graphs_.size() >= kMaxGraphs) drop_graphs();  // pointers moved many times: start over
      graphs_.emplace(key, segment_graph{});
      f();
      return;
    }
    segment_graph& g = it->second;
    use_device();
    if (g.exec == nullptr && !g.eager_only) g.exec = capture(f);
    if (g.exec == nullptr) {
      g.eager_only = true;
      f();
      return;
    }
    CUDA_CHECK(cudaGraphLaunch(g.exec, ctx_.stream));
  }

 private:
  void init(int device, const backend_settings& settings) {
    ctx_.device = device;
    CUDA_CHECK(cudaSetDevice(device));
    cudaFuncAttributes attr{};
    const cudaError_t probe = cudaFuncGetAttributes(&attr, probe_kernel);
    if (probe != cudaSuccess) {
      (void)cudaGetLastError();
      int major = 0, minor = 0;
      (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
      fail("cuda backend: device ", device, " (sm_", major, minor, ") cannot run this build's kernels: ",
           cudaGetErrorString(probe), "; rebuild with CMAKE_CUDA_ARCHITECTURES including it, on ", where_am_i());
    }
    int v = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device));
    ctx_.n_sm = std::max(1, v);
    CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    ctx_.smem_optin = (size_t)std::max(v, 48 << 10);
    ctx_.tf32 = settings.cuda_tf32.value_or(true);
    graphs_enabled_ = settings.cuda_graphs.value_or(true);
    // A blocking stream: it orders with the legacy default stream other libraries may use.
    CUDA_CHECK(cudaStreamCreate(&ctx_.stream));
    CUBLAS_CHECK(cublasCreate(&ctx_.blas));
    CUBLAS_CHECK(cublasSetStream(ctx_.blas, ctx_.stream));
    CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&err_host_), device_error_words * sizeof(int),
                             cudaHostAllocMapped));
    std::memset(err_host_, 0, device_error_words * sizeof(int));
    CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&ctx_.err), err_host_, 0));
  }

  // Tolerates a partly built object (constructor failure) and never throws.
  void release() noexcept {
    if (cudaSetDevice(ctx_.device) != cudaSuccess) (void)cudaGetLastError();
    if (ctx_.stream != nullptr && cudaStreamSynchronize(ctx_.stream) != cudaSuccess) (void)cudaGetLastError();
    drop_graphs();
    if (ctx_.scratch_ptr != nullptr) (void)cudaFree(ctx_.scratch_ptr);
    if (ctx_.blas != nullptr) (void)cublasDestroy(ctx_.blas);
    if (ctx_.stream != nullptr) (void)cudaStreamDestroy(ctx_.stream);
    if (err_host_ != nullptr) (void)cudaFreeHost(err_host_);
    (void)cudaGetLastError();
    ctx_ = context{};
    err_host_ = nullptr;
  }

  void use_device() { CUDA_CHECK(cudaSetDevice(ctx_.device)); }

  struct segment_graph {
    cudaGraphExec_t exec = nullptr;
    bool eager_only = false;
  };
  static constexpr size_t kMaxGraphs = 4096;  // 2 per layer and engine in use; far more means churn

  // f's kernels captured into an executable graph (not run); null when the capture failed.
  cudaGraphExec_t capture(const std::function<void()>& f) {
    // Thread-local mode: only this thread's unsafe calls (a synchronize, a cudaMalloc) break it.
    CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream, cudaStreamCaptureModeThreadLocal));
    std::string why;
    try {
      f();
    } catch (const std::exception& e) {
      why = e.what();
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(ctx_.stream, &graph);
    cudaGraphExec_t exec = nullptr;
    cudaError_t made = ended;
    if (ended == cudaSuccess && why.empty()) made = cudaGraphInstantiate(&exec, graph, 0);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    if (made != cudaSuccess || !why.empty()) {
      (void)cudaGetLastError();
      if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
      if (!capture_failure_noted_)
        std::fprintf(stderr, "xctx cuda: a decode segment could not be captured as a CUDA graph (%s); it runs "
                             "eagerly\n", why.empty() ? cudaGetErrorString(made) : why.c_str());
      capture_failure_noted_ = true;
      return nullptr;
    }
    return exec;
  }
  void drop_graphs() noexcept {
    for (auto& [key, g] : graphs_)
      if (g.exec != nullptr) (void)cudaGraphExecDestroy(g.exec);
    graphs_.clear();
  }

  // Called after the stream has drained, so the kernels' writes to the mapped words are visible.
  void raise_device_errors() {
    volatile int* e = err_host_;
    const int code = e[0];
    if (code == 0) return;
    const int a = e[1], b = e[2], c = e[3];
    for (int k = 1; k < device_error_words; ++k) e[k] = 0;
    e[0] = 0;
    switch ((device_error)code) {
      case device_error::device_error_none: return;
      case device_error::device_error_row_id:
        fail("cuda::get_rows: row id ", a, " at position ", b, " is outside [0, ", c, ")");
      case device_error::device_error_kv_order:
        fail("cuda attention: kv_pos must be non-decreasing, kv_pos[", a, "]=", b, " > kv_pos[", (int64_t)a + 1,
             "]=", c);
    }
    fail("cuda backend: unknown device error code ", code);
  }

  context ctx_;
  int* err_host_ = nullptr;  // [device_error_words] mapped; ctx_.err is its device address
  bool graphs_enabled_ = true;  // backend_settings::cuda_graphs off: every segment eager
  bool capture_failure_noted_ = false;
  std::unordered_map<uint64_t, segment_graph> graphs_;
};

}  // namespace

bool device_present() {
  static const bool present = [] {
    int n = 0;
    // No driver, no device, or a driver too old for this runtime: all mean "no device" here.
    if (cudaGetDeviceCount(&n) != cudaSuccess || n <= 0) {
      (void)cudaGetLastError();
      return false;
    }
    try {
      // Probe the device this process would use, so no context is created on another rank's GPU.
      const int dev = cuda_device_for_process(n);
      cudaFuncAttributes attr{};
      if (cudaSetDevice(dev) != cudaSuccess || cudaFuncGetAttributes(&attr, probe_kernel) != cudaSuccess) {
        const cudaError_t e = cudaGetLastError();
        std::fprintf(stderr, "xctx cuda: device %d is visible but unusable: %s\n", dev, cudaGetErrorString(e));
        return false;
      }
    } catch (const Error& err) {
      std::fprintf(stderr, "xctx cuda: %s\n", err.what());
      return false;
    }
    return true;
  }();
  return present;
}

cuda_probe probe_runtime() {
  cuda_probe p;
  p.compiled = true;
  if (cudaRuntimeGetVersion(&p.runtime_version) != cudaSuccess) (void)cudaGetLastError();
  if (cudaDriverGetVersion(&p.driver_version) != cudaSuccess) (void)cudaGetLastError();
  int n = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n <= 0) {
    (void)cudaGetLastError();
    p.error = e != cudaSuccess ? std::string("no usable CUDA driver or device: ") + cudaGetErrorString(e)
                               : std::string("no CUDA device is visible (CUDA_VISIBLE_DEVICES?)");
    return p;
  }
  // Properties need no context; only the device this process binds to gets one (its free memory).
  for (int d = 0; d < n; ++d) {
    cudaDeviceProp prop{};
    cuda_probe::device dev;
    if (cudaGetDeviceProperties(&prop, d) == cudaSuccess) {
      dev.name = prop.name;
      dev.cc_major = prop.major, dev.cc_minor = prop.minor, dev.sm_count = prop.multiProcessorCount;
      dev.total_bytes = prop.totalGlobalMem;
    } else {
      (void)cudaGetLastError();
      dev.name = "(properties unreadable)";
    }
    p.devices.push_back(dev);
  }
  try {
    p.bound = cuda_device_for_process(n, &p.bound_why);
  } catch (const Error& e) {
    p.bound_why = e.what();
    return p;
  }
  if (!device_present()) {
    p.error = "device " + std::to_string(p.bound) + " is visible but cannot run this build's kernels (see above)";
    return p;
  }
  size_t free_b = 0, total_b = 0;
  if (cudaSetDevice(p.bound) == cudaSuccess && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
    p.bound_free_bytes = free_b;
  else
    (void)cudaGetLastError();
  return p;
}

std::string bound_device_pci_bus_id() {
  int n = 0;
  CUDA_CHECK(cudaGetDeviceCount(&n));
  XCTX_CHECK(n > 0, "cuda: no CUDA device on ", where_am_i());
  char id[32] = {};
  CUDA_CHECK(cudaDeviceGetPCIBusId(id, (int)sizeof id, cuda_device_for_process(n)));
  return id;
}

std::unique_ptr<backend> make_cuda_backend(const backend_settings& settings) {
  int n = 0;
  CUDA_CHECK(cudaGetDeviceCount(&n));
  XCTX_CHECK(n > 0, "cuda backend: no CUDA device on ", where_am_i());
  return std::make_unique<cuda_backend>(cuda_device_for_process(n), settings);
}

}  // namespace xctx::cuda
