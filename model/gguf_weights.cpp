// GGUF -> model_hparams / model_weights for the Llama family (llama, mistral, qwen2 share one
// forward), plus model_hparams::validate, which every loader runs.
#include <glog/logging.h>

#include <cmath>
#include <limits>
#include <set>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"
#include "model/gguf.h"
#include "model/weights.h"

namespace xctx {
namespace {

bool is_supported_arch(const std::string& arch) { return arch == "llama" || arch == "mistral" || arch == "qwen2"; }

int checked_int(const gguf_file& f, const std::string& key, int64_t v) {
  XCTX_CHECK(v >= 0 && v <= std::numeric_limits<int32_t>::max(), f.path(), ": key '", key, "' = ", v,
             " is out of range");
  return (int)v;
}

// Reads `<arch>.rope.scaling.*`. Only linear scaling (position interpolation) is implemented by
// the rope kernels; YaRN and LongRoPE change every frequency and the attention scale, so
// running them as "none" would silently differ from the reference at every position. They are
// refused, as the Hugging Face loader refuses them. Pre-2024 files used `rope.scale_linear`.
void read_rope_scaling(const gguf_file& f, const std::string& a, model_hparams& hp) {
  hp.rope_scale_type = rope_scaling::rope_scaling_none;
  hp.rope_scale_factor = 1.0f;
  const std::string type_key = a + "rope.scaling.type";
  const std::string factor_key = a + "rope.scaling.factor";
  if (f.has(type_key)) {
    const std::string type = f.get_string(type_key);
    if (type == "none") return;
    XCTX_CHECK(type == "linear", f.path(), ": key '", type_key, "' = \"", type,
               "\" is not supported (xctx implements \"none\" and \"linear\" rope scaling)");
    hp.rope_scale_type = rope_scaling::rope_scaling_linear;
    hp.rope_scale_factor = (float)f.get_float(factor_key, 1.0);
    return;
  }
  const std::string legacy_key = a + "rope.scale_linear";
  if (f.has(legacy_key)) {
    hp.rope_scale_type = rope_scaling::rope_scaling_linear;
    hp.rope_scale_factor = (float)f.get_float(legacy_key);
  }
}

std::string tensor_shape_string(const gguf_tensor_info& t) {
  std::string s = "[";
  for (size_t i = 0; i < t.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

// Shape without trailing 1s: GGUF writers may store a matrix as [n_cols, n_rows, 1, 1].
std::vector<int64_t> squeezed(const gguf_tensor_info& t) {
  std::vector<int64_t> s = t.shape;
  while (s.size() > 1 && s.back() == 1) s.pop_back();
  return s;
}

class weight_reader {
 public:
  weight_reader(const gguf_file& f, const model_hparams& hp) : f_(f), hp_(hp) {}

  // A matrix of n_rows outputs by n_cols inputs: GGUF shape [n_cols, n_rows].
  weight_view matrix(const std::string& name, int64_t n_rows, int64_t n_cols) {
    const gguf_tensor_info& t = get(name);
    const std::vector<int64_t> s = squeezed(t);
    // A 1-row matrix squeezes to one dim; compare against the padded expectation.
    const bool ok = (s.size() == 2 && s[0] == n_cols && s[1] == n_rows) ||
                    (s.size() == 1 && n_rows == 1 && s[0] == n_cols);
    XCTX_CHECK(ok, f_.path(), ": tensor '", name, "': shape ", tensor_shape_string(t), ", expected [", n_cols, ", ",
               n_rows, "] (GGUF order: [n_cols, n_rows]) for ", hp_.arch, " with the file's hyper-parameters");
    // Every type the reader accepts has a reference dequantizer, so any is usable for a matrix.
    weight_view w;
    w.type = t.type;
    w.n_rows = n_rows;
    w.n_cols = n_cols;
    w.data = t.data;
    return w;
  }

  // A vector (norm weight or bias) converted to float.
  std::vector<float> vector(const std::string& name, int64_t n) {
    const gguf_tensor_info& t = get(name);
    const std::vector<int64_t> s = squeezed(t);
    XCTX_CHECK(s.size() == 1 && s[0] == n, f_.path(), ": tensor '", name, "': shape ", tensor_shape_string(t),
               ", expected [", n, "]");
    XCTX_CHECK(t.type == ggml_type::ggml_f32 || t.type == ggml_type::ggml_f16 || t.type == ggml_type::ggml_bf16,
               f_.path(), ": tensor '", name, "': type ", ggml_traits(t.type).name,
               ", expected F32 (or F16/BF16) for a norm or bias vector");
    std::vector<float> out((size_t)n);
    ref::dequantize_row(t.type, t.data, out.data(), n);
    return out;
  }

  bool has(const std::string& name) const { return f_.find_tensor(name) != nullptr; }
  const std::set<std::string>& used() const { return used_; }

 private:
  const gguf_tensor_info& get(const std::string& name) {
    const gguf_tensor_info* t = f_.find_tensor(name);
    XCTX_CHECK(t != nullptr, f_.path(), ": missing tensor '", name, "' (required by ", hp_.arch, " with ",
               hp_.n_layer, " layers)");
    used_.insert(name);
    return *t;
  }
  const gguf_file& f_;
  const model_hparams& hp_;
  std::set<std::string> used_;
};

}  // namespace

void model_hparams::validate(const std::string& source) const {
  auto bad = [&](const char* field, const auto& value, const char* rule) {
    fail(source, ": hyper-parameter ", field, " = ", value, " is invalid: ", rule);
  };
  if (!is_supported_arch(arch)) bad("arch", arch, "xctx runs llama, mistral and qwen2");
  if (n_layer < 1 || n_layer > 1024) bad("n_layer", n_layer, "must be in 1..1024");
  if (n_embd <= 0 || n_embd > (1 << 20)) bad("n_embd", n_embd, "must be in 1..1048576");
  if (n_ff <= 0 || n_ff > (1 << 22)) bad("n_ff", n_ff, "must be in 1..4194304");
  if (n_head <= 0 || n_head > 4096) bad("n_head", n_head, "must be in 1..4096");
  if (n_embd % n_head != 0) bad("n_embd", n_embd, ("must be a multiple of n_head = " + std::to_string(n_head)).c_str());
  if (n_head_kv <= 0 || n_head % n_head_kv != 0)
    bad("n_head_kv", n_head_kv, ("must be positive and divide n_head = " + std::to_string(n_head)).c_str());
  if (head_dim <= 0 || head_dim > 4096 || head_dim % 2 != 0)
    bad("head_dim", head_dim, "must be even and in 2..4096 (rotary pairs)");
  if (n_rot <= 0 || n_rot > head_dim || n_rot % 2 != 0)
    bad("n_rot", n_rot, ("must be even and in 2..head_dim = " + std::to_string(head_dim)).c_str());
  if (n_vocab <= 0) bad("n_vocab", n_vocab, "must be positive");
  if (n_ctx_train <= 0) bad("n_ctx_train", n_ctx_train, "must be positive");
  if (!(rms_eps > 0.0f && rms_eps < 1.0f)) bad("rms_eps", rms_eps, "must be in (0, 1)");
  if (!(rope_freq_base > 0.0f && std::isfinite(rope_freq_base))) bad("rope_freq_base", rope_freq_base, "must be > 0");
  if (!(rope_scale_factor > 0.0f && std::isfinite(rope_scale_factor)))
    bad("rope_scale_factor", rope_scale_factor, "must be > 0");
}

size_t model_weights::weight_bytes() const {
  size_t total = tok_embd.bytes() + out_norm.size() * sizeof(float);
  if (output.data != tok_embd.data) total += output.bytes();
  for (const layer_weights& l : layers) {
    total += l.wq.bytes() + l.wk.bytes() + l.wv.bytes() + l.wo.bytes();
    total += l.w_gate.bytes() + l.w_up.bytes() + l.w_down.bytes();
    total += (l.attn_norm.size() + l.ffn_norm.size() + l.bq.size() + l.bk.size() + l.bv.size()) * sizeof(float);
  }
  return total;
}

void make_resident(const model_weights& w) {
  // One read per page maps the file's pages into this process (the page cache is shared
  // between the node's ranks); volatile reads are never optimized away.
  constexpr size_t kPage = 4096;
  const auto touch = [&](const weight_view& v) {
    const volatile uint8_t* p = static_cast<const uint8_t*>(v.data);
    for (size_t b = 0; b < v.bytes(); b += kPage) (void)p[b];
  };
  touch(w.tok_embd);
  if (w.output.data != w.tok_embd.data) touch(w.output);
  for (const layer_weights& l : w.layers)
    for (const weight_view* v : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) touch(*v);
}

model_hparams read_gguf_hparams(const gguf_file& f) {
  model_hparams hp;
  hp.arch = f.get_string("general.architecture");
  XCTX_CHECK(is_supported_arch(hp.arch), f.path(), ": key 'general.architecture' = \"", hp.arch,
             "\" is not supported (xctx runs llama, mistral, qwen2)");
  const std::string a = hp.arch + ".";
  auto get = [&](const std::string& k) { return checked_int(f, a + k, f.get_int(a + k)); };
  auto get_or = [&](const std::string& k, int64_t fb) { return checked_int(f, a + k, f.get_int(a + k, fb)); };

  hp.name = f.get_string("general.name", "");
  hp.n_layer = get("block_count");
  hp.n_embd = get("embedding_length");
  hp.n_ff = get("feed_forward_length");
  hp.n_head = get("attention.head_count");
  hp.n_head_kv = get_or("attention.head_count_kv", hp.n_head);
  hp.n_ctx_train = get("context_length");
  hp.rms_eps = (float)f.get_float(a + "attention.layer_norm_rms_epsilon");
  hp.rope_freq_base = (float)f.get_float(a + "rope.freq_base", 10000.0);
  XCTX_CHECK(hp.n_head > 0, f.path(), ": key '", a, "attention.head_count' = ", hp.n_head, " must be positive");
  hp.head_dim = get_or("attention.key_length", hp.n_embd / hp.n_head);
  const int v_len = get_or("attention.value_length", hp.head_dim);
  XCTX_CHECK(v_len == hp.head_dim, f.path(), ": key '", a, "attention.value_length' = ", v_len,
             " differs from the key length ", hp.head_dim, " (not supported)");
  hp.n_rot = get_or("rope.dimension_count", hp.head_dim);
  read_rope_scaling(f, a, hp);

  // rope_freqs.weight carries Llama-3.1 style per-frequency factors the rope kernel lacks.
  XCTX_CHECK(f.find_tensor("rope_freqs.weight") == nullptr, f.path(),
             ": tensor 'rope_freqs.weight' (Llama 3.1 rope frequency factors) is not supported");

  if (f.has(a + "vocab_size")) {
    hp.n_vocab = get("vocab_size");
  } else if (const gguf_value* toks = f.find("tokenizer.ggml.tokens");
             toks != nullptr && toks->type == gguf_value_type::gguf_array) {
    hp.n_vocab = (int)std::get<std::vector<gguf_value>>(toks->v).size();
  } else {
    const gguf_tensor_info& e = f.tensor("token_embd.weight");
    XCTX_CHECK(e.shape.size() >= 2, f.path(), ": tensor 'token_embd.weight' has ", e.shape.size(),
               " dims, expected 2 (needed to infer the vocabulary size)");
    hp.n_vocab = checked_int(f, "token_embd.weight rows", e.shape[1]);
  }
  hp.tied_output = f.find_tensor("output.weight") == nullptr;
  hp.qkv_bias = f.find_tensor("blk.0.attn_q.bias") != nullptr;
  hp.validate(f.path());
  return hp;
}

model_weights load_gguf_weights(std::shared_ptr<gguf_file> file) {
  XCTX_CHECK(file != nullptr, "load_gguf_weights: null file");
  const gguf_file& f = *file;
  model_weights w;
  w.hp = read_gguf_hparams(f);
  const model_hparams& hp = w.hp;
  w.source = f.path();

  weight_reader r(f, hp);
  const int64_t q_dim = (int64_t)hp.n_head * hp.head_dim;
  const int64_t kv_dim = hp.kv_dim();
  w.tok_embd = r.matrix("token_embd.weight", hp.n_vocab, hp.n_embd);
  w.out_norm = r.vector("output_norm.weight", hp.n_embd);
  w.output = hp.tied_output ? w.tok_embd : r.matrix("output.weight", hp.n_vocab, hp.n_embd);

  w.layers.resize((size_t)hp.n_layer);
  for (int l = 0; l < hp.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    layer_weights& L = w.layers[(size_t)l];
    L.attn_norm = r.vector(p + "attn_norm.weight", hp.n_embd);
    L.wq = r.matrix(p + "attn_q.weight", q_dim, hp.n_embd);
    L.wk = r.matrix(p + "attn_k.weight", kv_dim, hp.n_embd);
    L.wv = r.matrix(p + "attn_v.weight", kv_dim, hp.n_embd);
    L.wo = r.matrix(p + "attn_output.weight", hp.n_embd, q_dim);
    if (hp.qkv_bias) {
      L.bq = r.vector(p + "attn_q.bias", q_dim);
      L.bk = r.vector(p + "attn_k.bias", kv_dim);
      L.bv = r.vector(p + "attn_v.bias", kv_dim);
    }
    L.ffn_norm = r.vector(p + "ffn_norm.weight", hp.n_embd);
    L.w_gate = r.matrix(p + "ffn_gate.weight", hp.n_ff, hp.n_embd);
    L.w_up = r.matrix(p + "ffn_up.weight", hp.n_ff, hp.n_embd);
    L.w_down = r.matrix(p + "ffn_down.weight", hp.n_embd, hp.n_ff);
  }

  // Tensors the forward never reads (an output bias, extra layers, ...) mean the file is a
  // variant this forward does not implement; say so instead of failing quietly later.
  std::vector<std::string> unused;
  for (const auto& t : f.tensors())
    if (!r.used().count(t.name)) unused.push_back(t.name);
  if (!unused.empty()) {
    std::string list;
    for (size_t i = 0; i < unused.size() && i < 8; ++i) list += (i ? ", " : "") + unused[i];
    LOG(WARNING) << f.path() << ": " << unused.size() << " tensor(s) not used by the " << hp.arch
                 << " forward: " << list << (unused.size() > 8 ? ", ..." : "");
  }
  w.storage = std::static_pointer_cast<void>(std::move(file));
  return w;
}

}  // namespace xctx
