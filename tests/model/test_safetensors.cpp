// safetensors reader: round trips through the writer, and every malformed-file error names the
// file (and the tensor where there is one).
#include <cstring>
#include <fstream>
#include <functional>
#include <random>

#include "common/error.h"
#include "common/half.h"
#include "model/safetensors.h"
#include "test_util.h"

namespace xctx {
namespace {

std::vector<uint8_t> encode(const std::string& dtype, const std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (float x : v) {
    if (dtype == "F32") {
      uint8_t b[4];
      std::memcpy(b, &x, 4);
      out.insert(out.end(), b, b + 4);
    } else {
      const uint16_t h = dtype == "F16" ? fp32_to_fp16(x) : fp32_to_bf16(x);
      out.push_back((uint8_t)(h & 0xff));
      out.push_back((uint8_t)(h >> 8));
    }
  }
  return out;
}

float decode(const st_tensor_info& t, size_t i) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  if (t.dtype == "F32") {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  }
  const uint16_t h = (uint16_t)(p[2 * i] | (p[2 * i + 1] << 8));
  return t.dtype == "F16" ? fp16_to_fp32(h) : bf16_to_fp32(h);
}

// Writes [u64 length][header][data] verbatim, so tests can produce any malformed file.
// `claimed_len` overrides the length field.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes, int64_t claimed_len = -1) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  const uint64_t len = claimed_len >= 0 ? (uint64_t)claimed_len : header.size();
  for (int i = 0; i < 8; ++i) out.put((char)(len >> (8 * i)));
  out << header;
  out << std::string(data_bytes, '\0');
}

// Runs `fn`, expects xctx::Error, and checks the message names everything in `needles`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
    return;
  }
  ADD_FAILURE() << "expected xctx::Error";
}

struct dtype_case {
  std::string dtype;
  ggml_type type;
};
class SafetensorsRoundTrip : public testing::TestWithParam<dtype_case> {};

TEST_P(SafetensorsRoundTrip, ValuesShapesAndOffsets) {
  const auto& p = GetParam();
  const uint32_t seed = 1234;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  SCOPED_TRACE("seed " + std::to_string(seed));

  // Odd sizes so tensor boundaries are not aligned to anything in particular.
  const std::vector<std::pair<std::string, std::vector<int64_t>>> specs = {
      {"a.weight", {7, 5}}, {"b.bias", {3}}, {"c.scalar", {}}, {"d.empty", {0, 4}}, {"e.cube", {2, 3, 4}}};
  std::vector<st_tensor_out> outs;
  std::vector<std::vector<float>> want;
  for (const auto& [name, shape] : specs) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> v((size_t)n);
    for (float& x : v) x = dist(rng);
    outs.push_back({name, p.dtype, shape, encode(p.dtype, v)});
    // The expected value is what the encoding keeps, decoded independently of the reader.
    std::vector<float> kept(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      kept[i] = p.dtype == "F32"   ? v[i]
                : p.dtype == "F16" ? fp16_to_fp32(fp32_to_fp16(v[i]))
                                   : bf16_to_fp32(fp32_to_bf16(v[i]));
    }
    want.push_back(kept);
  }
  const std::string path = (test::scratch_dir() / "rt.safetensors").string();
  write_safetensors(path, outs, {{"format", "pt"}});

  auto f = safetensors_file::open(path);
  EXPECT_EQ(f->tensors().size(), specs.size());  // __metadata__ is not a tensor
  EXPECT_EQ(f->data_offset() % 8, 0u);
  for (size_t k = 0; k < specs.size(); ++k) {
    const st_tensor_info& t = f->tensor(specs[k].first);
    EXPECT_EQ(t.dtype, p.dtype);
    ASSERT_TRUE(t.type.has_value());
    EXPECT_EQ(*t.type, p.type);
    EXPECT_EQ(t.shape, specs[k].second);
    EXPECT_EQ((size_t)t.n_elements(), want[k].size());
    EXPECT_EQ(t.bytes(), want[k].size() * t.elem_bytes);
    for (size_t i = 0; i < want[k].size(); ++i) ASSERT_EQ(decode(t, i), want[k][i]) << t.name << "[" << i << "]";
  }
  EXPECT_EQ(f->find_tensor("nope"), nullptr);
  expect_error([&] { f->tensor("nope"); }, {path, "nope"});
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SafetensorsRoundTrip,
                         testing::Values(dtype_case{"F32", ggml_type::ggml_f32}, dtype_case{"F16", ggml_type::ggml_f16},
                                         dtype_case{"BF16", ggml_type::ggml_bf16}),
                         [](const auto& info) { return info.param.dtype; });

TEST(Safetensors, NonFloatDtypeIsListedWithoutType) {
  const std::string path = (test::scratch_dir() / "ids.safetensors").string();
  write_raw(path, R"({"ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}})", 24);
  auto f = safetensors_file::open(path);
  const st_tensor_info& t = f->tensor("ids");
  EXPECT_FALSE(t.type.has_value());
  EXPECT_EQ(t.elem_bytes, 8u);
  EXPECT_EQ(t.bytes(), 24u);
}

