// The kernels backend interface: every op the transformer forward needs. Implementations:
//   ref  (kernels/ref)  scalar, obviously-correct oracles; tests compare everything against them
//   cpu  (kernels/cpu)  OpenMP + AVX2/FMA (run-time dispatched) + OpenBLAS GEMM
//   cuda (kernels/cuda) device kernels + cuBLAS; compiled in CI, tests skip without a device
// Pointers passed to a backend live in that backend's memory space (alloc/upload/download move
// data in and out), so one test body can run against every backend.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend_settings.h"
#include "kernels/quant_blocks.h"
#include "kernels/types.h"

namespace xctx {

// Which keys each query may see beyond causality: the units (kAttnUnit absolute positions,
// kernels/softmax_acc.h) listed for it. Host memory. Retrieval attention (worker/retrieval.h)
// lists the sink's, the local window's and the selected blocks' units per query; attention
// kernels skip every (query, unit) pair not listed, so the result is a function of each query's
// list and the keys in it, whatever the split of the keys over caches and ranks.
struct attn_selection {
  // Lists per query: 1 (every head of the query reads one list) or the call's n_head_kv (list
  // g covers KV head g's query heads: selection per KV head, as Quest selects per head).
  int lists_per_query = 1;
  std::vector<int64_t> offsets;  // [n_q * lists_per_query + 1]: list l's units are units[offsets[l] .. offsets[l + 1])
  std::vector<int64_t> units;    // absolute unit ids (floor(pos / kAttnUnit)), ascending per list
  int64_t n_queries() const {
    return offsets.empty() || lists_per_query < 1 ? 0 : ((int64_t)offsets.size() - 1) / lists_per_query;
  }
  // Whether the list l holds the unit (binary search).
  bool listed(int64_t l, int64_t unit) const {
    const auto b = units.begin() + offsets[(size_t)l], e = units.begin() + offsets[(size_t)l + 1];
    const auto it = std::lower_bound(b, e, unit);
    return it != e && *it == unit;
  }
  // Whether some head of query i sees the unit (the unit must be read for query i).
  bool sees(int64_t i, int64_t unit) const {
    for (int g = 0; g < lists_per_query; ++g)
      if (listed(i * lists_per_query + g, unit)) return true;
    return false;
  }
  // Whether the query heads of KV head kvh (of query i) see the unit.
  bool sees(int64_t i, int kvh, int64_t unit) const {
    return listed(i * lists_per_query + (lists_per_query == 1 ? 0 : kvh), unit);
  }
  // Every head of query i sees exactly the same units (one list): no per-head mask needed.
  bool shared() const { return lists_per_query == 1; }
};
// Throws unless the selection fits a call of n_q queries over n_head_kv KV heads.
void check_selection(const attn_selection& s, int64_t n_q, int n_head_kv, const char* who);

// Element type of cached keys/values handed to the attention kernels.
enum class kv_dtype : uint8_t { kv_f32, kv_f16 };

// Quantized-cache kernels (encode, attention over one quantized layer): kernels/kv_quant.h.
struct kvq_encode_job;
struct kvq_outlier_append;
struct kvq_attn_args;
// X-cache kernels (encode a latent stream, attention rebuilding K and V): kernels/x_quant.h.
struct xq_encode_job;
struct xq_attn_args;
struct xq_stream;
class softmax_acc;  // kernels/softmax_acc.h

// One attention call: queries against a set of cached tokens, producing a *partial* result
// (o normalised by its own softmax sum, plus the log-sum-exp) that can be merged with the
// partials of other blocks/ranks. Key j is visible to query i iff kv_pos[j] <= q_pos[i].
// A query that sees no key yields o = 0 and lse = -inf.
struct attn_args {
  const float* q = nullptr;        // [n_q, n_head, head_dim], RoPE applied
  const int32_t* q_pos = nullptr;  // [n_q]
  int64_t n_q = 0;
  const void* k = nullptr;          // [n_kv, n_head_kv, head_dim] post-RoPE, kv_type
  const void* v = nullptr;          // [n_kv, n_head_kv, head_dim], kv_type
  const int32_t* kv_pos = nullptr;  // [n_kv], non-decreasing
  int64_t n_kv = 0;
  kv_dtype kv_type = kv_dtype::kv_f32;
  int n_head = 0;
  int n_head_kv = 0;  // query head h reads kv head h / (n_head / n_head_kv)
  int head_dim = 0;
  float scale = 0.0f;  // usually 1/sqrt(head_dim)
  float* o = nullptr;    // [n_q, n_head, head_dim]
  float* lse = nullptr;  // [n_q, n_head], natural log
  // When set, o/lse are not written: the partial is added to acc (rows n_q * n_head, width
  // head_dim) as exact per-unit deposits whose sum does not depend on how the keys are split
  // (kernels/cpu/attention/attention_units.h). Host memory; the CPU backend implements it per unit, the
  // ref backend as one deposit per row, the CUDA backend not at all (it throws).
  softmax_acc* acc = nullptr;
  // The rope the keys were rotated with. Only SelfExtend reads it (grouped side: keys turned by
  // floor(p / G) - p, queries by their grouped shift). Every backend takes it on (o, lse) calls;
  // the CPU kernels run those through an accumulator of the call's own rows.
  rope_config rope;
  // When set (retrieval attention), query i sees only the units select->sees(i, unit) lists.
  // Every backend takes it (cuda copies the lists to the device per call and skips tiles no row
  // lists); choosing the units, worker/retrieval.h, runs on host-memory backends only so far.
  const attn_selection* select = nullptr;
};

class backend {
 public:
  virtual ~backend() = default;
  virtual std::string name() const = 0;
  // Where this backend's arithmetic departs from the CPU backend's fp32, for run headers and
  // results (cuda: TF32 prefill GEMMs unless XCTX_CUDA_TF32=0); empty when it does not.
  virtual std::string arithmetic() const { return {}; }
  // The choices this backend was made with, resolved (kernels/backend_settings.h); unset fields
  // are choices it does not have.
  virtual backend_settings settings() const { return {}; }

