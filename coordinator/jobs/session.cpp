#include "coordinator/jobs/session.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "cache/cache.h"
#include "cache/calibration.h"
#include "cache/x_factors.h"
#include "coordinator/jobs/calibration_store.h"
#include "common/error.h"
#include "model/gguf.h"
#include "registry/registry.h"

#ifndef XCTX_SOURCE_DIR
#define XCTX_SOURCE_DIR "."
#endif

namespace xctx {

static const char* kDefaultModelFile = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

std::string default_model_path() {
  if (const char* env = std::getenv("XCTX_MODEL")) return env;
  if (std::filesystem::exists(kDefaultModelFile)) return kDefaultModelFile;
  const std::string in_tree = std::string(XCTX_SOURCE_DIR) + "/" + kDefaultModelFile;
  if (std::filesystem::exists(in_tree)) return in_tree;
  fail("no --model given and the default model is not fetched (looked for ", kDefaultModelFile,
       " here and in ", XCTX_SOURCE_DIR, "); run launch/fetch-model");
}

model_session open_session(const std::string& model_path, const std::string& tokenizer_path, const run_params& rp,
                           bool report) {
  model_session s;
  s.weights = load_model(model_path);
  make_resident(s.weights);
  std::string vocab_source = tokenizer_path;
  if (vocab_source.empty()) {
    XCTX_CHECK(!std::filesystem::is_directory(model_path), "model ", model_path,
               " is a checkpoint directory: pass --tokenizer FILE.gguf to take the vocabulary from a GGUF");
    vocab_source = model_path;
  }
  auto vocab_file = gguf_file::open(vocab_source);
  s.tok = make_tokenizer(read_gguf_vocab(*vocab_file));
  s.chat_template = vocab_file->get_string("tokenizer.chat_template", "");
  XCTX_CHECK(s.tok->n_vocab() <= s.weights.hp.n_vocab, "tokenizer ", vocab_source, " has ", s.tok->n_vocab(),
             " tokens but the model's vocabulary has ", s.weights.hp.n_vocab);
  s.be = make_backend(rp.backend, rp.settings);
  s.cache = cache_spec(rp.cache, rp.cache_opts);
  if (format_traits(rp.cache).needs_calibration) {
    const uint64_t fingerprint = model_fingerprint(s.weights);
    std::shared_ptr<const calibration> c;
    std::string cal_path = rp.calib_path;
    if (!rp.calib_path.empty()) {  // --calib overrides the stored one
      c = std::make_shared<calibration>(load_calibration(rp.calib_path));
      s.calibration_note = "calibration " + rp.calib_path + " (--calib)";
    } else {
      const stored_calibration st = find_or_make_calibration(
          default_calibration_path(model_path, fingerprint), fingerprint,
          [&] { return make_default_calibration(s.weights, *s.be, *s.tok, rp, true); });
      c = st.cal;
      cal_path = st.path;
      s.calibration_note = st.describe();
    }
    c->check_model(fingerprint, s.weights.hp, cal_path);
    s.cache.options.calib = std::move(c);
    if (report) std::fprintf(stderr, "[xctx] %s: %s\n", format_traits(rp.cache).name, s.calibration_note.c_str());
  }
  if (format_needs_x_factors(rp.cache))  // xquant*, xquant-cl*: offline SVD of W_k, W_v
    s.cache.options.factors = build_x_factors(s.weights, x_factor_kind_for(rp.cache));
  return s;
}

}  // namespace xctx
