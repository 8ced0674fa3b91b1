// Hugging Face checkpoint loading: a tiny Llama/Qwen2 written here in F32/F16/BF16, single file
// and sharded, must load with exact values, Q/K rows permuted from rotate-half into the
// adjacent-pair rope layout, the right tying, and clear errors for every broken input.
#include <cfloat>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "common/error.h"
#include "common/half.h"
#include "kernels/ref/ref_ops.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "test_util.h"

namespace xctx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct ref_tensor {
  std::vector<int64_t> shape;
  std::vector<float> v;  // values exactly representable in the checkpoint's dtype
  std::string dtype;     // empty: the checkpoint's dtype
};

// A tiny Llama-family checkpoint held in memory until written: config + HF-named tensors.
struct checkpoint {
  std::string arch = "llama";
  int n_layer = 2, n_embd = 64, n_head = 4, n_head_kv = 2, n_ff = 96, n_vocab = 97;
  std::string dtype = "F32";
  json config;
  std::map<std::string, ref_tensor> tensors;
  int head_dim() const { return n_embd / n_head; }
};

float round_to(const std::string& dtype, float x) {
  if (dtype == "F16") return fp16_to_fp32(fp32_to_fp16(x));
  if (dtype == "BF16") return bf16_to_fp32(fp32_to_bf16(x));
  return x;
}

std::vector<uint8_t> encode(const std::string& dtype, const std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (float x : v) {
    uint8_t b[4];
    size_t n = 2;
    if (dtype == "F32") {
      std::memcpy(b, &x, 4);
      n = 4;
    } else if (dtype == "I32") {
      const int32_t i = (int32_t)x;
      std::memcpy(b, &i, 4);
      n = 4;
    } else {
      const uint16_t h = dtype == "F16" ? fp32_to_fp16(x) : fp32_to_bf16(x);
      std::memcpy(b, &h, 2);
    }
    out.insert(out.end(), b, b + n);
  }
  return out;
}

