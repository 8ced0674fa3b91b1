// Perplexity: the scored path (layer-major, every target once) equals exp(mean NLL) computed by
// hand from a plain forward's logits; sliding windows score each target exactly once; every
// cache format's scoring path runs on the real model and lands near the fp16 figure.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "cache/calibration.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "model/corpus.h"
#include "coordinator/jobs/jobs.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "registry/registry.h"
#include "test_util.h"
#include "worker/calibrate.h"
#include "worker/sequence_parallel.h"

namespace xctx {
namespace {

std::vector<int32_t> austen_ids(const tokenizer& tok, size_t n) {
  auto ids = tok.encode(load_text("austen:persuasion"), false, false);
  ids.resize(n);
  return ids;
}

TEST(ppl, equals_exp_mean_nll_from_the_logits) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  auto tok = make_tokenizer(read_gguf_vocab(*gguf_file::open(path)));
  const std::vector<int32_t> ids = austen_ids(*tok, 300);
  auto be = make_backend(backend_kind::backend_cpu);
  run_params rp;
  rp.cache = cache_format::cache_fp32;
  llama_engine engine(w, *be, rp);
  // By hand: one forward with all logits, NLL of each next token in double.
  auto cache = make_cache(cache_format::cache_fp32, engine.cache_geometry_for(300), *be);
  std::vector<int32_t> pos(300);
  for (int i = 0; i < 300; ++i) pos[i] = i;
  std::vector<float> logits((size_t)300 * w.hp.n_vocab);
  engine.forward(ids.data(), pos.data(), 300, *cache, llama_engine::logits_for::logits_all, logits.data());
  double nll = 0;
  for (int i = 0; i + 1 < 300; ++i) {
    const float* l = logits.data() + (size_t)i * w.hp.n_vocab;
    double mx = l[0], s = 0;
    for (int j = 0; j < w.hp.n_vocab; ++j) mx = std::max(mx, (double)l[j]);
    for (int j = 0; j < w.hp.n_vocab; ++j) s += std::exp(l[j] - mx);
    nll += mx + std::log(s) - l[ids[i + 1]];
  }
  const double by_hand = std::exp(nll / 299);
  auto comm = make_local_communicator();
  const ppl_result r = perplexity(engine, *comm, *be, cache_format::cache_fp32, sequence_options{}, ids, 300, 300, 0);
  EXPECT_EQ(r.n_scored, 299);
  // Layer-major vs chunk-major changes float summation order only (logits ~1e-5 apart).
  EXPECT_NEAR(r.ppl, by_hand, 1e-4 * by_hand);

  // Sliding windows score every target once; disjoint windows (stride = window) cannot score
  // the first token of each later window (nothing precedes it inside the window).
  for (int64_t stride : {int64_t(50), int64_t(100), int64_t(128)}) {
    const ppl_result s = perplexity(engine, *comm, *be, cache_format::cache_fp32, sequence_options{}, ids, 128, stride, 0);
    EXPECT_EQ(s.n_scored, stride == 128 ? 299 - (s.n_windows - 1) : 299) << "stride " << stride;
  }
  EXPECT_THROW(perplexity(engine, *comm, *be, cache_format::cache_fp32, sequence_options{}, ids, 128, 300, 0), Error);
}

// Scoring the way generation attends (score_stepwise: one token prefilled, then steps of 256 queries with
// every row's logits) under retrieval whose local window covers the whole text is full attention:
// the same perplexity as the layer-major scored path within float summation order (as above).
// With a short window and one block the selection is live: a different perplexity, and the
// ppl job's retrieval path gives the stepwise figure.
TEST(ppl, retrieval_scoring_with_a_window_over_everything_is_full_attention) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  auto tok = make_tokenizer(read_gguf_vocab(*gguf_file::open(path)));
  const int64_t n = 1200;
  const std::vector<int32_t> ids = austen_ids(*tok, n);
  auto be = make_backend(backend_kind::backend_cpu);
  auto comm = make_local_communicator();
  const auto full_ppl = [&] {
    run_params rp;
    rp.cache = cache_format::cache_fp32;
    llama_engine engine(w, *be, rp);
    sequence_parallel_runner runner(engine, *comm, *be, cache_format::cache_fp32, sequence_options{});
    const auto [sum, count] = runner.score(ids, 1);
    EXPECT_EQ(count, n - 1);
    return std::exp(sum / (double)count);
  };
  const auto retrieval_ppl = [&](int64_t local, int top_k) {
    sequence_options seq;
    seq.attention = attention_mode::attention_retrieval;
    seq.retrieval.local = local, seq.retrieval.top_k = top_k;
    seq.max_new_tokens = n;
    run_params rp;
    rp.cache = cache_format::cache_fp32;
    cache_spec spec(cache_format::cache_fp32);
    apply_attention_mode(seq, rp, spec, n, w.hp.n_ctx_train);
    llama_engine engine(w, *be, rp);
    sequence_parallel_runner runner(engine, *comm, *be, spec, seq);
    const auto [sum, count] = runner.score_stepwise(ids, 1, 256);
    EXPECT_EQ(count, n - 1);
    return std::pair<double, ppl_result>{
        std::exp(sum / (double)count), perplexity(engine, *comm, *be, spec, seq, ids, n, n, 0)};
  };
  const double full = full_ppl();
  const auto [wide, wide_job] = retrieval_ppl(2048, 32);
  EXPECT_NEAR(wide, full, 1e-4 * full) << "window over everything";
  const auto [narrow, narrow_job] = retrieval_ppl(256, 1);
  EXPECT_GT(std::fabs(narrow - full), 1e-3 * full) << "a 256-token window and one block changed nothing";
  EXPECT_LT(narrow, 2 * full);
  // The job's path (perplexity() under retrieval) is the stepwise one.
  EXPECT_EQ(narrow_job.ppl, narrow);
  EXPECT_EQ(narrow_job.n_scored, n - 1);
  EXPECT_TRUE(std::isfinite(narrow_job.ppl));
  EXPECT_NEAR(wide_job.ppl, full, 1e-4 * full);
}

