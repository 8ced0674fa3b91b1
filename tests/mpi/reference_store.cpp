#include "reference_store.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "common/hash.h"
#include "mpi_test.h"

namespace xctx::mpi_test {
namespace {

constexpr char kMagic[8] = {'X', 'C', 'T', 'X', 'R', 'E', 'F', '1'};

std::string hex16(uint64_t v) {
  char s[17];
  std::snprintf(s, sizeof s, "%016llx", (unsigned long long)v);
  return s;
}

// The store's folder, or "" when there is none.
const std::string& store_dir() {
  static const std::string dir = [] {
    const char* d = std::getenv("XCTX_MPI_REFERENCE_DIR");
    return std::string(d != nullptr ? d : "");
  }();
  return dir;
}

// This test binary's build: its size and modification time (a rebuild relinks it).
const std::string& build_stamp() {
  static const std::string stamp = [] {
    struct stat st {};
    XCTX_CHECK(::stat("/proc/self/exe", &st) == 0, "reference store: cannot stat /proc/self/exe");
    const uint64_t fields[] = {(uint64_t)st.st_size, (uint64_t)st.st_mtim.tv_sec, (uint64_t)st.st_mtim.tv_nsec};
    return hex16(hash64::of(fields, sizeof fields));
  }();
  return stamp;
}

std::string path_for(const std::string& key, const char* ext) {
  return (std::filesystem::path(store_dir()) / (build_stamp() + "-" + hex16(hash64::of(key.data(), key.size())) + ext))
      .string();
}

// Files of other builds go when the reference-only run of a new build first opens the store.
void prepare_store() {
  static bool done = false;
  if (done || store_dir().empty()) return;
  done = true;
  std::filesystem::create_directories(store_dir());
  if (!references_only()) return;
  for (const auto& e : std::filesystem::directory_iterator(store_dir()))
    if (e.path().filename().string().rfind(build_stamp(), 0) != 0) std::filesystem::remove_all(e.path());
}

// Written under a temporary name, then renamed: a reader sees the whole file or none.
void publish(const std::string& path, const std::function<void(const std::string&)>& write) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  write(tmp);
  std::filesystem::rename(tmp, path);
}

template <typename T>
void put_vector(std::ofstream& out, const std::vector<T>& v) {
  const uint64_t n = v.size();
  out.write(reinterpret_cast<const char*>(&n), sizeof n);
  out.write(reinterpret_cast<const char*>(v.data()), (std::streamsize)(n * sizeof(T)));
}

template <typename T>
bool get_vector(std::ifstream& in, std::vector<T>& v) {
  uint64_t n = 0;
  if (!in.read(reinterpret_cast<char*>(&n), sizeof n) || n > (uint64_t(1) << 32)) return false;
  v.resize(n);
  return (bool)in.read(reinterpret_cast<char*>(v.data()), (std::streamsize)(n * sizeof(T)));
}

bool load(const std::string& path, const std::string& key, reference_run& r) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  char magic[sizeof kMagic];
  std::vector<char> stored_key;
  if (!in.read(magic, sizeof magic) || std::memcmp(magic, kMagic, sizeof kMagic) != 0) return false;
  if (!get_vector(in, stored_key) || std::string(stored_key.begin(), stored_key.end()) != key) return false;
  return get_vector(in, r.logits) && get_vector(in, r.tokens);
}

void save(const std::string& path, const std::string& key, const reference_run& r) {
  publish(path, [&](const std::string& tmp) {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(kMagic, sizeof kMagic);
    put_vector(out, std::vector<char>(key.begin(), key.end()));
    put_vector(out, r.logits);
    put_vector(out, r.tokens);
    XCTX_CHECK((bool)out, "reference store: cannot write ", tmp);
  });
}

}  // namespace

bool references_only() {
  static const bool only = [] {
    const char* v = std::getenv("XCTX_MPI_REFERENCES_ONLY");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return only;
}

reference_run stored_reference(const std::string& key, const std::function<reference_run()>& make) {
  communicator& comm = world();
  reference_run r;
  uint64_t sizes[2] = {0, 0};
  if (comm.rank() == 0) {
    prepare_store();
    const std::string path = store_dir().empty() ? "" : path_for(key, ".ref");
    if (path.empty() || !load(path, key, r)) {
      r = make();
      if (!path.empty()) save(path, key, r);
    }
    sizes[0] = r.logits.size(), sizes[1] = r.tokens.size();
  }
  comm.broadcast(sizes, sizeof sizes, 0);
  r.logits.resize(sizes[0]);
  r.tokens.resize(sizes[1]);
  comm.broadcast(r.logits.data(), r.logits.size() * sizeof(float), 0);
  comm.broadcast(r.tokens.data(), r.tokens.size() * sizeof(int32_t), 0);
  return r;
}

std::string stored_file(const std::string& key, const std::function<void(const std::string&)>& make) {
  communicator& comm = world();
  std::string path;
  if (store_dir().empty()) {  // one file per mpirun (its ranks share the parent)
    path = (std::filesystem::temp_directory_path() /
            ("xctx-tests-mpi-" + hex16(hash64::of(key.data(), key.size())) + "-" + std::to_string(::getppid())))
               .string();
    if (comm.rank() == 0) publish(path, make);
  } else {
    path = path_for(key, ".file");
    if (comm.rank() == 0) {
      prepare_store();
      if (!std::filesystem::exists(path)) publish(path, make);
    }
  }
  comm.barrier();
  return path;
}

bool has_store() { return !store_dir().empty(); }

std::string fingerprint(const std::vector<int32_t>& ids) {
  return std::to_string(ids.size()) + "/" + hex16(hash64::of(ids.data(), ids.size() * sizeof(int32_t)));
}

}  // namespace xctx::mpi_test
