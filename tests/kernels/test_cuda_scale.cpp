// Decode attention at the product's scale on a real device: one query over millions of keys of
// one layer (SmolLM2's 9/3 heads of 64) against a double-precision host reference. Three needle
// keys aligned with the query carry most of the softmax mass (each ~e^20 against ~10^7 ordinary
// keys), one at the start, one inside and one at the end, so a split whose partial is lost or
// mis-merged moves the output by O(1), far beyond the bound. The bound follows the kernel's plan
// (kernels/cuda/attention.cuh): each warp accumulates chunk / attn_warps keys in order, so the
// summation depth, not n_kv, sets the rounding.
//
// Needs a device and XCTX_CUDA_SCALE=1 (the device check, launch/device-check, sets it): the
// 10M-key case reads 7.7 GB of fp16 keys and values and its reference takes seconds on 16 cores.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/half.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/device.h"
#include "kernels/ops.h"
#include "registry/registry.h"

#include "kernels/cuda_backend_test_util.h"

namespace xctx {
namespace {

using namespace cuda_test;

constexpr int kHeads = 9, kHeadsKv = 3, kDim = 64;

// A value in [-1, 1) from a counter (splitmix64): the same data on any thread count.
float hashed(uint64_t i) {
  uint64_t z = i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (float)((double)(z >> 40) / (double)(1ull << 23)) - 1.0f;
}

struct scale_case {
  kv_dtype kv;
  int64_t n_kv;
};

std::string case_name(const scale_case& c) {
  return std::string(c.kv == kv_dtype::kv_f16 ? "f16_" : "f32_") + std::to_string(c.n_kv >> 20) + "M";
}

class CudaScale : public testing::TestWithParam<scale_case> {};

TEST_P(CudaScale, DecodeMatchesDoubleReference) {
  XCTX_REQUIRE_CUDA();
  const char* on = std::getenv("XCTX_CUDA_SCALE");
  if (!on || std::string(on) != "1") GTEST_SKIP() << "scale test: set XCTX_CUDA_SCALE=1 (launch/device-check does)";
  const scale_case c = GetParam();
  const int64_t n = c.n_kv, row = (int64_t)kHeadsKv * kDim;
  const bool half = c.kv == kv_dtype::kv_f16;
  std::vector<float> q((size_t)kHeads * kDim);
  for (size_t e = 0; e < q.size(); ++e) q[e] = hashed(e + (1ull << 62));
  const int64_t needles[3] = {0, n / 3 + 17, n - 1};
  // Keys and values as the device stores them (fp16 bits or f32), generated in parallel.
  std::vector<uint16_t> k16(half ? (size_t)(n * row) : 0), v16(half ? (size_t)(n * row) : 0);
  std::vector<float> k32(half ? 0 : (size_t)(n * row)), v32(half ? 0 : (size_t)(n * row));
  auto key_at = [&](int64_t j, int e) -> float {
    for (int64_t nd : needles)
      if (j == nd) {  // aligned with query head g*3 of its group: score ~ 0.125 * 5 * sum|q| ~ 20
        const int g = e / kDim, d = e % kDim;
        return q[(size_t)(g * (kHeads / kHeadsKv) * kDim + d)] >= 0 ? 5.0f : -5.0f;
      }
    return hashed((uint64_t)(j * row + e));
  };
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n; ++j)
    for (int e = 0; e < row; ++e) {
      const float kv = key_at(j, e), vv = hashed((uint64_t)(j * row + e) + (1ull << 61));
      const float vn = (j == needles[0] ? 1.0f : j == needles[1] ? -1.0f : j == needles[2] ? 0.5f : 0.0f);
      const float v = vn != 0.0f ? vn : vv;
      if (half)
        k16[(size_t)(j * row + e)] = fp32_to_fp16(kv), v16[(size_t)(j * row + e)] = fp32_to_fp16(v);
      else
        k32[(size_t)(j * row + e)] = kv, v32[(size_t)(j * row + e)] = v;
    }
  auto K = [&](int64_t j, int e) -> double {
    return half ? fp16_to_fp32(k16[(size_t)(j * row + e)]) : k32[(size_t)(j * row + e)];
  };
  auto V = [&](int64_t j, int e) -> double {
    return half ? fp16_to_fp32(v16[(size_t)(j * row + e)]) : v32[(size_t)(j * row + e)];
  };
  std::vector<int32_t> kv_pos((size_t)n);
  for (int64_t j = 0; j < n; ++j) kv_pos[(size_t)j] = (int32_t)j;
  const int32_t q_pos = (int32_t)n;
  const float scale = 1.0f / std::sqrt((float)kDim);

