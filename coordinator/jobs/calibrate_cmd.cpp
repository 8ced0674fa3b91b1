// `xctx calibrate`: the nuqX calibration file for a model (see worker/calibrate.h).
#include <cstdio>

#include "cache/calibration.h"
#include "common/error.h"
#include "coordinator/jobs/calibration_store.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/jobs/session.h"

namespace xctx {

int run_calibrate(const calibrate_cmd_options& opt) {
  XCTX_CHECK(!opt.out.empty(), "calibrate: --out FILE is required");
  XCTX_CHECK(opt.weighting == "attention" || opt.weighting == "none", "calibrate: --weighting must be attention or none, got '",
             opt.weighting, "'");
  run_params rp = opt.run;
  rp.cache = cache_format::cache_fp32;  // so opening the session neither needs nor makes a calibration
  model_session s = open_session(opt.model.empty() ? default_model_path() : opt.model, "", rp, true);
  calibrate_options co = opt.calib;
  co.weighted = opt.weighting == "attention";
  co.text_source = opt.text;
  const calibration c = make_calibration(s.weights, *s.be, *s.tok, rp, co, true);
  save_calibration(c, opt.out);
  std::fprintf(stderr, "[xctx] wrote %s (%d layers, 2/3/4-bit key and value datatypes, outliers 0%% and 1%%)\n",
               opt.out.c_str(), c.n_layer);
  return 0;
}

}  // namespace xctx
