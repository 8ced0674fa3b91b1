// safetensors reader (and a small writer for tests and tools).
// Layout: u64 little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "BF16", "shape": [out, in], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {...}}
// then the data section; offsets are relative to its start. Shapes are row-major with the
// outermost dimension first (the reverse of GGUF's order). The file is memory-mapped and every
// tensor's offsets are validated against the data section and against each other.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/quant_blocks.h"

namespace xctx {

struct st_tensor_info {
  std::string name;
  std::string dtype;              // as written in the header: "BF16", "F32", "I64", ...
  std::optional<ggml_type> type;  // set for F32 / F16 / BF16, the dtypes xctx computes with
  size_t elem_bytes = 0;
  std::vector<int64_t> shape;   // outermost first; HF Linear weights are [out, in]
  uint64_t begin = 0, end = 0;  // [begin, end) relative to the data section
  const void* data = nullptr;   // into the mapping
  size_t bytes() const { return (size_t)(end - begin); }
  int64_t n_elements() const;
};

class safetensors_file {
 public:
  // Throws xctx::Error naming the file (and tensor) for a missing, truncated or malformed file,
  // a dtype outside the safetensors set, or offsets that leave the data section or overlap.
  // Tensors of a valid but non-float dtype (I64, U8, ...) are listed with `type` unset; the
  // consumer decides whether it needs them. "__metadata__" is skipped.
  static std::unique_ptr<safetensors_file> open(const std::string& path);
  ~safetensors_file();
  safetensors_file(const safetensors_file&) = delete;
  safetensors_file& operator=(const safetensors_file&) = delete;

  const std::string& path() const { return path_; }
  size_t file_bytes() const { return size_; }
  size_t data_offset() const { return data_offset_; }  // 8 + header length

  const std::map<std::string, st_tensor_info>& tensors() const { return tensors_; }
  const st_tensor_info* find_tensor(const std::string& name) const;
  const st_tensor_info& tensor(const std::string& name) const;  // throws naming file and tensor

 private:
  safetensors_file() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  size_t data_offset_ = 0;
  std::map<std::string, st_tensor_info> tensors_;
};

// One tensor to write: `data` holds n_elements values already encoded in `dtype`.
struct st_tensor_out {
  std::string name;
  std::string dtype;           // "F32", "F16", "BF16" (or any valid safetensors dtype)
  std::vector<int64_t> shape;  // outermost first
  std::vector<uint8_t> data;
};
// Writes tensors in the given order, header padded with spaces so the data section starts on
// an 8-byte boundary (as the reference writer does). Throws naming the path on I/O errors.
void write_safetensors(const std::string& path, const std::vector<st_tensor_out>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Bytes per element of a safetensors dtype name; 0 if the name is not a safetensors dtype.
size_t st_dtype_bytes(const std::string& dtype);

}  // namespace xctx
