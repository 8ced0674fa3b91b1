// GGUF reader: metadata round trips through gguf_writer, tensor table and alignment, typed
// getters, and one test per malformed-file error (a valid file with one field patched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>

#include "common/error.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "test_util.h"

namespace xctx {
namespace {

using vt = gguf_value_type;

void write_bytes(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), (std::streamsize)bytes.size());
  ASSERT_TRUE(out.good()) << path;
}

template <typename T>
void patch(std::vector<uint8_t>& bytes, size_t pos, T value) {
  ASSERT_LE(pos + sizeof(T), bytes.size());
  std::memcpy(bytes.data() + pos, &value, sizeof(T));
}

// Runs fn, expects an xctx::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

// ---- metadata round trip ------------------------------------------------------------------

gguf_writer all_types_writer(uint32_t version) {
  gguf_writer w(version);
  w.add("v.u8", gguf_make_u8(250));
  w.add("v.i8", gguf_make_i8(-120));
  w.add("v.u16", gguf_make_u16(65000));
  w.add("v.i16", gguf_make_i16(-32000));
  w.add("v.u32", gguf_make_u32(4000000000u));
  w.add("v.i32", gguf_make_i32(-2000000000));
  w.add("v.u64", gguf_make_u64(std::numeric_limits<uint64_t>::max()));
  w.add("v.i64", gguf_make_i64(std::numeric_limits<int64_t>::min()));
  w.add("v.f32", gguf_make_f32(0.1f));
  w.add("v.f64", gguf_make_f64(0.1));
  w.add("v.f32_inf", gguf_make_f32(-INFINITY));
  w.add("v.bool_t", gguf_make_bool(true));
  w.add("v.bool_f", gguf_make_bool(false));
  w.add("v.str", gguf_make_string("héllo \"world\"\n"));
  w.add("v.str_empty", gguf_make_string(""));
  w.add_string_array("v.strs", {"a", "", "ccc"});
  w.add_f32_array("v.f32s", {1.5f, -2.0f});
  w.add_i32_array("v.i32s", {1, -2, 3});
  w.add("v.u8s_empty", gguf_make_array(vt::gguf_u8, {}));
  w.add("v.nested", gguf_make_array(vt::gguf_array, {
                                                       gguf_make_array(vt::gguf_i16, {gguf_make_i16(-1), gguf_make_i16(2)}),
                                                       gguf_make_array(vt::gguf_string, {gguf_make_string("x")}),
                                                       gguf_make_array(vt::gguf_u64, {}),
                                                   }));
  w.add("v.u64s_big", gguf_make_array(vt::gguf_u64, {gguf_make_u64(1ull << 40)}));
  return w;
}

class gguf_roundtrip : public testing::TestWithParam<uint32_t> {};

