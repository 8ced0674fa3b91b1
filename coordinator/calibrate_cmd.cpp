// `xctx calibrate`: the nuqX calibration file for a model (see worker/calibrate.h).
#include <cstdio>

#include "cache/calibration.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/corpus.h"
#include "coordinator/distributed.h"
#include "coordinator/jobs.h"
#include "coordinator/session.h"
#include "worker/calibrate.h"

namespace xctx {

int run_calibrate(const calibrate_cmd_options& opt) {
  XCTX_CHECK(!opt.out.empty(), "calibrate: --out FILE is required");
  XCTX_CHECK(opt.weighting == "attention" || opt.weighting == "none", "calibrate: --weighting must be attention or none, got '",
             opt.weighting, "'");
  run_params rp = opt.run;
  rp.cache = cache_format::cache_fp32;  // calibration reads the exact activations
  rp.n_ctx = opt.calib.seq_len;
  model_session s = open_session(opt.model.empty() ? default_model_path() : opt.model, "", rp);
  llama_engine engine(s.weights, *s.be, rp);
  const std::string text = load_text(opt.text);
  const std::vector<int32_t> ids = s.tok->encode(text, false, false);
  calibrate_options co = opt.calib;
  co.weighted = opt.weighting == "attention";
  co.text_source = opt.text;
  const size_t C = (size_t)s.weights.hp.kv_dim();
  std::fprintf(stderr, "[xctx] calibrating %s on %s: %zu tokens, %d windows of %d, seed %llu, %s weighting (~%s of keys held)\n",
               s.weights.hp.name.c_str(), opt.text.c_str(), ids.size(), co.n_samples, co.seq_len,
               (unsigned long long)co.seed, opt.weighting.c_str(),
               format_bytes(2.0 * 4 * C * s.weights.hp.n_layer * (double)co.n_samples * co.seq_len).c_str());
  progress_line fwd("calibrate: forward", true, "windows"), fit("calibrate: k-means", true, "layers");
  const calibration c = calibrate_model(engine, *s.be, ids, model_fingerprint(s.weights), co,
                                        [&](const std::string& stage, int64_t done, int64_t total) {
                                          if (stage == "forward") {
                                            fwd(done, total);
                                          } else {
                                            fwd.finish();
                                            fit(done, total);
                                          }
                                        });
  fit.finish();
  save_calibration(c, opt.out);
  std::fprintf(stderr, "[xctx] wrote %s (%d layers, 2/3/4-bit key and value datatypes, outliers 0%% and 1%%)\n",
               opt.out.c_str(), c.n_layer);
  return 0;
}

}  // namespace xctx
