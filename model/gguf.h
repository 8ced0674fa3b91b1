// GGUF v2/v3 reader: memory-maps the file, parses every metadata value type and the tensor
// table, and validates offsets, alignment and sizes against the file length. Every error names
// the file, the key or tensor, and the problem.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "kernels/quant_blocks.h"

namespace xctx {

// GGUF metadata value types (on-disk ids).
enum class gguf_value_type : uint32_t {
  gguf_u8 = 0, gguf_i8 = 1, gguf_u16 = 2, gguf_i16 = 3, gguf_u32 = 4, gguf_i32 = 5,
  gguf_f32 = 6, gguf_bool = 7, gguf_string = 8, gguf_array = 9, gguf_u64 = 10, gguf_i64 = 11,
  gguf_f64 = 12,
};

// One metadata value. Arrays hold their elements (arrays of arrays are allowed by the format).
struct gguf_value {
  gguf_value_type type = gguf_value_type::gguf_u8;
  gguf_value_type elem_type = gguf_value_type::gguf_u8;  // for arrays
  std::variant<uint64_t, int64_t, double, bool, std::string, std::vector<gguf_value>> v;
};

struct gguf_tensor_info {
  std::string name;
  std::vector<int64_t> shape;  // GGML order: shape[0] is the contiguous (column) dimension
  ggml_type type = ggml_type::ggml_f32;
  uint64_t offset = 0;         // relative to the data section
  const void* data = nullptr;  // into the mapping
  size_t bytes = 0;
  int64_t n_elements() const;
};

class gguf_file {
 public:
  // Throws xctx::Error for a missing, truncated or malformed file.
  static std::unique_ptr<gguf_file> open(const std::string& path);
  ~gguf_file();
  gguf_file(const gguf_file&) = delete;
  gguf_file& operator=(const gguf_file&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }
  size_t file_bytes() const { return size_; }

  const std::map<std::string, gguf_value>& metadata() const { return kv_; }
  const std::vector<gguf_tensor_info>& tensors() const { return tensors_; }

  bool has(const std::string& key) const { return kv_.count(key) != 0; }
  const gguf_value* find(const std::string& key) const;
  // Typed getters: throw naming file and key if missing or of an incompatible type.
  // Integer getters accept any integer type and range-check.
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key) const;  // accepts f32/f64 (and integers)
  double get_float(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  std::vector<std::string> get_string_array(const std::string& key) const;
  std::vector<float> get_float_array(const std::string& key) const;
  std::vector<int32_t> get_int_array(const std::string& key) const;

  const gguf_tensor_info* find_tensor(const std::string& name) const;
  const gguf_tensor_info& tensor(const std::string& name) const;  // throws if missing

 private:
  gguf_file() = default;
  std::string path_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, gguf_value> kv_;
  std::vector<gguf_tensor_info> tensors_;
};

// Human-readable rendering of a value (arrays abbreviated), for `xctx info`.
std::string gguf_value_to_string(const gguf_value& v, size_t max_elems = 8);

}  // namespace xctx
