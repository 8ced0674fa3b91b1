// What every job on rank 0 needs: the model, its tokenizer and a backend.
#pragma once

#include <memory>
#include <string>

#include "kernels/ops.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "worker/run_params.h"

namespace xctx {

struct model_session {
  model_weights weights;
  std::unique_ptr<tokenizer> tok;
  std::string chat_template;  // the file's tokenizer.chat_template, if any
  std::unique_ptr<backend> be;
  cache_spec cache;  // rp.cache with its options and, for nuq formats, the loaded calibration
  std::string calibration_note;  // nuq formats: which calibration and where it came from
};

// Resolves the default model: $XCTX_MODEL, then models/<default> under the current directory,
// then under the source tree the binary was built from.
std::string default_model_path();

// Loads weights from `model_path` (GGUF file or HF directory) and the tokenizer from
// `tokenizer_path` (a GGUF; empty: the model file itself). nuq formats take rp.calib_path, else
// the model's stored calibration, made now if there is none (coordinator/jobs/calibration_store.h);
// `report` (rank 0) prints which one and the progress of making it.
model_session open_session(const std::string& model_path, const std::string& tokenizer_path, const run_params& rp,
                           bool report);

}  // namespace xctx
