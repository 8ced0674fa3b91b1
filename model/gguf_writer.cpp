#include "model/gguf_writer.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>

#include "common/error.h"
#include "kernels/ref/ref_ops.h"

namespace xctx {
namespace {

gguf_value make(gguf_value_type t, decltype(gguf_value::v) v) {
  gguf_value out;
  out.type = t;
  out.v = std::move(v);
  return out;
}

class byte_sink {
 public:
  std::vector<uint8_t> bytes;
  size_t pos() const { return bytes.size(); }
  template <typename T>
  void put(T x) {
    const auto* p = reinterpret_cast<const uint8_t*>(&x);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void put_string(const std::string& s) {
    put<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  void pad_to(size_t alignment) {
    while (bytes.size() % alignment != 0) bytes.push_back(0);
  }
};

void put_value(byte_sink& out, const gguf_value& v, const std::string& key) {
  switch (v.type) {
    case gguf_value_type::gguf_u8: out.put<uint8_t>((uint8_t)std::get<uint64_t>(v.v)); return;
    case gguf_value_type::gguf_i8: out.put<int8_t>((int8_t)std::get<int64_t>(v.v)); return;
    case gguf_value_type::gguf_u16: out.put<uint16_t>((uint16_t)std::get<uint64_t>(v.v)); return;
    case gguf_value_type::gguf_i16: out.put<int16_t>((int16_t)std::get<int64_t>(v.v)); return;
    case gguf_value_type::gguf_u32: out.put<uint32_t>((uint32_t)std::get<uint64_t>(v.v)); return;
    case gguf_value_type::gguf_i32: out.put<int32_t>((int32_t)std::get<int64_t>(v.v)); return;
    case gguf_value_type::gguf_u64: out.put<uint64_t>(std::get<uint64_t>(v.v)); return;
    case gguf_value_type::gguf_i64: out.put<int64_t>(std::get<int64_t>(v.v)); return;
    case gguf_value_type::gguf_f32: out.put<float>((float)std::get<double>(v.v)); return;
    case gguf_value_type::gguf_f64: out.put<double>(std::get<double>(v.v)); return;
    case gguf_value_type::gguf_bool: out.put<uint8_t>(std::get<bool>(v.v) ? 1 : 0); return;
    case gguf_value_type::gguf_string: out.put_string(std::get<std::string>(v.v)); return;
    case gguf_value_type::gguf_array: {
      const auto& elems = std::get<std::vector<gguf_value>>(v.v);
      out.put<uint32_t>((uint32_t)v.elem_type);
      out.put<uint64_t>(elems.size());
      for (const auto& e : elems) {
        XCTX_CHECK(e.type == v.elem_type, "gguf_writer: key '", key, "': array element of type id ", (uint32_t)e.type,
                   " in an array of type id ", (uint32_t)v.elem_type);
        put_value(out, e, key);
      }
      return;
    }
  }
  fail("gguf_writer: key '", key, "': unknown value type id ", (uint32_t)v.type);
}

}  // namespace

gguf_value gguf_make_u8(uint8_t x) { return make(gguf_value_type::gguf_u8, (uint64_t)x); }
gguf_value gguf_make_i8(int8_t x) { return make(gguf_value_type::gguf_i8, (int64_t)x); }
gguf_value gguf_make_u16(uint16_t x) { return make(gguf_value_type::gguf_u16, (uint64_t)x); }
gguf_value gguf_make_i16(int16_t x) { return make(gguf_value_type::gguf_i16, (int64_t)x); }
gguf_value gguf_make_u32(uint32_t x) { return make(gguf_value_type::gguf_u32, (uint64_t)x); }
gguf_value gguf_make_i32(int32_t x) { return make(gguf_value_type::gguf_i32, (int64_t)x); }
gguf_value gguf_make_u64(uint64_t x) { return make(gguf_value_type::gguf_u64, x); }
gguf_value gguf_make_i64(int64_t x) { return make(gguf_value_type::gguf_i64, x); }
gguf_value gguf_make_f32(float x) { return make(gguf_value_type::gguf_f32, (double)x); }
gguf_value gguf_make_f64(double x) { return make(gguf_value_type::gguf_f64, x); }
gguf_value gguf_make_bool(bool x) { return make(gguf_value_type::gguf_bool, x); }
gguf_value gguf_make_string(const std::string& x) { return make(gguf_value_type::gguf_string, x); }
gguf_value gguf_make_array(gguf_value_type elem_type, std::vector<gguf_value> elems) {
  gguf_value out = make(gguf_value_type::gguf_array, std::move(elems));
  out.elem_type = elem_type;
  return out;
}

void gguf_writer::set_alignment(uint32_t alignment) {
  XCTX_CHECK(alignment != 0 && (alignment & (alignment - 1)) == 0, "gguf_writer: alignment ", alignment,
             " is not a power of two");
  alignment_ = alignment;
  for (auto& [k, v] : kv_) {
    if (k == "general.alignment") {
      v = gguf_make_u32(alignment);
      return;
    }
  }
  kv_.emplace_back("general.alignment", gguf_make_u32(alignment));
}

void gguf_writer::add(const std::string& key, const gguf_value& value) {
  for (const auto& kv : kv_) XCTX_CHECK(kv.first != key, "gguf_writer: duplicate key '", key, "'");
  kv_.emplace_back(key, value);
}

void gguf_writer::add_string_array(const std::string& key, const std::vector<std::string>& xs) {
  std::vector<gguf_value> elems;
  elems.reserve(xs.size());
  for (const auto& s : xs) elems.push_back(gguf_make_string(s));
  add(key, gguf_make_array(gguf_value_type::gguf_string, std::move(elems)));
}

void gguf_writer::add_f32_array(const std::string& key, const std::vector<float>& xs) {
  std::vector<gguf_value> elems;
  for (const float x : xs) elems.push_back(gguf_make_f32(x));
  add(key, gguf_make_array(gguf_value_type::gguf_f32, std::move(elems)));
}

void gguf_writer::add_i32_array(const std::string& key, const std::vector<int32_t>& xs) {
  std::vector<gguf_value> elems;
  for (const int32_t x : xs) elems.push_back(gguf_make_i32(x));
  add(key, gguf_make_array(gguf_value_type::gguf_i32, std::move(elems)));
}

void gguf_writer::add_tensor(const std::string& name, ggml_type type, const std::vector<int64_t>& shape,
                             const void* data, size_t bytes) {
  const ggml_type_traits tr = ggml_traits(type);
  XCTX_CHECK(tr.name != nullptr, "gguf_writer: tensor '", name, "': unknown type id ", (uint32_t)type);
  XCTX_CHECK(!shape.empty() && shape.size() <= 4, "gguf_writer: tensor '", name, "': ", shape.size(), " dims");
  XCTX_CHECK(shape[0] % tr.block_elems == 0, "gguf_writer: tensor '", name, "': ne[0] = ", shape[0],
             " is not a multiple of the ", tr.name, " block size ", tr.block_elems);
  size_t expect = ggml_row_bytes(type, shape[0]);
  for (size_t d = 1; d < shape.size(); ++d) expect *= (size_t)shape[d];
  XCTX_CHECK(bytes == expect, "gguf_writer: tensor '", name, "': ", bytes, " bytes given, shape needs ", expect);
  for (const auto& t : tensors_) XCTX_CHECK(t.name != name, "gguf_writer: duplicate tensor '", name, "'");
  const auto* p = static_cast<const uint8_t*>(data);
  tensors_.push_back({name, type, shape, std::vector<uint8_t>(p, p + bytes)});
}

void gguf_writer::add_tensor_from_f32(const std::string& name, ggml_type type, const std::vector<int64_t>& shape,
                                      const std::vector<float>& values) {
  XCTX_CHECK(!shape.empty(), "gguf_writer: tensor '", name, "': empty shape");
  int64_t rows = 1;
  for (size_t d = 1; d < shape.size(); ++d) rows *= shape[d];
  XCTX_CHECK((int64_t)values.size() == rows * shape[0], "gguf_writer: tensor '", name, "': ", values.size(),
             " values for a shape of ", rows * shape[0], " elements");
  const size_t row_bytes = ggml_row_bytes(type, shape[0]);
  std::vector<uint8_t> bytes(row_bytes * (size_t)rows);
  for (int64_t r = 0; r < rows; ++r)
    ref::quantize_row(type, values.data() + r * shape[0], bytes.data() + (size_t)r * row_bytes, shape[0]);
  add_tensor(name, type, shape, bytes.data(), bytes.size());
}

std::vector<uint8_t> gguf_writer::to_bytes(layout* out_layout) const {
  layout lay;
  byte_sink out;
  out.put<uint32_t>(0x46554747);  // "GGUF"
  out.put<uint32_t>(version_);
  out.put<uint64_t>(tensors_.size());
  out.put<uint64_t>(kv_.size());
  for (const auto& [key, value] : kv_) {
    kv_layout kl;
    kl.key_pos = out.pos();
    out.put_string(key);
    kl.type_pos = out.pos();
    out.put<uint32_t>((uint32_t)value.type);
    kl.value_pos = out.pos();
    put_value(out, value, key);
    lay.kv.push_back(kl);
  }
  // Data offsets: each tensor starts on an alignment boundary of the data section.
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const auto& t : tensors_) {
    offsets.push_back(next);
    next = (next + t.data.size() + alignment_ - 1) / alignment_ * alignment_;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const auto& t = tensors_[i];
    tensor_layout tl;
    tl.info_pos = out.pos();
    out.put_string(t.name);
    tl.n_dims_pos = out.pos();
    out.put<uint32_t>((uint32_t)t.shape.size());
    tl.dims_pos = out.pos();
    for (const int64_t d : t.shape) out.put<uint64_t>((uint64_t)d);
    tl.type_pos = out.pos();
    out.put<uint32_t>((uint32_t)t.type);
    tl.offset_pos = out.pos();
    out.put<uint64_t>(offsets[i]);
    lay.tensors.push_back(tl);
  }
  out.pad_to(alignment_);
  lay.data_section_pos = out.pos();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    lay.tensors[i].data_pos = lay.data_section_pos + offsets[i];
    out.bytes.insert(out.bytes.end(), tensors_[i].data.begin(), tensors_[i].data.end());
    out.pad_to(alignment_);
  }
  lay.total_bytes = out.pos();
  if (out_layout) *out_layout = std::move(lay);
  return std::move(out.bytes);
}

void gguf_writer::write(const std::string& path, layout* out_layout) const {
  const std::vector<uint8_t> bytes = to_bytes(out_layout);
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), std::fclose);
  XCTX_CHECK(f != nullptr, path, ": cannot create: ", std::strerror(errno));
  XCTX_CHECK(std::fwrite(bytes.data(), 1, bytes.size(), f.get()) == bytes.size(), path,
             ": short write: ", std::strerror(errno));
  XCTX_CHECK(std::fclose(f.release()) == 0, path, ": close failed: ", std::strerror(errno));
}

