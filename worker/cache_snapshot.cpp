#include "worker/cache_snapshot.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>

#include "cache/calibration.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "common/hash.h"
#include "model/weights.h"

namespace xctx {
namespace {

constexpr char kMagic[8] = {'X', 'C', 'T', 'X', 'S', 'N', 'A', 'P'};
constexpr size_t kPreamble = 8 + 4 + 4 + 8;            // magic, version, reserved, header bytes
constexpr uint64_t kLayerSeed = 0x6c61796572;           // "layer": seeds each layer's own checksum
constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 26;  // JSON of a few numbers per rank and layer

uint64_t pad8(uint64_t b) { return (b + 7) / 8 * 8; }

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", (unsigned long long)v);
  return buf;
}

template <typename T>
void hash_vec(hash64& h, const std::vector<T>& v) {
  const uint64_t n = v.size();
  h.update(&n, sizeof n);
  if (n) h.update(v.data(), n * sizeof(T));
}

nlohmann::json identity_json(const snapshot_identity& id) {
  nlohmann::json j;
  j["model_name"] = id.model_name;
  j["model_fingerprint"] = hex(id.model_fingerprint);
  j["format"] = id.format;
  j["spec_digest"] = hex(id.spec_digest);
  j["geometry"] = {id.n_layer, id.n_head, id.n_head_kv, id.head_dim, id.n_embd};
  j["post_rope_keys"] = id.post_rope_keys;
  j["rope"] = {{"n_rot", id.n_rot}, {"freq_base", id.freq_base}, {"scaling", id.rope_scaling},
               {"factor", id.rope_scaling_factor}};
  return j;
}

// Names the first difference between what a file was saved with and what this run has.
void check_identity(const nlohmann::json& saved, const snapshot_identity& id, const std::string& path) {
  const nlohmann::json want = identity_json(id);
  const auto differs = [&](const char* key) { return !saved.contains(key) || saved[key] != want[key]; };
  const auto shown = [&](const char* key) { return saved.contains(key) ? saved[key].dump() : std::string("nothing"); };
  XCTX_CHECK(!differs("format"), path, ": saved with cache format ", shown("format"), "; this run uses ",
             want["format"].dump(), " (--cache)");
  XCTX_CHECK(!differs("model_fingerprint") && !differs("geometry"), path, ": saved with model ", shown("model_name"),
             " (fingerprint ", shown("model_fingerprint"), "); this run loaded ", want["model_name"].dump(),
             " (fingerprint ", want["model_fingerprint"].dump(), ")");
  XCTX_CHECK(!differs("spec_digest"), path, ": saved with other ", id.format,
             " options (group size, sink, Q-Norm, calibration file or X factors differ: digest ", shown("spec_digest"),
             ", this run ", want["spec_digest"].dump(), ")");
  XCTX_CHECK(!id.post_rope_keys || !differs("rope"), path, ": ", id.format,
             " stores keys after RoPE, and they were rotated with ", shown("rope"), "; this run rotates with ",
             want["rope"].dump(), " (--rope-scaling / --rope-factor must match the saving run)");
}

// A file written through a temporary name; every byte also goes into the checksum.
class snapshot_writer {
 public:
  explicit snapshot_writer(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    f_ = std::fopen(tmp_.c_str(), "wb");
    XCTX_CHECK(f_ != nullptr, "cannot write the cache snapshot ", tmp_, ": ", std::strerror(errno));
  }
  ~snapshot_writer() {
    if (f_ != nullptr) {
      std::fclose(f_);
      std::remove(tmp_.c_str());
    }
  }
  void put(const void* p, size_t n) {
    if (n == 0) return;
    XCTX_CHECK(std::fwrite(p, 1, n, f_) == n, "writing the cache snapshot ", tmp_, " failed: ", std::strerror(errno));
    hash_.update(p, n);
    bytes_ += n;
  }
  void pad() {
    static const uint8_t zeros[8] = {};
    put(zeros, pad8(bytes_) - bytes_);
  }
  uint64_t commit() {  // checksum, flush to disk, rename into place
    const uint64_t sum = hash_.digest();
    XCTX_CHECK(std::fwrite(&sum, 1, 8, f_) == 8 && std::fflush(f_) == 0 && ::fsync(fileno(f_)) == 0,
               "writing the cache snapshot ", tmp_, " failed: ", std::strerror(errno));
    const int rc = std::fclose(f_);
    f_ = nullptr;
    XCTX_CHECK(rc == 0 && std::rename(tmp_.c_str(), path_.c_str()) == 0, "cannot put the cache snapshot in place at ",
               path_, ": ", std::strerror(errno));
    return bytes_ + 8;
  }

