// The CUDA quantized-KV encode kernels (kernels/cuda/kvq.cu). The device suite runs through the
// backend interface and GTEST_SKIPs without a usable CUDA device: every tensor kind x bits 2/3/4
// (plus no-threshold keys, side-0 values and a row of 8192 channels, the shared-memory sort
// limit): codes, scales, outliers byte-equal to ref::kvq_encode. Host suites (run everywhere):
// the sort key and bitonic network of the value-outlier selection and the encode launch plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cuda/kvq.cuh"
#include "kernels/kv_quant.h"
#include "kernels/ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/kvq_cuda_test_util.h"
#include "registry/registry.h"

namespace xctx {
namespace {

using namespace xctx::cuda;
using kvq_cuda_test::ascending_lut;
using kvq_cuda_test::device_arena;

constexpr float kInf = std::numeric_limits<float>::infinity();

// ---- host-only: the outlier sort ------------------------------------------------------------

std::vector<float> tricky_row(int C, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(C);
  for (float& v : x) v = std::round(nd(rng) * 4.0f) / 4.0f;  // coarse: many exact ties
  for (int c = 0; c < C; c += 11) x[c] = (c / 11) % 2 ? -0.0f : 0.0f;
  x[C / 3] = kInf, x[C / 2] = -kInf, x[C - 1] = 1e-40f;  // infinities and a subnormal
  return x;
}

std::vector<int> ref_order(const std::vector<float>& x) {
  std::vector<int> o(x.size());
  std::iota(o.begin(), o.end(), 0);
  std::sort(o.begin(), o.end(), [&](int a, int b) { return x[a] < x[b] || (x[a] == x[b] && a < b); });
  return o;
}

TEST(KvqCudaHost, order_key_sorts_like_the_reference_comparator) {
  const uint32_t seed = 11;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  const std::vector<float> x = tricky_row(300, rng);
  std::vector<uint64_t> keys(x.size());
  for (size_t c = 0; c < x.size(); ++c) keys[c] = kvq_order_key(x[c], (int)c);
  std::sort(keys.begin(), keys.end());
  const std::vector<int> want = ref_order(x);
  for (size_t e = 0; e < x.size(); ++e) ASSERT_EQ(kvq_order_channel(keys[e]), want[e]) << "rank " << e;
  EXPECT_LT(kvq_order_key(kInf, 65535), kvq_order_pad);
}

TEST(KvqCudaHost, bitonic_network_sorts_padded_rows) {
  const uint32_t seed = 12;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  for (int C : {8, 48, 300, 1040, 8192}) {
    const std::vector<float> x = tricky_row(C, rng);
    const int n = kvq_sort_size(C);
    ASSERT_TRUE(n >= C && n < 2 * C && (n & (n - 1)) == 0) << C;
    std::vector<uint64_t> keys(n, kvq_order_pad);
    for (int c = 0; c < C; ++c) keys[c] = kvq_order_key(x[c], c);
    for (int k = 2; k <= n; k <<= 1)  // the kernel's loop nest, items of a stage in any order
      for (int j = k >> 1; j > 0; j >>= 1)
        for (int i = n - 1; i >= 0; --i) kvq_bitonic_step(keys.data(), k, j, i);
    const std::vector<int> want = ref_order(x);
    for (int e = 0; e < C; ++e) ASSERT_EQ(kvq_order_channel(keys[e]), want[e]) << "C " << C << " rank " << e;
    for (int e = C; e < n; ++e) ASSERT_EQ(keys[e], kvq_order_pad) << "C " << C;
  }
}

TEST(KvqCudaHost, encode_plan_fits_the_sort_in_shared_memory_up_to_its_limit) {
  for (int C : {8, 1040, 4096, 8192}) {
    const kvq_encode_plan p = plan_kvq_encode(kvq_tensor::kvq_lut_values, C, 5, 132);
    EXPECT_EQ(p.blocks, 5u);
    EXPECT_GE(p.sort_n, C);
    EXPECT_GE(p.smem_bytes, (size_t)p.sort_n * 8 + C);
    EXPECT_LE(p.smem_bytes, (size_t)166912) << "exceeds the sm_80 opt-in shared memory, C " << C;
    if (C <= 4096) {
      EXPECT_LE(p.smem_bytes, (size_t)48 << 10) << "needs no opt-in, C " << C;
    }
  }
  try {
    plan_kvq_encode(kvq_tensor::kvq_lut_values, 8200, 1, 1);
    ADD_FAILURE() << "8200 channels accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("8192"), std::string::npos) << e.what();
  }
  EXPECT_EQ(plan_kvq_encode(kvq_tensor::kvq_uniform_keys, 1040, 32, 132).blocks, 9u);  // slabs of 128
  EXPECT_EQ(plan_kvq_encode(kvq_tensor::kvq_lut_keys, 64, 100000, 10).blocks, 80u);    // grid-stride rows
  EXPECT_EQ(plan_kvq_encode(kvq_tensor::kvq_uniform_values, 64, 0, 10).blocks, 0u);
}

// ---- device: encode -------------------------------------------------------------------------

struct encode_case {
  const char* name;
  kvq_tensor tensor;
  int bits;
  int channels;
  int64_t n;
  int group;       // uniform
  int side;        // lut values: outliers per side
  bool thresholds;  // lut keys: outlier thresholds on
  bool half_rows = false;  // uniform: the rows given as fp16 (x16), as kivi's window encodes them
};

class KvqCudaEncode : public ::testing::TestWithParam<encode_case> {};

TEST_P(KvqCudaEncode, device_is_bit_identical_to_ref) {
  XCTX_REQUIRE_CUDA();
  const encode_case p = GetParam();
  const uint32_t seed = 4242 + p.bits + 7 * (int)p.tensor;
  SCOPED_TRACE(::testing::Message() << p.name << " seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int C = p.channels;
  const int64_t n = p.n;
  std::vector<float> x((size_t)n * C);
  for (float& v : x) v = nd(rng) * 2.0f;
  for (int64_t t = 0; t < n; t += 3) x[t * C + (t % C)] = x[t * C + ((t + 5) % C)];  // ties
  for (int64_t t = 0; t < n; t += 4) x[t * C + 3] = 25.0f, x[t * C + 9] = -25.0f;  // extremes, repeated
  for (int64_t t = 1; t < n; t += 5) x[t * C + 11] = 25.0f;
  for (int c = 0; c < C; ++c) x[(n - 1) * C + c] = c % 3 == 0 ? -0.0f : 0.0f;  // a row of signed zeros
  for (int64_t t = 0; t < n; ++t)  // channels of signed zeros: the first zero decides the stored sign
    x[t * C + 5] = t % 2 ? -0.0f : 0.0f, x[t * C + 6] = t % 2 ? 0.0f : -0.0f;
  std::vector<float> lut = ascending_lut(p.bits, 1.7f);
  std::vector<float> sc(C), zc(C), lo(C), hi(C);
  for (int c = 0; c < C; ++c) {
    sc[c] = 2.0f + 0.01f * (c % 50), zc[c] = 0.02f * (c % 30);
    lo[c] = zc[c] - sc[c], hi[c] = zc[c] + sc[c];
  }
  const int n_vg = p.group > 0 ? (C + p.group - 1) / p.group : 1;
  const size_t n_aff = p.tensor == kvq_tensor::kvq_uniform_keys     ? (size_t)C
                       : p.tensor == kvq_tensor::kvq_uniform_values ? (size_t)n * n_vg
                                                                    : (size_t)n;
  const size_t out_w = p.tensor == kvq_tensor::kvq_lut_keys ? (size_t)C : (size_t)2 * p.side;
  struct outputs {
    std::vector<uint8_t> codes;
    std::vector<kvq_affine> aff;
    std::vector<uint16_t> idx, val;
    std::vector<uint32_t> cnt;
  };
  outputs r, d;
  for (outputs* o : {&r, &d}) {  // same fill: untouched scratch compares equal too
    o->codes.assign(n * kvq_row_bytes(C, p.bits), 0xA5);
    o->aff.assign(n_aff, kvq_affine{0x1234, 0x5678});
    o->idx.assign(std::max<size_t>(1, n * out_w), 0xBEEF), o->val.assign(o->idx.size(), 0xBEEF);
    o->cnt.assign(n, 0xDEADBEEF);
  }
  std::vector<uint16_t> x16;
  if (p.half_rows)
    for (float v : x) x16.push_back(fp32_to_fp16(v));
  kvq_encode_job j;
  j.tensor = p.tensor, j.bits = p.bits, j.channels = C, j.group = p.group, j.n = n, j.x = x.data();
  if (p.half_rows) j.x = nullptr, j.x16 = x16.data();
  j.lut = lut.data(), j.ch_scale = sc.data(), j.ch_zero = zc.data();
  if (p.thresholds) j.ch_lo = lo.data(), j.ch_hi = hi.data();
  j.v_out_side = p.side;
  j.codes = r.codes.data(), j.affine = r.aff.data(), j.out_idx = r.idx.data(), j.out_val = r.val.data();
  j.out_count = r.cnt.data();
  ref::kvq_encode(j);

  auto be = make_backend(backend_kind::backend_cuda);
  device_arena dev(*be);
  kvq_encode_job jd = j;
  if (p.half_rows) jd.x16 = dev.put(x16);
  else jd.x = dev.put(x);
  jd.lut = dev.put(lut), jd.ch_scale = dev.put(sc), jd.ch_zero = dev.put(zc);
  if (p.thresholds) jd.ch_lo = dev.put(lo), jd.ch_hi = dev.put(hi);
  jd.codes = dev.put(d.codes), jd.affine = dev.put(d.aff), jd.out_idx = dev.put(d.idx), jd.out_val = dev.put(d.val);
  jd.out_count = dev.put(d.cnt);
  be->kvq_encode(jd);
  be->download(d.codes.data(), jd.codes, d.codes.size());
  be->download(d.aff.data(), jd.affine, d.aff.size() * sizeof(kvq_affine));
  be->download(d.idx.data(), jd.out_idx, d.idx.size() * 2);
  be->download(d.val.data(), jd.out_val, d.val.size() * 2);
  be->download(d.cnt.data(), jd.out_count, d.cnt.size() * 4);

  ASSERT_EQ(r.codes, d.codes);
  for (size_t i = 0; i < n_aff; ++i) {
    ASSERT_EQ(r.aff[i].scale, d.aff[i].scale) << "affine " << i;
    ASSERT_EQ(r.aff[i].zero, d.aff[i].zero) << "affine " << i;
  }
  EXPECT_EQ(r.cnt, d.cnt);
  EXPECT_EQ(r.idx, d.idx);
  EXPECT_EQ(r.val, d.val);
}

using kt = kvq_tensor;
INSTANTIATE_TEST_SUITE_P(
    kinds, KvqCudaEncode,
    ::testing::Values(encode_case{"uniform_keys_2", kt::kvq_uniform_keys, 2, 1040, 32, 32, 0, false},
                      encode_case{"uniform_keys_3", kt::kvq_uniform_keys, 3, 1040, 32, 32, 0, false},
                      encode_case{"uniform_keys_4", kt::kvq_uniform_keys, 4, 1040, 32, 32, 0, false},
                      encode_case{"uniform_values_2", kt::kvq_uniform_values, 2, 1040, 37, 48, 0, false},
                      encode_case{"uniform_values_3", kt::kvq_uniform_values, 3, 1040, 37, 48, 0, false},
                      encode_case{"uniform_values_4", kt::kvq_uniform_values, 4, 1040, 37, 48, 0, false},
                      encode_case{"uniform_keys_2_fp16_rows", kt::kvq_uniform_keys, 2, 1040, 32, 32, 0, false, true},
                      encode_case{"uniform_values_3_fp16_rows", kt::kvq_uniform_values, 3, 1040, 37, 48, 0, false, true},
                      encode_case{"lut_keys_2", kt::kvq_lut_keys, 2, 1040, 37, 0, 0, true},
                      encode_case{"lut_keys_3", kt::kvq_lut_keys, 3, 1040, 37, 0, 0, true},
                      encode_case{"lut_keys_4", kt::kvq_lut_keys, 4, 1040, 37, 0, 0, true},
                      encode_case{"lut_keys_3_no_thresholds", kt::kvq_lut_keys, 3, 1040, 37, 0, 0, false},
                      encode_case{"lut_values_2", kt::kvq_lut_values, 2, 1040, 37, 0, 5, false},
                      encode_case{"lut_values_3", kt::kvq_lut_values, 3, 1040, 37, 0, 5, false},
                      encode_case{"lut_values_4", kt::kvq_lut_values, 4, 1040, 37, 0, 5, false},
                      encode_case{"lut_values_3_side0", kt::kvq_lut_values, 3, 1040, 37, 0, 0, false},
                      encode_case{"lut_values_4_c8192", kt::kvq_lut_values, 4, 8192, 3, 0, 41, false}),
    [](const auto& info) { return std::string(info.param.name); });

// ---- outlier append ------------------------------------------------------------------------

TEST(KvqCudaHost, outlier_copy_fills_the_sms_but_never_outnumbers_the_rows) {
  EXPECT_EQ(kvq_outlier_copy_blocks(0, 132), 0);
  EXPECT_EQ(kvq_outlier_copy_blocks(1, 132), 1);
  EXPECT_EQ(kvq_outlier_copy_blocks(5000, 132), 8 * 132);
  EXPECT_EQ(kvq_outlier_copy_blocks(5000, 0), 8);
}

// The device append (a one-block scan over tiles of kvq_threads rows, then a row-per-block copy)
// writes the host append's offsets and lists exactly: one row (a decode step), rows spanning
// several scan tiles, entries held before, and a capacity that cuts the lists.
TEST(KvqCudaOutliers, append_equals_the_host_append) {
  XCTX_REQUIRE_CUDA();
  auto be = make_backend(backend_kind::backend_cuda);
  const int C = 96;
  for (const int64_t n : {int64_t{1}, int64_t{127}, int64_t{300}, int64_t{1000}})
    for (const bool cut : {false, true}) {
      SCOPED_TRACE(::testing::Message() << n << " rows, capacity " << (cut ? "cut" : "ample"));
      const kvq_cuda_test::outlier_scratch s = kvq_cuda_test::make_outlier_scratch(n, C, 17 + (uint32_t)n);
      uint64_t total = 33;
      for (uint32_t c : s.count) total += c;
      const uint64_t cap = cut ? total * 2 / 3 : total + 5;
      std::vector<uint32_t> off(n + 1, 0xDEADu);
      off[0] = 33;
      std::vector<uint16_t> idx(cap, 0x1111), val(cap, 0x2222);
      device_arena dev(*be);
      kvq_outlier_append d;
      d.channels = C, d.n = n, d.count = dev.put(s.count), d.row_idx = dev.put(s.idx), d.row_val = dev.put(s.val);
      d.off = dev.put(off), d.idx = dev.put(idx), d.val = dev.put(val), d.capacity = cap;
      kvq_outlier_append h = d;
      h.count = s.count.data(), h.row_idx = s.idx.data(), h.row_val = s.val.data();
      h.off = off.data(), h.idx = idx.data(), h.val = val.data();
      kvq_append_outliers_host(h);
      be->kvq_append_outliers(d);
      std::vector<uint32_t> d_off(off.size());
      std::vector<uint16_t> d_idx(cap), d_val(cap);
      be->download(d_off.data(), d.off, d_off.size() * 4);
      be->download(d_idx.data(), d.idx, cap * 2), be->download(d_val.data(), d.val, cap * 2);
      EXPECT_EQ(d_off, off);
      EXPECT_EQ(d_idx, idx);
      EXPECT_EQ(d_val, val);
    }
}

}  // namespace
}  // namespace xctx
