// `xctx generate`: tokenize, prefill, stream a continuation, report speed and memory.
#include <cstdio>
#include <fstream>
#include <sstream>

#include "cache/cache.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs.h"
#include "coordinator/session.h"
#include "worker/llama_engine.h"

namespace xctx {
namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  XCTX_CHECK(in.good(), "cannot read prompt file ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

int run_generate(const generate_options& opt) {
  XCTX_CHECK(opt.prompt.empty() || opt.prompt_file.empty(), "give --prompt or --prompt-file, not both");
  XCTX_CHECK(opt.max_tokens >= 0, "--max-tokens must be >= 0, got ", opt.max_tokens);
  std::string text = opt.prompt_file.empty() ? opt.prompt : read_text_file(opt.prompt_file);
  XCTX_CHECK(!text.empty(), "the prompt is empty (use --prompt TEXT or --prompt-file FILE)");

  stopwatch load_clock;
  const std::string model_path = opt.model.empty() ? default_model_path() : opt.model;
  model_session s = open_session(model_path, opt.tokenizer, opt.run);
  const model_hparams& hp = s.weights.hp;

  std::vector<int32_t> prompt_ids;
  if (opt.chat) {
    std::vector<chat_message> msgs;
    if (!opt.system.empty()) msgs.push_back({"system", opt.system});
    msgs.push_back({"user", text});
    const std::string rendered = apply_chat_template(detect_chat_style(s.chat_template), msgs, true);
    prompt_ids = s.tok->encode(rendered, s.tok->vocab().add_bos, /*parse_special=*/true);
  } else {
    prompt_ids = s.tok->encode(text, s.tok->vocab().add_bos, /*parse_special=*/false);
  }
  const int64_t n_prompt = (int64_t)prompt_ids.size();
  const int64_t n_ctx = opt.run.n_ctx > 0 ? opt.run.n_ctx : hp.n_ctx_train;
  XCTX_CHECK(n_prompt + opt.max_tokens <= n_ctx, "prompt (", n_prompt, " tokens) + --max-tokens (", opt.max_tokens,
             ") exceed the context of ", n_ctx, " tokens (raise --ctx, with --rope-scaling beyond the trained ",
             hp.n_ctx_train, ")");

  llama_engine engine(s.weights, *s.be, opt.run);
  auto cache = make_cache(opt.run.cache, engine.cache_geometry_for(n_ctx), *s.be);
  const double load_s = load_clock.seconds();

  std::vector<int32_t> pos(n_prompt);
  for (int64_t i = 0; i < n_prompt; ++i) pos[i] = (int32_t)i;
  std::vector<float> logits(hp.n_vocab);
  stopwatch prefill_clock;
  const bool show_progress = n_prompt >= 4 * opt.run.n_batch && opt.show_stats;
  engine.forward(prompt_ids.data(), pos.data(), n_prompt, *cache, llama_engine::logits_for::logits_last,
                 logits.data(), [&](int64_t done, int64_t total) {
                   if (show_progress) std::fprintf(stderr, "\rprefill %lld/%lld tokens", (long long)done, (long long)total);
                 });
  if (show_progress) std::fprintf(stderr, "\n");
  const double prefill_s = prefill_clock.seconds();

  sampler smp(opt.sampling);
  stopwatch decode_clock;
  int n_generated = 0;
  int n_decode_steps = 0;  // forward passes of one token (the first token comes from prefill)
  int32_t p = (int32_t)n_prompt;
  for (; n_generated < opt.max_tokens; ++n_generated) {
    const int32_t id = smp.sample(logits.data(), hp.n_vocab);
    if (s.tok->is_end_of_generation(id)) break;
    const std::string piece = s.tok->token_piece(id);
    std::fwrite(piece.data(), 1, piece.size(), stdout);
    std::fflush(stdout);
    if (n_generated + 1 == opt.max_tokens) {
      ++n_generated;
      break;
    }
    engine.forward(&id, &p, 1, *cache, llama_engine::logits_for::logits_last, logits.data());
    ++p;
    ++n_decode_steps;
  }
  std::fputc('\n', stdout);
  const double decode_s = decode_clock.seconds();

  if (opt.show_stats) {
    std::fprintf(stderr,
                 "\n[xctx] model %s | backend %s | cache %s (%s of %s allocated) | load %.2f s\n"
                 "[xctx] prefill %lld tokens in %.2f s = %.1f tokens/s | generated %d tokens; decode %d steps in %.2f s = %.1f tokens/s\n"
                 "[xctx] peak memory (RSS) %s\n",
                 hp.name.c_str(), s.be->name().c_str(), format_traits(opt.run.cache).name,
                 format_bytes((double)cache->bytes_used()).c_str(), format_bytes((double)cache->bytes_allocated()).c_str(),
                 load_s, (long long)n_prompt, prefill_s, n_prompt / prefill_s, n_generated, n_decode_steps, decode_s,
                 n_decode_steps > 0 ? n_decode_steps / decode_s : 0.0, format_bytes((double)peak_rss_bytes()).c_str());
  }
  return 0;
}

}  // namespace xctx