checkpoint make_checkpoint(const std::string& arch, const std::string& dtype, bool with_lm_head, uint32_t seed) {
  checkpoint c;
  c.arch = arch;
  c.dtype = dtype;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    ref_tensor t{std::move(shape), std::vector<float>((size_t)n), ""};
    for (float& x : t.v) x = round_to(dtype, dist(rng));
    c.tensors[name] = std::move(t);
  };
  const int64_t q_dim = (int64_t)c.n_head * c.head_dim(), kv_dim = (int64_t)c.n_head_kv * c.head_dim();
  add("model.embed_tokens.weight", {c.n_vocab, c.n_embd});
  add("model.norm.weight", {c.n_embd});
  if (with_lm_head) add("lm_head.weight", {c.n_vocab, c.n_embd});
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string p = "model.layers." + std::to_string(il) + ".";
    add(p + "input_layernorm.weight", {c.n_embd});
    add(p + "self_attn.q_proj.weight", {q_dim, c.n_embd});
    add(p + "self_attn.k_proj.weight", {kv_dim, c.n_embd});
    add(p + "self_attn.v_proj.weight", {kv_dim, c.n_embd});
    add(p + "self_attn.o_proj.weight", {c.n_embd, q_dim});
    if (arch == "qwen2") {
      add(p + "self_attn.q_proj.bias", {q_dim});
      add(p + "self_attn.k_proj.bias", {kv_dim});
      add(p + "self_attn.v_proj.bias", {kv_dim});
    }
    add(p + "post_attention_layernorm.weight", {c.n_embd});
    add(p + "mlp.gate_proj.weight", {c.n_ff, c.n_embd});
    add(p + "mlp.up_proj.weight", {c.n_ff, c.n_embd});
    add(p + "mlp.down_proj.weight", {c.n_embd, c.n_ff});
  }
  static const std::map<std::string, std::string> cls = {
      {"llama", "LlamaForCausalLM"}, {"mistral", "MistralForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}};
  c.config = {{"architectures", {cls.at(arch)}},
              {"model_type", arch},
              {"hidden_size", c.n_embd},
              {"intermediate_size", c.n_ff},
              {"num_hidden_layers", c.n_layer},
              {"num_attention_heads", c.n_head},
              {"num_key_value_heads", c.n_head_kv},
              {"rms_norm_eps", 1e-5},
              {"rope_theta", 100000.0},
              {"rope_scaling", nullptr},
              {"max_position_embeddings", 2048},
              {"vocab_size", c.n_vocab},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", !with_lm_head},
              {"torch_dtype", dtype == "F32"   ? "float32"
                              : dtype == "F16" ? "float16"
                                               : "bfloat16"}};
  return c;
}

std::string shard_name(int i, int n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

// n_shards == 0 writes a single model.safetensors; otherwise tensors are dealt round-robin
// into shards so every shard holds some of each kind, plus the index.
void write_checkpoint(const fs::path& dir, const checkpoint& c, int n_shards) {
  std::ofstream(dir / "config.json") << c.config.dump(2);
  auto out_tensor = [&](const std::string& name, const ref_tensor& t) {
    const std::string dt = t.dtype.empty() ? c.dtype : t.dtype;
    return st_tensor_out{name, dt, t.shape, encode(dt, t.v)};
  };
  if (n_shards == 0) {
    std::vector<st_tensor_out> outs;
    for (const auto& [name, t] : c.tensors) outs.push_back(out_tensor(name, t));
    write_safetensors((dir / "model.safetensors").string(), outs, {{"format", "pt"}});
    return;
  }
  std::vector<std::vector<st_tensor_out>> shards((size_t)n_shards);
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  size_t k = 0, total = 0;
  for (const auto& [name, t] : c.tensors) {
    const size_t s = k++ % (size_t)n_shards;
    shards[s].push_back(out_tensor(name, t));
    total += shards[s].back().data.size();
    index["weight_map"][name] = shard_name((int)s + 1, n_shards);
  }
  index["metadata"]["total_size"] = total;
  for (int s = 0; s < n_shards; ++s) write_safetensors((dir / shard_name(s + 1, n_shards)).string(), shards[(size_t)s]);
  std::ofstream(dir / "model.safetensors.index.json") << index.dump(2);
}

std::vector<float> row_values(const weight_view& w, int64_t r) {
  std::vector<float> out((size_t)w.n_cols);
  const auto* p = static_cast<const uint8_t*>(w.data) + (size_t)r * w.row_bytes();
  for (int64_t c = 0; c < w.n_cols; ++c) {
    if (w.type == ggml_type::ggml_f32) {
      std::memcpy(&out[(size_t)c], p + 4 * c, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, p + 2 * c, 2);
      EXPECT_TRUE(w.type == ggml_type::ggml_f16 || w.type == ggml_type::ggml_bf16);
      out[(size_t)c] = w.type == ggml_type::ggml_f16 ? fp16_to_fp32(h) : bf16_to_fp32(h);
    }
  }
  return out;
}

std::vector<float> hf_row(const ref_tensor& t, int64_t r) {
  const size_t n = (size_t)t.shape[1];
  return std::vector<float>(t.v.begin() + (ptrdiff_t)(r * (int64_t)n), t.v.begin() + (ptrdiff_t)((r + 1) * (int64_t)n));
}

// Row r of a loaded Q/K matrix comes from this HF row: within each head, loaded rows 2i and
// 2i+1 are HF rows i and i + d/2 (the rotate-half partners).
int64_t hf_source_row(int64_t r, int head_dim) {
  const int64_t h = r / head_dim, j = r % head_dim;
  return h * head_dim + (j % 2 == 0 ? j / 2 : j / 2 + head_dim / 2);
}

void expect_matrix(const weight_view& w, const ref_tensor& t, const std::string& what, int permute_head_dim = 0) {
  ASSERT_EQ(w.n_rows, t.shape[0]) << what;
  ASSERT_EQ(w.n_cols, t.shape[1]) << what;
  for (int64_t r = 0; r < w.n_rows; ++r) {
    const int64_t src = permute_head_dim ? hf_source_row(r, permute_head_dim) : r;
    ASSERT_EQ(row_values(w, r), hf_row(t, src)) << what << " row " << r << " (HF row " << src << ")";
  }
}

std::vector<float> permuted(const std::vector<float>& v, int head_dim) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = v[(size_t)hf_source_row((int64_t)i, head_dim)];
  return out;
}

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

// Checks every loaded tensor of `mw` against the checkpoint it was written from.
void expect_weights_match(const model_weights& mw, const checkpoint& c) {
  const model_hparams& hp = mw.hp;
  EXPECT_EQ(hp.arch, c.arch);
  EXPECT_EQ(hp.n_layer, c.n_layer);
  EXPECT_EQ(hp.n_embd, c.n_embd);
  EXPECT_EQ(hp.n_ff, c.n_ff);
  EXPECT_EQ(hp.n_head, c.n_head);
  EXPECT_EQ(hp.n_head_kv, c.n_head_kv);
  EXPECT_EQ(hp.head_dim, c.head_dim());
  EXPECT_EQ(hp.n_rot, c.head_dim());
  EXPECT_EQ(hp.n_vocab, c.n_vocab);
  EXPECT_EQ(hp.n_ctx_train, 2048);
  EXPECT_FLOAT_EQ(hp.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(hp.rope_freq_base, 100000.0f);
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_none);
  EXPECT_EQ(hp.qkv_bias, c.arch == "qwen2");
  ASSERT_EQ(mw.layers.size(), (size_t)c.n_layer);

  const auto& T = c.tensors;
  expect_matrix(mw.tok_embd, T.at("model.embed_tokens.weight"), "tok_embd");
  EXPECT_EQ(mw.out_norm, T.at("model.norm.weight").v);
  if (T.count("lm_head.weight") && !c.config.value("tie_word_embeddings", false)) {
    EXPECT_FALSE(hp.tied_output);
    EXPECT_NE(mw.output.data, mw.tok_embd.data);
    expect_matrix(mw.output, T.at("lm_head.weight"), "output");
  } else {
    EXPECT_TRUE(hp.tied_output);
    EXPECT_EQ(mw.output.data, mw.tok_embd.data);
    EXPECT_EQ(mw.output.n_rows, c.n_vocab);
  }
  const int d = c.head_dim();
  for (int il = 0; il < c.n_layer; ++il) {
    const layer_weights& l = mw.layers[(size_t)il];
    const std::string p = "model.layers." + std::to_string(il) + ".";
    EXPECT_EQ(l.attn_norm, T.at(p + "input_layernorm.weight").v);
    EXPECT_EQ(l.ffn_norm, T.at(p + "post_attention_layernorm.weight").v);
    expect_matrix(l.wq, T.at(p + "self_attn.q_proj.weight"), p + "wq", d);
    expect_matrix(l.wk, T.at(p + "self_attn.k_proj.weight"), p + "wk", d);
    expect_matrix(l.wv, T.at(p + "self_attn.v_proj.weight"), p + "wv");
    expect_matrix(l.wo, T.at(p + "self_attn.o_proj.weight"), p + "wo");
    expect_matrix(l.w_gate, T.at(p + "mlp.gate_proj.weight"), p + "w_gate");
    expect_matrix(l.w_up, T.at(p + "mlp.up_proj.weight"), p + "w_up");
    expect_matrix(l.w_down, T.at(p + "mlp.down_proj.weight"), p + "w_down");
    if (c.arch == "qwen2") {
      EXPECT_EQ(l.bq, permuted(T.at(p + "self_attn.q_proj.bias").v, d));
      EXPECT_EQ(l.bk, permuted(T.at(p + "self_attn.k_proj.bias").v, d));
      EXPECT_EQ(l.bv, T.at(p + "self_attn.v_proj.bias").v);
    } else {
      EXPECT_TRUE(l.bq.empty() && l.bk.empty() && l.bv.empty());
    }
  }
}

struct load_case {
  std::string arch;
  std::string dtype;
  int n_shards;  // 0: single model.safetensors
  bool lm_head;  // false: tied (no lm_head.weight, tie_word_embeddings true)
  std::string name() const {
    return arch + "_" + dtype + (n_shards ? "_sharded" : "_single") + (lm_head ? "_untied" : "_tied");
  }
};

void PrintTo(const load_case& c, std::ostream* os) { *os << c.name(); }

class HfLoad : public testing::TestWithParam<load_case> {};

TEST_P(HfLoad, ValuesRoundTrip) {
  const load_case& p = GetParam();
  const uint32_t seed = 20240601;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const checkpoint c = make_checkpoint(p.arch, p.dtype, p.lm_head, seed);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, p.n_shards);

  const model_weights mw = load_hf_weights(dir.string());
  EXPECT_EQ(mw.source, dir.string());
  EXPECT_TRUE(mw.storage);
  const ggml_type want = p.dtype == "F32"   ? ggml_type::ggml_f32
                         : p.dtype == "F16" ? ggml_type::ggml_f16
                                            : ggml_type::ggml_bf16;
  EXPECT_EQ(mw.tok_embd.type, want);
  EXPECT_EQ(mw.layers[0].wq.type, want);
  expect_weights_match(mw, c);

  // load_model dispatches a directory to the same loader.
  const model_weights again = load_model(dir.string());
  expect_weights_match(again, c);
}

