// A backend with a memory space of its own, for checking on a machine without a GPU that code
// written for device backends keeps to the pointer-space rules (kernels/ops.h, cache/cache.h,
// worker/llama_engine.h). It runs the CPU kernels, but
//  - its allocations are mapped PROT_NONE and opened only while one of its own ops (or an
//    upload/download) runs: host code that reads or writes "device" memory directly faults, as
//    it would on a GPU's memory;
//  - every op checks that each pointer it is given, with its whole extent, lies in one of its
//    allocations: a host pointer passed to a kernel is an error naming the op and argument;
//  - it has no exact accumulator (attn_args::acc is refused), so callers take the (o, lse)
//    partials path the CUDA backend needs.
// With record_segments it replays decode segments from a record of their ops, as the CUDA
// backend replays graphs (run_segment). It counts uploads and downloads, so tests can bound host
// round trips per step.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "common/error.h"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/x_quant.h"
#include "registry/registry.h"

namespace xctx::test {

class device_space_backend final : public backend {
 public:
  device_space_backend() : cpu_(make_backend(backend_kind::backend_cpu)), page_((size_t)sysconf(_SC_PAGESIZE)) {}
  ~device_space_backend() override {
    for (const auto& [start, bytes] : blocks_) munmap(reinterpret_cast<void*>(start), bytes);
  }

  std::string name() const override { return "device-space"; }
  bool host_memory() const override { return false; }
  bool exact_accumulator() const override { return false; }
  size_t memory_share_bytes() const override { return memory_share; }

  void* alloc(size_t bytes) override {
    not_recording("alloc");
    const size_t mapped = std::max<size_t>(page_, (bytes + page_ - 1) / page_ * page_);
    void* p = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    XCTX_CHECK(p != MAP_FAILED, "device_space: cannot map ", bytes, " bytes");
    madvise(p, mapped, MADV_HUGEPAGE);  // fewer page-table entries for mprotect to rewrite (a hint)
    blocks_[reinterpret_cast<uintptr_t>(p)] = mapped;
    return p;
  }
  void free(void* p) override {
    if (p == nullptr) return;
    not_recording("free");
    const auto it = blocks_.find(reinterpret_cast<uintptr_t>(p));
    XCTX_CHECK(it != blocks_.end(), "device_space: free of ", p, ", which this backend did not allocate");
    munmap(p, it->second);
    blocks_.erase(it);
  }
  void upload(void* dst, const void* src_host, size_t bytes) override {
    not_recording("upload");
    check(dst, bytes, "upload", "dst");
    ++uploads, upload_bytes += bytes;
    with_memory_open([&] { std::memcpy(dst, src_host, bytes); });
  }
  void download(void* dst_host, const void* src, size_t bytes) override {
    not_recording("download");
    check(src, bytes, "download", "src");
    XCTX_CHECK(!in_space(dst_host, 1), "device_space: download into device memory");
    ++downloads, download_bytes += bytes;
    with_memory_open([&] { std::memcpy(dst_host, src, bytes); });
  }