TEST(Safetensors, UnalignedHeaderLengthIsAccepted) {
  // Nothing in the format requires padding; the reader must not assume it.
  const std::string path = (test::scratch_dir() / "odd.safetensors").string();
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_NE((8 + header.size()) % 4, 0u);
  write_raw(path, header, 8);
  auto f = safetensors_file::open(path);
  EXPECT_EQ(f->data_offset(), 8 + header.size());
  EXPECT_EQ(f->tensor("x").shape, std::vector<int64_t>{2});
}

TEST(SafetensorsErrors, MissingFile) {
  const std::string path = (test::scratch_dir() / "absent.safetensors").string();
  expect_error([&] { safetensors_file::open(path); }, {path, "cannot open"});
}

TEST(SafetensorsErrors, TruncatedBelowLengthField) {
  const std::string path = (test::scratch_dir() / "short.safetensors").string();
  std::ofstream(path, std::ios::binary) << "abc";
  expect_error([&] { safetensors_file::open(path); }, {path, "truncated", "3 bytes"});
}

TEST(SafetensorsErrors, HeaderLengthBeyondFile) {
  const std::string path = (test::scratch_dir() / "long.safetensors").string();
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  write_raw(path, header, 8, (int64_t)header.size() + 100);
  expect_error([&] { safetensors_file::open(path); }, {path, "header length", std::to_string(header.size() + 100)});
}

TEST(SafetensorsErrors, TruncatedData) {
  // A file cut short after its header: the last tensor's end lies beyond the data section.
  const std::string path = (test::scratch_dir() / "cut.safetensors").string();
  write_raw(path, R"({"w":{"dtype":"BF16","shape":[4,4],"data_offsets":[0,32]}})", 20);
  expect_error([&] { safetensors_file::open(path); }, {path, "'w'", "out of range", "20 bytes"});
}

TEST(SafetensorsErrors, BadJson) {
  const std::string path = (test::scratch_dir() / "json.safetensors").string();
  write_raw(path, R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8);  // missing brace
  expect_error([&] { safetensors_file::open(path); }, {path, "not valid JSON"});
}

TEST(SafetensorsErrors, HeaderNotAnObject) {
  const std::string path = (test::scratch_dir() / "array.safetensors").string();
  write_raw(path, "[1, 2]", 0);
  expect_error([&] { safetensors_file::open(path); }, {path, "JSON object"});
}

TEST(SafetensorsErrors, UnknownDtype) {
  const std::string path = (test::scratch_dir() / "dtype.safetensors").string();
  write_raw(path, R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,2]}})", 2);
  expect_error([&] { safetensors_file::open(path); }, {path, "'w'", "unknown dtype", "Q7"});
}

TEST(SafetensorsErrors, MissingFields) {
  const auto dir = test::scratch_dir();
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"w":{"shape":[2],"data_offsets":[0,8]}})", "dtype"},
      {R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", "shape"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", "data_offsets"},
      {R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "non-negative"},
      {R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", "non-negative"},
      {R"({"w":[1,2]})", "must be an object"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(cases[i].first);
    const std::string path = (dir / (std::to_string(i) + "_case.safetensors")).string();
    write_raw(path, cases[i].first, 8);
    expect_error([&] { safetensors_file::open(path); }, {path, "'w'", cases[i].second});
  }
}

TEST(SafetensorsErrors, OffsetsOutOfRange) {
  const std::string path = (test::scratch_dir() / "range.safetensors").string();
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}})", 16);
  expect_error([&] { safetensors_file::open(path); }, {path, "'w'", "[16, 24]", "out of range"});
}

TEST(SafetensorsErrors, OffsetsReversed) {
  const std::string path = (test::scratch_dir() / "rev.safetensors").string();
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 16);
  expect_error([&] { safetensors_file::open(path); }, {path, "'w'", "end before begin"});
}

TEST(SafetensorsErrors, OffsetsDisagreeWithShape) {
  const std::string path = (test::scratch_dir() / "size.safetensors").string();
  write_raw(path, R"({"w":{"dtype":"F16","shape":[3,2],"data_offsets":[0,16]}})", 16);
  expect_error([&] { safetensors_file::open(path); }, {path, "'w'", "[3, 2]", "12", "span 16"});
}

TEST(SafetensorsErrors, OverlappingTensors) {
  const std::string path = (test::scratch_dir() / "overlap.safetensors").string();
  write_raw(path,
            R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
            R"("b":{"dtype":"F32","shape":[4],"data_offsets":[12,28]}})",
            28);
  expect_error([&] { safetensors_file::open(path); }, {path, "'a'", "'b'", "overlap"});
}

TEST(SafetensorsErrors, WriterRejectsSizeMismatch) {
  const std::string path = (test::scratch_dir() / "w.safetensors").string();
  expect_error([&] { write_safetensors(path, {{"t", "F32", {2, 2}, std::vector<uint8_t>(12)}}); }, {path, "'t'", "16"});
}

}  // namespace
}  // namespace xctx
