// Reference (de)quantizers: bit-exact against the independent `gguf` Python package and against
// blocks llama.cpp's quantizer wrote (goldens in tests/data/dequant_golden, made by
// tests/data/make_dequant_golden.py), and quantize -> dequantize error bounded by the step
// size of each format.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"
#include "model/gguf.h"
#include "test_util.h"

namespace xctx {
namespace {

using json = nlohmann::json;

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> read_floats(const std::string& path) {
  const std::vector<uint8_t> b = read_bytes(path);
  std::vector<float> out(b.size() / 4);
  std::memcpy(out.data(), b.data(), out.size() * 4);
  return out;
}

const json& golden_index() {
  static const json index = [] {
    std::ifstream in(test::data_path("dequant_golden/index.json"));
    return in.good() ? json::parse(in) : json::object();
  }();
  return index;
}

const json* synthetic_entry(const std::string& type_name) {
  const json& idx = golden_index();
  if (!idx.contains("synthetic")) return nullptr;
  for (const json& e : idx["synthetic"])
    if (e["type"] == type_name) return &e;
  return nullptr;
}

// Index of the first element whose bits differ, or -1.
int64_t first_bit_mismatch(const std::vector<float>& a, const std::vector<float>& b) {
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (std::memcmp(&a[i], &b[i], 4) != 0) return (int64_t)i;
  return a.size() == b.size() ? -1 : (int64_t)std::min(a.size(), b.size());
}

std::string type_param_name(const testing::TestParamInfo<ggml_type>& info) { return ggml_traits(info.param).name; }

const ggml_type k_all_types[] = {
    ggml_type::ggml_f32,  ggml_type::ggml_f16,  ggml_type::ggml_bf16, ggml_type::ggml_q4_0, ggml_type::ggml_q4_1,
    ggml_type::ggml_q5_0, ggml_type::ggml_q5_1, ggml_type::ggml_q8_0, ggml_type::ggml_q2_k, ggml_type::ggml_q3_k,
    ggml_type::ggml_q4_k, ggml_type::ggml_q5_k, ggml_type::ggml_q6_k,
};

// ---- goldens from the gguf Python package -------------------------------------------------

class quant_golden : public testing::TestWithParam<ggml_type> {};

TEST_P(quant_golden, dequantize_matches_gguf_python_bit_exactly) {
  const char* name = ggml_traits(GetParam()).name;
  const json* e = synthetic_entry(name);
  ASSERT_NE(e, nullptr) << "no golden for " << name << " in " << test::data_path("dequant_golden/index.json");
  const int64_t n = (*e)["n"];
  const std::vector<uint8_t> blocks = read_bytes(test::data_path("dequant_golden/" + (*e)["blocks"].get<std::string>()));
  const std::vector<float> expect = read_floats(test::data_path("dequant_golden/" + (*e)["values"].get<std::string>()));
  ASSERT_EQ(blocks.size(), ggml_row_bytes(GetParam(), n));
  ASSERT_EQ((int64_t)expect.size(), n);
  std::vector<float> got((size_t)n);
  ref::dequantize_row(GetParam(), blocks.data(), got.data(), n);
  const int64_t bad = first_bit_mismatch(got, expect);
  EXPECT_EQ(bad, -1) << name << " element " << bad << ": got " << got[(size_t)std::max<int64_t>(bad, 0)]
                     << ", gguf-py " << expect[(size_t)std::max<int64_t>(bad, 0)];
}

TEST_P(quant_golden, quantize_reproduces_gguf_python_codes) {
  const char* name = ggml_traits(GetParam()).name;
  if (!ref::can_quantize(GetParam())) GTEST_SKIP() << name << " is decode-only";
  const json* e = synthetic_entry(name);
  ASSERT_NE(e, nullptr) << "no golden for " << name;
  ASSERT_TRUE(e->contains("input")) << "golden for " << name << " lacks the float input";
  const int64_t n = (*e)["n"];
  const std::vector<float> input = read_floats(test::data_path("dequant_golden/" + (*e)["input"].get<std::string>()));
  const std::vector<uint8_t> expect = read_bytes(test::data_path("dequant_golden/" + (*e)["blocks"].get<std::string>()));
  ASSERT_EQ((int64_t)input.size(), n);
  std::vector<uint8_t> got(ggml_row_bytes(GetParam(), n));
  ref::quantize_row(GetParam(), input.data(), got.data(), n);
  ASSERT_EQ(got.size(), expect.size());
  const size_t block_bytes = (size_t)ggml_traits(GetParam()).block_bytes;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], expect[i]) << name << ": byte " << i << " (block " << i / block_bytes << ", byte "
                                 << i % block_bytes << " within it) differs from gguf-py's encoding";
  }
}

INSTANTIATE_TEST_SUITE_P(types, quant_golden, testing::ValuesIn(k_all_types), type_param_name);