  void matmul(const weight_view& w, const float* x, int64_t n_tok, float* y) override {
    check_matmul(w, x, n_tok, y, "matmul");
    run_op([=, this] { cpu_->matmul(w, x, n_tok, y); });
  }
  void matmul_n(const weight_view* w, int n_w, const float* x, int64_t n_tok, float* const* y) override {
    for (int i = 0; i < n_w; ++i) check_matmul(w[i], x, n_tok, y[i], "matmul_n");
    // The arrays are the caller's: a recorded call keeps copies, as a graph keeps launch arguments.
    run_op([=, this, wv = std::vector<weight_view>(w, w + n_w), yv = std::vector<float*>(y, y + n_w)] {
      cpu_->matmul_n(wv.data(), n_w, x, n_tok, yv.data());
    });
  }
  void get_rows(const weight_view& w, const int32_t* ids, int64_t n, float* out) override {
    check(w.data, w.bytes(), "get_rows", "w"), check(ids, n * 4, "get_rows", "ids");
    check(out, n * w.n_cols * 4, "get_rows", "out");
    run_op([=, this] { cpu_->get_rows(w, ids, n, out); });
  }
  void rms_norm(const float* x, const float* weight, int64_t n_tok, int64_t dim, float eps, float* y) override {
    check(x, n_tok * dim * 4, "rms_norm", "x"), check(weight, dim * 4, "rms_norm", "weight");
    check(y, n_tok * dim * 4, "rms_norm", "y");
    run_op([=, this] { cpu_->rms_norm(x, weight, n_tok, dim, eps, y); });
  }
  void rope(float* x, const int32_t* pos, int64_t n_tok, int n_head, const rope_config& cfg) override {
    check(x, n_tok * n_head * cfg.head_dim * 4, "rope", "x"), check(pos, n_tok * 4, "rope", "pos");
    run_op([=, this] { cpu_->rope(x, pos, n_tok, n_head, cfg); });
  }
  void swiglu(const float* gate, const float* up, int64_t n, float* out) override {
    check(gate, n * 4, "swiglu", "gate"), check(up, n * 4, "swiglu", "up"), check(out, n * 4, "swiglu", "out");
    run_op([=, this] { cpu_->swiglu(gate, up, n, out); });
  }
  void add(float* y, const float* x, int64_t n) override {
    check(y, n * 4, "add", "y"), check(x, n * 4, "add", "x");
    run_op([=, this] { cpu_->add(y, x, n); });
  }
  void add_rows(float* y, const float* b, int64_t n_tok, int64_t dim) override {
    check(y, n_tok * dim * 4, "add_rows", "y"), check(b, dim * 4, "add_rows", "b");
    run_op([=, this] { cpu_->add_rows(y, b, n_tok, dim); });
  }
  void convert_rows(void* dst, kv_dtype type, const float* src, int64_t n) override {
    check(dst, n * (type == kv_dtype::kv_f32 ? 4 : 2), "convert_rows", "dst"), check(src, n * 4, "convert_rows", "src");
    run_op([=, this] { cpu_->convert_rows(dst, type, src, n); });
  }
  void attention_partial(const attn_args& a) override {
    XCTX_CHECK(a.acc == nullptr, "device_space: attention with the exact accumulator (a host object)");
    const int64_t q_elems = a.n_q * a.n_head * a.head_dim, kv_elems = a.n_kv * a.n_head_kv * a.head_dim;
    const int64_t kv_bytes = kv_elems * (a.kv_type == kv_dtype::kv_f32 ? 4 : 2);
    check(a.q, q_elems * 4, "attention", "q"), check(a.q_pos, a.n_q * 4, "attention", "q_pos");
    if (a.n_kv > 0) {
      check(a.k, kv_bytes, "attention", "k"), check(a.v, kv_bytes, "attention", "v");
      check(a.kv_pos, a.n_kv * 4, "attention", "kv_pos");
    }
    check(a.o, q_elems * 4, "attention", "o"), check(a.lse, a.n_q * a.n_head * 4, "attention", "lse");
    ++attention_calls;
    run_op([=, this] { cpu_->attention_partial(a); });
  }
  void merge_partials(const float* o_parts, const float* lse_parts, int n_part, int64_t n_row, int head_dim, float* o,
                      float* lse) override {
    check(o_parts, n_part * n_row * head_dim * 4, "merge_partials", "o_parts");
    check(lse_parts, n_part * n_row * 4, "merge_partials", "lse_parts");
    check(o, n_row * head_dim * 4, "merge_partials", "o"), check(lse, n_row * 4, "merge_partials", "lse");
    run_op([=, this] { cpu_->merge_partials(o_parts, lse_parts, n_part, n_row, head_dim, o, lse); });
  }
  void kvq_encode(const kvq_encode_job& j) override {
    const int64_t C = j.channels, n = j.n, rb = (int64_t)kvq_row_bytes(j.channels, j.bits);
    if (j.x16 != nullptr) check_some(j.x16, n * C * 2, "kvq_encode", "x16");
    else check_some(j.x, n * C * 4, "kvq_encode", "x");
    check_some(j.codes, n * rb, "kvq_encode", "codes");
    switch (j.tensor) {
      case kvq_tensor::kvq_uniform_keys: check_some(j.affine, C * 4, "kvq_encode", "affine"); break;
      case kvq_tensor::kvq_uniform_values:
        check_some(j.affine, n * ((C + j.group - 1) / std::max(j.group, 1)) * 4, "kvq_encode", "affine");
        break;
      case kvq_tensor::kvq_lut_keys:
        check_some(j.lut, 4 << j.bits, "kvq_encode", "lut");
        check_some(j.ch_scale, C * 4, "kvq_encode", "ch_scale"), check_some(j.ch_zero, C * 4, "kvq_encode", "ch_zero");
        if (j.ch_lo != nullptr) {
          check_some(j.ch_lo, C * 4, "kvq_encode", "ch_lo"), check_some(j.ch_hi, C * 4, "kvq_encode", "ch_hi");
          check_some(j.out_idx, n * C * 2, "kvq_encode", "out_idx"), check_some(j.out_val, n * C * 2, "kvq_encode", "out_val");
          check_some(j.out_count, n * 4, "kvq_encode", "out_count");
        }
        break;
      case kvq_tensor::kvq_lut_values:
        check_some(j.lut, 4 << j.bits, "kvq_encode", "lut"), check_some(j.affine, n * 4, "kvq_encode", "affine");
        check_some(j.out_idx, n * 2 * j.v_out_side * 2, "kvq_encode", "out_idx");
        check_some(j.out_val, n * 2 * j.v_out_side * 2, "kvq_encode", "out_val");
        break;
    }
    run_op([=, this] { cpu_->kvq_encode(j); });
  }
  void kvq_append_outliers(const kvq_outlier_append& a) override {
    const int64_t n = a.n, C = a.channels, cap = (int64_t)a.capacity;
    check_some(a.count, n * 4, "kvq_append_outliers", "count");
    check_some(a.row_idx, n * C * 2, "kvq_append_outliers", "row_idx");
    check_some(a.row_val, n * C * 2, "kvq_append_outliers", "row_val");
    check(a.off, (n + 1) * 4, "kvq_append_outliers", "off");
    check_some(a.idx, cap * 2, "kvq_append_outliers", "idx"), check_some(a.val, cap * 2, "kvq_append_outliers", "val");
    ++outlier_appends;
    run_op([=, this] { cpu_->kvq_append_outliers(a); });
  }
  void attention_kvq(const kvq_attn_args& a) override {
    XCTX_CHECK(a.acc == nullptr, "device_space: attention with the exact accumulator (a host object)");
    const kvq_layer_view& L = a.kv;
    const int64_t C = L.channels(), nq = L.n_quant(), n_tail = L.n - L.q_end, q_rows = a.n_q * a.n_head;
    check(a.q, q_rows * L.head_dim * 4, "attention_kvq", "q"), check(a.q_pos, a.n_q * 4, "attention_kvq", "q_pos");
    check(a.o, q_rows * L.head_dim * 4, "attention_kvq", "o"), check(a.lse, q_rows * 4, "attention_kvq", "lse");
    check_some(L.pos, L.n * 4, "attention_kvq", "kv.pos");
    check_some(L.k_sink, L.n_sink * C * 2, "attention_kvq", "kv.k_sink");
    check_some(L.v_sink, L.n_sink * C * 2, "attention_kvq", "kv.v_sink");
    check_some(L.k_tail, n_tail * C * 2, "attention_kvq", "kv.k_tail");
    check_some(L.v_tail, n_tail * C * 2, "attention_kvq", "kv.v_tail");
    check_some(L.k_codes, nq * (int64_t)kvq_row_bytes((int)C, L.bits), "attention_kvq", "kv.k_codes");
    check_some(L.v_codes, nq * (int64_t)kvq_row_bytes((int)C, L.value_bits()), "attention_kvq", "kv.v_codes");
    if (L.scheme == kvq_scheme::kvq_uniform) {
      check_some(L.k_group, nq / std::max(L.group, 1) * C * 4, "attention_kvq", "kv.k_group");
      check_some(L.v_group, nq * ((C + L.group - 1) / std::max(L.group, 1)) * 4, "attention_kvq", "kv.v_group");
    } else {
      check_some(L.lut_k, 4 << L.bits, "attention_kvq", "kv.lut_k"), check_some(L.lut_v, 4 << L.bits, "attention_kvq", "kv.lut_v");
      check_some(L.k_ch_scale, C * 4, "attention_kvq", "kv.k_ch_scale");
      check_some(L.k_ch_zero, C * 4, "attention_kvq", "kv.k_ch_zero");
      check_some(L.v_tok, nq * 4, "attention_kvq", "kv.v_tok");
      if (L.k_out_off != nullptr) {
        check(L.k_out_off, (nq + 1) * 4, "attention_kvq", "kv.k_out_off");
        const int64_t nk = peek_u32(L.k_out_off + nq);  // the entry count the kernel will read
        check_some(L.k_out_idx, nk * 2, "attention_kvq", "kv.k_out_idx");
        check_some(L.k_out_val, nk * 2, "attention_kvq", "kv.k_out_val");
      }
      check_some(L.v_out_idx, nq * L.v_out_per_tok * 2, "attention_kvq", "kv.v_out_idx");
      check_some(L.v_out_val, nq * L.v_out_per_tok * 2, "attention_kvq", "kv.v_out_val");
    }
    ++attention_calls;
    run_op([=, this] { cpu_->attention_kvq(a); });
  }

