// `xctx calibrate`: runs the model over calibration windows, records every layer's pre-RoPE
// keys, values and queries, and derives the nuqX calibration (cache/calibration.h).
//
// Sensitivity weighting. KVQuant weights its k-means by the diagonal Fisher information, the
// squared gradient of the loss with respect to each cached element; that needs a backward
// pass the engine does not have. We weight by the first-order effect of an element's error
// on the layer's attention output instead (forward only). For a query row with probabilities
// p_t and output o = sum_t p_t v_t:
//   dv_t[c] moves o[c] by p_t dv_t[c]                       -> w_V(t, c) = sum p_t^2
//   dk_t[c] moves score s_t by q[c] dk_t[c] / sqrt(d), and o by p_t (v_t - o) ds_t
//                                                         -> w_K(t, c) = sum p_t^2 |v_t - o|^2 q[c]^2 / d
// summed over a seeded sample of query positions and the heads reading the kv head. It is the
// Fisher diagonal under the assumption that dL/do is isotropic. For rotated channels q[c]^2 is
// the pair's mean energy (q_2i^2 + q_2i+1^2) / 2, which RoPE does not change. `weighting none`
// gives plain k-means (KVQuant Table 9's "unweighted" row).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "cache/calibration.h"
#include "worker/llama_engine.h"

namespace xctx {

struct calibrate_options {
  int n_samples = 16;   // windows (KVQuant / XQuant: 16 of 2K)
  int seq_len = 2048;
  uint64_t seed = 1;    // window offsets and sampled query positions
  bool weighted = true;  // attention-output sensitivity; false: unweighted k-means
  int queries_per_sample = 64;
  std::string text_source;  // recorded in the file
};

using calibrate_progress = std::function<void(const std::string& stage, int64_t done, int64_t total)>;

// tokens: the calibration text, at least seq_len tokens. The engine's rope and model define
// the file's fingerprint via `fingerprint`.
calibration calibrate_model(llama_engine& engine, backend& be, const std::vector<int32_t>& tokens,
                            uint64_t fingerprint, const calibrate_options& opt, const calibrate_progress& progress = {});

// The window start offsets calibrate_model uses (deterministic in seed; non-overlapping when
// the text is long enough).
std::vector<int64_t> calibration_windows(int64_t n_tokens, int n_samples, int seq_len, uint64_t seed);

}  // namespace xctx
