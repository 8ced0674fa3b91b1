// safetensors reader (model/safetensors.cpp): header length, JSON header, dtypes, shapes,
// offsets against the data section. The file is then also loaded as the model.safetensors of a
// tiny fixed Llama checkpoint (model/hf_loader.cpp), so tensor presence, dtype and shape checks
// and the bf16/f16/f32 conversions run on whatever the header lets through.
#include <cstdint>
#include <cstdlib>

#include "common/error.h"
#include "fuzz_util.h"
#include "model/safetensors.h"
#include "model/weights.h"

using namespace xctx;

namespace {

// n_embd 8, 2 heads of 4, 1 layer, vocab 4: small enough that a fuzzed header can describe it.
constexpr const char* kConfig = R"({"model_type": "llama", "hidden_size": 8, "intermediate_size": 8,
  "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4,
  "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": true})";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool config_written = (xctx_fuzz::write_file("config.json", kConfig), true);
  (void)config_written;
  const std::string path = xctx_fuzz::write_file("model.safetensors", data, size);
  try {
    const auto f = safetensors_file::open(path);
    for (const auto& [name, t] : f->tensors()) {
      // The reader promises every tensor lies inside the mapped data section.
      if (f->data_offset() + t.end > f->file_bytes() || t.begin > t.end) std::abort();
      (void)t.n_elements();
      if (t.bytes() != 0) {
        volatile uint8_t first = static_cast<const uint8_t*>(t.data)[0];
        volatile uint8_t last = static_cast<const uint8_t*>(t.data)[t.bytes() - 1];
        (void)first, (void)last;
      }
    }
  } catch (const Error&) {
    return 0;
  }
  try {
    (void)load_hf_weights(xctx_fuzz::scratch_dir());
  } catch (const Error&) {
  }
  return 0;
}
