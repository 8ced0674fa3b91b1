// The encoder inputs of xq_encode_job that let a cache encode its residual window where it lies
// (any backend): fp16 rows (x16) and channel 0 kept fp16 (ch0, XQuant App. B). Their meaning is
// fixed by the f32 form: x16 encodes exactly as its rows widened to f32, and ch0 exactly as rows
// whose channel 0 is zeroed after copying it out. The CPU encoder (split over rows / groups)
// equals the reference for every form.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/x_quant.h"

namespace xctx {
namespace {

struct encoded {
  std::vector<uint8_t> codes;
  std::vector<kvq_affine> params;
  std::vector<uint16_t> ch0;
};

bool same(const encoded& a, const encoded& b) {
  if (a.codes != b.codes || a.ch0 != b.ch0 || a.params.size() != b.params.size()) return false;
  for (size_t i = 0; i < a.params.size(); ++i)
    if (a.params[i].scale != b.params[i].scale || a.params[i].zero != b.params[i].zero) return false;
  return true;
}

struct shape {
  xq_axis axis;
  int bits, channels, group;
  int64_t n;
  float eta;
};

encoded run(void (*encode)(const xq_encode_job&), const shape& s, const float* x, const uint16_t* x16, bool ch0) {
  encoded e;
  e.codes.assign((size_t)s.n * kvq_row_bytes(s.channels, s.bits), 0);
  e.params.resize(s.axis == xq_axis::xq_per_channel ? (size_t)(s.n / s.group) * s.channels
                                                     : (size_t)s.n * ((s.channels + s.group - 1) / s.group));
  if (ch0) e.ch0.assign((size_t)s.n, 0);
  xq_encode_job j;
  j.axis = s.axis, j.bits = s.bits, j.channels = s.channels, j.group = s.group, j.eta = s.eta, j.n = s.n;
  j.x = x, j.x16 = x16, j.codes = e.codes.data(), j.params = e.params.data();
  j.ch0 = ch0 ? e.ch0.data() : nullptr;
  encode(j);
  return e;
}

TEST(xq_encode_inputs, fp16_rows_and_the_fp16_first_channel_mean_what_the_f32_form_means) {
  const shape shapes[] = {{xq_axis::xq_per_channel, 2, 96, 24, 72, 0.0f},
                          {xq_axis::xq_per_channel, 3, 64, 8, 48, 0.1f},
                          {xq_axis::xq_per_token, 4, 96, 32, 50, 0.0f},
                          {xq_axis::xq_per_token, 1, 40, 16, 9, 0.2f}};
  for (const shape& s : shapes) {
    SCOPED_TRACE(::testing::Message() << "axis " << (int)s.axis << " bits " << s.bits << " C " << s.channels);
    std::mt19937 rng(41 + s.bits);
    std::normal_distribution<float> nd;
    const size_t n_el = (size_t)s.n * s.channels;
    std::vector<uint16_t> x16(n_el);
    std::vector<float> widened(n_el);
    for (size_t e = 0; e < n_el; ++e) {
      x16[e] = fp32_to_fp16(nd(rng) * ((e % s.channels) == 0 ? 9.0f : 1.0f));  // channel 0: the outlier
      widened[e] = fp16_to_fp32(x16[e]);
    }
    // The f32 forms: widened rows; widened rows with channel 0 copied out and zeroed.
    std::vector<float> zeroed = widened;
    encoded kept;
    for (int64_t t = 0; t < s.n; ++t) {
      kept.ch0.push_back(x16[(size_t)t * s.channels]);
      zeroed[(size_t)t * s.channels] = 0.0f;
    }
    const encoded plain = run(ref::xq_encode, s, widened.data(), nullptr, false);
    encoded expect_ch0 = run(ref::xq_encode, s, zeroed.data(), nullptr, false);
    expect_ch0.ch0 = kept.ch0;
    for (auto encode : {ref::xq_encode, cpu::xq_encode}) {
      EXPECT_TRUE(same(run(encode, s, nullptr, x16.data(), false), plain));
      EXPECT_TRUE(same(run(encode, s, nullptr, x16.data(), true), expect_ch0));
      EXPECT_TRUE(same(run(encode, s, widened.data(), nullptr, true), expect_ch0));  // f32 rows with ch0
    }
  }
}

TEST(xq_encode_inputs, exactly_one_row_source) {
  const shape s{xq_axis::xq_per_token, 2, 8, 8, 2, 0.0f};
  std::vector<float> x(16, 1.0f);
  std::vector<uint16_t> x16(16, fp32_to_fp16(1.0f));
  EXPECT_THROW(run(ref::xq_encode, s, x.data(), x16.data(), false), Error);
  EXPECT_THROW(run(ref::xq_encode, s, nullptr, nullptr, false), Error);
}

}  // namespace
}  // namespace xctx
