// Hugging Face checkpoint directory -> model_weights: config.json for the hyper-parameters,
// safetensors (single file or shards + index) for the tensors.
#include <glog/logging.h>

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "common/error.h"
#include "common/half.h"
#include "model/safetensors.h"
#include "model/weights.h"

namespace xctx {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

json read_json_file(const fs::path& path, const char* what) {
  std::ifstream in(path, std::ios::binary);
  XCTX_CHECK(in, path.string(), ": cannot open ", what);
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(path.string(), ": ", what, " is not valid JSON: ", e.what());
  }
}

// Typed access to config.json; a key that is present but null counts as absent (transformers
// writes e.g. "head_dim": null). Errors name the file, the key and the offending value.
class config_reader {
 public:
  config_reader(const json& j, std::string path) : j_(j), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  const json& at(const char* key) const { return j_[key]; }

  int get_int(const char* key) const {
    XCTX_CHECK(has(key), path_, ": missing required key \"", key, "\"");
    const json& v = j_[key];
    XCTX_CHECK(v.is_number_integer(), path_, ": \"", key, "\" must be an integer, found ", v.dump());
    const int64_t x = v.get<int64_t>();
    XCTX_CHECK(x >= INT_MIN && x <= INT_MAX, path_, ": \"", key, "\" = ", x, " is out of range");
    return (int)x;
  }
  int get_int(const char* key, int fallback) const { return has(key) ? get_int(key) : fallback; }

  double get_float(const char* key) const {
    XCTX_CHECK(has(key), path_, ": missing required key \"", key, "\"");
    return number(j_[key], key);
  }
  double get_float(const char* key, double fallback) const { return has(key) ? get_float(key) : fallback; }

  bool get_bool(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    XCTX_CHECK(j_[key].is_boolean(), path_, ": \"", key, "\" must be true or false, found ", j_[key].dump());
    return j_[key].get<bool>();
  }

  std::string get_string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    XCTX_CHECK(j_[key].is_string(), path_, ": \"", key, "\" must be a string, found ", j_[key].dump());
    return j_[key].get<std::string>();
  }

  double number(const json& v, const std::string& key) const {
    XCTX_CHECK(v.is_number(), path_, ": \"", key, "\" must be a number, found ", v.dump());
    return v.get<double>();
  }

 private:
  const json& j_;
  std::string path_;
};

std::string arch_from_config(const config_reader& cfg) {
  static const std::map<std::string, std::string> by_model_type = {
      {"llama", "llama"}, {"mistral", "mistral"}, {"qwen2", "qwen2"}};
  static const std::map<std::string, std::string> by_class = {
      {"LlamaForCausalLM", "llama"}, {"MistralForCausalLM", "mistral"}, {"Qwen2ForCausalLM", "qwen2"}};
  if (cfg.has("model_type")) {
    const std::string mt = cfg.get_string("model_type", "");
    auto it = by_model_type.find(mt);
    XCTX_CHECK(it != by_model_type.end(), cfg.path(), ": model_type \"", mt,
               "\" is not supported (xctx loads llama, mistral, qwen2)");
    return it->second;
  }
  XCTX_CHECK(cfg.has("architectures") && cfg.at("architectures").is_array() && !cfg.at("architectures").empty() &&
                 cfg.at("architectures")[0].is_string(),
             cfg.path(), ": neither \"model_type\" nor \"architectures\" says which model this is");
  const std::string cls = cfg.at("architectures")[0].get<std::string>();
  auto it = by_class.find(cls);
  XCTX_CHECK(it != by_class.end(), cfg.path(), ": architecture \"", cls,
             "\" is not supported (xctx loads LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)");
  return it->second;
}

