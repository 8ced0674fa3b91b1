// `xctx generate`: tokenize, prefill, stream a continuation, report speed and memory.
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

#include "cache/cache.h"
#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/distributed.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/service/generate_text.h"
#include "coordinator/jobs/sequence_driver.h"
#include "coordinator/jobs/session.h"
#include "worker/cache_snapshot.h"
#include "worker/llama_engine.h"
#include "worker/sequence_parallel.h"
#include "worker/sequence_plan.h"

namespace xctx {
namespace {

// With --chat, a saved sequence ends with a finished user turn (the document); the prompt that
// resumes it is the template's next user turn and the assistant header: what rendering both
// messages adds to rendering the first alone.
std::string chat_continuation(chat_style style, const std::string& system, const std::string& question) {
  std::vector<chat_message> before;
  if (!system.empty()) before.push_back({"system", system});
  before.push_back({"user", "(saved)"});
  std::vector<chat_message> after = before;
  after.push_back({"user", question});
  const std::string head = apply_chat_template(style, before, false), whole = apply_chat_template(style, after, true);
  XCTX_ASSERT(whole.compare(0, head.size(), head) == 0, "chat template: a further turn does not extend the first");
  return whole.substr(head.size());
}

}  // namespace

int run_generate(const generate_options& opt, communicator& comm) {
  const bool coordinator = comm.rank() == 0;
  XCTX_CHECK(opt.prompt.empty() || opt.prompt_file.empty(), "give --prompt or --prompt-file, not both");
  XCTX_CHECK(opt.max_tokens >= 0, "--max-tokens must be >= 0, got ", opt.max_tokens);

  stopwatch load_clock;
  const std::string model_path = opt.model.empty() ? default_model_path() : opt.model;
  model_session s = open_session(model_path, opt.tokenizer, opt.run, comm.rank() == 0);
  const model_hparams& hp = s.weights.hp;

  std::vector<int32_t> prompt_ids;
  if (coordinator) {
    std::string text = opt.prompt_file.empty() ? opt.prompt : read_file_bytes(opt.prompt_file, "prompt file");
    XCTX_CHECK(!text.empty(), "the prompt is empty (use --prompt TEXT or --prompt-file FILE)");
    if (!opt.load_cache.empty()) {  // continues a saved sequence: no BOS, no system prompt again
      const std::string rest =
          opt.chat ? chat_continuation(detect_chat_style(s.chat_template), opt.system, text) : text;
      prompt_ids = s.tok->encode(rest, false, /*parse_special=*/opt.chat);
    } else if (opt.chat) {
      std::vector<chat_message> msgs;
      if (!opt.system.empty()) msgs.push_back({"system", opt.system});
      msgs.push_back({"user", text});
      // Saved for later questions: the document as a finished user turn (chat_continuation).
      const std::string rendered =
          apply_chat_template(detect_chat_style(s.chat_template), msgs, opt.save_cache.empty());
      prompt_ids = s.tok->encode(rendered, s.tok->vocab().add_bos, /*parse_special=*/true);
    } else {
      prompt_ids = s.tok->encode(text, s.tok->vocab().add_bos, /*parse_special=*/false);
    }
    XCTX_CHECK(!prompt_ids.empty(), "the prompt has no tokens");
  }
  broadcast_tokens(comm, prompt_ids);
  // A resumed sequence already holds the snapshot's tokens (its manifest says how many).
  int64_t n_saved = 0;
  if (!opt.load_cache.empty() && coordinator) n_saved = read_snapshot_manifest(opt.load_cache).tokens;
  comm.broadcast(&n_saved, sizeof n_saved, 0);
  const int64_t n_prompt = n_saved + (int64_t)prompt_ids.size();
  // Past the trained window, auto turns retrieval on; the context then follows the prompt.
  const sequence_plan plan = plan_sequences(hp, opt.seq, opt.run, s.cache,
                                            {n_prompt, n_prompt + opt.max_tokens, (int64_t)opt.max_tokens + 1, false},
                                            comm.size());
  XCTX_CHECK(n_prompt + opt.max_tokens <= plan.n_ctx, "prompt (", n_prompt, " tokens", n_saved ? ", saved ones included" : "",
             ") + --max-tokens (", opt.max_tokens, ") exceed the context of ", plan.n_ctx,
             " tokens (raise --ctx, with --rope-scaling beyond the trained ", hp.n_ctx_train, ")");

  llama_engine engine(s.weights, *s.be, plan.run);
  sequence_parallel_runner runner(engine, comm, *s.be, plan.cache, plan.seq);
  sequence_driver driver(runner, comm, *s.tok, hp.n_vocab);
  const double load_s = load_clock.seconds();

  sequence_outcome out;
  if (coordinator) {
    progress_line progress("[xctx] prefill", opt.show_stats && n_prompt - n_saved >= 4 * opt.run.n_batch);
    sequence_hooks hooks;
    hooks.prefill_progress = [&progress](int64_t done, int64_t total) {
      progress(done, total);
      if (done == total) progress.finish();
    };
    // With --stop the output goes through text_stream (held back while it may begin a stop
    // string, cut before one); without, each token's bytes go out as they come.
    std::optional<text_stream> text;
    if (!opt.stop.empty()) text.emplace(*s.tok, opt.stop);
    bool hit_stop = false;
    const auto emit = [](const std::string& piece) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    };
    hooks.on_token = [&](int32_t id) {
      if (!text) return emit(s.tok->token_piece(id));
      hit_stop = text->push(id);
      emit(text->take_ready());
    };
    hooks.should_stop = [&hit_stop] { return hit_stop; };
    sequence_request req{prompt_ids, {}, opt.max_tokens, opt.sampling};
    req.save_cache_dir = opt.save_cache;
    if (!opt.load_cache.empty()) req.load_cache_dir = opt.load_cache, req.context.swap(req.suffix);
    out = driver.run(req, hooks);
    if (text) {
      text->finish();
      emit(text->take_ready());
    }
    progress.finish();
    std::fputc('\n', stdout);
    driver.finish();
  } else {
    driver.follow();
  }
  const double prefill_s = out.prefill_s, decode_s = out.decode_s;
  const int n_generated = (int)out.ids.size(), n_decode_steps = out.decode_steps;