// Perplexity over fp16's of each format in the committed sweep
// (benchmarks/results/ppl_sweep.csv, Persuasion: 4 windows of 2048 tokens).
std::map<std::string, double> sweep_ratios() {
  std::ifstream in(test::source_path("benchmarks/results/ppl_sweep.csv"));
  std::string line;
  std::getline(in, line);
  std::map<std::string, double> ppl;
  while (std::getline(in, line)) {
    std::stringstream row(line);
    std::string name, kv, bytes, p;
    std::getline(row, name, ','), std::getline(row, kv, ','), std::getline(row, bytes, ','), std::getline(row, p, ',');
    ppl[name] = std::stod(p);
  }
  std::map<std::string, double> ratio;
  for (const auto& [name, v] : ppl) ratio[name] = v / ppl.at("fp16");
  return ratio;
}

// Every format on one 512-token window of Persuasion (two attention units; calibration from
// Sense and Sensibility), held to its committed sweep figure: ppl / fp16 <= 1 + 1.5·(sweep ratio
// - 1) + 0.03. The margin covers the shorter window and the smaller calibration (measured
// below the bound for every format; the test prints both); a format that drifts by half its
// committed loss again fails. clkv included (its sweep ratio is ~22x: broken on this model, as
// docs/x_formats.md says, but held to that).
TEST(ppl, every_format_within_its_committed_sweep_figure) {
  XCTX_REQUIRE_MODEL(path);
  const std::map<std::string, double> sweep = sweep_ratios();
  const model_weights w = load_model(path);
  auto tok = make_tokenizer(read_gguf_vocab(*gguf_file::open(path)));
  constexpr int64_t kWindow = 512;
  const std::vector<int32_t> ids = austen_ids(*tok, kWindow + 1);
  auto be = make_backend(backend_kind::backend_cpu);
  run_params rp;
  llama_engine engine(w, *be, rp);
  calibrate_options co;  // a small calibration on other text (sense and sensibility)
  co.n_samples = 2, co.seq_len = 256, co.queries_per_sample = 16;
  auto cal_ids = tok->encode(load_text("austen:sensesensibility"), false, false);
  auto calib = std::make_shared<calibration>(calibrate_model(engine, *be, cal_ids, model_fingerprint(w), co));
  auto comm = make_local_communicator();
  const double fp16 =
      perplexity(engine, *comm, *be, cache_format::cache_fp16, sequence_options{}, ids, kWindow, kWindow, 0).ppl;
  for (cache_format f : all_cache_formats()) {
    cache_options o;
    o.calib = calib;
    if (format_needs_x_factors(f)) o.factors = build_x_factors(w, x_factor_kind_for(f));
    const ppl_result r = perplexity(engine, *comm, *be, cache_spec(f, o), sequence_options{}, ids, kWindow, kWindow, 0);
    const cache_format_traits t = format_traits(f);
    EXPECT_EQ(r.n_scored, kWindow - 1) << t.name;
    const double ratio = r.ppl / fp16;
    if (f == cache_format::cache_fp32) {  // not in the sweep: fp16's K/V rounding is all that differs
      EXPECT_NEAR(ratio, 1.0, 0.005) << r.ppl << " vs fp16 " << fp16;
      continue;
    }
    ASSERT_TRUE(sweep.count(t.name)) << t.name << " is missing from benchmarks/results/ppl_sweep.csv";
    const double bound = 1.0 + 1.5 * (sweep.at(t.name) - 1.0) + 0.03;
    EXPECT_TRUE(std::isfinite(r.ppl) && r.ppl > 1.0) << t.name << " " << r.ppl;
    EXPECT_LE(ratio, bound) << t.name << " " << r.ppl << " vs fp16 " << fp16;
    EXPECT_GE(ratio, 0.97) << t.name << " " << r.ppl << " vs fp16 " << fp16 << ": better than fp16 by more than noise";
    std::printf("[ppl] %-10s %8.3f  ratio %.3f  bound %.3f  (sweep ratio %.3f)\n", t.name, r.ppl, ratio, bound,
                sweep.at(t.name));
  }
}

}  // namespace
}  // namespace xctx
