// GGUF -> hparams and weights: the real model, tiny models written by gguf_writer (every
// supported arch, several storage types), key defaults, and the shape/type/presence errors.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <map>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/weights.h"
#include "test_util.h"

namespace xctx {
namespace {

void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

std::shared_ptr<gguf_file> open_shared(const std::string& path) { return gguf_file::open(path); }

// What load_gguf_weights reports: matrices as stored, vectors as the floats they become.
size_t expected_weight_bytes(const gguf_file& f) {
  size_t total = 0;
  for (const auto& t : f.tensors()) total += t.shape.size() == 1 ? (size_t)t.n_elements() * sizeof(float) : t.bytes;
  return total;
}

// ---- the real model -----------------------------------------------------------------------

TEST(gguf_real_model, hparams) {
  XCTX_REQUIRE_MODEL(path);
  const auto f = gguf_file::open(path);
  const model_hparams hp = read_gguf_hparams(*f);
  EXPECT_EQ(hp.arch, "llama");
  EXPECT_EQ(hp.n_layer, 30);
  EXPECT_EQ(hp.n_embd, 576);
  EXPECT_EQ(hp.n_ff, 1536);
  EXPECT_EQ(hp.n_head, 9);
  EXPECT_EQ(hp.n_head_kv, 3);
  EXPECT_EQ(hp.head_dim, 64);
  EXPECT_EQ(hp.n_rot, 64);
  EXPECT_EQ(hp.n_vocab, 49152);
  EXPECT_EQ(hp.n_ctx_train, 8192);
  EXPECT_EQ(hp.rope_freq_base, 100000.0f);
  EXPECT_EQ(hp.rms_eps, 1e-5f);
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_none);
  EXPECT_TRUE(hp.tied_output);
  EXPECT_FALSE(hp.qkv_bias);
  EXPECT_EQ(hp.n_gqa(), 3);
  EXPECT_EQ(hp.kv_dim(), 192);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->get_string_array("tokenizer.ggml.tokens").size(), 49152u);
}

TEST(gguf_real_model, weights) {
  XCTX_REQUIRE_MODEL(path);
  std::shared_ptr<gguf_file> f = open_shared(path);
  const model_weights w = load_gguf_weights(f);
  EXPECT_EQ(w.source, path);
  ASSERT_EQ(w.layers.size(), 30u);
  EXPECT_EQ(w.tok_embd.type, ggml_type::ggml_q8_0);
  EXPECT_EQ(w.tok_embd.n_rows, 49152);
  EXPECT_EQ(w.tok_embd.n_cols, 576);
  EXPECT_EQ(w.tok_embd.data, f->tensor("token_embd.weight").data);  // a view, not a copy
  EXPECT_EQ(w.output.data, w.tok_embd.data);                         // tied
  EXPECT_EQ(w.out_norm.size(), 576u);
  for (const layer_weights& l : w.layers) {
    EXPECT_EQ(l.wq.type, ggml_type::ggml_q4_1);
    EXPECT_EQ(l.wq.n_rows, 576);
    EXPECT_EQ(l.wk.n_rows, 192);
    EXPECT_EQ(l.wv.n_rows, 192);
    EXPECT_EQ(l.wo.n_cols, 576);
    EXPECT_EQ(l.w_gate.n_rows, 1536);
    EXPECT_EQ(l.w_up.n_rows, 1536);
    EXPECT_EQ(l.w_down.n_rows, 576);
    EXPECT_EQ(l.w_down.n_cols, 1536);
    EXPECT_EQ(l.attn_norm.size(), 576u);
    EXPECT_EQ(l.ffn_norm.size(), 576u);
    EXPECT_TRUE(l.bq.empty());
  }
  EXPECT_EQ(w.layers[29].w_down.data, f->tensor("blk.29.ffn_down.weight").data);
  EXPECT_EQ(std::memcmp(w.layers[3].ffn_norm.data(), f->tensor("blk.3.ffn_norm.weight").data, 576 * 4), 0);
  EXPECT_EQ(w.weight_bytes(), expected_weight_bytes(*f));
  // The weights keep the mapping alive on their own.
  EXPECT_EQ(w.storage.get(), (void*)f.get());
  const long uses = f.use_count();
  f.reset();
  EXPECT_EQ(w.storage.use_count(), uses - 1);
}