  if (opt.show_stats) {
    if (coordinator)
      std::fprintf(stderr,
                   "\n[xctx] model %s | backend %s | %d rank(s) x %d thread(s), %s | load %.2f s\n"
                   "[xctx] prefill %lld tokens in %.2f s = %.1f tokens/s | generated %d tokens (%s); decode %d steps in "
                   "%.2f s = %.1f tokens/s\n"
                   "[xctx] peak memory (RSS) of rank 0: %s\n",
                   hp.name.c_str(),
                   (s.be->name() + (s.be->arithmetic().empty() ? "" : " (" + s.be->arithmetic() + ")")).c_str(),
                   comm.size(), engine.params().n_threads,
                   n_saved ? ("resumed from a snapshot | " + plan.header()).c_str() : plan.header().c_str(), load_s,
                   (long long)(n_prompt - n_saved), prefill_s, (n_prompt - n_saved) / prefill_s, n_generated,
                   describe_sampler(opt.sampling).c_str(), n_decode_steps, decode_s,
                   n_decode_steps > 0 ? n_decode_steps / decode_s : 0.0, format_bytes((double)peak_rss_bytes()).c_str());
    report_shards(comm, runner, opt.run.cache);
  }
  if (coordinator && out.snapshot_bytes > 0)
    std::fprintf(stderr, "[xctx] saved %lld tokens of cache (%s over %d rank(s)) to %s\n",
                 (long long)out.prompt_tokens, format_bytes((double)out.snapshot_bytes).c_str(), comm.size(),
                 opt.save_cache.c_str());
  if (coordinator && out.restored_tokens > 0)
    std::fprintf(stderr, "[xctx] resumed %lld saved tokens from %s (restore and question: %.2f s)\n",
                 (long long)out.restored_tokens, opt.load_cache.c_str(), out.prefill_s);
  return 0;
}

}  // namespace xctx
