// Where a model's nuq calibration lives when --calib is not given, and making it once.
//
// The file is keyed by the model's fingerprint (a hash of its shapes and key projections, the
// same one every calibration file records), next to the model: <model dir>/<model stem>.<16 hex
// digits>.calib, or under $XCTX_CALIB_DIR, or ~/.cache/xctx when the model's folder is read-only.
// The first job that needs it makes it with `xctx calibrate`'s defaults (KVQuant's 16 windows of
// 2K tokens of Sense and Sensibility, attention-weighted k-means) and every later job loads it.
// Ranks that start together take a file lock: one makes it, the others wait and load the same
// bytes, so every rank quantizes with one calibration.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "cache/calibration.h"
#include "worker/calibrate.h"

namespace xctx {

class tokenizer;

struct stored_calibration {
  std::shared_ptr<const calibration> cal;
  std::string path;
  bool made_now = false;         // by this process
  bool made_by_another = false;  // while this process waited for the lock
  double make_seconds = 0;
  std::string describe() const;  // "calibration PATH (made now in 58 s from austen:...)" or "(found)"
};

// The default file for a model with this fingerprint: see above.
std::string default_calibration_path(const std::string& model_path, uint64_t fingerprint);

// Loads `path` if it exists; otherwise, holding `path`.lock, makes it with `make` (unless another
// process made it while this one waited), writes it atomically (a temporary file, then rename) and
// loads it. The result is checked against the model (fingerprint, shapes).
stored_calibration find_or_make_calibration(const std::string& path, uint64_t fingerprint,
                                            const std::function<calibration()>& make);

// A calibration of `w` on co.text_source (a file, austen:NAME, kjv:BOOK) with the options `co`,
// read with exact fp32 activations at the model's own positions; progress on stderr when `report`.
calibration make_calibration(const model_weights& w, backend& be, const tokenizer& tok, const run_params& rp,
                             const calibrate_options& co, bool report);

// `make` for find_or_make_calibration: `xctx calibrate`'s defaults on this model and backend, with
// progress on stderr when `report` (the process that makes it reports, whichever rank it is).
calibration make_default_calibration(const model_weights& w, backend& be, const tokenizer& tok, const run_params& rp,
                                     bool report);

}  // namespace xctx
