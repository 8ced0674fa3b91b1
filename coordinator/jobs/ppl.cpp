// `xctx ppl`: teacher-forced perplexity where attention reads the cache format under test.
//
// Windows of ctx tokens start every `stride` tokens. A window is prefilled layer-major: every
// layer stores all of the window's tokens in the cache (compressing them as the format does:
// kivi quantizes every complete group of `group` positions and keeps the rest, at most
// group-1 tokens, in the fp16 residual window; nuq keeps position 0 of the window in fp16 and
// quantizes all other tokens) before any query of that layer attends. So every query reads the
// compressed keys and values of its whole visible context, itself included: the papers'
// simulated-quantization perplexity. The first window scores all its next-token targets; later
// windows only the last `stride` (their earlier tokens are context), so each target is scored
// once. Under mpirun the window is split over the ranks (exact ring prefill, compressed blocks
// passed), each rank scores its own positions and the sums meet.
//
// With --attention retrieval (docs/retrieval.md) a window is scored the way generation attends:
// its first token prefilled, then the rest fed kScoreChunk tokens per step through the merged
// path, every query selecting its own blocks and seeing every key beyond the local window at
// distance --local. The cache then holds the window as generation would (the format's append
// path, not layer-major).
#include <cmath>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/sys.h"
#include "model/corpus.h"
#include "coordinator/jobs/distributed.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/jobs/session.h"
#include "worker/sequence_plan.h"

namespace xctx {

namespace {
// Queries per merged step when scoring under retrieval: a suffix-sized chunk (the selection and
// the attention run per query; the chunk only bounds the logits held, kScoreChunk x n_vocab).
constexpr int64_t kScoreChunk = 256;
}  // namespace

ppl_result perplexity(llama_engine& engine, communicator& comm, backend& be, const cache_spec& spec,
                      const sequence_options& seq, const std::vector<int32_t>& ids, int64_t ctx, int64_t stride,
                      int64_t max_windows, const std::function<void(int64_t, int64_t)>& progress) {
  XCTX_CHECK(ctx >= 2, "ppl: --window must be at least 2 tokens, got ", ctx);
  XCTX_CHECK(stride >= 1 && stride <= ctx, "ppl: --stride must be in [1, --window=", ctx, "], got ", stride);
  XCTX_CHECK((int64_t)ids.size() >= 2, "ppl: the text has ", ids.size(), " tokens; need at least 2");
  const int64_t n = (int64_t)ids.size();
  std::vector<int64_t> starts;
  for (int64_t s = 0;; s += stride) {
    const int64_t e = std::min(n, s + ctx);
    // A window must hold a target (>= 2 tokens) that earlier windows did not score.
    if (!starts.empty() && (e <= starts.back() + ctx || e - s < 2)) break;
    starts.push_back(s);
    if (e == n || (max_windows > 0 && (int64_t)starts.size() >= max_windows)) break;
  }
  ppl_result r;
  for (size_t w = 0; w < starts.size(); ++w) {
    const int64_t s = starts[w], e = std::min(n, s + ctx);
    const std::vector<int32_t> window(ids.begin() + s, ids.begin() + e);
    sequence_parallel_runner runner(engine, comm, be, spec, seq);
    // Targets already scored by the previous window (positions < its end) are context here.
    const int64_t first = w == 0 ? 1 : std::max<int64_t>(1, (starts[w - 1] + ctx) - s);
    const auto [sum, count] =
        seq.attention == attention_mode::attention_retrieval
            ? runner.score_stepwise(window, first, kScoreChunk)
            : runner.score(window, first);
    r.nll_sum += sum, r.n_scored += count;
    r.window_nll.push_back(count > 0 ? sum / (double)count : 0.0);
    ++r.n_windows;
    r.cache_bytes = std::max(r.cache_bytes, runner.cache().bytes_used());
    if (progress) progress((int64_t)w + 1, (int64_t)starts.size());
  }
  r.ppl = std::exp(r.nll_sum / (double)r.n_scored);
  return r;
}

int run_ppl(const ppl_options& opt, communicator& comm) {
  const bool coordinator = comm.rank() == 0;
  model_session s = open_session(opt.model.empty() ? default_model_path() : opt.model, opt.tokenizer, opt.run, comm.rank() == 0);
  // Full attention by default (windows inside the trained context); retrieval only when asked,
  // with its window below the scoring window's length so it selects (docs/retrieval.md).
  sequence_options asked = opt.seq;
  if (asked.attention == attention_mode::attention_auto) asked.attention = attention_mode::attention_full;
  // Retrieval scores every window position through the merged path: it reserves the window.
  const bool retrieval = asked.attention == attention_mode::attention_retrieval;
  const sequence_plan plan = plan_sequences(s.weights.hp, asked, opt.run, s.cache,
                                            {opt.ctx, opt.ctx, retrieval ? opt.ctx : asked.max_new_tokens, false},
                                            comm.size());
  const sequence_options& seq = plan.seq;
  s.cache = plan.cache;
  llama_engine engine(s.weights, *s.be, plan.run);
  std::vector<int32_t> ids;
  if (coordinator) ids = s.tok->encode(load_text(opt.text), false, false);
  broadcast_tokens(comm, ids);
  if (opt.max_tokens > 0 && (int64_t)ids.size() > opt.max_tokens) ids.resize(opt.max_tokens);
  if (coordinator)
    std::fprintf(stderr, "[xctx] ppl of %s on %s: %zu tokens, ctx %lld, stride %lld, cache %s, %d rank(s), %s\n",
                 s.weights.hp.name.c_str(), opt.text.c_str(), ids.size(), (long long)opt.ctx, (long long)opt.stride,
                 format_traits(s.cache.format).name, comm.size(), describe_attention(seq).c_str());
  progress_line bar("[xctx] ppl", coordinator, "windows");
  const stopwatch t;
  const ppl_result r = perplexity(engine, comm, *s.be, s.cache, seq, ids, opt.ctx, opt.stride, opt.max_windows,
                                  [&](int64_t d, int64_t total) { bar(d, total); });
  bar.finish();
  if (!coordinator) return 0;
  const double secs = t.seconds();
  std::printf("ppl %.4f  (%s, %lld targets in %lld windows of %lld, %.1f s, %.0f tok/s)\n", r.ppl,
              format_traits(s.cache.format).name, (long long)r.n_scored, (long long)r.n_windows, (long long)opt.ctx,
              secs, (double)r.n_scored / secs);
  if (!opt.json_path.empty()) {
    nlohmann::json j = {{"model", s.weights.hp.name},
                        {"text", opt.text},
                        {"cache", format_traits(s.cache.format).name},
                        {"attention", describe_attention(seq)},
                        {"ctx", opt.ctx},
                        {"stride", opt.stride},
                        {"ranks", comm.size()},
                        {"tokens", ids.size()},
                        {"targets", r.n_scored},
                        {"windows", r.n_windows},
                        {"nll_mean", r.nll_sum / (double)r.n_scored},
                        {"window_nll_mean", r.window_nll},
                        {"ppl", r.ppl},
                        {"cache_bytes_rank0_max_window", r.cache_bytes},
                        {"cache_bytes_per_token", cache_bytes_per_token(s.cache, engine.cache_geometry_for(opt.ctx))},
                        {"fp16_bytes_per_token",
                         cache_bytes_per_token(cache_format::cache_fp16, engine.cache_geometry_for(opt.ctx))},
                        {"seconds", secs}};
    std::ofstream out(opt.json_path);
    XCTX_CHECK(out.good(), "cannot write ", opt.json_path);
    out << j.dump(2) << "\n";
  }
  return 0;
}

}  // namespace xctx