  // Memory of this backend's space (host for ref/cpu, device for cuda).
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* p) = 0;
  virtual void upload(void* dst, const void* src_host, size_t bytes) = 0;
  virtual void download(void* dst_host, const void* src, size_t bytes) = 0;
  virtual void synchronize() {}
  // Host-memory backends (ref, cpu): their pointers are host pointers, so weights are used where
  // they lie, host code may read what the kernels wrote, and upload/download are plain copies.
  virtual bool host_memory() const { return false; }
  // Whether attention_partial / attention_kvq take attn_args::acc (exact per-unit deposits into
  // a host softmax_acc). Without it, attention runs as (o, lse) partials in this backend's memory
  // merged with merge_partials (worker/attention_sum.h).
  virtual bool exact_accumulator() const { return false; }
  // Whether collectives can move this backend's memory directly (CUDA: NCCL). Without them,
  // partials travel through host memory and the host communicator.
  virtual bool has_device_collectives() const { return false; }
  // The bytes this process may still allocate in this backend's memory: a device's free memory
  // divided among the node's ranks bound to it. 0 when the memory is the host's (the host's
  // figure, available_memory_bytes in worker/memory_plan.h, applies).
  virtual size_t memory_share_bytes() const { return 0; }

  // y = x · Wᵀ : y[t, r] = Σ_c W[r, c] x[t, c]
  virtual void matmul(const weight_view& w,
                      const float* x,  // [n_tok, w.n_cols]
                      int64_t n_tok,
                      float* y)  // [n_tok, w.n_rows]
      = 0;
  // y[i] = x · W[i]ᵀ for n_w weights that read the same x (q, k and v; gate and up): the same
  // bits as n_w matmul calls, which is what backends without a fused version do.
  virtual void matmul_n(const weight_view* w /*[n_w]*/, int n_w, const float* x /*[n_tok, n_cols]*/, int64_t n_tok,
                        float* const* y /*[n_w]*/) {
    for (int i = 0; i < n_w; ++i) matmul(w[i], x, n_tok, y[i]);
  }
  void matmul2(const weight_view& a, const weight_view& b, const float* x, int64_t n_tok, float* ya, float* yb) {
    const weight_view w[2] = {a, b};
    float* const y[2] = {ya, yb};
    matmul_n(w, 2, x, n_tok, y);
  }
  // out[i, :] = dequant(W[ids[i], :])   (embedding lookup)
  virtual void get_rows(const weight_view& w, const int32_t* ids /*[n]*/, int64_t n,
                        float* out /*[n, w.n_cols]*/) = 0;
  // y = x / sqrt(mean(x²) + eps) * weight, per row
  virtual void rms_norm(const float* x /*[n_tok, dim]*/, const float* weight /*[dim]*/, int64_t n_tok,
                        int64_t dim, float eps, float* y /*[n_tok, dim]*/) = 0;
  // In place; pos[t] is the absolute position of row t.
  virtual void rope(float* x /*[n_tok, n_head, head_dim]*/, const int32_t* pos /*[n_tok]*/, int64_t n_tok,
                    int n_head, const rope_config& cfg) = 0;
  // out = silu(gate) * up
  virtual void swiglu(const float* gate /*[n]*/, const float* up /*[n]*/, int64_t n, float* out /*[n]*/) = 0;
  // y += x
  virtual void add(float* y /*[n]*/, const float* x /*[n]*/, int64_t n) = 0;
  // y[t, :] += b for n_tok rows (biases); one add per row unless a backend fuses it.
  virtual void add_rows(float* y /*[n_tok, dim]*/, const float* b /*[dim]*/, int64_t n_tok, int64_t dim) {
    for (int64_t t = 0; t < n_tok; ++t) add(y + t * dim, b, dim);
  }
  // dst[i] = src[i] stored as `type` (f32: a copy; f16: fp32_to_fp16, round to nearest even, the
  // same bits on every backend), both in this backend's memory: how caches store rows.
  virtual void convert_rows(void* dst /*[n] of type*/, kv_dtype type, const float* src /*[n]*/, int64_t n) = 0;
  virtual void attention_partial(const attn_args& a) = 0;
  // Merges n_part partials of the same queries (see attn_args); o/lse may alias part 0.
  virtual void merge_partials(const float* o_parts /*[n_part, n_row, head_dim]*/,
                              const float* lse_parts /*[n_part, n_row]*/, int n_part, int64_t n_row,
                              int head_dim, float* o /*[n_row, head_dim]*/, float* lse /*[n_row]*/) = 0;
  // Encodes rows of a quantized cache (bit-identical codes on every backend).
  virtual void kvq_encode(const kvq_encode_job& job) = 0;
  // Appends encoded rows' key outliers to a layer's compressed columns (kernels/kv_quant.h).
  virtual void kvq_append_outliers(const kvq_outlier_append& a) = 0;
  // Attention partial over one quantized layer: dequantize, RoPE, q·k, softmax, p·v, fused.
  virtual void attention_kvq(const kvq_attn_args& a) = 0;
  // The X caches (cache/x_cache.cpp): rows of a latent stream encoded (bit-identical codes on
  // every backend); out = x·u, the latents of n new rows; attention over one layer's streams
  // (exact deposits into a.acc where the backend has the accumulator, else (o, lse)).
  virtual void xq_encode(const xq_encode_job& job) = 0;
  virtual void xq_project(const float* x /*[n, d]*/, const float* u /*[d, r]*/, int64_t n, int d, int r,
                          float* out /*[n, r]*/) = 0;
  virtual void attention_xq(const xq_attn_args& a) = 0;
  // xquant-cl's accumulator (cache/x_cl_cache.cpp): rows [t0, t0 + nt) of a stream in f32, and
  // acc[t, :] += z[t, :]·uᵀ (a decoded delta latent brought back to X space); both row-invariant.
  virtual void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out /*[nt, C]*/) = 0;
  virtual void xq_add_projected(const float* z /*[n, r]*/, const float* u /*[d, r]*/, int64_t n, int r, int d,
                                float* acc /*[n, d]*/) = 0;
  // y = a - b elementwise (y may alias a or b).
  virtual void sub(float* y /*[n]*/, const float* a /*[n]*/, const float* b /*[n]*/, int64_t n) = 0;
  // dst = src, both in this backend's memory (no overlap).
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;

  // A decode segment: `f` calls only this backend's kernel ops (no alloc, free, upload, download
  // or synchronize), with the same arguments every time it runs under `key` (the key names its
  // pointers and sizes; what the pointed-to memory holds may change). A backend may record the
  // calls once and replay the record instead of calling f: cuda captures a CUDA graph at the
  // key's second use (the first runs eagerly and warms lazily grown state) and launches it from
  // then on. The others run f.
  virtual void run_segment(uint64_t key, const std::function<void()>& f) {
    (void)key;
    f();
  }
};

