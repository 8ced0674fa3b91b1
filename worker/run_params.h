// Runtime parameters (the read-only counterpart is model_hparams).
#pragma once

#include <cstdint>
#include <string>

#include "cache/format.h"
#include "kernels/ops.h"

namespace xctx {

struct run_params {
  backend_kind backend = backend_kind::backend_cpu;
  backend_settings settings;  // what the backend is made with (--decode-act, --prefill-act)
  cache_format cache = cache_format::cache_fp16;
  cache_options cache_opts;  // group size, Q-Norm, sink (the calibration is loaded from calib_path)
  std::string calib_path;    // nuq formats: file made by `xctx calibrate`
  int n_threads = 0;        // 0: default_threads()
  int64_t n_ctx = 0;        // cache capacity in tokens; 0: the model's trained context
  int n_batch = 512;        // prefill chunk: tokens per forward call (bounds scratch memory)
  // RoPE scaling for running past the trained context; none keeps what the file says.
  rope_scaling rope_scale = rope_scaling::rope_scaling_none;
  float rope_factor = 1.0f;
  // SelfExtend grouped positions at attention time (rope_config::se_group in kernels/ops.h):
  // group 1 = off; keys within se_window positions of the query keep their exact positions.
  int se_group = 1;
  int se_window = 0;
  int se_period = 0;  // retrieval's ordered far positions (rope_config::se_period), set with se_group
};

}  // namespace xctx