// RoPE settings. Older configs carry "rope_theta" and "rope_scaling" at top level; transformers
// 5 folds both into "rope_parameters" ({"rope_theta", "rope_type", "factor", ...}). Of the
// scaling kinds only "linear" (position interpolation) is implemented by the kernels; the others
// ("dynamic" NTK, which depends on the sequence length, "yarn", "llama3", "longrope") change the
// frequencies in ways the rope kernel does not reproduce, so they are refused, not approximated.
void read_rope(const config_reader& cfg, model_hparams& hp) {
  const json* params = cfg.has("rope_parameters") ? &cfg.at("rope_parameters") : nullptr;
  XCTX_CHECK(!params || params->is_object(), cfg.path(), ": \"rope_parameters\" must be an object");
  hp.rope_freq_base = 10000.0f;  // transformers' default for all three architectures
  if (cfg.has("rope_theta")) {
    hp.rope_freq_base = (float)cfg.get_float("rope_theta");
  } else if (params && params->contains("rope_theta")) {
    hp.rope_freq_base = (float)cfg.number((*params)["rope_theta"], "rope_parameters.rope_theta");
  }

  const json* scaling = cfg.has("rope_scaling") ? &cfg.at("rope_scaling") : params;
  const std::string key = cfg.has("rope_scaling") ? "rope_scaling" : "rope_parameters";
  hp.rope_scale_type = rope_scaling::rope_scaling_none;
  hp.rope_scale_factor = 1.0f;
  if (!scaling) return;
  XCTX_CHECK(scaling->is_object(), cfg.path(), ": \"", key, "\" must be an object or null, found ", scaling->dump());
  std::string type = "default";
  for (const char* k : {"rope_type", "type"}) {
    if (scaling->contains(k)) {
      XCTX_CHECK((*scaling)[k].is_string(), cfg.path(), ": \"", key, ".", k, "\" must be a string");
      type = (*scaling)[k].get<std::string>();
      break;
    }
  }
  if (type == "default") return;
  XCTX_CHECK(type == "linear", cfg.path(), ": ", key, " type \"", type,
             "\" is not supported (xctx implements \"linear\" rope scaling only)");
  XCTX_CHECK(scaling->contains("factor"), cfg.path(), ": ", key, " type \"linear\" needs a \"factor\"");
  hp.rope_scale_type = rope_scaling::rope_scaling_linear;
  hp.rope_scale_factor = (float)cfg.number((*scaling)["factor"], key + ".factor");
}

model_hparams read_hf_hparams(const config_reader& cfg, const fs::path& dir) {
  model_hparams hp;
  hp.arch = arch_from_config(cfg);
  hp.name = cfg.get_string("_name_or_path", "");
  if (hp.name.empty()) hp.name = fs::absolute(dir).lexically_normal().filename().string();
  if (hp.name.empty()) hp.name = fs::absolute(dir).lexically_normal().parent_path().filename().string();

  hp.n_embd = cfg.get_int("hidden_size");
  hp.n_ff = cfg.get_int("intermediate_size");
  hp.n_layer = cfg.get_int("num_hidden_layers");
  hp.n_head = cfg.get_int("num_attention_heads");
  // Multi-head checkpoints written before GQA existed (Llama 1/2-7B) omit the key.
  hp.n_head_kv = cfg.get_int("num_key_value_heads", hp.n_head);
  hp.n_vocab = cfg.get_int("vocab_size");
  hp.n_ctx_train = cfg.get_int("max_position_embeddings");
  hp.rms_eps = (float)cfg.get_float("rms_norm_eps");
  if (cfg.has("head_dim")) {
    hp.head_dim = cfg.get_int("head_dim");
  } else {
    XCTX_CHECK(hp.n_head > 0 && hp.n_embd % hp.n_head == 0, cfg.path(), ": hidden_size ", hp.n_embd,
               " is not a multiple of num_attention_heads ", hp.n_head, " and no head_dim is given");
    hp.head_dim = hp.n_embd / hp.n_head;
  }
  hp.n_rot = hp.head_dim;  // these architectures rotate the whole head
  read_rope(cfg, hp);
  hp.tied_output = cfg.get_bool("tie_word_embeddings", false);
  hp.qkv_bias = hp.arch == "qwen2";

  // Variants of the Llama block the forward does not implement: refuse rather than run wrong.
  const std::string act = cfg.get_string("hidden_act", "silu");
  XCTX_CHECK(act == "silu", cfg.path(), ": hidden_act \"", act, "\" is not supported (xctx implements silu)");
  XCTX_CHECK(hp.arch == "qwen2" || !cfg.get_bool("attention_bias", false), cfg.path(),
             ": attention_bias = true (q/k/v/o biases) is not supported for ", hp.arch);
  XCTX_CHECK(!cfg.get_bool("mlp_bias", false), cfg.path(), ": mlp_bias = true is not supported");
  if (cfg.has("sliding_window") && cfg.get_bool("use_sliding_window", hp.arch == "mistral")) {
    LOG(WARNING) << cfg.path() << ": sliding_window " << cfg.at("sliding_window").dump()
                 << " is ignored: xctx attends to the full context";
  }
  hp.validate(cfg.path());  // also guarantees an even head_dim, which the Q/K permutation needs
  return hp;
}