// Blocks made by llama.cpp's own quantizer (llama_model_quantize) from known float rows.
class quant_llama_cpp : public testing::TestWithParam<ggml_type> {};

TEST_P(quant_llama_cpp, quantize_reproduces_llama_cpp_codes) {
  const char* name = ggml_traits(GetParam()).name;
  const json& idx = golden_index();
  ASSERT_TRUE(idx.contains("llama_cpp_quantized")) << "golden index lacks llama_cpp_quantized";
  const json* e = nullptr;
  for (const json& x : idx["llama_cpp_quantized"])
    if (x["type"] == name) e = &x;
  ASSERT_NE(e, nullptr) << "no llama.cpp golden for " << name;
  const int64_t rows = (*e)["rows"], n_cols = (*e)["n_cols"];
  const std::vector<float> input = read_floats(test::data_path("dequant_golden/" + (*e)["input"].get<std::string>()));
  const std::vector<uint8_t> expect = read_bytes(test::data_path("dequant_golden/" + (*e)["blocks"].get<std::string>()));
  ASSERT_EQ((int64_t)input.size(), rows * n_cols);
  const size_t row_bytes = ggml_row_bytes(GetParam(), n_cols);
  ASSERT_EQ(expect.size(), row_bytes * (size_t)rows);
  std::vector<uint8_t> got(expect.size());
  for (int64_t r = 0; r < rows; ++r)
    ref::quantize_row(GetParam(), input.data() + r * n_cols, got.data() + (size_t)r * row_bytes, n_cols);
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(got[i], expect[i]) << name << ": byte " << i << " (row " << i / row_bytes << ") differs from llama.cpp";
}

INSTANTIATE_TEST_SUITE_P(types, quant_llama_cpp,
                         testing::Values(ggml_type::ggml_q4_0, ggml_type::ggml_q4_1, ggml_type::ggml_q5_0,
                                         ggml_type::ggml_q5_1, ggml_type::ggml_q8_0),
                         type_param_name);

TEST(quant_golden_model, first_rows_match_gguf_python) {
  XCTX_REQUIRE_MODEL(model_path);
  const json& idx = golden_index();
  ASSERT_TRUE(idx.contains("model")) << "golden index missing";
  const auto file = gguf_file::open(model_path);
  // The goldens were cut from one specific file; a different download must regenerate them.
  ASSERT_EQ(file->file_bytes(), idx["model"]["bytes"].get<size_t>())
      << model_path << " is not the file the goldens were made from (sha256 " << idx["model"]["sha256"]
      << "); rerun tests/data/make_dequant_golden.py";
  for (const json& t : idx["model"]["tensors"]) {
    const std::string name = t["tensor"];
    const int64_t rows = t["rows"], n_cols = t["n_cols"];
    const gguf_tensor_info& info = file->tensor(name);
    ASSERT_EQ(info.shape[0], n_cols) << name;
    EXPECT_STREQ(ggml_traits(info.type).name, t["type"].get<std::string>().c_str()) << name;
    const std::vector<float> expect = read_floats(test::data_path("dequant_golden/" + t["values"].get<std::string>()));
    std::vector<float> got((size_t)(rows * n_cols));
    for (int64_t r = 0; r < rows; ++r) {
      const auto* row = static_cast<const uint8_t*>(info.data) + r * ggml_row_bytes(info.type, n_cols);
      ref::dequantize_row(info.type, row, got.data() + r * n_cols, n_cols);
    }
    const int64_t bad = first_bit_mismatch(got, expect);
    EXPECT_EQ(bad, -1) << name << " element " << bad;
  }
}

// ---- quantize -> dequantize error bounds ----------------------------------------------------

// Slack for float rounding inside the encoder (x*id, + offset) and decoder (q*d + m): a few
// ulps of values of magnitude <= amax, far below any quantization step tested here.
constexpr float k_float_slack_ulps = 8.0f;

struct roundtrip_case {
  ggml_type type;
  float scale;  // data ~ N(0, scale²) with outliers
};

std::vector<float> test_data(uint64_t seed, int64_t n, float scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x((size_t)n);
  for (auto& v : x) v = normal(rng);
  // Corner cases in the first blocks of 32: zeros, a constant, an outlier of either sign.
  if (n >= 128) {
    for (int j = 0; j < 32; ++j) x[(size_t)j] = 0.0f;
    for (int j = 32; j < 64; ++j) x[(size_t)j] = 0.75f * scale;
    x[70] = -20.0f * scale;
    x[100] = 20.0f * scale;
  }
  return x;
}