std::vector<load_case> load_cases() {
  std::vector<load_case> out;
  for (const char* dt : {"F32", "F16", "BF16"})
    for (int shards : {0, 2})
      for (bool lm_head : {true, false}) out.push_back({"llama", dt, shards, lm_head});
  out.push_back({"qwen2", "BF16", 0, false});
  out.push_back({"qwen2", "F32", 2, true});
  out.push_back({"mistral", "F16", 0, true});
  return out;
}
INSTANTIATE_TEST_SUITE_P(Checkpoints, HfLoad, testing::ValuesIn(load_cases()),
                         [](const auto& info) { return info.param.name(); });

TEST(HfLoader, KnownPermutedElements) {
  // head_dim 16: loaded row 2i <- HF row i, 2i+1 <- HF row i + 8, per head.
  const checkpoint c = make_checkpoint("qwen2", "F32", true, 7);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  const model_weights mw = load_hf_weights(dir.string());
  const ref_tensor& q = c.tensors.at("model.layers.0.self_attn.q_proj.weight");
  const ref_tensor& k = c.tensors.at("model.layers.1.self_attn.k_proj.weight");
  const ref_tensor& bq = c.tensors.at("model.layers.0.self_attn.q_proj.bias");
  const std::vector<std::pair<int64_t, int64_t>> q_rows = {{0, 0},   {1, 8},   {2, 1},  {15, 15},
                                                           {16, 16}, {17, 24}, {63, 63}};
  for (auto [loaded, hf] : q_rows) {
    EXPECT_EQ(row_values(mw.layers[0].wq, loaded), hf_row(q, hf)) << "wq row " << loaded;
    EXPECT_EQ(mw.layers[0].bq[(size_t)loaded], bq.v[(size_t)hf]) << "bq " << loaded;
  }
  // second kv head of layer 1: loaded row 16 + 3 = 2*1 + 1 -> HF row 16 + 1 + 8
  EXPECT_EQ(row_values(mw.layers[1].wk, 19), hf_row(k, 25));
  EXPECT_EQ(row_values(mw.layers[1].wk, 30), hf_row(k, 23));
  EXPECT_EQ(row_values(mw.layers[1].wv, 19), hf_row(c.tensors.at("model.layers.1.self_attn.v_proj.weight"), 19));
}