// Where each tensor lives: one model.safetensors, or shards named by the index's weight_map.
class tensor_source {
 public:
  explicit tensor_source(const fs::path& dir) {
    const fs::path index = dir / "model.safetensors.index.json";
    const fs::path single = dir / "model.safetensors";
    if (fs::exists(index)) {
      index_path_ = index.string();
      const json j = read_json_file(index, "safetensors index");
      XCTX_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(), index_path_,
                 ": missing \"weight_map\" object");
      std::map<std::string, std::shared_ptr<safetensors_file>> shards;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        XCTX_CHECK(it.value().is_string(), index_path_, ": weight_map[\"", it.key(), "\"] must be a file name");
        const std::string shard = it.value().get<std::string>();
        auto s = shards.find(shard);
        if (s == shards.end()) {
          const fs::path shard_path = dir / shard;
          XCTX_CHECK(fs::exists(shard_path), index_path_, ": shard '", shard, "' (holding tensor '", it.key(),
                     "') is missing: ", shard_path.string(), " does not exist");
          std::shared_ptr<safetensors_file> file = safetensors_file::open(shard_path.string());
          s = shards.emplace(shard, std::move(file)).first;
        }
        by_name_[it.key()] = s->second.get();
      }
      for (auto& [name, file] : shards) files_.push_back(file);
    } else {
      XCTX_CHECK(fs::exists(single), dir.string(), ": no model.safetensors or model.safetensors.index.json",
                 fs::exists(dir / "pytorch_model.bin") ? " (PyTorch .bin checkpoints are not supported)" : "");
      files_.push_back(std::shared_ptr<safetensors_file>(safetensors_file::open(single.string())));
      for (const auto& [name, info] : files_[0]->tensors()) by_name_[name] = files_[0].get();
    }
  }

  const std::vector<std::shared_ptr<safetensors_file>>& files() const { return files_; }

  // Null if the checkpoint does not have the tensor (used for the optional lm_head).
  const safetensors_file* file_of(const std::string& name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : it->second;
  }

  // Presence, dtype and exact shape; errors name the shard (or index) and the tensor.
  const st_tensor_info& expect(const std::string& name, const std::vector<int64_t>& shape) const {
    const safetensors_file* f = file_of(name);
    if (!f) {
      XCTX_CHECK(index_path_.empty(), index_path_, ": tensor '", name, "' is not in the weight_map");
      fail(files_[0]->path(), ": tensor '", name, "' is missing");
    }
    const st_tensor_info* t = f->find_tensor(name);
    XCTX_CHECK(t, f->path(), ": tensor '", name, "' is missing (", index_path_, " says it is in this shard)");
    XCTX_CHECK(t->type.has_value(), f->path(), ": tensor '", name, "' has dtype ", t->dtype,
               "; xctx loads F32, F16 or BF16");
    XCTX_CHECK(t->shape == shape, f->path(), ": tensor '", name, "' has shape ", shape_str(t->shape), ", expected ",
               shape_str(shape), " from config.json");
    return *t;
  }

  static std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "[";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + "]";
  }

 private:
  std::string index_path_;  // empty for a single file
  std::vector<std::shared_ptr<safetensors_file>> files_;
  std::map<std::string, const safetensors_file*> by_name_;
};