  void xq_encode(const xq_encode_job& j) override {
    const int64_t C = j.channels, n = j.n, rb = (int64_t)kvq_row_bytes(j.channels, j.bits);
    if (j.x16 != nullptr) check_some(j.x16, n * C * 2, "xq_encode", "x16");
    else check_some(j.x, n * C * 4, "xq_encode", "x");
    if (j.codes != nullptr) check_some(j.codes, n * rb, "xq_encode", "codes");
    const int64_t n_params = j.axis == xq_axis::xq_per_channel ? n / std::max(j.group, 1) * C
                                                                : n * ((C + j.group - 1) / std::max(j.group, 1));
    check_some(j.params, n_params * 4, "xq_encode", "params");
    if (j.ch0 != nullptr) check_some(j.ch0, n * 2, "xq_encode", "ch0");
    run_op([=, this] { cpu_->xq_encode(j); });
  }
  void xq_project(const float* x, const float* u, int64_t n, int d, int r, float* out) override {
    check_some(x, n * d * 4, "xq_project", "x"), check(u, (int64_t)d * r * 4, "xq_project", "u");
    check_some(out, n * r * 4, "xq_project", "out");
    run_op([=, this] { cpu_->xq_project(x, u, n, d, r, out); });
  }
  void attention_xq(const xq_attn_args& a) override {
    XCTX_CHECK(a.acc == nullptr, "device_space: attention with the exact accumulator (a host object)");
    const int64_t q_rows = a.n_q * a.n_head, kv = (int64_t)a.n_head_kv * a.head_dim;
    check(a.q, q_rows * a.head_dim * 4, "attention_xq", "q"), check(a.q_pos, a.n_q * 4, "attention_xq", "q_pos");
    check(a.o, q_rows * a.head_dim * 4, "attention_xq", "o"), check(a.lse, q_rows * 4, "attention_xq", "lse");
    check_some(a.pos, a.n * 4, "attention_xq", "pos");
    check_stream(a.zk, a.n, "attention_xq zk");
    if (!a.same_stream) check_stream(a.zv, a.n, "attention_xq zv");
    if (a.m_k != nullptr) check(a.m_k, (a.zk.channels - 1) * a.ld_mk * 4 + kv * 4, "attention_xq", "m_k");
    if (a.m_v != nullptr) check(a.m_v, (a.zv.channels - 1) * a.ld_mv * 4 + kv * 4, "attention_xq", "m_v");
    if (a.b_k != nullptr) check(a.b_k, kv * 4, "attention_xq", "b_k");
    if (a.b_v != nullptr) check(a.b_v, kv * 4, "attention_xq", "b_v");
    ++attention_calls;
    run_op([=, this] { cpu_->attention_xq(a); });
  }
  void xq_decode_rows(const xq_stream& s, int64_t t0, int64_t nt, float* out) override {
    check_stream(s, t0 + nt, "xq_decode_rows s");
    check_some(out, nt * s.channels * 4, "xq_decode_rows", "out");
    run_op([=, this] { cpu_->xq_decode_rows(s, t0, nt, out); });
  }
  void xq_add_projected(const float* z, const float* u, int64_t n, int r, int d, float* acc) override {
    check_some(z, n * r * 4, "xq_add_projected", "z"), check(u, (int64_t)d * r * 4, "xq_add_projected", "u");
    check_some(acc, n * d * 4, "xq_add_projected", "acc");
    run_op([=, this] { cpu_->xq_add_projected(z, u, n, r, d, acc); });
  }
  void sub(float* y, const float* a, const float* b, int64_t n) override {
    check_some(y, n * 4, "sub", "y"), check_some(a, n * 4, "sub", "a"), check_some(b, n * 4, "sub", "b");
    run_op([=, this] { cpu_->sub(y, a, b, n); });
  }
  void synchronize() override { not_recording("synchronize"); }

