// Shared by the CUDA backend test files (test_cuda_backend.cpp, test_cuda_attention.cpp): the
// reference-vs-CUDA harness (buffers in a backend's memory, both backends, element-wise
// comparison), weight and input generators, and the skip when no CUDA device is usable.
// Functions are inline (not static) so a file that uses some of them builds warning-free.
#pragma once

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "common/half.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "registry/registry.h"
#include "require_gpu.h"  // XCTX_REQUIRE_CUDA

namespace xctx {

// gtest prints parameters through PrintTo found by ADL; static keeps it out of other test files.
[[maybe_unused]] static void PrintTo(ggml_type t, std::ostream* os) {
  const char* n = ggml_traits(t).name;
  *os << (n ? n : "?");
}

namespace cuda_test {

inline constexpr double kEps = FLT_EPSILON;
inline constexpr double kTf32Operands = 2.0 / 1024.0;  // two operands, each within 2^-10 of exact
inline constexpr double kDoubleUlp = 1.0 / 9007199254740992.0;  // 2^-53
inline constexpr float kInf = std::numeric_limits<float>::infinity();


// ---- shared helpers ----------------------------------------------------------------------

inline const ggml_type kAllTypes[] = {
    ggml_type::ggml_f32,  ggml_type::ggml_f16,  ggml_type::ggml_bf16, ggml_type::ggml_q4_0, ggml_type::ggml_q4_1,
    ggml_type::ggml_q5_0, ggml_type::ggml_q5_1, ggml_type::ggml_q8_0, ggml_type::ggml_q8_1, ggml_type::ggml_q2_k,
    ggml_type::ggml_q3_k, ggml_type::ggml_q4_k, ggml_type::ggml_q5_k, ggml_type::ggml_q6_k, ggml_type::ggml_q8_k};

inline std::string type_name(ggml_type t) { return ggml_traits(t).name; }

// Sets the fp16/f32 scale fields of a block of random bytes to finite, modest values, so random
// code bytes decode to finite numbers. Offsets are the block layouts of quant_blocks.h.
inline void fix_scales(ggml_type t, uint8_t* blk, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.001f, 0.05f);
  auto half_at = [&](int off) {
    const uint16_t h = fp32_to_fp16(u(rng));
    std::memcpy(blk + off, &h, 2);
  };
  switch (t) {  // no default: every type decides
    case ggml_type::ggml_f32:
    case ggml_type::ggml_f16:
    case ggml_type::ggml_bf16: return;
    case ggml_type::ggml_q4_0:
    case ggml_type::ggml_q5_0:
    case ggml_type::ggml_q8_0: half_at(0); return;
    case ggml_type::ggml_q4_1:
    case ggml_type::ggml_q5_1:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k: half_at(0), half_at(2); return;
    case ggml_type::ggml_q2_k: half_at(80), half_at(82); return;
    case ggml_type::ggml_q3_k: half_at(108); return;
    case ggml_type::ggml_q6_k: half_at(208); return;
    case ggml_type::ggml_q8_k: {
      const float d = u(rng);
      std::memcpy(blk, &d, 4);
      return;
    }
  }
}

// A weight matrix in `t`: plain types from uniform floats; types the reference can encode via
// ref::quantize_row (realistic codes); the rest (K-quants) as random code bytes with sane scales.
inline std::vector<uint8_t> make_weight(ggml_type t, int64_t n_rows, int64_t n_cols, std::mt19937& rng) {
  const size_t row_bytes = ggml_row_bytes(t, n_cols);
  std::vector<uint8_t> out(row_bytes * (size_t)n_rows);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  if (ref::can_quantize(t)) {
    std::vector<float> row((size_t)n_cols);  // [n_cols]
    for (int64_t r = 0; r < n_rows; ++r) {
      for (float& v : row) v = u(rng);
      ref::quantize_row(t, row.data(), out.data() + (size_t)r * row_bytes, n_cols);
    }
    return out;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (uint8_t& b : out) b = (uint8_t)byte(rng);
  const ggml_type_traits tr = ggml_traits(t);
  for (size_t off = 0; off < out.size(); off += (size_t)tr.block_bytes) fix_scales(t, out.data() + off, rng);
  return out;
}

inline std::vector<float> uniform(size_t n, float lo, float hi, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// A buffer in one backend's memory.
class buffer {
 public:
  buffer(backend& be, size_t bytes) : be_(&be), p_(be.alloc(bytes)) {}
  template <typename T>
  buffer(backend& be, const std::vector<T>& host) : buffer(be, host.size() * sizeof(T)) {
    be.upload(p_, host.data(), host.size() * sizeof(T));
  }
  ~buffer() { be_->free(p_); }
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  template <typename T>
  std::vector<T> read(size_t n) const {
    std::vector<T> v(n);
    be_->download(v.data(), p_, n * sizeof(T));
    return v;
  }

 private:
  backend* be_;
  void* p_;
};

struct backends {
  std::unique_ptr<backend> ref = make_backend(backend_kind::backend_ref);
  std::unique_ptr<backend> cuda = make_backend(backend_kind::backend_cuda);
};

// Compares element-wise; reports the first few violations and the count.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::vector<double>& tol,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool same_inf = std::isinf(want[i]) && got[i] == want[i];
    const double err = std::fabs((double)got[i] - (double)want[i]);
    if (!same_inf && !(err <= tol[i])) {
      if (++bad <= 5)
        ADD_FAILURE() << what << "[" << i << "]: cuda " << got[i] << " ref " << want[i] << " |diff| " << err
                      << " > tol " << tol[i];
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " elements out of tolerance";
}

inline uint32_t seed_of(const std::string& name) {
  uint32_t h = 2166136261u;  // FNV-1a: a stable seed per test case
  for (char c : name) h = (h ^ (uint8_t)c) * 16777619u;
  return h;
}

}  // namespace cuda_test
}  // namespace xctx