// HF's rotate-half RoPE applied to HF-layout q must equal the adjacent-pair reference rope
// applied to the permuted q, element for element under the permutation: that is the property
// the permutation exists for.
TEST(HfLoader, PermutedQMatchesRotateHalfRope) {
  const uint32_t seed = 99;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const checkpoint c = make_checkpoint("llama", "F32", true, seed);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  const model_weights mw = load_hf_weights(dir.string());
  const int d = c.head_dim(), nh = c.n_head;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> x((size_t)c.n_embd);
  for (float& v : x) v = dist(rng);

  const ref_tensor& wq = c.tensors.at("model.layers.0.self_attn.q_proj.weight");
  std::vector<float> q_hf((size_t)nh * d), q_ours((size_t)nh * d);
  ref::matmul(mw.layers[0].wq, x.data(), 1, q_ours.data());
  for (int r = 0; r < nh * d; ++r) {
    double s = 0;
    for (int k = 0; k < c.n_embd; ++k) s += (double)wq.v[(size_t)r * c.n_embd + k] * x[(size_t)k];
    q_hf[(size_t)r] = (float)s;
  }
  rope_config cfg;
  cfg.head_dim = d;
  cfg.n_rot = d;
  cfg.freq_base = mw.hp.rope_freq_base;
  float max_abs = 0;
  double l1_max = 0;  // max over rows of sum |w x|: bounds any accumulation order's error
  for (int r = 0; r < nh * d; ++r) {
    max_abs = std::max(max_abs, std::fabs(q_hf[(size_t)r]));
    double l1 = 0;
    for (int k = 0; k < c.n_embd; ++k) l1 += std::fabs(wq.v[(size_t)r * c.n_embd + k] * x[(size_t)k]);
    l1_max = std::max(l1_max, l1);
  }
  // Two contributions: the float matmul's accumulation error (n_embd * eps * l1 per input, two
  // inputs per rotated output), and the rotation itself: the angle pos * theta (pos <= 7) is off
  // by up to ~4 ulps relative, i.e. 28 eps absolute, plus rounding of cos/sin and the two
  // products, so 40 eps per unit of |a| + |b| <= 2 max_abs.
  const double tol = 2 * c.n_embd * FLT_EPSILON * l1_max + 2 * max_abs * 40 * FLT_EPSILON;
  for (int32_t pos : {0, 1, 7}) {
    std::vector<float> ours = q_ours;
    ref::rope(ours.data(), &pos, 1, nh, cfg);
    for (int h = 0; h < nh; ++h) {
      for (int i = 0; i < d / 2; ++i) {
        const double theta = pos * std::pow((double)cfg.freq_base, -2.0 * i / d);
        const double a = q_hf[(size_t)(h * d + i)], b = q_hf[(size_t)(h * d + i + d / 2)];
        const double hf_lo = a * std::cos(theta) - b * std::sin(theta);  // rotate_half: x*cos + (-x2, x1)*sin
        const double hf_hi = b * std::cos(theta) + a * std::sin(theta);
        EXPECT_NEAR(ours[(size_t)(h * d + 2 * i)], hf_lo, tol) << "pos " << pos << " head " << h << " pair " << i;
        EXPECT_NEAR(ours[(size_t)(h * d + 2 * i + 1)], hf_hi, tol) << "pos " << pos << " head " << h << " pair " << i;
      }
    }
  }
}

TEST(HfLoader, TieWordEmbeddingsOverridesStoredLmHead) {
  checkpoint c = make_checkpoint("llama", "BF16", true, 3);
  c.config["tie_word_embeddings"] = true;
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  const model_weights mw = load_hf_weights(dir.string());
  EXPECT_TRUE(mw.hp.tied_output);
  EXPECT_EQ(mw.output.data, mw.tok_embd.data);
}