// ---- tiny models written by gguf_writer ----------------------------------------------------

struct tiny_case {
  const char* name;
  const char* arch;
  ggml_type matrix_type;
  ggml_type vector_type;
  bool tied;
  bool bias;
  int head_dim;  // 0: n_embd / n_head
};

std::ostream& operator<<(std::ostream& os, const tiny_case& c) { return os << c.name; }

model_hparams tiny_hparams(const tiny_case& c) {
  model_hparams hp;
  hp.arch = c.arch;
  hp.n_layer = 2;
  hp.n_embd = 64;
  hp.n_ff = 96;
  hp.n_head = 4;
  hp.n_head_kv = 2;
  hp.head_dim = c.head_dim ? c.head_dim : 16;
  hp.n_rot = hp.head_dim;
  hp.n_vocab = 40;
  hp.n_ctx_train = 256;
  hp.rms_eps = 1e-6f;
  hp.rope_freq_base = 50000.0f;
  hp.tied_output = c.tied;
  hp.qkv_bias = c.bias;
  return hp;
}

class gguf_tiny_model : public testing::TestWithParam<tiny_case> {};

TEST_P(gguf_tiny_model, loads_with_expected_shapes_and_values) {
  const tiny_case c = GetParam();
  const model_hparams want = tiny_hparams(c);
  const uint64_t seed = 42;
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const std::string path = (test::scratch_dir() / "tiny.gguf").string();
  make_tiny_model_writer(want, c.matrix_type, seed, false, c.vector_type).write(path);

  std::shared_ptr<gguf_file> f = open_shared(path);
  const model_weights w = load_gguf_weights(f);
  const model_hparams& hp = w.hp;
  EXPECT_EQ(hp.arch, want.arch);
  EXPECT_EQ(hp.n_layer, 2);
  EXPECT_EQ(hp.n_embd, 64);
  EXPECT_EQ(hp.n_ff, 96);
  EXPECT_EQ(hp.n_head, 4);
  EXPECT_EQ(hp.n_head_kv, 2);
  EXPECT_EQ(hp.head_dim, want.head_dim);
  EXPECT_EQ(hp.n_rot, want.n_rot);
  EXPECT_EQ(hp.n_vocab, 40);
  EXPECT_EQ(hp.n_ctx_train, 256);
  EXPECT_EQ(hp.rms_eps, 1e-6f);
  EXPECT_EQ(hp.rope_freq_base, 50000.0f);
  EXPECT_EQ(hp.tied_output, c.tied);
  EXPECT_EQ(hp.qkv_bias, c.bias);

  const int64_t q_dim = 4 * (int64_t)want.head_dim;
  EXPECT_EQ(w.tok_embd.type, c.matrix_type);
  EXPECT_EQ(w.tok_embd.n_rows, 40);
  if (c.tied) {
    EXPECT_EQ(w.output.data, w.tok_embd.data);
  } else {
    EXPECT_EQ(w.output.data, f->tensor("output.weight").data);
    EXPECT_EQ(w.output.n_rows, 40);
  }
  for (int l = 0; l < 2; ++l) {
    const layer_weights& L = w.layers[(size_t)l];
    const std::string p = "blk." + std::to_string(l) + ".";
    EXPECT_EQ(L.wq.n_rows, q_dim);
    EXPECT_EQ(L.wq.n_cols, 64);
    EXPECT_EQ(L.wk.n_rows, 2 * want.head_dim);
    EXPECT_EQ(L.wo.n_rows, 64);
    EXPECT_EQ(L.wo.n_cols, q_dim);
    EXPECT_EQ(L.w_down.n_cols, 96);
    EXPECT_EQ(L.wq.data, f->tensor(p + "attn_q.weight").data);
    EXPECT_EQ(L.bq.size(), c.bias ? (size_t)q_dim : 0u);
    EXPECT_EQ(L.bv.size(), c.bias ? (size_t)(2 * want.head_dim) : 0u);
    // Vectors were converted to float exactly as the reference dequantizer does.
    const gguf_tensor_info& norm = f->tensor(p + "ffn_norm.weight");
    EXPECT_EQ(norm.type, c.vector_type);
    std::vector<float> expect(64);
    ref::dequantize_row(norm.type, norm.data, expect.data(), 64);
    EXPECT_EQ(L.ffn_norm, expect);
    for (const float x : L.attn_norm) EXPECT_NEAR(x, 1.0f, 0.11f);  // written as 1 ± 0.1
  }
  EXPECT_EQ(w.weight_bytes(), expected_weight_bytes(*f));
}

