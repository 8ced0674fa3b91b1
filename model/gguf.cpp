// GGUF reader. Layout (little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv, then n_kv
// (string key, u32 type, value), then n_tensors (string name, u32 n_dims, u64 dims[n_dims],
// u32 ggml type, u64 offset), then padding to `general.alignment`, then the data section.
// Strings are u64 length + bytes; arrays are u32 element type + u64 count + elements.
//
// Every count read from the file is checked against the bytes left before anything is
// allocated, so a corrupt count fails fast instead of reserving gigabytes.
#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>

#include "common/error.h"

namespace xctx {
namespace {

constexpr uint32_t k_gguf_magic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int k_max_dims = 4;
// Arrays of arrays are legal; real files nest at most once. A bound keeps a hostile file from
// recursing the stack away.
constexpr int k_max_array_depth = 8;

bool known_value_type(uint32_t t) { return t <= (uint32_t)gguf_value_type::gguf_f64; }

const char* value_type_name(gguf_value_type t) {
  switch (t) {
    case gguf_value_type::gguf_u8: return "u8";
    case gguf_value_type::gguf_i8: return "i8";
    case gguf_value_type::gguf_u16: return "u16";
    case gguf_value_type::gguf_i16: return "i16";
    case gguf_value_type::gguf_u32: return "u32";
    case gguf_value_type::gguf_i32: return "i32";
    case gguf_value_type::gguf_f32: return "f32";
    case gguf_value_type::gguf_bool: return "bool";
    case gguf_value_type::gguf_string: return "string";
    case gguf_value_type::gguf_array: return "array";
    case gguf_value_type::gguf_u64: return "u64";
    case gguf_value_type::gguf_i64: return "i64";
    case gguf_value_type::gguf_f64: return "f64";
  }
  return "?";
}

// Fewest bytes one value of type t can occupy; used to bound counts before allocating.
uint64_t min_value_bytes(gguf_value_type t) {
  switch (t) {
    case gguf_value_type::gguf_u8:
    case gguf_value_type::gguf_i8:
    case gguf_value_type::gguf_bool: return 1;
    case gguf_value_type::gguf_u16:
    case gguf_value_type::gguf_i16: return 2;
    case gguf_value_type::gguf_u32:
    case gguf_value_type::gguf_i32:
    case gguf_value_type::gguf_f32: return 4;
    case gguf_value_type::gguf_u64:
    case gguf_value_type::gguf_i64:
    case gguf_value_type::gguf_f64:
    case gguf_value_type::gguf_string: return 8;
    case gguf_value_type::gguf_array: return 12;
  }
  return 1;
}

// Bounds-checked little-endian cursor over the mapping. `where` describes the item being read
// so truncation errors say what was cut off.
class reader {
 public:
  reader(const std::string& path, const uint8_t* base, size_t size) : path_(path), base_(base), size_(size) {}

  size_t pos() const { return pos_; }
  size_t remaining() const { return size_ - pos_; }

  void need(uint64_t n, const std::string& where) const {
    XCTX_CHECK(n <= remaining(), path_, ": file truncated while reading ", where, " (needs ", n,
               " bytes at offset ", pos_, ", file has ", size_, ")");
  }
  template <typename T>
  T read(const std::string& where) {
    need(sizeof(T), where);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const std::string& where) {
    const uint64_t len = read<uint64_t>(where + " (string length)");
    // A length beyond the file is corruption, not a request to allocate.
    XCTX_CHECK(len <= remaining(), path_, ": ", where, ": string length ", len, " exceeds the ", remaining(),
               " bytes left in the file");
    std::string s(reinterpret_cast<const char*>(base_ + pos_), (size_t)len);
    pos_ += (size_t)len;
    return s;
  }