TEST(HfLoader, AbsentLmHeadTiesEvenIfConfigSaysUntied) {
  checkpoint c = make_checkpoint("llama", "F16", false, 4);
  c.config["tie_word_embeddings"] = false;
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  const model_weights mw = load_hf_weights(dir.string());
  EXPECT_TRUE(mw.hp.tied_output);
  EXPECT_EQ(mw.output.data, mw.tok_embd.data);
}

TEST(HfLoader, MisalignedDataIsCopiedAligned) {
  // A 2-byte tensor first in the data section (names sort before "model.") leaves every F32
  // tensor after it 2 bytes off a 4-byte boundary; the format allows that, the kernels do not.
  checkpoint c = make_checkpoint("llama", "F32", true, 8);
  c.tensors["a.pad"] = ref_tensor{{1}, {1.0f}, "BF16"};
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  const auto f = safetensors_file::open((dir / "model.safetensors").string());
  ASSERT_NE(reinterpret_cast<uintptr_t>(f->tensor("model.layers.0.self_attn.v_proj.weight").data) % 4, 0u);
  const model_weights mw = load_hf_weights(dir.string());
  for (const layer_weights& l : mw.layers)
    for (const weight_view* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down})
      EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data) % 4, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(mw.tok_embd.data) % 4, 0u);
  c.tensors.erase("a.pad");
  expect_weights_match(mw, c);
}

TEST(HfLoader, ConfigVariants) {
  const fs::path dir = test::scratch_dir();
  checkpoint c = make_checkpoint("llama", "F32", true, 5);
  write_checkpoint(dir, c, 0);
  auto load_with = [&](const std::function<void(json&)>& edit) {
    json cfg = c.config;
    edit(cfg);
    std::ofstream(dir / "config.json") << cfg.dump();
    return load_hf_weights(dir.string()).hp;
  };
  // Linear rope scaling, in both the "type" and the "rope_type" spelling.
  model_hparams hp = load_with([](json& j) { j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}}; });
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_linear);
  EXPECT_FLOAT_EQ(hp.rope_scale_factor, 4.0f);
  hp = load_with([](json& j) { j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2}}; });
  EXPECT_FLOAT_EQ(hp.rope_scale_factor, 2.0f);
  // transformers 5 layout: rope settings under rope_parameters.
  hp = load_with([](json& j) {
    j.erase("rope_theta");
    j.erase("rope_scaling");
    j["rope_parameters"] = {{"rope_theta", 500000.0}, {"rope_type", "default"}};
  });
  EXPECT_FLOAT_EQ(hp.rope_freq_base, 500000.0f);
  EXPECT_EQ(hp.rope_scale_type, rope_scaling::rope_scaling_none);
  // Optional keys fall back to transformers' defaults; head_dim null means n_embd / n_head.
  hp = load_with([](json& j) {
    j.erase("rope_theta");
    j["head_dim"] = nullptr;
    j.erase("model_type");  // architectures alone identifies the model
  });
  EXPECT_FLOAT_EQ(hp.rope_freq_base, 10000.0f);
  EXPECT_EQ(hp.head_dim, 16);
  EXPECT_EQ(hp.arch, "llama");
  hp = load_with([](json& j) { j["_name_or_path"] = "tiny/llama"; });
  EXPECT_EQ(hp.name, "tiny/llama");
}

// ---- equivalence with GGUF -------------------------------------------------------------------