INSTANTIATE_TEST_SUITE_P(
    archs, gguf_tiny_model,
    testing::Values(tiny_case{"llama_q4_1_tied", "llama", ggml_type::ggml_q4_1, ggml_type::ggml_f32, true, false, 0},
                    tiny_case{"mistral_q8_0_untied", "mistral", ggml_type::ggml_q8_0, ggml_type::ggml_f32, false, false, 0},
                    tiny_case{"qwen2_f16_bias", "qwen2", ggml_type::ggml_f16, ggml_type::ggml_f16, false, true, 0},
                    tiny_case{"llama_q4_0_bf16_norms", "llama", ggml_type::ggml_q4_0, ggml_type::ggml_bf16, true, false, 0},
                    tiny_case{"llama_f32_head_dim_32", "llama", ggml_type::ggml_f32, ggml_type::ggml_f32, true, false, 32}),
    [](const testing::TestParamInfo<tiny_case>& i) { return std::string(i.param.name); });

// Writes the tiny llama model and returns its bytes plus layout, for patching.
struct tiny_file {
  std::string path;
  std::vector<uint8_t> bytes;
  gguf_writer::layout layout;
  std::vector<std::string> names;  // tensor names in file order
};

tiny_file tiny_llama(ggml_type vector_type = ggml_type::ggml_f32) {
  tiny_file t;
  t.path = (test::scratch_dir() / "tiny.gguf").string();
  const model_hparams hp = tiny_hparams({"", "llama", ggml_type::ggml_q8_0, vector_type, true, false, 0});
  t.bytes = make_tiny_model_writer(hp, ggml_type::ggml_q8_0, 7, false, vector_type).to_bytes(&t.layout);
  std::ofstream(t.path, std::ios::binary).write((const char*)t.bytes.data(), (std::streamsize)t.bytes.size());
  const auto f = gguf_file::open(t.path);
  for (const auto& info : f->tensors()) t.names.push_back(info.name);
  return t;
}

size_t tensor_index(const tiny_file& t, const std::string& name) {
  for (size_t i = 0; i < t.names.size(); ++i)
    if (t.names[i] == name) return i;
  ADD_FAILURE() << "no tensor " << name;
  return 0;
}

void rewrite(const tiny_file& t) {
  std::ofstream(t.path, std::ios::binary).write((const char*)t.bytes.data(), (std::streamsize)t.bytes.size());
}

TEST(gguf_weights_errors, matrix_shape_mismatch) {
  tiny_file t = tiny_llama();
  // ffn_up is [n_embd=64, n_ff=96]; claim 48 rows (smaller, so the file itself stays valid).
  const auto& tl = t.layout.tensors[tensor_index(t, "blk.0.ffn_up.weight")];
  const uint64_t rows = 48;
  std::memcpy(t.bytes.data() + tl.dims_pos + 8, &rows, 8);
  rewrite(t);
  expect_error([&] { load_gguf_weights(open_shared(t.path)); },
               {t.path, "tensor 'blk.0.ffn_up.weight'", "shape [64, 48]", "expected [64, 96]"});
}