  // Decode segments as the CUDA backend's graphs take them: eager at a key's first use; at its
  // second the ops f calls are recorded (checked, not run) with their arguments, and from then
  // on the record is replayed without calling f. A segment whose host code moves memory or
  // changes its calls' arguments between uses then computes the wrong thing here, as a graph
  // would on a GPU. Off unless record_segments is set.
  void run_segment(uint64_t key, const std::function<void()>& f) override {
    if (!record_segments) return f();
    XCTX_CHECK(recording_ == nullptr, "device_space: a segment began inside the recording of another");
    auto it = segments_.find(key);
    if (it == segments_.end()) {
      segments_.emplace(key, segment{});
      f();
      return;
    }
    segment& seg = it->second;
    if (!seg.recorded) {
      recording_ = &seg.ops;
      try {
        f();
      } catch (...) {
        recording_ = nullptr;
        seg.ops.clear();
        throw;
      }
      recording_ = nullptr;
      seg.recorded = true;
      ++segments_recorded;
    }
    for (const recorded_op& op : seg.ops) {
      used_ = op.used;
      with_memory_open(op.run);
    }
    ++segment_replays;
  }
  bool record_segments = false;
  int64_t segments_recorded = 0, segment_replays = 0;

  void copy(void* dst, const void* src, size_t bytes) override {
    check_some(dst, (int64_t)bytes, "copy", "dst"), check_some(src, (int64_t)bytes, "copy", "src");
    run_op([=, this] { cpu_->copy(dst, src, bytes); });
  }
  // The arrays of stream s holding rows [0, n), for op `at`.
  void check_stream(const xq_stream& s, int64_t n, const std::string& at) {
    const int64_t C = s.channels, nq = s.nq;
    if (s.dense != nullptr) {
      check_some(s.dense, n * C * 4, at.c_str(), "dense");
      return;
    }
    check_some(s.codes, nq * (int64_t)kvq_row_bytes(s.channels, s.bits), at.c_str(), "codes");
    const int64_t n_params = s.axis == xq_axis::xq_per_channel ? nq / std::max(s.group, 1) * C
                                                                : nq * ((C + s.group - 1) / std::max(s.group, 1));
    check_some(s.params, n_params * 4, at.c_str(), "params");
    check_some(s.tail, (n - nq) * C * 2, at.c_str(), "tail");
    if (s.ch0 != nullptr) check_some(s.ch0, nq * 2, at.c_str(), "ch0");
  }