// The same weights written the way llama.cpp's converter writes a GGUF (Q/K in adjacent-pair
// order, GGUF names and keys, F32) must load into exactly the views the HF loader produces.
void write_gguf_like_converter(const std::string& path, const checkpoint& c) {
  gguf_writer w;
  const std::string a = c.arch + ".";
  w.add_string("general.architecture", c.arch);
  w.add_string("general.name", "tiny");
  w.add_u32(a + "block_count", (uint32_t)c.n_layer);
  w.add_u32(a + "context_length", (uint32_t)c.config["max_position_embeddings"].get<int>());
  w.add_u32(a + "embedding_length", (uint32_t)c.n_embd);
  w.add_u32(a + "feed_forward_length", (uint32_t)c.n_ff);
  w.add_u32(a + "attention.head_count", (uint32_t)c.n_head);
  w.add_u32(a + "attention.head_count_kv", (uint32_t)c.n_head_kv);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", c.config["rms_norm_eps"].get<float>());
  w.add_f32(a + "rope.freq_base", c.config["rope_theta"].get<float>());
  w.add_u32(a + "rope.dimension_count", (uint32_t)c.head_dim());
  w.add_u32(a + "vocab_size", (uint32_t)c.n_vocab);

  const int d = c.head_dim();
  // Converter's view of one head's rows: HF [2, d/2, ...] transposed to [d/2, 2, ...].
  auto to_pairs = [&](const ref_tensor& t) {
    const int64_t n_cols = t.shape.size() == 2 ? t.shape[1] : 1;
    std::vector<float> out(t.v.size());
    for (int64_t h = 0; h < t.shape[0] / d; ++h)
      for (int half = 0; half < 2; ++half)
        for (int i = 0; i < d / 2; ++i)
          for (int64_t col = 0; col < n_cols; ++col)
            out[(size_t)(((h * d) + 2 * i + half) * n_cols + col)] =
                t.v[(size_t)(((h * d) + half * (d / 2) + i) * n_cols + col)];
    return out;
  };
  auto add = [&](const std::string& gguf_name, const std::string& hf_name, bool pairs = false) {
    const ref_tensor& t = c.tensors.at(hf_name);
    std::vector<int64_t> shape(t.shape.rbegin(), t.shape.rend());  // GGML order: contiguous first
    w.add_tensor_from_f32(gguf_name, ggml_type::ggml_f32, shape, pairs ? to_pairs(t) : t.v);
  };
  add("token_embd.weight", "model.embed_tokens.weight");
  add("output_norm.weight", "model.norm.weight");
  if (c.tensors.count("lm_head.weight")) add("output.weight", "lm_head.weight");
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string g = "blk." + std::to_string(il) + ".", h = "model.layers." + std::to_string(il) + ".";
    add(g + "attn_norm.weight", h + "input_layernorm.weight");
    add(g + "attn_q.weight", h + "self_attn.q_proj.weight", true);
    add(g + "attn_k.weight", h + "self_attn.k_proj.weight", true);
    add(g + "attn_v.weight", h + "self_attn.v_proj.weight");
    add(g + "attn_output.weight", h + "self_attn.o_proj.weight");
    if (c.arch == "qwen2") {
      add(g + "attn_q.bias", h + "self_attn.q_proj.bias", true);
      add(g + "attn_k.bias", h + "self_attn.k_proj.bias", true);
      add(g + "attn_v.bias", h + "self_attn.v_proj.bias");
    }
    add(g + "ffn_norm.weight", h + "post_attention_layernorm.weight");
    add(g + "ffn_gate.weight", h + "mlp.gate_proj.weight");
    add(g + "ffn_up.weight", h + "mlp.up_proj.weight");
    add(g + "ffn_down.weight", h + "mlp.down_proj.weight");
  }
  w.write(path);
}

void expect_same_view(const weight_view& a, const weight_view& b, const std::string& what) {
  ASSERT_EQ(a.n_rows, b.n_rows) << what;
  ASSERT_EQ(a.n_cols, b.n_cols) << what;
  std::vector<float> ra((size_t)a.n_cols), rb((size_t)b.n_cols);
  for (int64_t r = 0; r < a.n_rows; ++r) {
    ref::dequantize_row(a.type, static_cast<const uint8_t*>(a.data) + (size_t)r * a.row_bytes(), ra.data(), a.n_cols);
    ref::dequantize_row(b.type, static_cast<const uint8_t*>(b.data) + (size_t)r * b.row_bytes(), rb.data(), b.n_cols);
    ASSERT_EQ(ra, rb) << what << " row " << r;
  }
}

class HfGgufEquivalence : public testing::TestWithParam<std::string> {};

TEST_P(HfGgufEquivalence, EveryWeightDequantizesIdentically) {
  const std::string arch = GetParam();
  const uint32_t seed = 4242;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const bool lm_head = arch == "qwen2";  // one tied, one untied case
  const checkpoint c = make_checkpoint(arch, "F32", lm_head, seed);
  const fs::path dir = test::scratch_dir();
  const fs::path hf_dir = dir / "hf";
  fs::create_directories(hf_dir);
  write_checkpoint(hf_dir, c, 0);
  const std::string gguf_path = (dir / "tiny.gguf").string();
  write_gguf_like_converter(gguf_path, c);

  const model_weights h = load_model(hf_dir.string());
  const model_weights g = load_model(gguf_path);
  EXPECT_EQ(h.hp.arch, g.hp.arch);
  EXPECT_EQ(h.hp.n_layer, g.hp.n_layer);
  EXPECT_EQ(h.hp.n_embd, g.hp.n_embd);
  EXPECT_EQ(h.hp.n_ff, g.hp.n_ff);
  EXPECT_EQ(h.hp.n_head, g.hp.n_head);
  EXPECT_EQ(h.hp.n_head_kv, g.hp.n_head_kv);
  EXPECT_EQ(h.hp.head_dim, g.hp.head_dim);
  EXPECT_EQ(h.hp.n_rot, g.hp.n_rot);
  EXPECT_EQ(h.hp.n_vocab, g.hp.n_vocab);
  EXPECT_EQ(h.hp.n_ctx_train, g.hp.n_ctx_train);
  EXPECT_EQ(h.hp.rms_eps, g.hp.rms_eps);
  EXPECT_EQ(h.hp.rope_freq_base, g.hp.rope_freq_base);
  EXPECT_EQ(h.hp.rope_scale_type, g.hp.rope_scale_type);
  EXPECT_EQ(h.hp.tied_output, g.hp.tied_output);
  EXPECT_EQ(h.hp.qkv_bias, g.hp.qkv_bias);
  EXPECT_EQ(h.weight_bytes(), g.weight_bytes());

  expect_same_view(h.tok_embd, g.tok_embd, "tok_embd");
  expect_same_view(h.output, g.output, "output");
  EXPECT_EQ(h.out_norm, g.out_norm);
  ASSERT_EQ(h.layers.size(), g.layers.size());
  for (size_t il = 0; il < h.layers.size(); ++il) {
    const layer_weights &a = h.layers[il], &b = g.layers[il];
    const std::string p = "layer " + std::to_string(il) + " ";
    expect_same_view(a.wq, b.wq, p + "wq");
    expect_same_view(a.wk, b.wk, p + "wk");
    expect_same_view(a.wv, b.wv, p + "wv");
    expect_same_view(a.wo, b.wo, p + "wo");
    expect_same_view(a.w_gate, b.w_gate, p + "w_gate");
    expect_same_view(a.w_up, b.w_up, p + "w_up");
    expect_same_view(a.w_down, b.w_down, p + "w_down");
    EXPECT_EQ(a.attn_norm, b.attn_norm) << p;
    EXPECT_EQ(a.ffn_norm, b.ffn_norm) << p;
    EXPECT_EQ(a.bq, b.bq) << p;
    EXPECT_EQ(a.bk, b.bk) << p;
    EXPECT_EQ(a.bv, b.bv) << p;
  }
}