TEST(gguf_weights_errors, missing_tensor) {
  tiny_file t = tiny_llama();
  const auto& tl = t.layout.tensors[tensor_index(t, "blk.1.ffn_up.weight")];
  t.bytes[tl.info_pos + 8 + std::strlen("blk.1.ffn_u")] = 'q';  // -> blk.1.ffn_uq.weight
  rewrite(t);
  expect_error([&] { load_gguf_weights(open_shared(t.path)); }, {t.path, "missing tensor 'blk.1.ffn_up.weight'"});
}

TEST(gguf_weights_errors, norm_shape_and_type) {
  tiny_file t = tiny_llama();
  const auto& tl = t.layout.tensors[tensor_index(t, "output_norm.weight")];
  const uint64_t n = 32;
  std::memcpy(t.bytes.data() + tl.dims_pos, &n, 8);
  rewrite(t);
  expect_error([&] { load_gguf_weights(open_shared(t.path)); },
               {t.path, "tensor 'output_norm.weight'", "shape [32]", "expected [64]"});

  tiny_file q = tiny_llama(ggml_type::ggml_q8_0);
  expect_error([&] { load_gguf_weights(open_shared(q.path)); },
               {q.path, "tensor 'output_norm.weight'", "type Q8_0", "expected F32"});
}

// ---- hyper-parameter keys ------------------------------------------------------------------

// A metadata-only llama file: the keys below (minus `drop`, plus `extra`) and a token_embd of
// [64, embd_rows] plus any `tensors` as tiny F32 vectors.
std::string write_meta(const std::map<std::string, gguf_value>& extra, const std::vector<std::string>& drop = {},
                       const std::vector<std::string>& tensors = {}, int embd_rows = 10,
                       const std::string& arch = "llama") {
  std::map<std::string, gguf_value> kv = {
      {"block_count", gguf_make_u32(2)},
      {"context_length", gguf_make_u32(128)},
      {"embedding_length", gguf_make_u32(64)},
      {"feed_forward_length", gguf_make_u32(96)},
      {"attention.head_count", gguf_make_u32(4)},
      {"attention.head_count_kv", gguf_make_u32(2)},
      {"attention.layer_norm_rms_epsilon", gguf_make_f32(1e-5f)},
      {"rope.freq_base", gguf_make_f32(500000.0f)},
      {"vocab_size", gguf_make_u32(12)},
  };
  for (const auto& d : drop) kv.erase(d);
  gguf_writer w;
  w.add_string("general.architecture", arch);
  for (const auto& [k, v] : kv) w.add(arch + "." + k, v);
  for (const auto& [k, v] : extra) w.add(k, v);
  std::vector<float> embd((size_t)(64 * embd_rows), 0.0f);
  w.add_tensor_from_f32("token_embd.weight", ggml_type::ggml_f32, {64, embd_rows}, embd);
  for (const auto& name : tensors) w.add_tensor_from_f32(name, ggml_type::ggml_f32, {8}, std::vector<float>(8));
  const std::string path = (test::scratch_dir() / "meta.gguf").string();
  w.write(path);
  return path;
}

model_hparams hparams_of(const std::string& path) { return read_gguf_hparams(*gguf_file::open(path)); }

