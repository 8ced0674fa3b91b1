#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"

namespace xctx {

namespace {

// A header larger than this is far beyond any real checkpoint (the reference implementation
// uses the same bound) and most likely a corrupt length field.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

size_t st_dtype_bytes(const std::string& dtype) {
  static const std::map<std::string, size_t> table = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"F8_E8M0", 1},
      {"I16", 2},  {"U16", 2}, {"F16", 2}, {"BF16", 2},    {"I32", 4},     {"U32", 4},
      {"F32", 4},  {"F64", 8}, {"I64", 8}, {"U64", 8},     {"C64", 8},
  };
  auto it = table.find(dtype);
  return it == table.end() ? 0 : it->second;
}

int64_t st_tensor_info::n_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

safetensors_file::~safetensors_file() {
  if (map_) munmap(map_, size_);
}

const st_tensor_info* safetensors_file::find_tensor(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const st_tensor_info& safetensors_file::tensor(const std::string& name) const {
  const st_tensor_info* t = find_tensor(name);
  XCTX_CHECK(t, path_, ": tensor '", name, "' not found (file has ", tensors_.size(), " tensors)");
  return *t;
}

std::unique_ptr<safetensors_file> safetensors_file::open(const std::string& path) {
  std::unique_ptr<safetensors_file> f(new safetensors_file());
  f->path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  XCTX_CHECK(fd >= 0, path, ": cannot open safetensors file: ", std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, ": fstat failed: ", std::strerror(err));
  }
  f->size_ = (size_t)st.st_size;
  if (f->size_ < 8) {
    ::close(fd);
    fail(path, ": truncated safetensors file (", f->size_, " bytes, need at least the 8-byte header length)");
  }
  void* map = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  XCTX_CHECK(map != MAP_FAILED, path, ": mmap of ", f->size_, " bytes failed: ", std::strerror(map_err));
  f->map_ = map;
  const auto* base = static_cast<const uint8_t*>(map);

  const uint64_t header_len = read_u64_le(base);
  XCTX_CHECK(header_len <= f->size_ - 8, path, ": header length ", header_len, " runs past the end of the file (",
             f->size_, " bytes): truncated or not a safetensors file");
  XCTX_CHECK(header_len <= kMaxHeaderBytes, path, ": header length ", header_len, " exceeds the ", kMaxHeaderBytes,
             "-byte limit");
  f->data_offset_ = 8 + (size_t)header_len;
  const uint64_t data_bytes = f->size_ - f->data_offset_;

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(base + 8, base + f->data_offset_);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": header is not valid JSON: ", e.what());
  }
  XCTX_CHECK(header.is_object(), path, ": header must be a JSON object, found ", header.type_name());

  struct span {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<span> spans;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") continue;
    const nlohmann::json& e = it.value();
    const std::string where = path + ": tensor '" + name + "'";
    XCTX_CHECK(e.is_object(), where, ": entry must be an object, found ", e.type_name());
    XCTX_CHECK(e.contains("dtype") && e["dtype"].is_string(), where, ": missing or non-string \"dtype\"");
    XCTX_CHECK(e.contains("shape") && e["shape"].is_array(), where, ": missing or non-array \"shape\"");
    XCTX_CHECK(e.contains("data_offsets") && e["data_offsets"].is_array() && e["data_offsets"].size() == 2, where,
               ": \"data_offsets\" must be an array [begin, end]");

    st_tensor_info t;
    t.name = name;
    t.dtype = e["dtype"].get<std::string>();
    t.elem_bytes = st_dtype_bytes(t.dtype);
    XCTX_CHECK(t.elem_bytes != 0, where, ": unknown dtype \"", t.dtype, "\"");
    if (t.dtype == "F32") t.type = ggml_type::ggml_f32;
    if (t.dtype == "F16") t.type = ggml_type::ggml_f16;
    if (t.dtype == "BF16") t.type = ggml_type::ggml_bf16;

    uint64_t n_elem = 1;
    for (const auto& d : e["shape"]) {
      XCTX_CHECK(d.is_number_unsigned(), where, ": shape ", e["shape"].dump(), " must hold non-negative integers");
      const uint64_t dim = d.get<uint64_t>();
      XCTX_CHECK(dim < (1ull << 62) && !__builtin_mul_overflow(n_elem, dim, &n_elem), where, ": shape ",
                 e["shape"].dump(), " overflows");
      t.shape.push_back((int64_t)dim);
    }
    const auto& off = e["data_offsets"];
    XCTX_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(), where, ": data_offsets ", off.dump(),
               " must be non-negative integers");
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    XCTX_CHECK(t.begin <= t.end, where, ": data_offsets [", t.begin, ", ", t.end, "] end before begin");
    XCTX_CHECK(t.end <= data_bytes, where, ": data_offsets [", t.begin, ", ", t.end,
               "] out of range: data section has ", data_bytes, " bytes (file ", f->size_, " bytes)");
    uint64_t want = 0;
    XCTX_CHECK(!__builtin_mul_overflow(n_elem, (uint64_t)t.elem_bytes, &want), where, ": shape ", shape_str(t.shape),
               " overflows");
    XCTX_CHECK(want == t.end - t.begin, where, ": ", t.dtype, " ", shape_str(t.shape), " needs ", n_elem, " x ",
               t.elem_bytes, " = ", want, " bytes but data_offsets [", t.begin, ", ", t.end, "] span ",
               t.end - t.begin);
    t.data = base + f->data_offset_ + t.begin;
    auto [pos, inserted] = f->tensors_.emplace(name, std::move(t));
    XCTX_ASSERT(inserted);  // JSON object keys are unique after parsing
    spans.push_back({pos->second.begin, pos->second.end, &pos->first});
  }

  // Sorted by begin, a tensor overlaps its successor iff it ends after the successor begins.
  // Gaps are tolerated: they waste bytes but cannot alias two tensors.
  std::sort(spans.begin(), spans.end(),
            [](const span& a, const span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  for (size_t i = 1; i < spans.size(); ++i) {
    const span& a = spans[i - 1];
    const span& b = spans[i];
    if (a.begin == a.end || b.begin == b.end) continue;  // empty tensors own no bytes
    XCTX_CHECK(a.end <= b.begin, path, ": tensors '", *a.name, "' [", a.begin, ", ", a.end, ") and '", *b.name, "' [",
               b.begin, ", ", b.end, ") overlap");
  }
  return f;
}

void write_safetensors(const std::string& path, const std::vector<st_tensor_out>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const st_tensor_out& t : tensors) {
    XCTX_CHECK(st_dtype_bytes(t.dtype) != 0, path, ": cannot write tensor '", t.name, "' with unknown dtype \"",
               t.dtype, "\"");
    int64_t n = 1;
    for (int64_t d : t.shape) n *= d;
    XCTX_CHECK((uint64_t)n * st_dtype_bytes(t.dtype) == t.data.size(), path, ": tensor '", t.name, "' ",
               shape_str(t.shape), " ", t.dtype, " needs ", n * st_dtype_bytes(t.dtype), " bytes, got ", t.data.size());
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  XCTX_CHECK(out, path, ": cannot create file: ", std::strerror(errno));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = (uint8_t)((uint64_t)text.size() >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), (std::streamsize)text.size());
  for (const st_tensor_out& t : tensors)
    out.write(reinterpret_cast<const char*>(t.data.data()), (std::streamsize)t.data.size());
  out.flush();
  XCTX_CHECK(out, path, ": write failed: ", std::strerror(errno));
}

}  // namespace xctx
