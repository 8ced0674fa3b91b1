#include "coordinator/session.h"

#include <cstdlib>
#include <filesystem>

#include "cache/cache.h"
#include "cache/calibration.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "model/gguf.h"

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

model_session open_session(const std::string& model_path, const std::string& tokenizer_path, const run_params& rp) {
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
  s.be = make_backend(rp.backend);
  s.cache = resolve_cache_spec(rp, s.weights);
  return s;
}

cache_spec resolve_cache_spec(const run_params& rp, const model_weights& w) {
  cache_spec spec(rp.cache, rp.cache_opts);
  const cache_format_traits t = format_traits(rp.cache);
  if (t.needs_calibration) {
    XCTX_CHECK(!rp.calib_path.empty(), "cache ", t.name,
               " needs a calibration: pass --calib FILE (make one with `xctx calibrate --out FILE`)");
    auto c = std::make_shared<calibration>(load_calibration(rp.calib_path));
    c->check_model(model_fingerprint(w), w.hp, rp.calib_path);
    spec.options.calib = std::move(c);
  }
  if (format_needs_x_factors(rp.cache))  // xquant*, xquant-cl*: offline SVD of W_k, W_v
    spec.options.factors = build_x_factors(w, x_factor_kind_for(rp.cache));
  return spec;
}

}  // namespace xctx