TEST(gguf_hparams, keys_and_defaults) {
  model_hparams hp = hparams_of(write_meta({}));
  EXPECT_EQ(hp.n_head_kv, 2);
  EXPECT_EQ(hp.head_dim, 16);
  EXPECT_EQ(hp.n_rot, 16);
  EXPECT_EQ(hp.n_vocab, 12);
  EXPECT_EQ(hp.rope_freq_base, 500000.0f);
  EXPECT_TRUE(hp.tied_output);
  EXPECT_FALSE(hp.qkv_bias);

  hp = hparams_of(write_meta({}, {"attention.head_count_kv", "rope.freq_base", "vocab_size"}));
  EXPECT_EQ(hp.n_head_kv, 4);               // = head_count
  EXPECT_EQ(hp.rope_freq_base, 10000.0f);   // GGML's default
  EXPECT_EQ(hp.n_vocab, 10);                // token_embd rows

  hp = hparams_of(write_meta({{"tokenizer.ggml.tokens", gguf_make_array(gguf_value_type::gguf_string,
                                                                        {gguf_make_string("a"), gguf_make_string("b")})}},
                             {"vocab_size"}));
  EXPECT_EQ(hp.n_vocab, 2);  // tokenizer length wins over token_embd rows

  hp = hparams_of(write_meta({{"llama.attention.key_length", gguf_make_u32(32)},
                              {"llama.rope.dimension_count", gguf_make_u32(24)}}));
  EXPECT_EQ(hp.head_dim, 32);
  EXPECT_EQ(hp.n_rot, 24);

  hp = hparams_of(write_meta({{"general.name", gguf_make_string("tiny")}}, {}, {"output.weight"}));
  EXPECT_EQ(hp.name, "tiny");
  EXPECT_FALSE(hp.tied_output);

  hp = hparams_of(write_meta({}, {}, {"blk.0.attn_q.bias"}, 10, "qwen2"));
  EXPECT_EQ(hp.arch, "qwen2");
  EXPECT_TRUE(hp.qkv_bias);
  EXPECT_FALSE(hparams_of(write_meta({}, {}, {}, 10, "mistral")).qkv_bias);
}

TEST(gguf_hparams, rope_scaling) {
  model_hparams hp = hparams_of(write_meta({{"llama.rope.scaling.type", gguf_make_string("linear")},
                                            {"llama.rope.scaling.factor", gguf_make_f32(4.0f)}}));
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_linear);
  EXPECT_EQ(hp.rope_scale_factor, 4.0f);
  hp = hparams_of(write_meta({{"llama.rope.scaling.type", gguf_make_string("none")}}));
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_none);
  hp = hparams_of(write_meta({{"llama.rope.scale_linear", gguf_make_f32(2.0f)}}));
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_linear);
  EXPECT_EQ(hp.rope_scale_factor, 2.0f);

  const std::string yarn = write_meta({{"llama.rope.scaling.type", gguf_make_string("yarn")}});
  expect_error([&] { hparams_of(yarn); }, {yarn, "llama.rope.scaling.type", "yarn", "not supported"});
  const std::string bad_factor = write_meta({{"llama.rope.scaling.type", gguf_make_string("linear")},
                                             {"llama.rope.scaling.factor", gguf_make_f32(-1.0f)}});
  expect_error([&] { hparams_of(bad_factor); }, {bad_factor, "rope_scale_factor = -1"});
}

TEST(gguf_hparams, errors_name_file_and_key) {
  std::string p = write_meta({}, {}, {}, 10, "gpt2");
  expect_error([&] { hparams_of(p); }, {p, "general.architecture", "gpt2"});
  p = write_meta({}, {"block_count"});
  expect_error([&] { hparams_of(p); }, {p, "missing metadata key 'llama.block_count'"});
  p = write_meta({}, {"attention.layer_norm_rms_epsilon"});
  expect_error([&] { hparams_of(p); }, {p, "missing metadata key 'llama.attention.layer_norm_rms_epsilon'"});
  p = write_meta({{"llama.attention.head_count_kv", gguf_make_string("3")}}, {"attention.head_count_kv"});
  expect_error([&] { hparams_of(p); }, {p, "llama.attention.head_count_kv", "expected an integer"});
  p = write_meta({{"llama.attention.head_count_kv", gguf_make_u32(3)}}, {"attention.head_count_kv"});
  expect_error([&] { hparams_of(p); }, {p, "n_head_kv = 3"});
  p = write_meta({{"llama.attention.value_length", gguf_make_u32(8)}});
  expect_error([&] { hparams_of(p); }, {p, "llama.attention.value_length", "8"});
  p = write_meta({}, {}, {"rope_freqs.weight"});
  expect_error([&] { hparams_of(p); }, {p, "rope_freqs.weight"});
  p = write_meta({{"llama.rope.dimension_count", gguf_make_u32(40)}});
  expect_error([&] { hparams_of(p); }, {p, "n_rot = 40"});
  p = write_meta({{"llama.some_future_key", gguf_make_string("x")}});
  EXPECT_NO_THROW(hparams_of(p));  // unknown keys are ignored
}