 private:
  const std::string& path_;
  const uint8_t* base_;
  size_t size_;
  size_t pos_ = 0;
};

gguf_value read_value(reader& r, const std::string& path, const std::string& key, gguf_value_type type, int depth);

gguf_value_type read_type(reader& r, const std::string& path, const std::string& key, const char* what) {
  const uint32_t t = r.read<uint32_t>("type of key '" + key + "'");
  XCTX_CHECK(known_value_type(t), path, ": key '", key, "': unknown ", what, " id ", t, " (valid 0..12)");
  return (gguf_value_type)t;
}

gguf_value read_array(reader& r, const std::string& path, const std::string& key, int depth) {
  XCTX_CHECK(depth < k_max_array_depth, path, ": key '", key, "': arrays nested deeper than ", k_max_array_depth);
  gguf_value out;
  out.type = gguf_value_type::gguf_array;
  out.elem_type = read_type(r, path, key, "array element type");
  const uint64_t count = r.read<uint64_t>("array length of key '" + key + "'");
  const uint64_t min_bytes = min_value_bytes(out.elem_type);
  XCTX_CHECK(count <= r.remaining() / min_bytes, path, ": key '", key, "': array of ", count, " ",
             value_type_name(out.elem_type), " elements cannot fit in the ", r.remaining(),
             " bytes left in the file");
  std::vector<gguf_value> elems;
  elems.reserve((size_t)count);
  for (uint64_t i = 0; i < count; ++i) elems.push_back(read_value(r, path, key, out.elem_type, depth + 1));
  out.v = std::move(elems);
  return out;
}

gguf_value read_value(reader& r, const std::string& path, const std::string& key, gguf_value_type type, int depth) {
  const std::string where = "value of key '" + key + "'";
  gguf_value out;
  out.type = type;
  switch (type) {
    case gguf_value_type::gguf_u8: out.v = (uint64_t)r.read<uint8_t>(where); break;
    case gguf_value_type::gguf_i8: out.v = (int64_t)r.read<int8_t>(where); break;
    case gguf_value_type::gguf_u16: out.v = (uint64_t)r.read<uint16_t>(where); break;
    case gguf_value_type::gguf_i16: out.v = (int64_t)r.read<int16_t>(where); break;
    case gguf_value_type::gguf_u32: out.v = (uint64_t)r.read<uint32_t>(where); break;
    case gguf_value_type::gguf_i32: out.v = (int64_t)r.read<int32_t>(where); break;
    case gguf_value_type::gguf_u64: out.v = r.read<uint64_t>(where); break;
    case gguf_value_type::gguf_i64: out.v = r.read<int64_t>(where); break;
    case gguf_value_type::gguf_f32: out.v = (double)r.read<float>(where); break;
    case gguf_value_type::gguf_f64: out.v = r.read<double>(where); break;
    case gguf_value_type::gguf_bool: {
      const uint8_t b = r.read<uint8_t>(where);
      XCTX_CHECK(b <= 1, path, ": key '", key, "': bool value byte is ", (int)b, " (must be 0 or 1)");
      out.v = b != 0;
      break;
    }
    case gguf_value_type::gguf_string: out.v = r.read_string(where); break;
    case gguf_value_type::gguf_array: return read_array(r, path, key, depth);
  }
  return out;
}

bool is_unsigned(gguf_value_type t) {
  return t == gguf_value_type::gguf_u8 || t == gguf_value_type::gguf_u16 || t == gguf_value_type::gguf_u32 ||
         t == gguf_value_type::gguf_u64;
}
bool is_signed(gguf_value_type t) {
  return t == gguf_value_type::gguf_i8 || t == gguf_value_type::gguf_i16 || t == gguf_value_type::gguf_i32 ||
         t == gguf_value_type::gguf_i64;
}
bool is_float(gguf_value_type t) { return t == gguf_value_type::gguf_f32 || t == gguf_value_type::gguf_f64; }

// Integer value of v, or an error naming path/key. Unsigned values above INT64_MAX don't fit.
int64_t as_int(const gguf_value& v, const std::string& path, const std::string& key) {
  if (is_unsigned(v.type)) {
    const uint64_t u = std::get<uint64_t>(v.v);
    XCTX_CHECK(u <= (uint64_t)std::numeric_limits<int64_t>::max(), path, ": key '", key, "': value ", u,
               " is out of range for a signed 64-bit integer");
    return (int64_t)u;
  }
  XCTX_CHECK(is_signed(v.type), path, ": key '", key, "': expected an integer, found ", value_type_name(v.type));
  return std::get<int64_t>(v.v);
}

double as_float(const gguf_value& v, const std::string& path, const std::string& key) {
  if (is_float(v.type)) return std::get<double>(v.v);
  if (is_unsigned(v.type)) return (double)std::get<uint64_t>(v.v);
  XCTX_CHECK(is_signed(v.type), path, ": key '", key, "': expected a number, found ", value_type_name(v.type));
  return (double)std::get<int64_t>(v.v);
}

const std::vector<gguf_value>& as_array(const gguf_value& v, const std::string& path, const std::string& key) {
  XCTX_CHECK(v.type == gguf_value_type::gguf_array, path, ": key '", key, "': expected an array, found ",
             value_type_name(v.type));
  return std::get<std::vector<gguf_value>>(v.v);
}

uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

void append_escaped(std::ostringstream& os, const std::string& s) {
  os << '"';
  for (const char c : s) {
    switch (c) {
      case '\n': os << "\\n"; break;
      case '\t': os << "\\t"; break;
      case '\r': os << "\\r"; break;
      case '"': os << "\\\""; break;
      case '\\': os << "\\\\"; break;
      default: os << c;
    }
  }
  os << '"';
}

}  // namespace

int64_t gguf_tensor_info::n_elements() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

gguf_file::~gguf_file() {
  if (map_ != nullptr) munmap(map_, size_);
}

std::unique_ptr<gguf_file> gguf_file::open(const std::string& path) {
  std::unique_ptr<gguf_file> f(new gguf_file());
  f->path_ = path;

  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  XCTX_CHECK(fd >= 0, path, ": cannot open GGUF file: ", std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, ": cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  f->size_ = (size_t)st.st_size;
  if (f->size_ == 0) {  // mmap cannot map zero bytes; the reader reports every other truncation
    ::close(fd);
    fail(path, ": file truncated: it is empty (0 bytes)");
  }
  void* map = mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  XCTX_CHECK(map != MAP_FAILED, path, ": mmap of ", f->size_, " bytes failed: ", std::strerror(map_err));
  f->map_ = map;
  const auto* base = static_cast<const uint8_t*>(map);

  reader r(path, base, f->size_);
  const uint32_t magic = r.read<uint32_t>("magic");
  XCTX_CHECK(magic == k_gguf_magic, path, ": not a GGUF file (bad magic bytes ", std::hex, "0x", magic,
             ", expected \"GGUF\")");
  f->version_ = r.read<uint32_t>("version");
  XCTX_CHECK(f->version_ != 1, path, ": GGUF version 1 is not supported (its 32-bit counts predate v2); ",
             "re-convert the model with a current llama.cpp");
  XCTX_CHECK(f->version_ == 2 || f->version_ == 3, path, ": unsupported GGUF version ", f->version_,
             " (supported: 2, 3; a huge number suggests a big-endian file)");

  const uint64_t n_tensors = r.read<uint64_t>("tensor count");
  const uint64_t n_kv = r.read<uint64_t>("metadata count");
  // Smallest kv: 8-byte key length + empty key + 4-byte type + 1-byte value.
  XCTX_CHECK(n_kv <= r.remaining() / 13, path, ": metadata count ", n_kv, " cannot fit in a ", f->size_,
             "-byte file (corrupt header)");
  // Smallest tensor info: name length 8 + empty name + n_dims 4 + one dim 8 + type 4 + offset 8.
  XCTX_CHECK(n_tensors <= r.remaining() / 32, path, ": tensor count ", n_tensors, " cannot fit in a ", f->size_,
             "-byte file (corrupt header)");

  for (uint64_t i = 0; i < n_kv; ++i) {
    const std::string key = r.read_string("key of metadata entry " + std::to_string(i));
    XCTX_CHECK(!f->kv_.count(key), path, ": duplicate metadata key '", key, "'");
    const gguf_value_type type = read_type(r, path, key, "value type");
    f->kv_.emplace(key, read_value(r, path, key, type, 0));
  }

  if (const gguf_value* a = f->find("general.alignment")) {
    XCTX_CHECK(a->type == gguf_value_type::gguf_u32, path, ": key 'general.alignment' must be u32, found ",
               value_type_name(a->type));
    const uint64_t al = std::get<uint64_t>(a->v);
    XCTX_CHECK(al != 0 && (al & (al - 1)) == 0, path, ": key 'general.alignment' is ", al,
               " (must be a non-zero power of two)");
    f->alignment_ = (size_t)al;
  }

  std::set<std::string> names;
  f->tensors_.reserve((size_t)n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    gguf_tensor_info t;
    t.name = r.read_string("name of tensor " + std::to_string(i));
    const std::string tw = "tensor '" + t.name + "'";
    XCTX_CHECK(names.insert(t.name).second, path, ": duplicate tensor name '", t.name, "'");
    const uint32_t n_dims = r.read<uint32_t>("n_dims of " + tw);
    XCTX_CHECK(n_dims >= 1 && n_dims <= k_max_dims, path, ": ", tw, ": n_dims ", n_dims, " (must be 1..",
               k_max_dims, ")");
    int64_t n_elements = 1;  // as n_elements() computes it, which must not overflow
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = r.read<uint64_t>("dims of " + tw);
      XCTX_CHECK(dim <= (uint64_t)std::numeric_limits<int64_t>::max(), path, ": ", tw, ": dimension ", d,
                 " is ", dim, " (negative as int64)");
      XCTX_CHECK(!__builtin_mul_overflow(n_elements, (int64_t)dim, &n_elements), path, ": ", tw,
                 ": element count overflows int64 at dimension ", d, " (", dim, ")");
      t.shape.push_back((int64_t)dim);
    }
    const uint32_t type_id = r.read<uint32_t>("type of " + tw);
    t.type = (ggml_type)type_id;
    const ggml_type_traits tr = ggml_traits(t.type);
    XCTX_CHECK(tr.name != nullptr, path, ": ", tw, ": unknown or unsupported ggml type id ", type_id);
    t.offset = r.read<uint64_t>("offset of " + tw);
    XCTX_CHECK(t.shape[0] % tr.block_elems == 0, path, ": ", tw, ": row length ne[0] = ", t.shape[0],
               " is not a multiple of the ", tr.name, " block size ", tr.block_elems);

    // Byte size, refusing anything that could overflow: a tensor cannot exceed the file.
    uint64_t rows = 1;
    for (size_t d = 1; d < t.shape.size(); ++d) {
      const uint64_t dim = (uint64_t)t.shape[d];
      XCTX_CHECK(dim == 0 || rows <= f->size_ / dim, path, ": ", tw, ": shape is larger than the file");
      rows *= dim;
    }
    // Bounded before multiplying: a wrapped row size would let a huge tensor claim a few bytes.
    const uint64_t row_blocks = (uint64_t)t.shape[0] / tr.block_elems;
    XCTX_CHECK(row_blocks <= f->size_ / tr.block_bytes, path, ": ", tw, ": row length ne[0] = ", t.shape[0],
               " is larger than the file");
    const uint64_t row_bytes = row_blocks * (uint64_t)tr.block_bytes;
    XCTX_CHECK(rows == 0 || row_bytes <= f->size_ / rows, path, ": ", tw, ": shape is larger than the file");
    t.bytes = (size_t)(row_bytes * rows);
    f->tensors_.push_back(std::move(t));
  }

  const uint64_t data_start = align_up(r.pos(), f->alignment_);
  XCTX_CHECK(data_start <= f->size_ || f->tensors_.empty(), path, ": file truncated: data section would start at ",
             data_start, " but the file has ", f->size_, " bytes");

  // Offsets must be aligned, inside the file, and tensors must not overlap.
  std::vector<const gguf_tensor_info*> by_offset;
  for (auto& t : f->tensors_) {
    const std::string tw = "tensor '" + t.name + "'";
    XCTX_CHECK(t.offset % f->alignment_ == 0, path, ": ", tw, ": data offset ", t.offset,
               " is not a multiple of the alignment ", f->alignment_);
    const uint64_t avail = f->size_ - std::min<uint64_t>(data_start, f->size_);
    XCTX_CHECK(t.offset <= avail && t.bytes <= avail - t.offset, path, ": ", tw, ": data [", t.offset, ", ",
               t.offset + t.bytes, ") of the data section runs past the end of the file (data section holds ",
               avail, " bytes; file truncated?)");
    t.data = base + data_start + t.offset;
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const gguf_tensor_info* a, const gguf_tensor_info* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const gguf_tensor_info& prev = *by_offset[i - 1];
    const gguf_tensor_info& cur = *by_offset[i];
    XCTX_CHECK(prev.offset + prev.bytes <= cur.offset || cur.bytes == 0 || prev.bytes == 0, path, ": tensor '",
               cur.name, "' (data at ", cur.offset, ") overlaps tensor '", prev.name, "' (data [", prev.offset,
               ", ", prev.offset + prev.bytes, "))");
  }
  return f;
}

const gguf_value* gguf_file::find(const std::string& key) const {
  const auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

int64_t gguf_file::get_int(const std::string& key) const {
  const gguf_value* v = find(key);
  XCTX_CHECK(v != nullptr, path_, ": missing metadata key '", key, "'");
  return as_int(*v, path_, key);
}
int64_t gguf_file::get_int(const std::string& key, int64_t fallback) const {
  const gguf_value* v = find(key);
  return v == nullptr ? fallback : as_int(*v, path_, key);
}

double gguf_file::get_float(const std::string& key) const {
  const gguf_value* v = find(key);
  XCTX_CHECK(v != nullptr, path_, ": missing metadata key '", key, "'");
  return as_float(*v, path_, key);
}
double gguf_file::get_float(const std::string& key, double fallback) const {
  const gguf_value* v = find(key);
  return v == nullptr ? fallback : as_float(*v, path_, key);
}

bool gguf_file::get_bool(const std::string& key, bool fallback) const {
  const gguf_value* v = find(key);
  if (v == nullptr) return fallback;
  XCTX_CHECK(v->type == gguf_value_type::gguf_bool, path_, ": key '", key, "': expected bool, found ",
             value_type_name(v->type));
  return std::get<bool>(v->v);
}

std::string gguf_file::get_string(const std::string& key) const {
  const gguf_value* v = find(key);
  XCTX_CHECK(v != nullptr, path_, ": missing metadata key '", key, "'");
  XCTX_CHECK(v->type == gguf_value_type::gguf_string, path_, ": key '", key, "': expected string, found ",
             value_type_name(v->type));
  return std::get<std::string>(v->v);
}
std::string gguf_file::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

std::vector<std::string> gguf_file::get_string_array(const std::string& key) const {
  const gguf_value* v = find(key);
  XCTX_CHECK(v != nullptr, path_, ": missing metadata key '", key, "'");
  const auto& elems = as_array(*v, path_, key);
  XCTX_CHECK(v->elem_type == gguf_value_type::gguf_string, path_, ": key '", key,
             "': expected an array of strings, found an array of ", value_type_name(v->elem_type));
  std::vector<std::string> out;
  out.reserve(elems.size());
  for (const auto& e : elems) out.push_back(std::get<std::string>(e.v));
  return out;
}

std::vector<float> gguf_file::get_float_array(const std::string& key) const {
  const gguf_value* v = find(key);
  XCTX_CHECK(v != nullptr, path_, ": missing metadata key '", key, "'");
  const auto& elems = as_array(*v, path_, key);
  std::vector<float> out;
  out.reserve(elems.size());
  for (const auto& e : elems) out.push_back((float)as_float(e, path_, key));
  return out;
}

std::vector<int32_t> gguf_file::get_int_array(const std::string& key) const {
  const gguf_value* v = find(key);
  XCTX_CHECK(v != nullptr, path_, ": missing metadata key '", key, "'");
  const auto& elems = as_array(*v, path_, key);
  std::vector<int32_t> out;
  out.reserve(elems.size());
  for (size_t i = 0; i < elems.size(); ++i) {
    const int64_t x = as_int(elems[i], path_, key);
    XCTX_CHECK(x >= std::numeric_limits<int32_t>::min() && x <= std::numeric_limits<int32_t>::max(), path_,
               ": key '", key, "': element ", i, " = ", x, " does not fit in int32");
    out.push_back((int32_t)x);
  }
  return out;
}

const gguf_tensor_info* gguf_file::find_tensor(const std::string& name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

const gguf_tensor_info& gguf_file::tensor(const std::string& name) const {
  const gguf_tensor_info* t = find_tensor(name);
  XCTX_CHECK(t != nullptr, path_, ": missing tensor '", name, "'");
  return *t;
}

std::string gguf_value_to_string(const gguf_value& v, size_t max_elems) {
  std::ostringstream os;
  switch (v.type) {
    case gguf_value_type::gguf_u8:
    case gguf_value_type::gguf_u16:
    case gguf_value_type::gguf_u32:
    case gguf_value_type::gguf_u64: os << std::get<uint64_t>(v.v); break;
    case gguf_value_type::gguf_i8:
    case gguf_value_type::gguf_i16:
    case gguf_value_type::gguf_i32:
    case gguf_value_type::gguf_i64: os << std::get<int64_t>(v.v); break;
    case gguf_value_type::gguf_f32:
    case gguf_value_type::gguf_f64: {
      os.precision(v.type == gguf_value_type::gguf_f32 ? 9 : 17);
      os << std::get<double>(v.v);
      break;
    }
    case gguf_value_type::gguf_bool: os << (std::get<bool>(v.v) ? "true" : "false"); break;
    case gguf_value_type::gguf_string: append_escaped(os, std::get<std::string>(v.v)); break;
    case gguf_value_type::gguf_array: {
      const auto& elems = std::get<std::vector<gguf_value>>(v.v);
      os << '[';
      for (size_t i = 0; i < elems.size() && i < max_elems; ++i)
        os << (i ? ", " : "") << gguf_value_to_string(elems[i], max_elems);
      if (elems.size() > max_elems) os << (max_elems ? ", " : "") << "... (" << elems.size() << " total)";
      os << ']';
      break;
    }
  }
  return os.str();
}

}  // namespace xctx