gguf_writer make_tiny_model_writer(const model_hparams& hp, ggml_type matrix_type, uint64_t seed, bool with_vocab,
                                   ggml_type vector_type) {
  hp.validate("make_tiny_model_writer");
  gguf_writer w;
  const std::string a = hp.arch + ".";
  w.add_string("general.architecture", hp.arch);
  w.add_string("general.name", hp.name.empty() ? "tiny-" + hp.arch : hp.name);
  w.add_u32(a + "block_count", (uint32_t)hp.n_layer);
  w.add_u32(a + "context_length", (uint32_t)hp.n_ctx_train);
  w.add_u32(a + "embedding_length", (uint32_t)hp.n_embd);
  w.add_u32(a + "feed_forward_length", (uint32_t)hp.n_ff);
  w.add_u32(a + "attention.head_count", (uint32_t)hp.n_head);
  w.add_u32(a + "attention.head_count_kv", (uint32_t)hp.n_head_kv);
  w.add_f32(a + "attention.layer_norm_rms_epsilon", hp.rms_eps);
  w.add_f32(a + "rope.freq_base", hp.rope_freq_base);
  w.add_u32(a + "rope.dimension_count", (uint32_t)hp.n_rot);
  if (hp.head_dim * hp.n_head != hp.n_embd) w.add_u32(a + "attention.key_length", (uint32_t)hp.head_dim);
  if (hp.rope_scale_type == rope_scaling::rope_scaling_linear) {
    w.add_string(a + "rope.scaling.type", "linear");
    w.add_f32(a + "rope.scaling.factor", hp.rope_scale_factor);
  }
  XCTX_CHECK(hp.rope_scale_type != rope_scaling::rope_scaling_ntk, "make_tiny_model_writer: GGUF has no NTK rope key");
  w.add_u32(a + "vocab_size", (uint32_t)hp.n_vocab);
  if (with_vocab) {
    std::vector<std::string> toks;
    for (int i = 0; i < hp.n_vocab; ++i) toks.push_back("<t" + std::to_string(i) + ">");
    w.add_string_array("tokenizer.ggml.tokens", toks);
  }

  std::mt19937_64 rng(seed);
  auto matrix = [&](const std::string& name, int64_t n_rows, int64_t n_cols) {
    std::uniform_real_distribution<float> u(-1.0f / std::sqrt((float)n_cols), 1.0f / std::sqrt((float)n_cols));
    std::vector<float> v((size_t)(n_rows * n_cols));
    for (auto& x : v) x = u(rng);
    w.add_tensor_from_f32(name, matrix_type, {n_cols, n_rows}, v);
  };
  auto vec = [&](const std::string& name, int64_t n, float center, float spread) {
    std::uniform_real_distribution<float> u(center - spread, center + spread);
    std::vector<float> v((size_t)n);
    for (auto& x : v) x = u(rng);
    w.add_tensor_from_f32(name, vector_type, {n}, v);
  };
  const int64_t q_dim = (int64_t)hp.n_head * hp.head_dim;
  matrix("token_embd.weight", hp.n_vocab, hp.n_embd);
  vec("output_norm.weight", hp.n_embd, 1.0f, 0.1f);
  if (!hp.tied_output) matrix("output.weight", hp.n_vocab, hp.n_embd);
  for (int l = 0; l < hp.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    vec(p + "attn_norm.weight", hp.n_embd, 1.0f, 0.1f);
    matrix(p + "attn_q.weight", q_dim, hp.n_embd);
    matrix(p + "attn_k.weight", hp.kv_dim(), hp.n_embd);
    matrix(p + "attn_v.weight", hp.kv_dim(), hp.n_embd);
    if (hp.qkv_bias) {
      vec(p + "attn_q.bias", q_dim, 0.0f, 0.1f);
      vec(p + "attn_k.bias", hp.kv_dim(), 0.0f, 0.1f);
      vec(p + "attn_v.bias", hp.kv_dim(), 0.0f, 0.1f);
    }
    matrix(p + "attn_output.weight", hp.n_embd, q_dim);
    vec(p + "ffn_norm.weight", hp.n_embd, 1.0f, 0.1f);
    matrix(p + "ffn_gate.weight", hp.n_ff, hp.n_embd);
    matrix(p + "ffn_up.weight", hp.n_ff, hp.n_embd);
    matrix(p + "ffn_down.weight", hp.n_embd, hp.n_ff);
  }
  return w;
}

}  // namespace xctx