TEST_P(gguf_roundtrip, every_value_type) {
  const std::string path = (test::scratch_dir() / "all.gguf").string();
  all_types_writer(GetParam()).write(path);
  const auto f = gguf_file::open(path);
  EXPECT_EQ(f->version(), GetParam());
  EXPECT_EQ(f->metadata().size(), 21u);
  EXPECT_TRUE(f->tensors().empty());

  EXPECT_EQ(f->get_int("v.u8"), 250);
  EXPECT_EQ(f->get_int("v.i8"), -120);
  EXPECT_EQ(f->get_int("v.u16"), 65000);
  EXPECT_EQ(f->get_int("v.i16"), -32000);
  EXPECT_EQ(f->get_int("v.u32"), 4000000000ll);
  EXPECT_EQ(f->get_int("v.i32"), -2000000000);
  EXPECT_EQ(std::get<uint64_t>(f->find("v.u64")->v), std::numeric_limits<uint64_t>::max());
  EXPECT_EQ(f->get_int("v.i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(f->get_float("v.f32"), (double)0.1f);  // exactly the stored float
  EXPECT_EQ(f->get_float("v.f64"), 0.1);
  EXPECT_EQ(f->get_float("v.f32_inf"), -INFINITY);
  EXPECT_EQ(f->get_float("v.u16"), 65000.0);  // integers read as floats
  EXPECT_TRUE(f->get_bool("v.bool_t", false));
  EXPECT_FALSE(f->get_bool("v.bool_f", true));
  EXPECT_EQ(f->get_string("v.str"), "héllo \"world\"\n");
  EXPECT_EQ(f->get_string("v.str_empty"), "");
  EXPECT_EQ(f->get_string_array("v.strs"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f->get_float_array("v.f32s"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(f->get_int_array("v.i32s"), (std::vector<int32_t>{1, -2, 3}));
  EXPECT_TRUE(f->get_int_array("v.u8s_empty").empty());

  const gguf_value* nested = f->find("v.nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->type, vt::gguf_array);
  EXPECT_EQ(nested->elem_type, vt::gguf_array);
  const auto& outer = std::get<std::vector<gguf_value>>(nested->v);
  ASSERT_EQ(outer.size(), 3u);
  EXPECT_EQ(outer[0].elem_type, vt::gguf_i16);
  EXPECT_EQ(std::get<int64_t>(std::get<std::vector<gguf_value>>(outer[0].v)[0].v), -1);
  EXPECT_EQ(std::get<std::string>(std::get<std::vector<gguf_value>>(outer[1].v)[0].v), "x");
  EXPECT_TRUE(std::get<std::vector<gguf_value>>(outer[2].v).empty());

  // Every type comes back with the type it was written with.
  EXPECT_EQ(f->find("v.u8")->type, vt::gguf_u8);
  EXPECT_EQ(f->find("v.i16")->type, vt::gguf_i16);
  EXPECT_EQ(f->find("v.f64")->type, vt::gguf_f64);
  EXPECT_EQ(f->find("v.bool_t")->type, vt::gguf_bool);
}

INSTANTIATE_TEST_SUITE_P(versions, gguf_roundtrip, testing::Values(2u, 3u),
                         [](const testing::TestParamInfo<uint32_t>& i) { return "v" + std::to_string(i.param); });

TEST(gguf_getters, type_and_range_errors_name_file_and_key) {
  const std::string path = (test::scratch_dir() / "all.gguf").string();
  all_types_writer(3).write(path);
  const auto f = gguf_file::open(path);
  expect_error([&] { f->get_int("v.u64"); }, {path, "v.u64", "out of range"});
  expect_error([&] { f->get_int("v.str"); }, {path, "v.str", "expected an integer", "string"});
  expect_error([&] { f->get_int("nope"); }, {path, "missing metadata key 'nope'"});
  expect_error([&] { f->get_float("v.bool_t"); }, {path, "v.bool_t", "expected a number"});
  expect_error([&] { f->get_string("v.u8"); }, {path, "v.u8", "expected string"});
  expect_error([&] { f->get_bool("v.u8", false); }, {path, "v.u8", "expected bool"});
  expect_error([&] { f->get_string_array("v.i32s"); }, {path, "v.i32s", "array of strings"});
  expect_error([&] { f->get_int_array("v.u64s_big"); }, {path, "v.u64s_big", "int32"});
  expect_error([&] { f->get_float_array("v.str"); }, {path, "v.str", "expected an array"});
  expect_error([&] { f->tensor("w"); }, {path, "missing tensor 'w'"});
  EXPECT_EQ(f->get_int("nope", 7), 7);
  EXPECT_EQ(f->get_float("nope", 2.5), 2.5);
  EXPECT_EQ(f->get_string("nope", "fb"), "fb");
  EXPECT_TRUE(f->get_bool("nope", true));
  EXPECT_EQ(f->find_tensor("w"), nullptr);
}

TEST(gguf_value_to_string, renders_and_abbreviates) {
  EXPECT_EQ(gguf_value_to_string(gguf_make_u32(7)), "7");
  EXPECT_EQ(gguf_value_to_string(gguf_make_i8(-3)), "-3");
  EXPECT_EQ(gguf_value_to_string(gguf_make_bool(true)), "true");
  EXPECT_EQ(gguf_value_to_string(gguf_make_f32(0.5f)), "0.5");
  EXPECT_EQ(gguf_value_to_string(gguf_make_string("a\"b\nc")), "\"a\\\"b\\nc\"");
  std::vector<gguf_value> ten;
  for (int i = 0; i < 10; ++i) ten.push_back(gguf_make_i32(i));
  const gguf_value arr = gguf_make_array(vt::gguf_i32, ten);
  EXPECT_EQ(gguf_value_to_string(arr, 3), "[0, 1, 2, ... (10 total)]");
  EXPECT_EQ(gguf_value_to_string(arr, 10), "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]");
  EXPECT_EQ(gguf_value_to_string(gguf_make_array(vt::gguf_array, {gguf_make_array(vt::gguf_string, {gguf_make_string("x")})})),
            "[[\"x\"]]");
}

// ---- tensors ----------------------------------------------------------------------------------

TEST(gguf_tensors, every_type_shape_offset_and_alignment) {
  const std::string path = (test::scratch_dir() / "tensors.gguf").string();
  gguf_writer w;
  w.set_alignment(64);
  w.add_string("general.architecture", "llama");
  const ggml_type types[] = {ggml_type::ggml_f32,  ggml_type::ggml_f16,  ggml_type::ggml_bf16, ggml_type::ggml_q4_0,
                             ggml_type::ggml_q4_1, ggml_type::ggml_q5_0, ggml_type::ggml_q5_1, ggml_type::ggml_q8_0,
                             ggml_type::ggml_q8_1, ggml_type::ggml_q2_k, ggml_type::ggml_q3_k, ggml_type::ggml_q4_k,
                             ggml_type::ggml_q5_k, ggml_type::ggml_q6_k, ggml_type::ggml_q8_k};
  std::vector<std::vector<uint8_t>> payloads;
  for (size_t i = 0; i < std::size(types); ++i) {
    const std::vector<int64_t> shape = {256, 3, (int64_t)(i % 2 + 1)};
    std::vector<uint8_t> bytes(ggml_row_bytes(types[i], 256) * 3 * (size_t)shape[2]);
    for (size_t j = 0; j < bytes.size(); ++j) bytes[j] = (uint8_t)(j * 31 + i);
    w.add_tensor(std::string("t.") + ggml_traits(types[i]).name, types[i], shape, bytes.data(), bytes.size());
    payloads.push_back(bytes);
  }
  w.write(path);
  const auto f = gguf_file::open(path);
  EXPECT_EQ(f->alignment(), 64u);
  ASSERT_EQ(f->tensors().size(), std::size(types));
  for (size_t i = 0; i < std::size(types); ++i) {
    const gguf_tensor_info& t = f->tensors()[i];
    EXPECT_EQ(t.name, std::string("t.") + ggml_traits(types[i]).name);
    EXPECT_EQ(t.type, types[i]);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{256, 3, (int64_t)(i % 2 + 1)}));
    EXPECT_EQ(t.n_elements(), 256 * 3 * (int64_t)(i % 2 + 1));
    EXPECT_EQ(t.offset % 64, 0u) << t.name;
    EXPECT_EQ((uintptr_t)t.data % 64, 0u) << t.name << ": data pointer not aligned";
    ASSERT_EQ(t.bytes, payloads[i].size()) << t.name;
    EXPECT_EQ(std::memcmp(t.data, payloads[i].data(), t.bytes), 0) << t.name;
    EXPECT_EQ(&f->tensor(t.name), &t);
  }
}

TEST(gguf_tensors, default_alignment_is_32) {
  const std::string path = (test::scratch_dir() / "a.gguf").string();
  gguf_writer w;
  const float v[3] = {1, 2, 3};
  w.add_tensor("a", ggml_type::ggml_f32, {3}, v, sizeof v);
  w.add_tensor("b", ggml_type::ggml_f32, {3}, v, sizeof v);
  w.write(path);
  const auto f = gguf_file::open(path);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->tensor("b").offset, 32u);
  EXPECT_EQ(static_cast<const float*>(f->tensor("b").data)[2], 3.0f);
}

// ---- malformed files: one patched field each ----------------------------------------------

// The base file: kv 0 general.alignment, 1 aaaa, 2 aaab, 3 arr, 4 flag; tensors w_a (Q4_0
// [64, 2], 72 bytes) and w_b (F32 [8]) at data offsets 0 and 96.
gguf_writer base_writer() {
  gguf_writer w;
  w.set_alignment(32);
  w.add_u32("aaaa", 1);
  w.add_u32("aaab", 2);
  w.add("arr", gguf_make_array(vt::gguf_u32, {gguf_make_u32(1), gguf_make_u32(2), gguf_make_u32(3)}));
  w.add_bool("flag", true);
  std::vector<float> a(128, 0.5f), b(8, 1.0f);
  w.add_tensor_from_f32("w_a", ggml_type::ggml_q4_0, {64, 2}, a);
  w.add_tensor_from_f32("w_b", ggml_type::ggml_f32, {8}, b);
  return w;
}

struct corruption {
  const char* name;
  std::function<void(std::vector<uint8_t>&, const gguf_writer::layout&)> mutate;
  std::vector<std::string> expect;  // substrings of the error besides the path
};

std::ostream& operator<<(std::ostream& os, const corruption& c) { return os << c.name; }

const uint64_t k_huge = 1ull << 40;

std::vector<corruption> corruptions() {
  using L = gguf_writer::layout;
  using B = std::vector<uint8_t>;
  return {
      {"bad_magic", [](B& b, const L&) { b[0] = 'X'; }, {"not a GGUF file", "bad magic"}},
      {"version_1", [](B& b, const L&) { patch<uint32_t>(b, 4, 1); }, {"version 1 is not supported"}},
      {"version_99", [](B& b, const L&) { patch<uint32_t>(b, 4, 99); }, {"unsupported GGUF version 99"}},
      {"big_endian", [](B& b, const L&) { patch<uint32_t>(b, 4, 0x03000000); }, {"big-endian"}},
      {"empty", [](B& b, const L&) { b.clear(); }, {"truncated", "empty"}},
      {"truncated_header", [](B& b, const L&) { b.resize(20); }, {"truncated", "metadata count"}},
      {"truncated_kv", [](B& b, const L& l) { b.resize(l.kv[2].value_pos + 2); }, {"truncated", "aaab"}},
      {"truncated_key", [](B& b, const L& l) { b.resize(l.kv[3].key_pos + 9); }, {"string length", "exceeds"}},
      {"truncated_tensor_table", [](B& b, const L& l) { b.resize(l.tensors[1].dims_pos + 3); },
       {"truncated", "w_b"}},
      {"truncated_data", [](B& b, const L& l) { b.resize(l.tensors[1].data_pos + 16); },
       {"tensor 'w_b'", "past the end of the file"}},
      {"unknown_value_type", [](B& b, const L& l) { patch<uint32_t>(b, l.kv[1].type_pos, 13); },
       {"key 'aaaa'", "unknown value type id 13"}},
      {"unknown_array_elem_type", [](B& b, const L& l) { patch<uint32_t>(b, l.kv[3].value_pos, 99); },
       {"key 'arr'", "unknown array element type id 99"}},
      {"bad_bool", [](B& b, const L& l) { patch<uint8_t>(b, l.kv[4].value_pos, 2); }, {"key 'flag'", "bool"}},
      {"absurd_n_kv", [](B& b, const L&) { patch<uint64_t>(b, 16, k_huge); }, {"metadata count 1099511627776"}},
      {"absurd_n_tensors", [](B& b, const L&) { patch<uint64_t>(b, 8, k_huge); }, {"tensor count 1099511627776"}},
      {"absurd_string_length", [](B& b, const L& l) { patch<uint64_t>(b, l.kv[1].key_pos, k_huge); },
       {"string length 1099511627776", "exceeds"}},
      {"absurd_array_length", [](B& b, const L& l) { patch<uint64_t>(b, l.kv[3].value_pos + 4, k_huge); },
       {"key 'arr'", "array of 1099511627776", "cannot fit"}},
      {"duplicate_key", [](B& b, const L& l) { b[l.kv[2].key_pos + 8 + 3] = 'a'; },
       {"duplicate metadata key 'aaaa'"}},
      {"alignment_not_power_of_two", [](B& b, const L& l) { patch<uint32_t>(b, l.kv[0].value_pos, 24); },
       {"general.alignment", "24", "power of two"}},
      {"alignment_wrong_type", [](B& b, const L& l) { patch<uint32_t>(b, l.kv[0].type_pos, 5); },
       {"general.alignment", "must be u32", "i32"}},
      {"duplicate_tensor", [](B& b, const L& l) { b[l.tensors[1].info_pos + 8 + 2] = 'a'; },
       {"duplicate tensor name 'w_a'"}},
      {"too_many_dims", [](B& b, const L& l) { patch<uint32_t>(b, l.tensors[0].n_dims_pos, 5); },
       {"tensor 'w_a'", "n_dims 5"}},
      {"negative_dim", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[0].dims_pos + 8, ~0ull); },
       {"tensor 'w_a'", "negative"}},
      {"huge_dims", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[0].dims_pos + 8, k_huge); },
       {"tensor 'w_a'", "larger than the file"}},
      // Found by fuzz/fuzz_gguf: ne[0] = 2^62 + 8 F32 elements wrapped the row size to 32 bytes,
      // so the tensor passed as 32 bytes long and n_elements() overflowed.
      {"row_bytes_wrap", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[1].dims_pos, (1ull << 62) + 8); },
       {"tensor 'w_b'", "ne[0] = 4611686018427387912", "larger than the file"}},
      {"element_count_overflow", [](B& b, const L& l) {
         patch<uint64_t>(b, l.tensors[0].dims_pos, 1ull << 33);
         patch<uint64_t>(b, l.tensors[0].dims_pos + 8, 1ull << 31);
       },
       {"tensor 'w_a'", "element count overflows int64 at dimension 1"}},
      {"unknown_tensor_type", [](B& b, const L& l) { patch<uint32_t>(b, l.tensors[0].type_pos, 4); },
       {"tensor 'w_a'", "ggml type id 4"}},
      {"cols_not_block_multiple", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[0].dims_pos, 48); },
       {"tensor 'w_a'", "ne[0] = 48", "block size 32"}},
      {"unaligned_offset", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[1].offset_pos, 100); },
       {"tensor 'w_b'", "offset 100", "alignment 32"}},
      {"offset_out_of_range", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[1].offset_pos, k_huge); },
       {"tensor 'w_b'", "past the end"}},
      {"overlapping_tensors", [](B& b, const L& l) { patch<uint64_t>(b, l.tensors[1].offset_pos, 64); },
       {"overlaps", "w_a", "w_b"}},
  };
}

