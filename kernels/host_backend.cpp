#include "kernels/host_backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "common/half.h"
#include "kernels/kv_quant.h"

namespace xctx {
namespace {

class host_backend final : public backend {
 public:
  explicit host_backend(const host_kernels& k) : k_(k) {}
  std::string name() const override { return k_.name; }
  std::string arithmetic() const override { return k_.arithmetic; }
  backend_settings settings() const override { return k_.settings; }

  void* alloc(size_t bytes) override {
    // 64-byte aligned and sized to whole lines, so SIMD loads never straddle two.
    void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
    XCTX_CHECK(p != nullptr, k_.name, " backend: cannot allocate ", bytes, " bytes");
    return p;
  }
  void free(void* p) override { std::free(p); }
  void upload(void* dst, const void* src_host, size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src_host, bytes);
  }
  void download(void* dst_host, const void* src, size_t bytes) override {
    if (bytes != 0) std::memcpy(dst_host, src, bytes);
  }

  void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y) override { k_.matmul(w, x, n_tok, y); }
  void matmul_n(const weight_view* w, int n_w, const float* x, int64_t n_tok, float* const* y) override {
    if (k_.matmul_n != nullptr) {
      k_.matmul_n(w, n_w, x, n_tok, y);
    } else {
      backend::matmul_n(w, n_w, x, n_tok, y);
    }
  }
  void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out) override {
    k_.get_rows(w, ids, n, out);
  }
  void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y) override {
    k_.rms_norm(x, weight, n_tok, dim, eps, y);
  }
  void rope(float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg) override {
    k_.rope(x, pos, n_tok, n_head, cfg);
  }
  void swiglu(const float* gate, const float* up, int64_t n, float* out) override { k_.swiglu(gate, up, n, out); }
  void add(float* y, const float* x, int64_t n) override { k_.add(y, x, n); }
  void add_rows(float* y, const float* b, int64_t n_tok, int64_t dim) override {
    for (int64_t t = 0; t < n_tok; ++t)
      for (int64_t i = 0; i < dim; ++i) y[t * dim + i] += b[i];
  }
  void convert_rows(void* dst, kv_dtype type, const float* src, int64_t n) override {
    if (type == kv_dtype::kv_f32) {
      if (n > 0 && dst != src) std::memcpy(dst, src, (size_t)n * sizeof(float));
      return;
    }
    auto* h = static_cast<uint16_t*>(dst);
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) h[i] = fp32_to_fp16(src[i]);
  }
  bool host_memory() const override { return true; }
  bool exact_accumulator() const override { return true; }
  void attention_partial(const attn_args& a) override { k_.attention_partial(a); }
  void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim,
                      float* o, float* lse) override {
    k_.merge_partials(o_parts, lse_parts, n_part, n_row, head_dim, o, lse);
  }
  void kvq_encode(const kvq_encode_job& job) override { k_.kvq_encode(job); }
  void kvq_append_outliers(const kvq_outlier_append& a) override { kvq_append_outliers_host(a); }
  void attention_kvq(const kvq_attn_args& a) override { k_.attention_kvq(a); }
  void xq_encode(const xq_encode_job& job) override { k_.xq_encode(job); }
  void xq_project(const float* x, const float* u, int64_t n, int d, int r, float* out) override {
    k_.xq_project(x, u, n, d, r, out);
  }
  void attention_xq(const xq_attn_args& a) override { k_.attention_xq(a); }
  void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out) override {
    k_.xq_decode_rows(s, t0, nt, out);
  }
  void xq_add_projected(const float* z, const float* u, int64_t n, int r, int d, float* acc) override {
    k_.xq_add_projected(z, u, n, r, d, acc);
  }
  void sub(float* y, const float* a, const float* b, int64_t n) override {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; ++i) y[i] = a[i] - b[i];
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes != 0) std::memcpy(dst, src, bytes);
  }

 private:
  host_kernels k_;
};

}  // namespace

std::unique_ptr<backend> make_host_backend(const host_kernels& k) { return std::make_unique<host_backend>(k); }

}  // namespace xctx
