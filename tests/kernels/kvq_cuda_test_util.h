// Shared by the CUDA quantized-KV tests (test_kvq_cuda.cpp: attention, test_kvq_cuda_encode.cpp:
// encode): the device-test guard, device copies of host arrays, the test datatypes.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "registry/registry.h"
#include "require_gpu.h"  // XCTX_REQUIRE_CUDA


namespace xctx::kvq_cuda_test {

// Device copies of host arrays, freed with the backend.
class device_arena {
 public:
  explicit device_arena(backend& be) : be_(be) {}
  ~device_arena() {
    for (void* p : ptrs_) be_.free(p);
  }
  device_arena(const device_arena&) = delete;
  device_arena& operator=(const device_arena&) = delete;
  template <class T>
  T* put(const std::vector<T>& v) {
    if (v.empty()) return nullptr;
    T* p = alloc<T>(v.size());
    be_.upload(p, v.data(), v.size() * sizeof(T));
    return p;
  }
  template <class T>
  T* alloc(size_t n) {
    void* p = be_.alloc(std::max<size_t>(1, n) * sizeof(T));
    ptrs_.push_back(p);
    return static_cast<T*>(p);
  }

 private:
  backend& be_;
  std::vector<void*> ptrs_;
};

// A monotone nuq datatype of 2^bits levels in [-1, 1], |u|^power-shaped.
inline std::vector<float> ascending_lut(int bits, float power) {
  const int n = 1 << bits;
  std::vector<float> l(n);
  for (int i = 0; i < n; ++i) {
    const float u = -1.0f + 2.0f * (float)i / (float)(n - 1);
    l[i] = std::copysign(std::pow(std::fabs(u), power), u);
  }
  return l;
}

// kvq_encode's per-row key outlier scratch for n rows of C channels: counts from 0 to C (every
// fifth row none, the last row full), entries numbered so a misplaced one is seen; the rest
// of each row holds a filler no append may copy.
struct outlier_scratch {
  std::vector<uint32_t> count;     // [n]
  std::vector<uint16_t> idx, val;  // [n, C]
};
inline outlier_scratch make_outlier_scratch(int64_t n, int C, uint32_t seed) {
  std::mt19937 rng(seed);
  outlier_scratch s;
  s.count.resize(n), s.idx.assign((size_t)n * C, 0xFFFF), s.val.assign((size_t)n * C, 0xFFFF);
  for (int64_t i = 0; i < n; ++i) {
    s.count[i] = i == n - 1 ? (uint32_t)C : i % 5 == 0 ? 0u : (uint32_t)(rng() % (C / 4 + 1));
    for (uint32_t e = 0; e < s.count[i]; ++e)
      s.idx[i * C + e] = (uint16_t)((e * 7 + i) % C), s.val[i * C + e] = (uint16_t)(i * 31 + e);
  }
  return s;
}

}  // namespace xctx::kvq_cuda_test