 private:
  std::string path_, tmp_;
  std::FILE* f_ = nullptr;
  hash64 hash_;
  uint64_t bytes_ = 0;
};

// Reads a file front to back, hashing what it reads.
class snapshot_reader {
 public:
  explicit snapshot_reader(const std::string& path) : path_(path), in_(path, std::ios::binary) {
    XCTX_CHECK(in_.good(), path, ": cannot open the cache snapshot");
    std::error_code ec;
    size_ = std::filesystem::file_size(path, ec);
    XCTX_CHECK(!ec, path, ": cannot read its size: ", ec.message());
  }
  void get(void* p, uint64_t n) {
    XCTX_CHECK(n <= size_ - at_ && in_.read(static_cast<char*>(p), (std::streamsize)n), path_, ": ends after ",
               size_, " bytes while reading ", n, " more at offset ", at_, " (truncated?)");
    hash_.update(p, n);
    at_ += n;
  }
  void skip_pad() {
    uint8_t pad[8];
    get(pad, pad8(at_) - at_);
  }
  uint64_t size() const { return size_; }
  uint64_t offset() const { return at_; }
  uint64_t digest() const { return hash_.digest(); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ifstream in_;
  uint64_t size_ = 0, at_ = 0;
  hash64 hash_;
};

// v as an integer of type T, or a clear error naming the file and key: nlohmann's get<T>()
// converts floats (3e19 into an int is undefined behaviour) and out-of-range integers unchecked.
// (Found by the cache_snapshot fuzzer: "ranks": 29223372036854775807, which parses as a float.)
template <typename T>
T checked_int(const nlohmann::json& v, const char* key, const std::string& path) {
  using L = std::numeric_limits<T>;
  if (v.is_number_unsigned()) {
    const uint64_t x = v.get<uint64_t>();
    if (x <= (uint64_t)L::max()) return (T)x;
  } else if (v.is_number_integer() && L::is_signed) {  // nlohmann keeps non-negative integers unsigned
    const int64_t x = v.get<int64_t>();
    if (x >= (int64_t)L::min() && x <= (int64_t)L::max()) return (T)x;
  }
  fail(path, ": damaged: \"", key, "\" holds ", v.dump(), ", not an integer in [", +L::min(), ", ", +L::max(), "]");
}

template <typename T>
T json_int(const nlohmann::json& j, const char* key, const std::string& path) {
  return checked_int<T>(j.at(key), key, path);
}

// The array of integers at j[key], each checked as by json_int.
template <typename T>
std::vector<T> json_ints(const nlohmann::json& j, const char* key, const std::string& path) {
  const nlohmann::json& v = j.at(key);
  XCTX_CHECK(v.is_array(), path, ": damaged: \"", key, "\" holds ", v.dump(), ", not an array of integers");
  std::vector<T> out;
  out.reserve(v.size());
  for (const nlohmann::json& e : v) out.push_back(checked_int<T>(e, key, path));
  return out;
}

struct parsed_header {
  nlohmann::json j;
  std::vector<uint64_t> layer_bytes;
  uint64_t n_tokens_stored = 0;
};

// The preamble and header JSON of an open file, its total size checked against what they describe.
parsed_header read_header(snapshot_reader& r) {
  char magic[8];
  uint32_t version = 0, reserved = 0;
  uint64_t header_bytes = 0;
  XCTX_CHECK(r.size() >= kPreamble, r.path(), ": ", r.size(), " bytes is too short for a cache snapshot");
  r.get(magic, 8);
  XCTX_CHECK(std::memcmp(magic, kMagic, 8) == 0, r.path(), ": not an xctx cache snapshot (bad magic)");
  r.get(&version, 4), r.get(&reserved, 4), r.get(&header_bytes, 8);
  XCTX_CHECK(version == kSnapshotVersion, r.path(), ": snapshot version ", version, "; this xctx reads version ",
             kSnapshotVersion);
  XCTX_CHECK(header_bytes > 0 && header_bytes <= kMaxHeaderBytes && header_bytes <= r.size() - kPreamble, r.path(),
             ": header of ", header_bytes, " bytes does not fit the file");
  std::string text(header_bytes, '\0');
  r.get(text.data(), header_bytes);
  r.skip_pad();
  parsed_header h;
  try {
    h.j = nlohmann::json::parse(text);
    h.layer_bytes = json_ints<uint64_t>(h.j, "layer_bytes", r.path());
    h.n_tokens_stored = json_int<uint64_t>(h.j, "n_tokens_stored", r.path());
    (void)h.j.at("identity").at("format").get<std::string>();
    (void)json_ints<int64_t>(h.j.at("state"), "held_per_rank", r.path());
  } catch (const nlohmann::json::exception& e) {
    fail(r.path(), ": damaged header: ", e.what());
  }
  uint64_t expect = r.offset() + pad8(h.n_tokens_stored * 4);
  for (uint64_t b : h.layer_bytes) {
    XCTX_CHECK(b <= r.size(), r.path(), ": a layer of ", b, " bytes does not fit the file");
    expect += pad8(b) + 8;  // the layer, its padding and its own checksum
  }
  expect += 8;
  XCTX_CHECK(h.n_tokens_stored <= r.size() / 4 && expect == r.size(), r.path(), ": holds ", r.size(),
             " bytes where its header describes ", expect, " (truncated or damaged)");
  return h;
}

}  // namespace

snapshot_manifest read_snapshot_manifest(const std::string& dir) {
  XCTX_CHECK(std::filesystem::is_directory(dir), dir, ": no such directory (a cache snapshot is a directory)");
  const std::string path = dir + "/manifest.json";
  std::ifstream in(path);
  XCTX_CHECK(in.good(), path, ": missing: not a cache snapshot, or its save did not finish");
  snapshot_manifest m;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    m.ranks = json_int<int>(j, "ranks", path), m.tokens = json_int<int64_t>(j, "tokens", path);
    m.format = j.at("format").get<std::string>(), m.model = j.at("model").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": damaged: ", e.what());
  }
  XCTX_CHECK(m.ranks >= 1 && m.tokens >= 1, path, ": damaged: ", m.ranks, " ranks, ", m.tokens, " tokens");
  return m;
}