// What model_weights::storage keeps alive: the mappings and the buffers we had to own.
struct hf_storage {
  std::vector<std::shared_ptr<safetensors_file>> files;
  std::vector<std::shared_ptr<void>> buffers;

  uint8_t* alloc(size_t bytes) {
    // 64-byte alignment so SIMD row loads never straddle a cache line at the row start.
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    XCTX_CHECK(p, "out of memory allocating ", bytes, " bytes for weights");
    buffers.emplace_back(p, std::free);
    return static_cast<uint8_t*>(p);
  }
};

float element(const st_tensor_info& t, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(t.data);
  switch (*t.type) {
    case ggml_type::ggml_f32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case ggml_type::ggml_f16:
    case ggml_type::ggml_bf16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return *t.type == ggml_type::ggml_f16 ? fp16_to_fp32(b) : bf16_to_fp32(b);
    }
    case ggml_type::ggml_q4_0:
    case ggml_type::ggml_q4_1:
    case ggml_type::ggml_q5_0:
    case ggml_type::ggml_q5_1:
    case ggml_type::ggml_q8_0:
    case ggml_type::ggml_q8_1:
    case ggml_type::ggml_q2_k:
    case ggml_type::ggml_q3_k:
    case ggml_type::ggml_q4_k:
    case ggml_type::ggml_q5_k:
    case ggml_type::ggml_q6_k:
    case ggml_type::ggml_q8_k:
      break;
  }
  XCTX_ASSERT(false, "safetensors tensor with a block-quantized type");
  return 0.0f;
}

// HF's Llama attention rotates pairs (i, i + d/2) of each head ("rotate_half"); the rope kernels
// rotate adjacent pairs (2i, 2i + 1) as GGUF files store them. Since q·k is invariant under
// permuting both q and k the same way, reordering the output rows of q_proj and k_proj per head
// (new row 2i <- old row i, new row 2i+1 <- old row i + d/2) makes the adjacent-pair rope
// compute exactly HF's attention scores. This is the same reordering llama.cpp's HF converter
// applies when writing GGUF, so one forward serves both loaders. v and o are untouched.
size_t permuted_row(size_t row, int head_dim) {
  const size_t h = row / (size_t)head_dim, j = row % (size_t)head_dim, half = (size_t)head_dim / 2;
  return h * (size_t)head_dim + (j % 2 == 0 ? j / 2 : j / 2 + half);
}

class hf_builder {
 public:
  hf_builder(const tensor_source& src, hf_storage& store) : src_(src), store_(store) {}

  weight_view matrix(const std::string& name, int64_t rows, int64_t cols) {
    const st_tensor_info& t = src_.expect(name, {rows, cols});
    weight_view w{*t.type, rows, cols, t.data};
    // The mapping puts data at 8 + header length + begin, which writers pad to 8 bytes but the
    // format does not require; kernels read whole elements, so misaligned data gets copied.
    if (reinterpret_cast<uintptr_t>(t.data) % t.elem_bytes != 0) {
      uint8_t* p = store_.alloc(t.bytes());
      std::memcpy(p, t.data, t.bytes());
      w.data = p;
    }
    return w;
  }

  weight_view rope_matrix(const std::string& name, int64_t rows, int64_t cols, int head_dim) {
    const st_tensor_info& t = src_.expect(name, {rows, cols});
    weight_view w{*t.type, rows, cols, nullptr};
    const size_t row_bytes = (size_t)cols * t.elem_bytes;
    uint8_t* p = store_.alloc(t.bytes());
    const auto* in = static_cast<const uint8_t*>(t.data);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(p + (size_t)r * row_bytes, in + permuted_row((size_t)r, head_dim) * row_bytes, row_bytes);
    w.data = p;
    return w;
  }