// Worst-case |x - x̂| for one element of a block, derived from the format:
//   symmetric (Q4_0/Q5_0): d = max/-2^(b-1); codes reach -2^(b-1)..2^(b-1)-1, so the far side of
//     the range clips by one step (error |d|) and the rest round to |d|/2;
//   asymmetric (Q4_1/Q5_1): d = (max-min)/(2^b-1), no clipping: d/2;
//   Q8_0/Q8_1: d = amax/127: d/2;  Q8_K: d = max/-127 kept in f32: |d|/2;
// plus |code|·|d - fp16(d)| + |min - fp16(min)| for the scales stored as fp16.
float element_bound(ggml_type type, const float* blk, int n_blk, const void* block_ptr, float x) {
  float amax = 0.0f, max = 0.0f, mn = INFINITY, mx = -INFINITY;
  for (int j = 0; j < n_blk; ++j) {
    if (std::fabs(blk[j]) > amax) {
      amax = std::fabs(blk[j]);
      max = blk[j];
    }
    mn = std::min(mn, blk[j]);
    mx = std::max(mx, blk[j]);
  }
  const float slack = k_float_slack_ulps * FLT_EPSILON * std::max(amax, 1e-30f);
  auto stored = [&](uint16_t h) { return fp16_to_fp32(h); };
  switch (type) {
    case ggml_type::ggml_q4_0:
    case ggml_type::ggml_q5_0: {
      const float half_range = type == ggml_type::ggml_q4_0 ? 8.0f : 16.0f;
      const float d = max / -half_range;
      const float d16 = stored(*static_cast<const uint16_t*>(block_ptr));
      const bool clips = d != 0.0f && (double)x / d > half_range - 0.5;
      return (clips ? std::fabs(d) : std::fabs(d) / 2) + half_range * std::fabs(d - d16) + slack;
    }
    case ggml_type::ggml_q4_1:
    case ggml_type::ggml_q5_1: {
      const float levels = type == ggml_type::ggml_q4_1 ? 15.0f : 31.0f;
      const float d = (mx - mn) / levels;
      const auto* h = static_cast<const uint16_t*>(block_ptr);
      return d / 2 + levels * std::fabs(d - stored(h[0])) + std::fabs(mn - stored(h[1])) + slack;
    }
    case ggml_type::ggml_q8_0:
    case ggml_type::ggml_q8_1: {
      const float d = amax / 127.0f;
      return d / 2 + 127.0f * std::fabs(d - stored(*static_cast<const uint16_t*>(block_ptr))) + slack;
    }
    case ggml_type::ggml_q8_k: return amax / 127.0f / 2 + slack;
    case ggml_type::ggml_f32: return 0.0f;
    // Half an ulp of x (2^-11 relative for fp16, 2^-8 for bf16), or of the smallest subnormal.
    case ggml_type::ggml_f16: return std::max(std::fabs(x) * 0x1p-11f, 0x1p-25f);
    case ggml_type::ggml_bf16: return std::fabs(x) * 0x1p-8f;
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k: break;
  }
  ADD_FAILURE() << "no bound for " << ggml_traits(type).name;
  return 0.0f;
}

class quant_roundtrip : public testing::TestWithParam<roundtrip_case> {};

TEST_P(quant_roundtrip, error_within_one_step) {
  const roundtrip_case c = GetParam();
  const ggml_type_traits tr = ggml_traits(c.type);
  const uint64_t seed = 1000 + (uint64_t)c.type;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const int64_t n = 8 * 256;
  const std::vector<float> x = test_data(seed, n, c.scale);
  std::vector<uint8_t> q(ggml_row_bytes(c.type, n));
  ref::quantize_row(c.type, x.data(), q.data(), n);
  std::vector<float> y((size_t)n);
  ref::dequantize_row(c.type, q.data(), y.data(), n);
  // Float types: "blocks" of 32 only for locating elements in messages.
  const int blk = tr.block_elems > 1 ? tr.block_elems : 32;
  int failures = 0;
  for (int64_t i = 0; i < n && failures < 5; ++i) {
    const int64_t b = i / blk;
    const void* block_ptr = q.data() + (tr.block_elems > 1 ? (size_t)b * tr.block_bytes : 0);
    const float bound = element_bound(c.type, x.data() + b * blk, blk, block_ptr, x[(size_t)i]);
    if (!(std::fabs(x[(size_t)i] - y[(size_t)i]) <= bound)) {
      ++failures;
      ADD_FAILURE() << tr.name << " element " << i << " (block " << b << "): x " << x[(size_t)i] << " -> "
                    << y[(size_t)i] << ", error " << std::fabs(x[(size_t)i] - y[(size_t)i]) << " > bound " << bound;
    }
  }
}