class gguf_corrupt : public testing::TestWithParam<corruption> {};

TEST_P(gguf_corrupt, names_file_item_and_problem) {
  gguf_writer::layout lay;
  std::vector<uint8_t> bytes = base_writer().to_bytes(&lay);
  // The layout the cases rely on.
  ASSERT_EQ(lay.kv.size(), 5u);
  ASSERT_EQ(lay.tensors.size(), 2u);
  ASSERT_EQ(lay.tensors[1].data_pos - lay.data_section_pos, 96u);
  const std::string path = (test::scratch_dir() / "bad.gguf").string();
  write_bytes(path, bytes);
  ASSERT_NO_THROW(gguf_file::open(path)) << "the unmodified base file must be valid";

  GetParam().mutate(bytes, lay);
  write_bytes(path, bytes);
  std::vector<std::string> expect = GetParam().expect;
  expect.push_back(path);
  expect_error([&] { gguf_file::open(path); }, expect);
}

INSTANTIATE_TEST_SUITE_P(cases, gguf_corrupt, testing::ValuesIn(corruptions()),
                         [](const testing::TestParamInfo<corruption>& i) { return std::string(i.param.name); });

TEST(gguf_corrupt_misc, missing_file_and_deep_nesting) {
  const auto dir = test::scratch_dir();
  const std::string missing = (dir / "nope.gguf").string();
  expect_error([&] { gguf_file::open(missing); }, {missing, "cannot open"});
  expect_error([&] { gguf_file::open(dir.string()); }, {dir.string(), "not a regular file"});

  gguf_value v = gguf_make_array(vt::gguf_u8, {gguf_make_u8(1)});
  for (int i = 0; i < 12; ++i) v = gguf_make_array(vt::gguf_array, {v});
  gguf_writer w;
  w.add("deep", v);
  const std::string path = (dir / "deep.gguf").string();
  w.write(path);
  expect_error([&] { gguf_file::open(path); }, {path, "key 'deep'", "nested deeper"});
}

TEST(gguf_writer_checks, rejects_inconsistent_input) {
  gguf_writer w;
  w.add_u32("k", 1);
  expect_error([&] { w.add_u32("k", 2); }, {"duplicate key 'k'"});
  const float v[4] = {};
  expect_error([&] { w.add_tensor("t", ggml_type::ggml_f32, {5}, v, sizeof v); }, {"tensor 't'", "16 bytes"});
  expect_error([&] { w.add_tensor("t", ggml_type::ggml_q4_0, {16}, v, 9); }, {"tensor 't'", "block size 32"});
  expect_error([&] { w.set_alignment(48); }, {"48", "power of two"});
  w.add("mixed", gguf_make_array(vt::gguf_u8, {gguf_make_u16(1)}));
  expect_error([&] { w.to_bytes(); }, {"key 'mixed'", "array"});
}

}  // namespace
}  // namespace xctx