  std::vector<float> vec(const std::string& name, int64_t n, int rope_head_dim = 0) {
    const st_tensor_info& t = src_.expect(name, {n});
    std::vector<float> out((size_t)n);
    for (int64_t i = 0; i < n; ++i)
      out[(size_t)i] = element(t, rope_head_dim ? (int64_t)permuted_row((size_t)i, rope_head_dim) : i);
    return out;
  }

 private:
  const tensor_source& src_;
  hf_storage& store_;
};

}  // namespace

model_hparams read_hf_config(const std::string& dir_str) {
  const fs::path dir(dir_str);
  XCTX_CHECK(fs::is_directory(dir), dir_str, ": not a checkpoint directory");
  const fs::path config_path = dir / "config.json";
  XCTX_CHECK(fs::exists(config_path), dir_str, ": no config.json in the checkpoint directory");
  const json config = read_json_file(config_path, "config");
  XCTX_CHECK(config.is_object(), config_path.string(), ": must hold a JSON object");
  return read_hf_hparams(config_reader(config, config_path.string()), dir);
}

model_weights load_hf_weights(const std::string& dir_str) {
  const fs::path dir(dir_str);
  model_weights mw;
  mw.hp = read_hf_config(dir_str);
  mw.source = dir_str;
  const model_hparams& hp = mw.hp;

  const tensor_source src(dir);
  auto store = std::make_shared<hf_storage>();
  store->files = src.files();
  hf_builder b(src, *store);

  const int64_t q_dim = (int64_t)hp.n_head * hp.head_dim;
  const int64_t kv_dim = hp.kv_dim();
  mw.tok_embd = b.matrix("model.embed_tokens.weight", hp.n_vocab, hp.n_embd);
  mw.out_norm = b.vec("model.norm.weight", hp.n_embd);
  // transformers ties lm_head to the embedding when the config says so (a stored lm_head is
  // then overwritten on load), and small models often omit lm_head entirely.
  if (!hp.tied_output && src.file_of("lm_head.weight")) {
    mw.output = b.matrix("lm_head.weight", hp.n_vocab, hp.n_embd);
  } else {
    mw.hp.tied_output = true;
    mw.output = mw.tok_embd;
  }

  mw.layers.resize((size_t)hp.n_layer);
  for (int il = 0; il < hp.n_layer; ++il) {
    layer_weights& l = mw.layers[(size_t)il];
    const std::string p = "model.layers." + std::to_string(il) + ".";
    l.attn_norm = b.vec(p + "input_layernorm.weight", hp.n_embd);
    l.wq = b.rope_matrix(p + "self_attn.q_proj.weight", q_dim, hp.n_embd, hp.head_dim);
    l.wk = b.rope_matrix(p + "self_attn.k_proj.weight", kv_dim, hp.n_embd, hp.head_dim);
    l.wv = b.matrix(p + "self_attn.v_proj.weight", kv_dim, hp.n_embd);
    l.wo = b.matrix(p + "self_attn.o_proj.weight", hp.n_embd, q_dim);
    if (hp.qkv_bias) {
      l.bq = b.vec(p + "self_attn.q_proj.bias", q_dim, hp.head_dim);
      l.bk = b.vec(p + "self_attn.k_proj.bias", kv_dim, hp.head_dim);
      l.bv = b.vec(p + "self_attn.v_proj.bias", kv_dim);
    }
    l.ffn_norm = b.vec(p + "post_attention_layernorm.weight", hp.n_embd);
    l.w_gate = b.matrix(p + "mlp.gate_proj.weight", hp.n_ff, hp.n_embd);
    l.w_up = b.matrix(p + "mlp.up_proj.weight", hp.n_ff, hp.n_embd);
    l.w_down = b.matrix(p + "mlp.down_proj.weight", hp.n_embd, hp.n_ff);
  }
  mw.storage = std::move(store);
  return mw;
}

}  // namespace xctx