uint64_t cache_spec_digest(const cache_spec& spec) {
  const cache_options& o = spec.options;
  hash64 h(0x736e6170);  // "snap"
  const int fields[] = {(int)spec.format,          o.group_size,          o.qnorm,
                        o.sink ? 1 : 0,            o.x_fp16_first_channel ? 1 : 0, o.cl_hi_layers,
                        o.clkv_key_2bit_layers,    o.clkv_value_2bit_layers,       o.clkv_value_share_from,
                        o.clkv_key_share_from,     o.clkv_group};
  h.update(fields, sizeof fields);
  h.update(&o.clkv_eta1, sizeof o.clkv_eta1), h.update(&o.clkv_eta2, sizeof o.clkv_eta2);
  if (o.calib) {
    const calibration& c = *o.calib;
    h.update(&c.model_fingerprint, sizeof c.model_fingerprint);
    for (const auto& setting : c.layers)
      for (const calib_layer_setting& l : setting) {
        hash_vec(h, l.k_lo), hash_vec(h, l.k_hi);
        for (int b = 0; b < 3; ++b) hash_vec(h, l.k[b].centroids), hash_vec(h, l.v[b].centroids);
      }
  }
  if (o.factors) {  // the projections that turn X into the codes' latents decide the codes
    for (const x_layer_factors& f : o.factors->layers) hash_vec(h, f.u_k), hash_vec(h, f.u_v), hash_vec(h, f.u_kv);
  }
  return h.digest();
}