  // The device's (o, lse).
  auto gpu = make_backend(backend_kind::backend_cuda);
  std::vector<float> o((size_t)kHeads * kDim), lse(kHeads);
  {
    buffer qd(*gpu, q), qp(*gpu, std::vector<int32_t>{q_pos}), kp(*gpu, kv_pos);
    buffer kd = half ? buffer(*gpu, k16) : buffer(*gpu, k32);
    buffer vd = half ? buffer(*gpu, v16) : buffer(*gpu, v32);
    buffer od(*gpu, o.size() * sizeof(float)), ld(*gpu, lse.size() * sizeof(float));
    attn_args a;
    a.q = qd.as<float>(), a.q_pos = qp.as<int32_t>(), a.n_q = 1;
    a.k = kd.as<void>(), a.v = vd.as<void>(), a.kv_pos = kp.as<int32_t>(), a.n_kv = n, a.kv_type = c.kv;
    a.n_head = kHeads, a.n_head_kv = kHeadsKv, a.head_dim = kDim, a.scale = scale;
    a.o = od.as<float>(), a.lse = ld.as<float>();
    a.rope.head_dim = kDim, a.rope.n_rot = kDim;
    gpu->attention_partial(a);
    o = od.read<float>(o.size());
    lse = ld.read<float>(lse.size());
  }

  // The reference in double, per head: max score, then sum and weighted values.
  const cuda_probe probe = probe_cuda();
  ASSERT_GE(probe.bound, 0);
  const cuda::attn_plan plan =
      cuda::plan_attention(1, n, kHeads, kHeadsKv, kDim, probe.devices[(size_t)probe.bound].sm_count);
  const double depth = (double)plan.chunk / cuda::attn_warps + (double)plan.chunk / (cuda::attn_warps * cuda::attn_tile) +
                       cuda::attn_warps + plan.n_split;
  const int group = kHeads / kHeadsKv;
  double worst_ratio = 0.0;
  for (int h = 0; h < kHeads; ++h) {
    const int g = h / group;
    const float* qr = q.data() + (size_t)h * kDim;
    double m = -INFINITY, smax = 0.0, vmax = 0.0;
#pragma omp parallel for reduction(max : m, smax, vmax)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0, sa = 0.0;
      for (int d = 0; d < kDim; ++d) {
        const double kk = K(j, g * kDim + d);
        s += qr[d] * kk, sa += std::fabs(qr[d] * kk);
        vmax = std::max(vmax, std::fabs(V(j, g * kDim + d)));
      }
      m = std::max(m, s * scale), smax = std::max(smax, sa * scale);
    }
    double l = 0.0;
    std::vector<double> acc(kDim, 0.0);
#pragma omp parallel
    {
      double l_t = 0.0;
      std::vector<double> acc_t(kDim, 0.0);
#pragma omp for nowait
      for (int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (int d = 0; d < kDim; ++d) s += qr[d] * K(j, g * kDim + d);
        const double p = std::exp(s * scale - m);
        l_t += p;
        for (int d = 0; d < kDim; ++d) acc_t[d] += p * V(j, g * kDim + d);
      }
#pragma omp critical
      {
        l += l_t;
        for (int d = 0; d < kDim; ++d) acc[d] += acc_t[d];
      }
    }
    const double ds = (kDim + 2) * kEps * smax;
    const double want_lse = m + std::log(l);
    const double tol_lse = 2 * ds + (depth + 8) * kEps * (1.0 + std::fabs(want_lse));
    EXPECT_LE(std::fabs(lse[h] - want_lse), tol_lse) << "head " << h << " lse";
    worst_ratio = std::max(worst_ratio, std::fabs(lse[h] - want_lse) / tol_lse);
    for (int d = 0; d < kDim; ++d) {
      const double want = acc[d] / l;
      const double tol = vmax * (4 * ds + (2 * depth + 16) * kEps) + kEps * std::fabs(want);
      const double err = std::fabs(o[(size_t)(h * kDim + d)] - want);
      EXPECT_LE(err, tol) << "head " << h << " dim " << d << ": cuda " << o[(size_t)(h * kDim + d)] << " ref " << want;
      worst_ratio = std::max(worst_ratio, err / tol);
    }
  }
  std::printf("[cuda scale] %s: %lld keys, %d splits of %lld keys, worst observed/bound %.2e\n", case_name(c).c_str(),
              (long long)n, plan.n_split, (long long)plan.chunk, worst_ratio);
}

INSTANTIATE_TEST_SUITE_P(Keys, CudaScale,
                         testing::Values(scale_case{kv_dtype::kv_f16, int64_t(10) << 20},
                                         scale_case{kv_dtype::kv_f32, int64_t(4) << 20}),
                         [](const testing::TestParamInfo<scale_case>& i) { return case_name(i.param); });

}  // namespace
}  // namespace xctx