// ---- validate() ------------------------------------------------------------------------------

struct bad_field {
  const char* name;
  std::function<void(model_hparams&)> mutate;
  const char* expect;
};
std::ostream& operator<<(std::ostream& os, const bad_field& b) { return os << b.name; }

class hparams_validate : public testing::TestWithParam<bad_field> {};

TEST_P(hparams_validate, rejects_field_naming_source_and_value) {
  model_hparams hp = tiny_hparams({"", "llama", ggml_type::ggml_f32, ggml_type::ggml_f32, true, false, 0});
  ASSERT_NO_THROW(hp.validate("src.gguf"));
  GetParam().mutate(hp);
  expect_error([&] { hp.validate("src.gguf"); }, {"src.gguf", GetParam().expect});
}

INSTANTIATE_TEST_SUITE_P(
    fields, hparams_validate,
    testing::Values(bad_field{"arch", [](model_hparams& h) { h.arch = "gpt2"; }, "arch = gpt2"},
                    bad_field{"n_layer_0", [](model_hparams& h) { h.n_layer = 0; }, "n_layer = 0"},
                    bad_field{"n_layer_2000", [](model_hparams& h) { h.n_layer = 2000; }, "n_layer = 2000"},
                    bad_field{"n_embd_0", [](model_hparams& h) { h.n_embd = 0; }, "n_embd = 0"},
                    bad_field{"n_embd_not_multiple", [](model_hparams& h) { h.n_embd = 66; }, "n_embd = 66"},
                    bad_field{"n_ff_0", [](model_hparams& h) { h.n_ff = 0; }, "n_ff = 0"},
                    bad_field{"n_head_0", [](model_hparams& h) { h.n_head = 0; }, "n_head = 0"},
                    bad_field{"n_head_kv_not_divisor", [](model_hparams& h) { h.n_head_kv = 3; }, "n_head_kv = 3"},
                    bad_field{"head_dim_odd", [](model_hparams& h) { h.head_dim = 15; }, "head_dim = 15"},
                    bad_field{"n_rot_gt_head_dim", [](model_hparams& h) { h.n_rot = 18; }, "n_rot = 18"},
                    bad_field{"n_vocab_0", [](model_hparams& h) { h.n_vocab = 0; }, "n_vocab = 0"},
                    bad_field{"n_ctx_0", [](model_hparams& h) { h.n_ctx_train = 0; }, "n_ctx_train = 0"},
                    bad_field{"eps_0", [](model_hparams& h) { h.rms_eps = 0.0f; }, "rms_eps = 0"},
                    bad_field{"eps_1", [](model_hparams& h) { h.rms_eps = 1.0f; }, "rms_eps = 1"},
                    bad_field{"freq_base_0", [](model_hparams& h) { h.rope_freq_base = 0.0f; }, "rope_freq_base = 0"},
                    bad_field{"scale_factor_0", [](model_hparams& h) { h.rope_scale_factor = 0.0f; },
                              "rope_scale_factor = 0"}),
    [](const testing::TestParamInfo<bad_field>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace xctx