  // check() for an argument that may be absent when it holds nothing (bytes == 0).
  void check_some(const void* p, int64_t bytes, const char* op, const char* arg) {
    if (bytes > 0) check(p, bytes, op, arg);
  }

  // A value in this backend's memory, read as a kernel would (not counted as a download).
  uint32_t peek_u32(const uint32_t* p) {
    const uintptr_t start = block_of(p, 4);
    XCTX_CHECK(start != 0, "device_space: peek at ", static_cast<const void*>(p), ", not in this backend's memory");
    XCTX_CHECK(mprotect(reinterpret_cast<void*>(start), blocks_.at(start), PROT_READ) == 0, "device_space: mprotect failed");
    const uint32_t v = *p;
    XCTX_CHECK(mprotect(reinterpret_cast<void*>(start), blocks_.at(start), PROT_NONE) == 0, "device_space: mprotect failed");
    return v;
  }

  // Whether [p, p + bytes) lies in one allocation.
  bool in_space(const void* p, size_t bytes) const { return block_of(p, bytes) != 0; }

  size_t memory_share = 0;  // what memory_share_bytes reports (0: the host's figure applies)
  int64_t uploads = 0, downloads = 0, attention_calls = 0, outlier_appends = 0;
  uint64_t upload_bytes = 0, download_bytes = 0;

  // Checks an op's argument and marks its allocation to be opened for the op.
  void check(const void* p, int64_t bytes, const char* op, const char* arg) {
    const uintptr_t start = block_of(p, (size_t)std::max<int64_t>(bytes, 1));
    if (start == 0) used_.clear();  // the op will not run
    XCTX_CHECK(start != 0, "device_space: ", op, " got ", arg, " = ", p, " (", bytes,
               " bytes), which is not in this backend's memory");
    used_.push_back(start);
  }
  void check_matmul(const weight_view& w, const float* x, int64_t n_tok, float* y, const char* op) {
    check(w.data, w.bytes(), op, "w"), check(x, n_tok * w.n_cols * 4, op, "x"), check(y, n_tok * w.n_rows * 4, op, "y");
  }
  // The allocation holding [p, p + bytes), 0 if none does.
  uintptr_t block_of(const void* p, size_t bytes) const {
    const auto u = reinterpret_cast<uintptr_t>(p);
    auto it = blocks_.upper_bound(u);
    if (p == nullptr || it == blocks_.begin()) return 0;
    --it;
    return u >= it->first && u + bytes <= it->first + it->second ? it->first : 0;
  }
  // Opens or closes the allocations the pending op was checked against (only those: opening
  // every allocation for every op costs whole-model page-table updates per kernel).
  void protect(int prot) {
    for (uintptr_t start : used_)
      XCTX_CHECK(mprotect(reinterpret_cast<void*>(start), blocks_.at(start), prot) == 0, "device_space: mprotect failed");
  }

