#include <cstring>
#include <filesystem>
#include <fstream>

#include "common/error.h"
#include "model/gguf.h"
#include "model/weights.h"

namespace xctx {

namespace {

// GGUF files start with the magic "GGUF"; sniffing it accepts files renamed without the suffix.
bool has_gguf_magic(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

}  // namespace

model_weights load_model(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  XCTX_CHECK(fs::exists(st), path, ": model path does not exist");
  if (fs::is_directory(st)) return load_hf_weights(path);
  XCTX_CHECK(fs::is_regular_file(st), path, ": model path is neither a file nor a directory");

  const std::string ext = fs::path(path).extension().string();
  if (ext == ".gguf" || has_gguf_magic(path)) {
    return load_gguf_weights(std::shared_ptr<gguf_file>(gguf_file::open(path)));
  }
  XCTX_CHECK(ext != ".safetensors" && fs::path(path).filename() != "config.json", path,
             ": pass the checkpoint directory (with config.json and the safetensors files), not one file in it");
  fail(path, ": not a model: expected a .gguf file or a Hugging Face checkpoint directory");
}

}  // namespace xctx
