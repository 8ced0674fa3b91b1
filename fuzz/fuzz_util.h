// Shared helpers of the fuzz targets: the parsers under test read files, so each input is
// written to a scratch file first (tmpfs when there is one), unique per process so that
// parallel fuzzing jobs (-jobs=N) never share one.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace xctx_fuzz {

// A directory of this process's own, created on first use and removed at exit.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    std::string d = std::string(base) + "/xctx-fuzz-" + std::to_string((long)::getpid());
    std::filesystem::create_directories(d);
    static const std::string keep = d;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return d;
  }();
  return dir;
}

// Writes [data, data + size) to scratch_dir()/name and returns the path.
inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = scratch_dir() + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) std::abort();  // the harness itself failed: not a finding
  if (size != 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

inline std::string write_file(const std::string& name, const std::string& text) {
  return write_file(name, reinterpret_cast<const uint8_t*>(text.data()), text.size());
}

}  // namespace xctx_fuzz
