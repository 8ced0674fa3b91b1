// The ops caches and biases use to move rows within a backend's memory: convert_rows (f32 copy,
// f16 rounding to nearest even) and add_rows. fp16 codes must be the same bits on every backend
// (a cache written on one is read on another through snapshots and ring blocks), so each is
// compared with common/half.h's fp32_to_fp16 bit for bit, over values chosen for the rounding's
// edges. The CUDA case skips without a usable device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/half.h"
#include "kernels/ops.h"
#include "registry/registry.h"
#include "require_gpu.h"

namespace xctx {
namespace {

// Normals, halfway cases both ways, subnormal halves, values that round up to the next binade
// or to infinity, zeros, infinities and NaN, then random values over the whole f32 range.
std::vector<float> edge_values() {
  std::vector<float> v = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, 1e-8f, -1e-8f,
                          5.96e-8f, 2.98e-8f, 2.99e-8f, 6.1e-5f, 6.097e-5f, 3.0e-5f, 1e10f, -1e10f,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()};
  // Exactly halfway between two halves: 1 + (2k + 1) * 2^-11, for even and odd k.
  for (int k = 0; k < 8; ++k) v.push_back(1.0f + (2 * k + 1) * std::ldexp(1.0f, -11));
  // Halfway between two subnormal halves: (2k + 1) * 2^-25.
  for (int k = 0; k < 8; ++k) v.push_back((2 * k + 1) * std::ldexp(1.0f, -25));
  std::mt19937 rng(1234);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 20000; ++i) {
    const uint32_t b = bits(rng);
    float f;
    std::memcpy(&f, &b, 4);
    v.push_back(f);
  }
  return v;
}

void expect_converts_like_the_host(backend& be) {
  const std::vector<float> src = edge_values();
  const int64_t n = (int64_t)src.size();
  backend_buffer s(be), h(be), f(be);
  be.upload(s.reserve(n * 4), src.data(), n * 4);
  be.convert_rows(h.reserve(n * 2), kv_dtype::kv_f16, s.as<float>(), n);
  be.convert_rows(f.reserve(n * 4), kv_dtype::kv_f32, s.as<float>(), n);
  std::vector<uint16_t> got(n);
  std::vector<uint32_t> copied(n);
  be.download(got.data(), h.as<void>(), n * 2);
  be.download(copied.data(), f.as<void>(), n * 4);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t want_bits;
    std::memcpy(&want_bits, &src[i], 4);
    ASSERT_EQ(got[i], fp32_to_fp16(src[i])) << be.name() << " f16 of " << src[i] << " (bits " << want_bits << ")";
    ASSERT_EQ(copied[i], want_bits) << be.name() << " f32 copy, element " << i;
  }
}

void expect_adds_rows_like_the_host(backend& be) {
  const int64_t rows = 7, dim = 97;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3, 3);
  std::vector<float> y(rows * dim), b(dim);
  for (float& x : y) x = u(rng);
  for (float& x : b) x = u(rng);
  backend_buffer dy(be), db(be);
  be.upload(dy.reserve(y.size() * 4), y.data(), y.size() * 4);
  be.upload(db.reserve(b.size() * 4), b.data(), b.size() * 4);
  be.add_rows(dy.as<float>(), db.as<float>(), rows, dim);
  std::vector<float> got(y.size());
  be.download(got.data(), dy.as<void>(), got.size() * 4);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < dim; ++i) ASSERT_EQ(got[t * dim + i], y[t * dim + i] + b[i]) << be.name() << " " << t << "," << i;
}

TEST(convert_rows, host_backends_round_like_fp32_to_fp16) {
  for (backend_kind k : {backend_kind::backend_ref, backend_kind::backend_cpu}) {
    auto be = make_backend(k);
    expect_converts_like_the_host(*be);
    expect_adds_rows_like_the_host(*be);
  }
}

TEST(convert_rows, cuda_rounds_like_fp32_to_fp16) {
  XCTX_REQUIRE_CUDA();
  auto be = make_backend(backend_kind::backend_cuda);
  expect_converts_like_the_host(*be);
  expect_adds_rows_like_the_host(*be);
}

}  // namespace
}  // namespace xctx