// One allocation in a backend's memory, freed with the object. reserve() grows it (what it held
// is not kept: scratch), so a buffer sized for the largest call is allocated once.
class backend_buffer {
 public:
  explicit backend_buffer(backend& be) : be_(&be) {}
  ~backend_buffer() { release(); }
  backend_buffer(const backend_buffer&) = delete;
  backend_buffer& operator=(const backend_buffer&) = delete;
  backend_buffer(backend_buffer&& o) noexcept : be_(o.be_), p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }

  void* reserve(size_t bytes) {
    if (bytes > bytes_ || p_ == nullptr) {
      release();
      p_ = be_->alloc(bytes);
      bytes_ = bytes;
    }
    return p_;
  }
  template <typename T>
  T* reserve_as(int64_t n) { return static_cast<T*>(reserve((size_t)n * sizeof(T))); }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }
  // Exchanges allocations with o (same backend): how a buffer grows while keeping what it held.
  void swap(backend_buffer& o) noexcept {
    std::swap(be_, o.be_), std::swap(p_, o.p_), std::swap(bytes_, o.bytes_);
  }
  void release() {
    if (p_ != nullptr) be_->free(p_);
    p_ = nullptr;
    bytes_ = 0;
  }

 private:
  backend* be_;
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// n host values where `be` reads them: the host array itself on host-memory backends, else a
// copy uploaded into buf (positions, token ids: small next to the activations).
template <typename T>
const T* host_array_on(backend& be, const T* host, int64_t n, backend_buffer& buf) {
  if (be.host_memory() || n == 0) return host;
  T* dst = buf.reserve_as<T>(n);
  be.upload(dst, host, (size_t)n * sizeof(T));
  return dst;
}