snapshot_identity make_snapshot_identity(const model_weights& w, const cache_spec& spec, const cache_geometry& g) {
  snapshot_identity id;
  id.model_name = w.hp.name;
  id.model_fingerprint = model_fingerprint(w);
  id.format = format_traits(spec.format).name;
  id.spec_digest = cache_spec_digest(spec);
  id.n_layer = g.n_layer, id.n_head = g.n_head, id.n_head_kv = g.n_head_kv, id.head_dim = g.head_dim;
  id.n_embd = g.n_embd;
  id.post_rope_keys = format_traits(spec.format).family == cache_family::family_fp;
  id.n_rot = g.rope.n_rot, id.freq_base = g.rope.freq_base, id.rope_scaling = (int)g.rope.scaling;
  id.rope_scaling_factor = g.rope.scaling_factor;
  return id;
}

std::string snapshot_file(const std::string& dir, int rank, int n_rank) {
  return dir + "/rank-" + std::to_string(rank) + "-of-" + std::to_string(n_rank) + ".xsnap";
}

void write_cache_snapshot(const std::string& dir, const snapshot_identity& id, const snapshot_state& st,
                          const kv_cache& cache) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  XCTX_CHECK(!ec, "cannot create the cache snapshot directory ", dir, ": ", ec.message());
  const int n_layer = cache.geometry().n_layer;
  nlohmann::json j;
  j["identity"] = identity_json(id);
  j["state"] = {{"rank", st.rank},
                {"ranks", st.n_rank},
                {"tail_rank", st.tail_rank},
                {"next_position", st.next_position},
                {"held_per_rank", st.held_per_rank},
                {"prefill", st.prefill}};
  std::vector<uint64_t> layer_bytes(n_layer);
  size_t largest = 0;
  for (int l = 0; l < n_layer; ++l) {
    layer_bytes[l] = cache.snapshot_bytes(l);
    largest = std::max<size_t>(largest, layer_bytes[l]);
  }
  j["layer_bytes"] = layer_bytes;
  j["n_tokens_stored"] = st.tokens.size();
  const std::string header = j.dump();

  snapshot_writer w(snapshot_file(dir, st.rank, st.n_rank));
  const uint32_t version = kSnapshotVersion, reserved = 0;
  const uint64_t header_bytes = header.size();
  w.put(kMagic, 8), w.put(&version, 4), w.put(&reserved, 4), w.put(&header_bytes, 8);
  w.put(header.data(), header.size());
  w.pad();
  w.put(st.tokens.data(), st.tokens.size() * sizeof(int32_t));
  w.pad();
  std::vector<uint8_t> buf(largest);  // one layer at a time: temporaries bounded by a layer
  for (int l = 0; l < n_layer; ++l) {
    cache.snapshot_layer(l, buf.data());
    w.put(buf.data(), layer_bytes[l]);
    w.pad();
    // Each layer carries its own checksum, so a reader verifies a layer before the cache
    // parses it (the file's checksum comes only at the end).
    hash64 lh(kLayerSeed);
    lh.update(buf.data(), layer_bytes[l]);
    const uint64_t sum = lh.digest();
    w.put(&sum, 8);
  }
  w.commit();
}

void write_snapshot_manifest(const std::string& dir, const snapshot_identity& id, const snapshot_state& st,
                             double seconds, uint64_t bytes_all_ranks) {
  nlohmann::json m;
  m["version"] = kSnapshotVersion;
  m["model"] = id.model_name;
  m["model_fingerprint"] = hex(id.model_fingerprint);
  m["format"] = id.format;
  m["ranks"] = st.n_rank;
  m["tokens"] = st.next_position;
  m["held_per_rank"] = st.held_per_rank;
  m["prefill"] = st.prefill;
  m["bytes"] = bytes_all_ranks;
  m["save_seconds"] = seconds;
  std::vector<std::string> files;
  for (int r = 0; r < st.n_rank; ++r) files.push_back(std::filesystem::path(snapshot_file(dir, r, st.n_rank)).filename());
  m["files"] = files;
  const std::time_t now = std::time(nullptr);
  char when[32];
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  m["saved_at"] = when;
  const std::string path = dir + "/manifest.json", tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << m.dump(1) << "\n";
    XCTX_CHECK(out.good(), "cannot write ", tmp);
  }
  XCTX_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot put ", path, " in place: ", std::strerror(errno));
}

