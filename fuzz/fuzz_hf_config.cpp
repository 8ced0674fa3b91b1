// Hugging Face config.json loader (model/hf_loader.cpp, read_hf_config): architecture, sizes,
// RoPE settings (top-level, rope_scaling or transformers 5's rope_parameters), refused variants,
// and the hyper-parameter validation behind them.
#include <cstdint>

#include "common/error.h"
#include "fuzz_util.h"
#include "model/weights.h"

using namespace xctx;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  xctx_fuzz::write_file("config.json", data, size);
  try {
    const model_hparams hp = read_hf_config(xctx_fuzz::scratch_dir());
    (void)hp.n_gqa();
    (void)hp.kv_dim();
  } catch (const Error&) {
  }
  return 0;
}
