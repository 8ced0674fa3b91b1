// `xctx bench`: one whole-process speed measurement (prefill + decode) with peak memory.
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cache/cache.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs.h"
#include "coordinator/sampler.h"
#include "coordinator/session.h"
#include "worker/llama_engine.h"

namespace xctx {

int run_bench(const bench_options& opt) {
  XCTX_CHECK(opt.prompt_tokens > 0, "--prompt-tokens must be positive");
  XCTX_CHECK(opt.gen_tokens >= 0, "--gen-tokens must be >= 0");
  std::ifstream in(opt.text_file, std::ios::binary);
  XCTX_CHECK(in.good(), "cannot read --text ", opt.text_file);
  std::stringstream ss;
  ss << in.rdbuf();

  model_session s = open_session(opt.model.empty() ? default_model_path() : opt.model, "", opt.run);
  const model_hparams& hp = s.weights.hp;
  std::vector<int32_t> text_ids = s.tok->encode(ss.str(), false, false);
  XCTX_CHECK(!text_ids.empty(), "--text ", opt.text_file, " holds no tokens");
  std::vector<int32_t> ids;
  if (s.tok->vocab().add_bos) ids.push_back(s.tok->vocab().bos_id);
  while ((int64_t)ids.size() < opt.prompt_tokens)
    ids.insert(ids.end(), text_ids.begin(),
               text_ids.begin() + std::min<int64_t>(text_ids.size(), opt.prompt_tokens - ids.size()));

  const int64_t n = opt.prompt_tokens, n_ctx = n + opt.gen_tokens;
  llama_engine engine(s.weights, *s.be, opt.run);
  auto cache = make_cache(opt.run.cache, engine.cache_geometry_for(n_ctx), *s.be);
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
  std::vector<float> logits(hp.n_vocab);

  stopwatch prefill_clock;
  engine.forward(ids.data(), pos.data(), n, *cache, llama_engine::logits_for::logits_last, logits.data());
  const double prefill_s = prefill_clock.seconds();
  stopwatch decode_clock;
  int32_t p = (int32_t)n;
  for (int t = 0; t < opt.gen_tokens; ++t, ++p) {
    const int32_t id = argmax(logits.data(), hp.n_vocab);
    engine.forward(&id, &p, 1, *cache, llama_engine::logits_for::logits_last, logits.data());
  }
  const double decode_s = decode_clock.seconds();

  nlohmann::json j;
  j["engine"] = "xctx";
  j["backend"] = s.be->name();
  j["cache"] = format_traits(opt.run.cache).name;
  j["threads"] = opt.run.n_threads > 0 ? opt.run.n_threads : default_threads();
  j["prompt_tokens"] = n;
  j["gen_tokens"] = opt.gen_tokens;
  j["prefill_s"] = prefill_s;
  j["prefill_tok_s"] = n / prefill_s;
  j["decode_s"] = decode_s;
  j["decode_tok_s"] = opt.gen_tokens > 0 ? opt.gen_tokens / decode_s : 0.0;
  j["peak_rss_bytes"] = peak_rss_bytes();
  j["cache_bytes"] = cache->bytes_allocated();
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace xctx
