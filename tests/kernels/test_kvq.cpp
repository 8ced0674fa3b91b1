// Quantized-cache kernels: bit packing, and the CPU encoder producing exactly the reference
// encoder's codes, scales and outliers for every tensor kind and bit width; the AVX2 row
// decoders never read outside a row.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>

#include "common/half.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/kvq/kvq_impl.h"
#include "kernels/kv_quant.h"
#include "kernels/kvq_cuda_test_util.h"
#include "kernels/ref/ref_ops.h"
#include "test_util.h"

namespace xctx {
namespace {

TEST(kvq_packing, every_code_round_trips) {
  std::mt19937 rng(1);
  for (int bits = 2; bits <= 4; ++bits) {
    const int C = 72;
    std::vector<uint8_t> codes(C), row(kvq_row_bytes(C, bits), 0xAA);
    for (auto& c : codes) c = (uint8_t)(rng() % (1u << bits));
    for (int i = 0; i < C; i += 8) kvq_pack8(codes.data() + i, bits, row.data() + i / 8 * bits);
    for (int i = 0; i < C; ++i) ASSERT_EQ(kvq_get_code(row.data(), bits, i), codes[i]) << "bits " << bits << " i " << i;
  }
}

TEST(kvq_math, lut_encode_picks_the_nearest_signpost_ties_low) {
  const float lut[4] = {-1.0f, -0.25f, 0.25f, 1.0f};
  EXPECT_EQ(kvq_lut_encode(-2.0f, lut, 4), 0);
  EXPECT_EQ(kvq_lut_encode(-0.625f, lut, 4), 0);  // exactly between: the lower one
  EXPECT_EQ(kvq_lut_encode(-0.6f, lut, 4), 1);
  EXPECT_EQ(kvq_lut_encode(0.0f, lut, 4), 1);
  EXPECT_EQ(kvq_lut_encode(0.9f, lut, 4), 3);
  const kvq_affine p = kvq_uniform_params(-1.0f, 2.0f, 2);  // step 1
  EXPECT_EQ(kvq_uniform_encode(-1.0f, p, 2), 0);
  EXPECT_EQ(kvq_uniform_encode(0.4f, p, 2), 1);
  EXPECT_EQ(kvq_uniform_encode(5.0f, p, 2), 3);  // clamped
  EXPECT_EQ(kvq_uniform_encode(3.0f, kvq_uniform_params(3.0f, 3.0f, 2), 2), 0);  // constant group
}

// Bytes that end exactly where an inaccessible page begins: a load past the end faults (SIGSEGV
// fails the test), in any build, sanitizer or not.
class guarded_bytes {
 public:
  explicit guarded_bytes(size_t n) : page_((size_t)sysconf(_SC_PAGESIZE)), n_(n) {
    len_ = (n + page_ - 1) / page_ * page_ + page_;
    void* m = mmap(nullptr, len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::runtime_error("guarded_bytes: mmap failed");
    base_ = static_cast<uint8_t*>(m);
    if (mprotect(base_ + len_ - page_, page_, PROT_NONE) != 0) throw std::runtime_error("guarded_bytes: mprotect failed");
  }
  ~guarded_bytes() { munmap(base_, len_); }
  guarded_bytes(const guarded_bytes&) = delete;
  guarded_bytes& operator=(const guarded_bytes&) = delete;
  uint8_t* data() const { return base_ + len_ - page_ - n_; }

 private:
  size_t page_, n_, len_ = 0;
  uint8_t* base_ = nullptr;
};

// Every AVX2 row decoder on a row that ends at a guard page, so a wide load meant for the row's
// middle but issued at its end faults. The X-cache decoder must equal its scalar loop bitwise,
// the KV decoders (one FMA) theirs within the rounding the FMA saves.
TEST(kvq_avx2_rows, stay_inside_a_row_that_ends_at_a_guard_page) {
  if (!cpu::has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  std::mt19937 rng(7);
  for (int bits = 1; bits <= 4; ++bits) {
    for (int C : {8, 16, 24, 32, 40, 64, 72, 128, 576}) {
      SCOPED_TRACE(::testing::Message() << "bits " << bits << " C " << C);
      const size_t rb = kvq_row_bytes(C, bits);
      guarded_bytes row(rb);
      for (size_t i = 0; i < rb; ++i) row.data()[i] = (uint8_t)rng();
      std::vector<float> sc(C), zc(C), got(C), want(C);
      for (int c = 0; c < C; ++c) sc[c] = 0.25f + 0.01f * c, zc[c] = -1.0f + 0.03f * c;
      // The X-cache decoder (bits 1..4): a product then a sum, as the scalar loop in xq.cpp.
      cpu::impl::avx2::affine_codes_row(row.data(), C, bits, sc.data(), zc.data(), got.data());
      for (int c = 0; c < C; ++c) want[c] = (float)kvq_get_code(row.data(), bits, c) * sc[c] + zc[c];
      for (int c = 0; c < C; ++c) ASSERT_EQ(got[c], want[c]) << "c " << c;
      if (bits < 2) continue;
      // The KV decoders (bits 2..4), one uniform layer whose only quantized row is the guarded one.
      const int group = 8;
      std::vector<kvq_affine> v_group((C + group - 1) / group);
      for (size_t g = 0; g < v_group.size(); ++g) v_group[g] = {fp32_to_fp16(0.5f + 0.1f * g), fp32_to_fp16(-0.2f * g)};
      kvq_layer_view v;
      v.scheme = kvq_scheme::kvq_uniform, v.bits = bits, v.n_head_kv = 1, v.head_dim = C, v.group = group;
      v.n = v.q_end = 1;
      v.k_codes = v.v_codes = row.data();
      v.v_group = v_group.data();
      for (int keys = 0; keys < 2; ++keys) {
        if (keys) {
          cpu::impl::avx2::kvq_decode_keys(v, 0, 1, sc.data(), zc.data(), got.data());
          cpu::impl::kvq_decode_keys_scalar(v, 0, 1, sc.data(), zc.data(), want.data());
        } else {
          cpu::impl::avx2::kvq_decode_values(v, 0, 1, got.data());
          cpu::impl::kvq_decode_values_scalar(v, 0, 1, want.data());
        }
        // The vector code fuses code·scale + zero (one rounding), the scalar code also rounds the
        // product: they differ by at most half an ulp of the product plus half an ulp of the result,
        // both below 128 here (15 · 7.6 and the zeros), so 2 · 2^-18 = 64 FLT_EPSILON.
        for (int c = 0; c < C; ++c) ASSERT_NEAR(got[c], want[c], FLT_EPSILON * 64) << "keys " << keys << " c " << c;
      }
    }
  }
}

struct encode_case {
  kvq_tensor tensor;
  int bits;
  int side;  // value outliers per side / key thresholds on (1) or off (0)
  const char* name;
};

class kvq_encode_test : public ::testing::TestWithParam<encode_case> {};

TEST_P(kvq_encode_test, cpu_is_bit_identical_to_ref) {
  const encode_case p = GetParam();
  const uint32_t seed = 1234 + p.bits;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  const int C = 48, group = 16;
  const int64_t n = p.tensor == kvq_tensor::kvq_uniform_keys ? group : 300;
  std::vector<float> x(n * C);
  for (float& v : x) v = nd(rng) * 2.0f;
  for (int64_t t = 0; t < n; t += 7) x[t * C + (t % C)] = x[t * C + ((t + 1) % C)];  // ties
  for (int64_t t = 0; t < n; t += 5) x[t * C + 3] = 25.0f;                          // outliers
  // A row of signed zeros: which of equal extremes is kept decides the stored sign of the
  // scale (+0 first, -0 last).
  for (int c = 0; c < C; ++c) x[(n - 1) * C + c] = c + 1 < C ? 0.0f : -0.0f;
  std::vector<float> lut(1 << p.bits);
  for (size_t i = 0; i < lut.size(); ++i) lut[i] = -1.0f + 2.0f * (float)(i * i) / (float)((lut.size() - 1) * (lut.size() - 1));
  std::vector<float> sc(C), zc(C), lo(C), hi(C);
  for (int c = 0; c < C; ++c) sc[c] = 2.0f + 0.1f * c, zc[c] = 0.05f * c, lo[c] = zc[c] - sc[c], hi[c] = zc[c] + sc[c];
  const int n_aff = p.tensor == kvq_tensor::kvq_uniform_keys ? C
                    : p.tensor == kvq_tensor::kvq_uniform_values ? (int)n * ((C + group - 1) / group)
                                                                : (int)n;
  const int out_w = p.tensor == kvq_tensor::kvq_lut_keys ? C : 2 * p.side;
  struct outputs {
    std::vector<uint8_t> codes;
    std::vector<kvq_affine> aff;
    std::vector<uint16_t> idx, val;
    std::vector<uint32_t> cnt;
  } r, c;
  for (outputs* o : {&r, &c}) {
    o->codes.assign(n * kvq_row_bytes(C, p.bits), 0);
    o->aff.assign(n_aff, kvq_affine{0, 0});
    o->idx.assign(n * std::max(1, out_w), 0), o->val.assign(n * std::max(1, out_w), 0), o->cnt.assign(n, 0);
  }
  auto run = [&](outputs& o, void (*enc)(const kvq_encode_job&)) {
    kvq_encode_job j;
    j.tensor = p.tensor, j.bits = p.bits, j.channels = C, j.group = group, j.n = n, j.x = x.data();
    j.lut = lut.data(), j.ch_scale = sc.data(), j.ch_zero = zc.data();
    if (p.side > 0 && p.tensor == kvq_tensor::kvq_lut_keys) j.ch_lo = lo.data(), j.ch_hi = hi.data();
    j.v_out_side = p.tensor == kvq_tensor::kvq_lut_values ? p.side : 0;
    j.codes = o.codes.data(), j.affine = o.aff.data(), j.out_idx = o.idx.data(), j.out_val = o.val.data();
    j.out_count = o.cnt.data();
    enc(j);
  };
  run(r, ref::kvq_encode);
  run(c, cpu::kvq_encode);
  EXPECT_EQ(r.codes, c.codes);
  for (int i = 0; i < n_aff; ++i) {
    ASSERT_EQ(r.aff[i].scale, c.aff[i].scale) << i;
    ASSERT_EQ(r.aff[i].zero, c.aff[i].zero) << i;
  }
  EXPECT_EQ(r.cnt, c.cnt);
  EXPECT_EQ(r.idx, c.idx);
  EXPECT_EQ(r.val, c.val);
  if (p.tensor == kvq_tensor::kvq_lut_keys && p.side > 0) {
    uint32_t total = 0;
    for (uint32_t k : r.cnt) total += k;
    EXPECT_GT(total, 0u);  // the planted 25.0 values lie outside every channel's range
  }
}

INSTANTIATE_TEST_SUITE_P(
    kinds, kvq_encode_test,
    ::testing::Values(encode_case{kvq_tensor::kvq_uniform_keys, 2, 0, "uniform_keys_2"},
                      encode_case{kvq_tensor::kvq_uniform_keys, 3, 0, "uniform_keys_3"},
                      encode_case{kvq_tensor::kvq_uniform_keys, 4, 0, "uniform_keys_4"},
                      encode_case{kvq_tensor::kvq_uniform_values, 2, 0, "uniform_values_2"},
                      encode_case{kvq_tensor::kvq_uniform_values, 3, 0, "uniform_values_3"},
                      encode_case{kvq_tensor::kvq_uniform_values, 4, 0, "uniform_values_4"},
                      encode_case{kvq_tensor::kvq_lut_keys, 2, 0, "lut_keys_2"},
                      encode_case{kvq_tensor::kvq_lut_keys, 3, 1, "lut_keys_3_outliers"},
                      encode_case{kvq_tensor::kvq_lut_keys, 4, 1, "lut_keys_4_outliers"},
                      encode_case{kvq_tensor::kvq_lut_values, 2, 0, "lut_values_2"},
                      encode_case{kvq_tensor::kvq_lut_values, 3, 1, "lut_values_3_outliers"},
                      encode_case{kvq_tensor::kvq_lut_values, 4, 3, "lut_values_4_outliers3"}),
    [](const auto& info) { return std::string(info.param.name); });

// kivi's window lives in fp16; its groups are encoded from those fp16 rows (x16) with no f32
// copy. The codes and affines must be exactly those of the same rows widened to f32, on both
// encoders; the lut tensors take f32 only and refuse x16.
TEST(kvq_encode_fp16_rows, encode_exactly_like_their_widened_f32_rows) {
  std::mt19937 rng(77);
  std::normal_distribution<float> nd;
  const int C = 48, group = 16;
  const int64_t n = group;
  std::vector<uint16_t> x16(n * C);
  for (uint16_t& h : x16) h = fp32_to_fp16(nd(rng) * 3.0f);
  x16[5] = fp32_to_fp16(-0.0f), x16[C + 7] = fp32_to_fp16(40.0f);
  std::vector<float> wide(x16.size());
  for (size_t i = 0; i < x16.size(); ++i) wide[i] = fp16_to_fp32(x16[i]);
  for (kvq_tensor t : {kvq_tensor::kvq_uniform_keys, kvq_tensor::kvq_uniform_values})
    for (int bits : {2, 3, 4})
      for (void (*enc)(const kvq_encode_job&) : {ref::kvq_encode, cpu::kvq_encode}) {
        const size_t n_aff = t == kvq_tensor::kvq_uniform_keys ? C : n * ((C + group - 1) / group);
        std::vector<uint8_t> codes_h(n * kvq_row_bytes(C, bits)), codes_f(codes_h.size());
        std::vector<kvq_affine> aff_h(n_aff), aff_f(n_aff);
        kvq_encode_job j;
        j.tensor = t, j.bits = bits, j.channels = C, j.group = group, j.n = n;
        j.x16 = x16.data(), j.codes = codes_h.data(), j.affine = aff_h.data();
        enc(j);
        j.x16 = nullptr, j.x = wide.data(), j.codes = codes_f.data(), j.affine = aff_f.data();
        enc(j);
        ASSERT_EQ(codes_h, codes_f) << (int)t << " bits " << bits;
        for (size_t i = 0; i < n_aff; ++i) {
          ASSERT_EQ(aff_h[i].scale, aff_f[i].scale) << i;
          ASSERT_EQ(aff_h[i].zero, aff_f[i].zero) << i;
        }
      }
  for (void (*enc)(const kvq_encode_job&) : {ref::kvq_encode, cpu::kvq_encode}) {
    kvq_encode_job j;
    j.tensor = kvq_tensor::kvq_lut_values, j.bits = 3, j.channels = C, j.n = n, j.x16 = x16.data();
    test::expect_error_contains([&] { enc(j); }, "fp16 input rows (x16) are for the uniform tensors only");
  }
}

// The outlier append (kernels/kv_quant.h), against lists built the obvious way: offsets continue
// from off[0], rows' entries are concatenated in order, nothing past the capacity is written
// (the offsets are), and the same append after growing writes the whole lists.
TEST(kvq_outlier_append, concatenates_rows_after_the_held_entries) {
  const int C = 24;
  const int64_t n = 41;
  const uint32_t held = 9;
  const kvq_cuda_test::outlier_scratch s = kvq_cuda_test::make_outlier_scratch(n, C, 5);
  std::vector<uint32_t> want_off{held};
  std::vector<uint16_t> want_idx(held, 0x1111), want_val(held, 0x2222);
  for (int64_t i = 0; i < n; ++i) {
    want_off.push_back(want_off.back() + s.count[i]);
    want_idx.insert(want_idx.end(), s.idx.begin() + i * C, s.idx.begin() + i * C + s.count[i]);
    want_val.insert(want_val.end(), s.val.begin() + i * C, s.val.begin() + i * C + s.count[i]);
  }
  const size_t total = want_off.back();
  for (const size_t cap : {total / 2, total}) {
    std::vector<uint32_t> off(n + 1, 0xDEAD);
    off[0] = held;
    std::vector<uint16_t> idx(total + 3, 0x1111), val(total + 3, 0x2222);
    kvq_outlier_append a;
    a.channels = C, a.n = n, a.count = s.count.data(), a.row_idx = s.idx.data(), a.row_val = s.val.data();
    a.off = off.data(), a.idx = idx.data(), a.val = val.data(), a.capacity = cap;
    kvq_append_outliers_host(a);
    EXPECT_EQ(off, want_off) << "capacity " << cap;
    for (size_t e = 0; e < idx.size(); ++e) {
      const bool written = e < cap && e < total;
      EXPECT_EQ(idx[e], written ? want_idx[e] : 0x1111) << "capacity " << cap << " entry " << e;
      EXPECT_EQ(val[e], written ? want_val[e] : 0x2222) << "capacity " << cap << " entry " << e;
    }
  }
}

}  // namespace
}  // namespace xctx