std::vector<roundtrip_case> roundtrip_cases() {
  std::vector<roundtrip_case> out;
  for (const ggml_type t : {ggml_type::ggml_f32, ggml_type::ggml_f16, ggml_type::ggml_bf16, ggml_type::ggml_q4_0,
                            ggml_type::ggml_q4_1, ggml_type::ggml_q5_0, ggml_type::ggml_q5_1, ggml_type::ggml_q8_0,
                            ggml_type::ggml_q8_1, ggml_type::ggml_q8_k})
    for (const float s : {1e-3f, 1.0f, 100.0f}) out.push_back({t, s});
  return out;
}

INSTANTIATE_TEST_SUITE_P(types, quant_roundtrip, testing::ValuesIn(roundtrip_cases()),
                         [](const testing::TestParamInfo<roundtrip_case>& info) {
                           const float s = info.param.scale;
                           return std::string(ggml_traits(info.param.type).name) + "_scale_" +
                                  (s < 1 ? "1em3" : s < 10 ? "1" : "100");
                         });

// ---- format details the bound test cannot see ----------------------------------------------

TEST(quant_ref, q8_1_sum_field_is_d_times_code_sum) {
  const std::vector<float> x = test_data(7, 4 * 32, 2.0f);
  std::vector<block_q8_1> q(4);
  ref::quantize_row(ggml_type::ggml_q8_1, x.data(), q.data(), 128);
  for (int b = 0; b < 4; ++b) {
    float amax = 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(x[(size_t)(32 * b + j)]));
      sum += q[(size_t)b].qs[j];
    }
    // GGML multiplies by the unrounded d, then rounds to fp16 once.
    EXPECT_EQ(q[(size_t)b].s, fp32_to_fp16((float)sum * (amax / 127.0f))) << "block " << b;
    EXPECT_EQ(q[(size_t)b].d, fp32_to_fp16(amax / 127.0f)) << "block " << b;
  }
}

TEST(quant_ref, q8_k_block_sums_and_extreme_code) {
  const std::vector<float> x = test_data(11, 2 * 256, 3.0f);
  std::vector<block_q8_k> q(2);
  ref::quantize_row(ggml_type::ggml_q8_k, x.data(), q.data(), 512);
  for (int b = 0; b < 2; ++b) {
    int imax = 0;
    for (int j = 0; j < 256; ++j)
      if (std::fabs(x[(size_t)(256 * b + j)]) > std::fabs(x[(size_t)(256 * b + imax)])) imax = j;
    // The largest-magnitude element always maps to -127 (d carries the sign).
    EXPECT_EQ(q[(size_t)b].qs[imax], -127) << "block " << b;
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int l = 0; l < 16; ++l) sum += q[(size_t)b].qs[16 * g + l];
      EXPECT_EQ(q[(size_t)b].bsums[g], sum) << "block " << b << " group " << g;
    }
  }
}

TEST(quant_ref, zero_block_encodes_to_zero_scale) {
  const std::vector<float> zeros(256, 0.0f);
  for (const ggml_type t : {ggml_type::ggml_q4_0, ggml_type::ggml_q4_1, ggml_type::ggml_q5_0, ggml_type::ggml_q5_1,
                            ggml_type::ggml_q8_0, ggml_type::ggml_q8_1, ggml_type::ggml_q8_k}) {
    std::vector<uint8_t> q(ggml_row_bytes(t, 256), 0xAB);
    ref::quantize_row(t, zeros.data(), q.data(), 256);
    std::vector<float> y(256, 1.0f);
    ref::dequantize_row(t, q.data(), y.data(), 256);
    for (int i = 0; i < 256; ++i) ASSERT_EQ(y[(size_t)i], 0.0f) << ggml_traits(t).name << " element " << i;
  }
}

TEST(quant_ref, k_quant_encoders_are_refused_by_name) {
  for (const ggml_type t : {ggml_type::ggml_q2_k, ggml_type::ggml_q3_k, ggml_type::ggml_q4_k, ggml_type::ggml_q5_k,
                            ggml_type::ggml_q6_k}) {
    EXPECT_FALSE(ref::can_quantize(t));
    std::vector<float> x(256, 1.0f);
    std::vector<uint8_t> q(ggml_row_bytes(t, 256));
    try {
      ref::quantize_row(t, x.data(), q.data(), 256);
      ADD_FAILURE() << "quantize_row accepted " << ggml_traits(t).name;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(ggml_traits(t).name), std::string::npos) << e.what();
    }
  }
}

TEST(quant_ref, partial_blocks_and_unknown_types_are_errors) {
  std::vector<float> x(64, 1.0f);
  std::vector<uint8_t> q(1024);
  EXPECT_THROW(ref::quantize_row(ggml_type::ggml_q4_0, x.data(), q.data(), 40), Error);
  EXPECT_THROW(ref::dequantize_row(ggml_type::ggml_q4_k, q.data(), x.data(), 64), Error);
  try {
    ref::dequantize_row((ggml_type)4, q.data(), x.data(), 32);
    ADD_FAILURE() << "type id 4 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("type id 4"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace xctx