INSTANTIATE_TEST_SUITE_P(Archs, HfGgufEquivalence, testing::Values("llama", "qwen2"),
                         [](const auto& info) { return info.param; });

// ---- errors --------------------------------------------------------------------------------

TEST(HfLoaderErrors, MissingTensorSingleFile) {
  checkpoint c = make_checkpoint("llama", "BF16", true, 11);
  c.tensors.erase("model.layers.1.mlp.up_proj.weight");
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  expect_error([&] { load_hf_weights(dir.string()); },
               {(dir / "model.safetensors").string(), "model.layers.1.mlp.up_proj.weight", "missing"});
}

TEST(HfLoaderErrors, MissingTensorSharded) {
  checkpoint c = make_checkpoint("llama", "F16", true, 12);
  c.tensors.erase("model.norm.weight");
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 2);
  expect_error([&] { load_hf_weights(dir.string()); },
               {"model.safetensors.index.json", "model.norm.weight", "weight_map"});
}

TEST(HfLoaderErrors, IndexPointsAtWrongShard) {
  const checkpoint c = make_checkpoint("llama", "F32", true, 13);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 2);
  json index = json::parse(std::ifstream(dir / "model.safetensors.index.json"));
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  const std::string real = index["weight_map"][name];
  const std::string other = real == shard_name(1, 2) ? shard_name(2, 2) : shard_name(1, 2);
  index["weight_map"][name] = other;
  std::ofstream(dir / "model.safetensors.index.json") << index.dump();
  expect_error([&] { load_hf_weights(dir.string()); }, {other, name, "missing"});
}

TEST(HfLoaderErrors, ShardListedButMissing) {
  const checkpoint c = make_checkpoint("llama", "BF16", true, 14);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 2);
  fs::remove(dir / shard_name(2, 2));
  expect_error([&] { load_hf_weights(dir.string()); }, {"model.safetensors.index.json", shard_name(2, 2), "missing"});
}

TEST(HfLoaderErrors, TruncatedShard) {
  const checkpoint c = make_checkpoint("llama", "BF16", true, 15);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 2);
  const fs::path shard = dir / shard_name(1, 2);
  fs::resize_file(shard, fs::file_size(shard) - 100);
  expect_error([&] { load_hf_weights(dir.string()); }, {shard.string(), "out of range"});
}

TEST(HfLoaderErrors, ShapeMismatch) {
  checkpoint c = make_checkpoint("llama", "F32", true, 16);
  ref_tensor& k = c.tensors.at("model.layers.1.self_attn.k_proj.weight");
  k.shape = {64, 64};  // as if num_key_value_heads were 4
  k.v.resize(64 * 64);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  expect_error([&] { load_hf_weights(dir.string()); },
               {"model.safetensors", "model.layers.1.self_attn.k_proj.weight", "[64, 64]", "expected [32, 64]"});
}

TEST(HfLoaderErrors, VocabMismatch) {
  checkpoint c = make_checkpoint("llama", "F32", true, 17);
  c.config["vocab_size"] = 100;
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  expect_error([&] { load_hf_weights(dir.string()); }, {"model.embed_tokens.weight", "[97, 64]", "expected [100, 64]"});
}

TEST(HfLoaderErrors, UnsupportedDtype) {
  checkpoint c = make_checkpoint("llama", "F32", true, 18);
  c.tensors.at("model.layers.0.input_layernorm.weight").dtype = "I32";
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  expect_error([&] { load_hf_weights(dir.string()); },
               {"model.safetensors", "model.layers.0.input_layernorm.weight", "I32"});
}

