// `xctx bench`: one whole-process speed measurement (prefill + decode) with peak memory.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cache/cache.h"
#include "common/error.h"
#include "common/sys.h"
#include "model/corpus.h"
#include "coordinator/jobs/distributed.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/jobs/sampler.h"
#include "coordinator/jobs/session.h"
#include "kernels/host_cpu.h"
#include "worker/llama_engine.h"
#include "worker/sequence_parallel.h"
#include "worker/sequence_plan.h"

namespace xctx {
namespace {

// FNV-1a (over 32-bit words) of every logits vector the run produced: two runs agree on it only
// if their logits agree bitwise -- how rank counts and host layouts are compared end to end.
// ~50 µs per 49K logits, well under 1% of a decode step.
struct logits_digest {
  uint64_t h = 1469598103934665603ull;
  void add(const float* x, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      uint32_t w;
      std::memcpy(&w, x + i, sizeof w);
      h = (h ^ w) * 1099511628211ull;
    }
  }
};

}  // namespace

int run_bench(const bench_options& opt, communicator& comm) {
  XCTX_CHECK(opt.prompt_tokens > 1, "--prompt-tokens must be at least 2");
  XCTX_CHECK(opt.gen_tokens >= 0, "--gen-tokens must be >= 0");
  model_session s = open_session(opt.model.empty() ? default_model_path() : opt.model, "", opt.run, comm.rank() == 0);
  const model_hparams& hp = s.weights.hp;
  std::vector<int32_t> ids;
  if (comm.rank() == 0) {
    std::vector<int32_t> text_ids = s.tok->encode(load_text(opt.text_file), false, false);
    XCTX_CHECK(!text_ids.empty(), "--text ", opt.text_file, " holds no tokens");
    if (s.tok->vocab().add_bos) ids.push_back(s.tok->vocab().bos_id);
    while ((int64_t)ids.size() < opt.prompt_tokens)
      ids.insert(ids.end(), text_ids.begin(),
                 text_ids.begin() + std::min<int64_t>(text_ids.size(), opt.prompt_tokens - ids.size()));
  }
  broadcast_tokens(comm, ids);

  const sequence_plan plan =
      plan_sequences(hp, opt.seq, opt.run, s.cache,
                     {opt.prompt_tokens, opt.prompt_tokens + opt.gen_tokens, (int64_t)opt.gen_tokens + 1, false}, comm.size());
  const sequence_options& seq = plan.seq;
  llama_engine engine(s.weights, *s.be, plan.run);
  sequence_parallel_runner runner(engine, comm, *s.be, plan.cache, seq);
  std::vector<float> logits(hp.n_vocab);

  comm.barrier();
  stopwatch prefill_clock;
  runner.prefill(ids, {}, logits.data());
  comm.barrier();
  const double prefill_s = prefill_clock.seconds();
  const sequence_comm_stats after_prefill = runner.stats();
  // What one ring block of this shard weighs, summed over layers (the ring's bytes formula).
  double exported_after_prefill = 0;
  for (int l = 0; l < hp.n_layer; ++l) exported_after_prefill += (double)runner.cache().exported_bytes(l);
  logits_digest digest;
  digest.add(logits.data(), logits.size());
  // Per step too, so a layout difference names the first step where it appears.
  std::vector<uint64_t> step_digests;
  std::vector<int32_t> greedy_tokens;
  auto record_step = [&] {
    logits_digest one;
    one.add(logits.data(), logits.size());
    step_digests.push_back(one.h);
  };
  record_step();
  stopwatch decode_clock;
  for (int t = 0; t < opt.gen_tokens; ++t) {
    int32_t id = argmax(logits.data(), hp.n_vocab);
    comm.broadcast(&id, sizeof id, 0);
    greedy_tokens.push_back(id);
    runner.step(&id, 1, logits.data());
    digest.add(logits.data(), logits.size());
    record_step();
  }
  comm.barrier();
  const double decode_s = decode_clock.seconds();

  // Per-rank figures gathered to rank 0.
  struct rank_figures {
    double peak_rss, cache_used, cache_allocated, ring_sent, gather_sent_decode, gather_recv_decode;
    double tokens, ring_s, gather_s_decode, exported;
  } mine{(double)peak_rss_bytes(), (double)runner.cache().bytes_used(), (double)runner.cache().bytes_allocated(),
         (double)runner.stats().ring_bytes_sent,
         (double)(runner.stats().gather_bytes_sent - after_prefill.gather_bytes_sent),
         (double)(runner.stats().gather_bytes_recv - after_prefill.gather_bytes_recv),
         (double)runner.cache().n_tokens(0), runner.stats().ring_seconds,
         runner.stats().gather_seconds - after_prefill.gather_seconds, exported_after_prefill};
  std::vector<rank_figures> all(comm.size());
  comm.all_gather(&mine, all.data(), sizeof mine);
  if (comm.rank() != 0) return 0;

  nlohmann::json j;
  j["engine"] = "xctx";
  j["backend"] = s.be->name();
  if (!s.be->arithmetic().empty()) j["backend_arithmetic"] = s.be->arithmetic();
  j["cache"] = format_traits(opt.run.cache).name;
  j["ranks"] = comm.size();
  j["prefill_mode"] = prefill_mode_name(runner.mode());
  j["prefill"] = describe_prefill(seq, opt.prompt_tokens);
  j["rope"] = describe_rope(engine.rope(), hp.n_ctx_train);
  j["attention"] = describe_attention(seq);
  j["plan"] = plan.header();
  j["planned_bytes_per_rank"] = plan.memory.total();  // the fit check's figure for the fullest rank
  j["ring_held_bytes_peak"] = runner.stats().ring_held_bytes_peak;
  j["threads"] = opt.run.n_threads > 0 ? opt.run.n_threads : default_threads();
  // The backend's own settings (unset: choices it does not have, e.g. cuda's activations).
  const backend_settings bs = s.be->settings();
  if (bs.decode) j["decode_activations"] = decode_activations_name(*bs.decode);
  if (bs.prefill) j["prefill_activations"] = prefill_activations_name(*bs.prefill);
  if (bs.attn_avx512_rows) j["attn_avx512_rows"] = *bs.attn_avx512_rows;
  if (bs.kvq_key_lanes) j["kvq_key_lanes"] = *bs.kvq_key_lanes;
  if (bs.cuda_graphs) j["cuda_graphs"] = *bs.cuda_graphs;
  if (bs.cuda_tf32) j["cuda_tf32"] = *bs.cuda_tf32;
  j["prefill_q8_gemm"] = host_prefill_int_gemm();
  j["prompt_tokens"] = opt.prompt_tokens;
  j["gen_tokens"] = opt.gen_tokens;
  j["prefill_s"] = prefill_s;
  j["prefill_tok_s"] = opt.prompt_tokens / prefill_s;
  j["decode_s"] = decode_s;
  j["decode_tok_s"] = opt.gen_tokens > 0 ? opt.gen_tokens / decode_s : 0.0;
  j["peak_rss_bytes"] = (uint64_t)all[0].peak_rss;
  j["cache_bytes"] = (uint64_t)all[0].cache_allocated;
  j["partial_bytes_per_token_layer"] = partial_bytes_per_token_layer(hp);
  j["o_lse_bytes_per_token_layer"] = (uint64_t)hp.n_head * (hp.head_dim + 1) * sizeof(float);  // a plain merge's
  j["n_layer"] = hp.n_layer;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)digest.h);
  j["logits_fnv1a"] = hex;  // rank 0's logits after the prefill and after every decode step
  for (uint64_t h : step_digests) {
    std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)h);
    j["step_logits_fnv1a"].push_back(hex);  // [0] after the prefill, [t] after decode step t
  }
  j["greedy_tokens"] = greedy_tokens;
  for (const rank_figures& f : all) {
    nlohmann::json r;
    r["peak_rss_bytes"] = (uint64_t)f.peak_rss;
    r["cache_used_bytes"] = (uint64_t)f.cache_used;
    r["prefill_exported_bytes"] = (uint64_t)f.exported;  // the shard as ring blocks, all layers
    r["cache_allocated_bytes"] = (uint64_t)f.cache_allocated;
    r["tokens"] = (int64_t)f.tokens;
    r["ring_bytes_sent"] = (uint64_t)f.ring_sent;
    r["decode_gather_bytes_sent"] = (uint64_t)f.gather_sent_decode;
    r["decode_gather_bytes_recv"] = (uint64_t)f.gather_recv_decode;
    r["prefill_ring_s"] = f.ring_s;          // in the ring's transfers (and waits)
    r["decode_gather_s"] = f.gather_s_decode;  // in the decode all-gathers (and waits)
    j["per_rank"].push_back(r);
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}

}  // namespace xctx