enum class backend_kind : uint8_t { backend_ref, backend_cpu, backend_cuda };

// What a backend's kernels keep allocated while a rank prefills chunks of n_batch tokens and
// decodes (per-thread tiles, shared tiles, scaled queries): the fit check asks the backend
// (kernel_workspace_bytes, registry/registry.h) instead of knowing its tile sizes.
struct workspace_shape {
  int n_threads = 1;
  int64_t n_batch = 1;
  int64_t kv_dim = 0;  // key channels of a token
  int64_t q_dim = 0;   // query channels of a token
  // What the device kernels' scratch follows (kernels/cuda/scratch.h): the heads, the widest
  // weight row a GEMM dequantizes, and the tokens a rank holds (a selection's lists).
  int n_head = 0, n_head_kv = 0, head_dim = 0, n_embd = 0;
  int64_t max_weight_cols = 0;
  int64_t capacity = 0;
};

// Names as `--backend` and XCTX_BACKEND spell them (kernels/backend_kind.cpp); making one is
// the registry's (registry/registry.h, the only part that knows what was compiled in).
const char* backend_name(backend_kind kind);
// "cpu" / "cuda" (and "ref", the scalar oracle); an error naming `what` and the choices otherwise.
backend_kind parse_backend_kind(const std::string& name, const char* what);

}  // namespace xctx