struct config_error_case {
  std::string name;
  std::function<void(json&)> edit;
  std::vector<std::string> needles;  // besides config.json
};

void PrintTo(const config_error_case& c, std::ostream* os) { *os << c.name; }

class HfConfigErrors : public testing::TestWithParam<config_error_case> {};

TEST_P(HfConfigErrors, NamesKeyAndFile) {
  const auto& p = GetParam();
  checkpoint c = make_checkpoint("llama", "F32", true, 19);
  p.edit(c.config);
  const fs::path dir = test::scratch_dir();
  write_checkpoint(dir, c, 0);
  std::vector<std::string> needles = p.needles;
  needles.push_back((dir / "config.json").string());
  expect_error([&] { load_hf_weights(dir.string()); }, needles);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, HfConfigErrors,
    testing::Values(
        config_error_case{"MissingHiddenSize", [](json& j) { j.erase("hidden_size"); }, {"hidden_size", "missing"}},
        config_error_case{"MissingVocab", [](json& j) { j.erase("vocab_size"); }, {"vocab_size"}},
        config_error_case{"MissingEps", [](json& j) { j.erase("rms_norm_eps"); }, {"rms_norm_eps"}},
        config_error_case{
            "StringLayers", [](json& j) { j["num_hidden_layers"] = "2"; }, {"num_hidden_layers", "integer"}},
        config_error_case{"FloatHeads", [](json& j) { j["num_attention_heads"] = 4.5; }, {"num_attention_heads"}},
        config_error_case{
            "HugeFf", [](json& j) { j["intermediate_size"] = 1ll << 40; }, {"intermediate_size", "range"}},
        config_error_case{"HeadsNotDividingEmbd",
                          [](json& j) { j["num_attention_heads"] = 5; },
                          {"hidden_size", "num_attention_heads"}},
        // Out-of-range values caught by model_hparams::validate, which names the source file.
        config_error_case{"ZeroLayers", [](json& j) { j["num_hidden_layers"] = 0; }, {}},
        config_error_case{"KvHeadsNotDividingHeads", [](json& j) { j["num_key_value_heads"] = 3; }, {}},
        config_error_case{"NegativeVocab", [](json& j) { j["vocab_size"] = -5; }, {}},
        config_error_case{"UnknownModelType", [](json& j) { j["model_type"] = "gpt2"; }, {"gpt2", "model_type"}},
        config_error_case{"UnknownArchitecture",
                          [](json& j) {
                            j.erase("model_type");
                            j["architectures"] = {"FalconForCausalLM"};
                          },
                          {"FalconForCausalLM"}},
        config_error_case{"YarnScaling",
                          [](json& j) {
                            j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
                          },
                          {"yarn", "rope_scaling"}},
        config_error_case{"LinearWithoutFactor",
                          [](json& j) {
                            j["rope_scaling"] = {{"type", "linear"}};
                          },
                          {"factor"}},
        config_error_case{"GeluAct", [](json& j) { j["hidden_act"] = "gelu"; }, {"hidden_act", "gelu"}},
        config_error_case{"AttentionBias", [](json& j) { j["attention_bias"] = true; }, {"attention_bias"}}),
    [](const auto& info) { return info.param.name; });

TEST(HfLoaderErrors, DirectoryProblems) {
  const fs::path dir = test::scratch_dir();
  expect_error([&] { load_hf_weights((dir / "nope").string()); }, {"nope", "not a checkpoint directory"});
  expect_error([&] { load_hf_weights(dir.string()); }, {dir.string(), "config.json"});
  std::ofstream(dir / "config.json") << "{\"hidden_size\": 64,";
  expect_error([&] { load_hf_weights(dir.string()); }, {"config.json", "not valid JSON"});
  const checkpoint c = make_checkpoint("llama", "F32", true, 20);
  std::ofstream(dir / "config.json") << c.config.dump();
  expect_error([&] { load_hf_weights(dir.string()); }, {dir.string(), "model.safetensors"});
}

TEST(LoadModel, DispatchErrors) {
  const fs::path dir = test::scratch_dir();
  expect_error([&] { load_model((dir / "absent.gguf").string()); }, {"absent.gguf", "does not exist"});
  const checkpoint c = make_checkpoint("llama", "F32", true, 21);
  write_checkpoint(dir, c, 0);
  expect_error([&] { load_model((dir / "model.safetensors").string()); },
               {"model.safetensors", "checkpoint directory"});
  std::ofstream(dir / "notes.txt") << "hello";
  expect_error([&] { load_model((dir / "notes.txt").string()); }, {"notes.txt", "not a model"});
  // A .gguf suffix routes to the GGUF reader, whose error names the file.
  std::ofstream(dir / "fake.gguf") << "not a gguf at all";
  expect_error([&] { load_model((dir / "fake.gguf").string()); }, {"fake.gguf"});
}

}  // namespace
}  // namespace xctx
