// A small GGUF v2/v3 writer: metadata of every value type (nested arrays included), tensors of
// any ggml_type from raw bytes, configurable alignment. Tests use it to build tiny models and,
// via the recorded byte layout, to corrupt exactly one field of an otherwise valid file.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/gguf.h"
#include "model/hparams.h"

namespace xctx {

// Value constructors, so nested arrays read naturally:
//   w.add("k", gguf_make_array(gguf_value_type::gguf_u8, {gguf_make_u8(1), gguf_make_u8(2)}));
gguf_value gguf_make_u8(uint8_t x);
gguf_value gguf_make_i8(int8_t x);
gguf_value gguf_make_u16(uint16_t x);
gguf_value gguf_make_i16(int16_t x);
gguf_value gguf_make_u32(uint32_t x);
gguf_value gguf_make_i32(int32_t x);
gguf_value gguf_make_u64(uint64_t x);
gguf_value gguf_make_i64(int64_t x);
gguf_value gguf_make_f32(float x);
gguf_value gguf_make_f64(double x);
gguf_value gguf_make_bool(bool x);
gguf_value gguf_make_string(const std::string& x);
// Every element must have type elem_type (checked when written).
gguf_value gguf_make_array(gguf_value_type elem_type, std::vector<gguf_value> elems);

class gguf_writer {
 public:
  explicit gguf_writer(uint32_t version = 3) : version_(version) {}

  // Byte positions in the output of to_bytes()/write(), for tests that patch one field.
  struct tensor_layout {
    size_t info_pos = 0;    // start of the tensor-info record (the name's u64 length)
    size_t n_dims_pos = 0;  // u32
    size_t dims_pos = 0;    // u64[n_dims]
    size_t type_pos = 0;    // u32
    size_t offset_pos = 0;  // u64
    size_t data_pos = 0;    // first byte of the tensor's data
  };
  struct kv_layout {
    size_t key_pos = 0;    // the key's u64 length
    size_t type_pos = 0;   // u32 value type
    size_t value_pos = 0;  // first byte of the value
  };
  struct layout {
    std::vector<kv_layout> kv;          // in insertion order
    std::vector<tensor_layout> tensors;  // in insertion order
    size_t data_section_pos = 0;
    size_t total_bytes = 0;
  };

  // Writes general.alignment (u32) as a metadata key and pads to it. Default 32.
  void set_alignment(uint32_t alignment);

  // Keys are written in insertion order; re-adding a key is an error (the reader rejects it).
  void add(const std::string& key, const gguf_value& value);
  void add_u32(const std::string& key, uint32_t x) { add(key, gguf_make_u32(x)); }
  void add_i32(const std::string& key, int32_t x) { add(key, gguf_make_i32(x)); }
  void add_u64(const std::string& key, uint64_t x) { add(key, gguf_make_u64(x)); }
  void add_f32(const std::string& key, float x) { add(key, gguf_make_f32(x)); }
  void add_bool(const std::string& key, bool x) { add(key, gguf_make_bool(x)); }
  void add_string(const std::string& key, const std::string& x) { add(key, gguf_make_string(x)); }
  void add_string_array(const std::string& key, const std::vector<std::string>& xs);
  void add_f32_array(const std::string& key, const std::vector<float>& xs);
  void add_i32_array(const std::string& key, const std::vector<int32_t>& xs);

  // shape in GGML order (shape[0] = contiguous row length); `bytes` must be exactly
  // ggml_row_bytes(type, shape[0]) * prod(shape[1:]). The data is copied.
  void add_tensor(const std::string& name, ggml_type type, const std::vector<int64_t>& shape,
                  const void* data /*[prod(shape[1:]), row_bytes]*/, size_t bytes);
  // Quantizes `values` (row-major, [prod(shape[1:]), shape[0]]) with ref::quantize_row.
  void add_tensor_from_f32(const std::string& name, ggml_type type, const std::vector<int64_t>& shape,
                           const std::vector<float>& values /*[prod(shape[1:]), shape[0]]*/);

  std::vector<uint8_t> to_bytes(layout* out_layout = nullptr) const;
  void write(const std::string& path, layout* out_layout = nullptr) const;

 private:
  struct tensor_entry {
    std::string name;
    ggml_type type;
    std::vector<int64_t> shape;
    std::vector<uint8_t> data;
  };
  uint32_t version_;
  uint32_t alignment_ = 32;
  std::vector<std::pair<std::string, gguf_value>> kv_;
  std::vector<tensor_entry> tensors_;
};

// A writer pre-filled with a complete random Llama-family model for `hp` (keys under hp.arch,
// all tensors; matrices quantized to matrix_type, norms F32 near 1, no tokenizer keys unless
// with_vocab, in which case tokenizer.ggml.tokens holds "<t0>".."<tN-1>"). Weights are drawn
// uniformly in ±1/sqrt(n_cols) from `seed`, so the forward pass stays well scaled. Callers may
// add more keys/tensors before writing. hp.tied_output=false adds output.weight; hp.qkv_bias
// adds blk.N.attn_{q,k,v}.bias. Norm and bias vectors are stored as vector_type.
gguf_writer make_tiny_model_writer(const model_hparams& hp, ggml_type matrix_type, uint64_t seed,
                                   bool with_vocab = false, ggml_type vector_type = ggml_type::ggml_f32);

}  // namespace xctx