  // Runs a kernel op, or records it while a segment is being recorded (run_segment).
  template <typename F>
  void run_op(F&& f) {
    if (recording_ == nullptr) return with_memory_open(f);
    std::sort(used_.begin(), used_.end());
    used_.erase(std::unique(used_.begin(), used_.end()), used_.end());
    recording_->push_back({std::move(used_), std::function<void()>(std::forward<F>(f))});
    used_.clear();
  }
  void not_recording(const char* op) const {
    XCTX_CHECK(recording_ == nullptr, "device_space: ", op, " inside a decode segment (a CUDA graph cannot hold it)");
  }

 public:
  // Runs f with the allocations of the arguments checked since the last op readable and
  // writable (what a device-side kernel or library sees), then closes them again.
  template <typename F>
  void with_memory_open(F&& f) {
    std::sort(used_.begin(), used_.end());
    used_.erase(std::unique(used_.begin(), used_.end()), used_.end());
    protect(PROT_READ | PROT_WRITE);
    try {
      f();
    } catch (...) {
      protect(PROT_NONE);
      used_.clear();
      throw;
    }
    protect(PROT_NONE);
    used_.clear();
  }

 private:
  std::unique_ptr<backend> cpu_;
  size_t page_;
  std::map<uintptr_t, size_t> blocks_;  // start -> mapped bytes
  std::vector<uintptr_t> used_;         // allocations the pending op was checked against
  struct recorded_op {
    std::vector<uintptr_t> used;  // the allocations it opens
    std::function<void()> run;    // the op with its arguments
  };
  struct segment {
    bool recorded = false;
    std::vector<recorded_op> ops;
  };
  std::map<uint64_t, segment> segments_;
  std::vector<recorded_op>* recording_ = nullptr;  // the segment being recorded
};

// Collectives on a device_space_backend's memory, as NCCL's are on the CUDA backend's: buffers
// must lie in its space (checked), and the transfer itself goes through a host communicator.
class device_space_communicator final : public communicator {
 public:
  device_space_communicator(device_space_backend& dev, communicator& host) : dev_(dev), host_(host) {}
  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  std::string name() const override { return "device-space(" + host_.name() + ")"; }
  void all_gather(const void* send, void* recv, size_t bytes) override {
    dev_.check(send, (int64_t)bytes, "all_gather", "send");
    dev_.check(recv, (int64_t)bytes * size(), "all_gather", "recv");
    ++all_gathers;
    dev_.with_memory_open([&] { host_.all_gather(send, recv, bytes); });
  }
  void all_reduce_sum(float*, size_t) override { fail("device_space_communicator: all_reduce_sum not emulated"); }
  void all_reduce_max(float*, size_t) override { fail("device_space_communicator: all_reduce_max not emulated"); }
  void broadcast(void*, size_t, int) override { fail("device_space_communicator: broadcast not emulated"); }
  void send(const void*, size_t, int, int) override { fail("device_space_communicator: send not emulated"); }
  void recv(void*, size_t, int, int) override { fail("device_space_communicator: recv not emulated"); }
  void sendrecv(const void* send_buf, size_t send_bytes, int dst, void* recv_buf, size_t recv_bytes, int src,
                int tag) override {
    dev_.check_some(send_buf, (int64_t)send_bytes, "sendrecv", "send_buf");
    dev_.check_some(recv_buf, (int64_t)recv_bytes, "sendrecv", "recv_buf");
    ++sendrecvs;
    dev_.with_memory_open([&] { host_.sendrecv(send_buf, send_bytes, dst, recv_buf, recv_bytes, src, tag); });
  }
  void barrier() override { host_.barrier(); }
  [[noreturn]] void abort(const std::string& why) override {
    host_.abort(why);
    std::abort();  // unreachable: a communicator's abort does not return
  }

  int64_t all_gathers = 0, sendrecvs = 0;

 private:
  device_space_backend& dev_;
  communicator& host_;
};

}  // namespace xctx::test