snapshot_state read_snapshot_state(const std::string& dir, int rank, int n_rank, const snapshot_identity& expect) {
  const snapshot_manifest m = read_snapshot_manifest(dir);
  XCTX_CHECK(m.ranks == n_rank, dir, " was saved over ", m.ranks, " rank(s); this run has ", n_rank,
             " (run it with mpirun -np ", m.ranks, ")");
  const std::string path = snapshot_file(dir, rank, n_rank);
  XCTX_CHECK(std::filesystem::exists(path), path, ": missing (the manifest lists ", m.ranks, " rank files)");
  snapshot_reader r(path);
  const parsed_header h = read_header(r);
  check_identity(h.j["identity"], expect, path);
  snapshot_state st;
  try {
    const nlohmann::json& s = h.j.at("state");
    st.rank = json_int<int>(s, "rank", path), st.n_rank = json_int<int>(s, "ranks", path);
    st.tail_rank = json_int<int>(s, "tail_rank", path);
    st.next_position = json_int<int64_t>(s, "next_position", path);
    st.held_per_rank = json_ints<int64_t>(s, "held_per_rank", path);
    st.prefill = s.at("prefill").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": damaged header: ", e.what());
  }
  XCTX_CHECK(st.rank == rank && st.n_rank == n_rank && (int)st.held_per_rank.size() == n_rank && st.tail_rank >= 0 &&
                 st.tail_rank < n_rank && (int)h.layer_bytes.size() == expect.n_layer,
             path, ": its header describes rank ", st.rank, " of ", st.n_rank, " with ", h.layer_bytes.size(),
             " layers, not rank ", rank, " of ", n_rank, " with ", expect.n_layer);
  int64_t held = 0;
  for (int64_t t : st.held_per_rank) {
    XCTX_CHECK(t >= 0, path, ": negative token count in its header");
    held += t;
  }
  XCTX_CHECK(st.next_position == held && st.next_position < INT32_MAX, path, ": its ranks hold ", held,
             " tokens but the sequence has ", st.next_position);
  XCTX_CHECK(h.n_tokens_stored == (rank == 0 ? (uint64_t)st.next_position : 0), path, ": stores ", h.n_tokens_stored,
             " token ids for a sequence of ", st.next_position);
  st.tokens.resize(h.n_tokens_stored);
  r.get(st.tokens.data(), h.n_tokens_stored * 4);
  return st;
}

uint64_t restore_cache_snapshot(const std::string& dir, int rank, int n_rank, kv_cache& cache) {
  const std::string path = snapshot_file(dir, rank, n_rank);
  try {
    snapshot_reader r(path);
    const parsed_header h = read_header(r);
    XCTX_CHECK((int)h.layer_bytes.size() == cache.geometry().n_layer, path, ": ", h.layer_bytes.size(),
               " layers; the cache has ", cache.geometry().n_layer);
    std::vector<uint8_t> buf;
    buf.resize(h.n_tokens_stored * 4);
    r.get(buf.data(), buf.size());  // the token ids (read_snapshot_state took them): hashed here
    r.skip_pad();
    for (size_t l = 0; l < h.layer_bytes.size(); ++l) {
      buf.resize(h.layer_bytes[l]);
      r.get(buf.data(), buf.size());
      r.skip_pad();
      hash64 lh(kLayerSeed);
      lh.update(buf.data(), buf.size());
      uint64_t stored = 0;
      r.get(&stored, 8);
      XCTX_CHECK(stored == lh.digest(), path, ": checksum mismatch in layer ", l, " (stored ", hex(stored), ", computed ",
                 hex(lh.digest()), "): the file is damaged");
      cache.restore_layer((int)l, buf.data(), buf.size());
    }
    const uint64_t computed = r.digest();
    uint64_t stored = 0;
    r.get(&stored, 8);
    XCTX_CHECK(stored == computed, path, ": checksum mismatch (stored ", hex(stored), ", computed ", hex(computed),
               "): the file is damaged");
    return r.size();
  } catch (...) {
    cache.clear();
    throw;
  }
}

}  // namespace xctx
