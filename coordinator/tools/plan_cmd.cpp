// `xctx plan`: prints, per cache format, what a model at a context needs on a cluster and a
// roofline projection of its speed (coordinator/tools/cluster_plan.h); with --json, one object.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/tools/cluster_plan.h"
#include "coordinator/jobs/jobs.h"
#include "worker/sequence_plan.h"

namespace xctx {
namespace {

std::string tokens_text(int64_t n) {
  char b[32];
  if (n >= (int64_t)1 << 20 && n % ((int64_t)1 << 20) == 0) std::snprintf(b, sizeof b, "%lldM", (long long)(n >> 20));
  else if (n >= ((int64_t)1 << 20)) std::snprintf(b, sizeof b, "%.1fM", (double)n / (1 << 20));
  else if (n >= 1024) std::snprintf(b, sizeof b, "%.0fK", (double)n / 1024);
  else std::snprintf(b, sizeof b, "%lld", (long long)n);
  return b;
}

std::string seconds_text(double s) {
  char b[32];
  if (s < 1e-3) std::snprintf(b, sizeof b, "%.0f us", s * 1e6);
  else if (s < 1) std::snprintf(b, sizeof b, "%.2f ms", s * 1e3);
  else if (s < 120) std::snprintf(b, sizeof b, "%.1f s", s);
  else if (s < 7200) std::snprintf(b, sizeof b, "%.1f min", s / 60);
  else std::snprintf(b, sizeof b, "%.1f h", s / 3600);
  return b;
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0;
  while (a <= s.size()) {
    const size_t b = std::min(s.find(',', a), s.size());
    if (b > a) out.push_back(s.substr(a, b - a));
    a = b + 1;
  }
  return out;
}

}  // namespace

int run_plan(const plan_options& opt) {
  plan_inputs in;
  in.hp = plan_model_hparams(opt.model);
  in.context = opt.context;
  in.ranks = opt.gpus;
  in.device = find_device(opt.gpu);
  in.network = find_network(opt.network);
  in.weight_bits = opt.weight_bits;
  in.star_block = opt.block;
  XCTX_CHECK(opt.context >= 1 && opt.context <= ((int64_t)1 << 40), "--context must be in 1..2^40 tokens");
  XCTX_CHECK(opt.gpus >= 1 && opt.gpus <= 65536, "--gpus must be in 1..65536");
  XCTX_CHECK(opt.weight_bits > 0 && opt.weight_bits <= 32, "--weight-bits must be in (0, 32]");
  XCTX_CHECK(opt.block >= 1, "--block must be positive");
  if (opt.memory_gib > 0) in.device.memory_bytes = opt.memory_gib * 1024.0 * 1024.0 * 1024.0, in.device.source += "; memory overridden";
  if (opt.bandwidth_gbs > 0) in.device.bandwidth = opt.bandwidth_gbs * 1e9, in.device.source += "; bandwidth overridden";
  if (opt.tflops > 0) in.device.peak_flops = opt.tflops * 1e12, in.device.source += "; FLOP/s overridden";
  std::vector<cache_format> formats;
  for (const std::string& name : split_list(opt.formats)) formats.push_back(parse_cache_format(name));
  XCTX_CHECK(!formats.empty(), "--formats names no format");

  cpu_profile cpu;
  if (!opt.cpu_profile.empty()) {
    cpu = read_cpu_profile(opt.cpu_profile);
    XCTX_CHECK(cpu.n_layer == in.hp.n_layer && cpu.n_embd == in.hp.n_embd, opt.cpu_profile, ": measured with a model of ",
               cpu.n_layer, " layers and width ", cpu.n_embd, ", not ", in.hp.name, " (", in.hp.n_layer, ", ",
               in.hp.n_embd, ")");
    in.cpu = &cpu;
    in.hosts = opt.hosts;
  }
  // What a job would run for a sequence of this length with the default settings: the jobs' own
  // plan (worker/sequence_plan.h), so auto is decided in one place.
  sequence_options job_seq;
  job_seq.attention = attention_mode::attention_auto;
  job_seq.mode = prefill_mode::prefill_auto;
  job_seq.block_tokens = opt.block;
  job_seq.retrieval = opt.retrieval;
  const sequence_plan job = plan_sequences(in.hp, job_seq, run_params{}, cache_spec(formats[0]),
                                           {in.context, in.context, 0, false}, in.ranks);
  const bool retrieval = job.seq.attention == attention_mode::attention_retrieval;
  if (retrieval) in.retrieval = &job.seq.retrieval;
  std::vector<format_plan> plans;
  for (cache_format f : formats) plans.push_back(plan_format(in, f));
  const model_hparams& hp = in.hp;
  const double ridge = in.device.peak_flops / in.device.bandwidth;
  const double g = (double)hp.n_head / hp.n_head_kv;

  if (opt.json) {
    nlohmann::json j;
    j["model"] = hp.name, j["context"] = in.context, j["ranks"] = in.ranks;
    j["jobs_run"] = job.header();
    if (in.cpu != nullptr) j["hosts"] = in.hosts;
    j["device"] = in.cpu != nullptr ? "cpu:" + cpu.machine : in.device.name;
    j["network"] = in.cpu != nullptr ? "shared memory" : in.network.name;
    j["weight_bytes"] = model_parameters(hp) * in.weight_bits / 8.0;
    j["merge_bytes_per_token_layer"] = {{"exact", merge_bytes_exact(hp)}, {"o_lse", merge_bytes_o_lse(hp)}};
    for (const format_plan& p : plans)
      j["formats"].push_back({{"format", format_traits(p.format).name},
                              {"bytes_per_token", p.bytes_per_token},
                              {"tokens_per_rank", p.tokens_per_rank},
                              {"cache_bytes_per_rank", p.cache_bytes_per_rank},
                              {"fits", p.fits},
                              {"max_context", p.max_context},
                              {"decode_s", p.decode_s},
                              {"decode_memory_s", p.decode_memory_s},
                              {"decode_compute_s", p.decode_rebuild_s},
                              {"decode_merge_s", p.decode_merge_s},
                              {"prefill_ring_s", p.prefill_ring_s},
                              {"prefill_star_s", p.prefill_star_s},
                              {"retrieval", retrieval && in.cpu == nullptr
                                                ? nlohmann::json{{"summary_bytes_per_token", p.summary_bytes_per_token},
                                                                 {"selection_bytes_per_token_layer",
                                                                  p.selection_bytes_per_token_layer},
                                                                 {"bytes_read_per_step", p.retrieval_bytes_read},
                                                                 {"decode_s", p.retrieval_decode_s}}
                                                : nlohmann::json()}});
    std::printf("%s\n", j.dump().c_str());
    return 0;
  }

  std::printf("plan: %s (%d layers, %d/%d heads, head_dim %d, %.2fB parameters at %g bits = %s per rank)\n",
              hp.name.c_str(), hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, model_parameters(hp) / 1e9,
              in.weight_bits, format_bytes(plans[0].weight_bytes).c_str());
  if (in.cpu != nullptr) {
    std::printf("      %s tokens over %d ranks on %d host(s) sharing one %s (%d cores, %s), costs measured by %s\n",
                tokens_text(in.context).c_str(), in.ranks, in.hosts, cpu.machine.c_str(), cpu.cores,
                format_bytes(cpu.memory_bytes).c_str(), cpu.source.c_str());
    const cpu_profile::turns_factors turns = cpu.turns_at((double)in.ranks / cpu.cores);
    std::printf("      budget: %.0f%% of the machine's memory for the weights once + every rank's cache; times are "
                "the profile's core-seconds over min(ranks, cores) x %.3g (decode) / %.3g (prefill) for %.3g ranks "
                "per core, + %.3g ms per collective\n\n",
                100 * in.usable_fraction, turns.decode, turns.prefill, (double)in.ranks / cpu.cores,
                1e3 * cpu.collective_price(in.ranks, in.hosts));
  } else {
    std::printf("      %s tokens over %d x %s (%s, %.2f TB/s, %.0f TFLOP/s) linked by %s (%.1f GB/s, %.0f us/step)\n",
                tokens_text(in.context).c_str(), in.ranks, in.device.name.c_str(),
                format_bytes(in.device.memory_bytes).c_str(), in.device.bandwidth / 1e12, in.device.peak_flops / 1e12,
                in.network.name.c_str(), in.network.bandwidth / 1e9, in.network.latency_s * 1e6);
    std::printf("      budget per rank: %.0f%% of memory for weights + cache; projections assume %.0f%% of peak "
                "bandwidth and %.0f%% of peak FLOP/s\n\n",
                100 * in.usable_fraction, 100 * in.bandwidth_efficiency, 100 * in.flops_efficiency);
  }
  std::printf("      a job of this length runs: %s\n", job.header().c_str());
  if (in.cpu != nullptr)
    std::printf("      this CPU backend's fit check counts for the fullest rank (%s): %s\n", format_traits(formats[0]).name,
                job.memory.describe().c_str());
  std::printf("\n");
  std::printf("| format | B/token | cache/rank | fits | max context | decode step (memory / compute / merge) | tok/s | "
              "prefill ring | prefill star (%s blocks) |\n|---|---|---|---|---|---|---|---|---|\n",
              tokens_text(std::min<int64_t>(in.star_block, plans[0].tokens_per_rank)).c_str());
  for (const format_plan& p : plans)
    std::printf("| %s | %.0f | %s | %s | %s | %s (%s / %s / %s) | %.1f | %s | %s |\n", format_traits(p.format).name,
                p.bytes_per_token, format_bytes(p.cache_bytes_per_rank).c_str(), p.fits ? "yes" : "NO",
                tokens_text(p.max_context).c_str(), seconds_text(p.decode_s).c_str(),
                seconds_text(p.decode_memory_s).c_str(), seconds_text(p.decode_rebuild_s).c_str(),
                seconds_text(p.decode_merge_s).c_str(), 1.0 / p.decode_s, seconds_text(p.prefill_ring_s).c_str(),
                seconds_text(p.prefill_star_s).c_str());
  std::printf("\nmerge per token and layer: %.0f B per rank as (o, lse) partials (the CUDA backend's, projected "
              "above), %.0f B as the CPU backend's exact accumulator; each rank receives %d times that\n",
              merge_bytes_o_lse(hp), merge_bytes_exact(hp), in.ranks);
  if (in.cpu != nullptr) return 0;
  if (retrieval) {
    const retrieval_options& r = opt.retrieval;
    std::printf("\nretrieval attention past the trained %d positions (%s; docs/retrieval.md): the fullest rank "
                "reads the weights, its blocks' min/max and at most %lld tokens per step\n\n",
                hp.n_ctx_train, describe_retrieval(r).c_str(),
                (long long)(r.sink + r.local +
                            (int64_t)r.top_k * r.block * (r.scope == selection_scope::select_per_kv_head ? hp.n_head_kv : 1)));
    std::printf("| format | summaries B/token | bytes read per step | of the full step's | decode step | tok/s | "
                "selection gather B per token and layer (beside the merge's %.0f) |\n|---|---|---|---|---|---|---|\n",
                merge_bytes_o_lse(hp));
    for (const format_plan& p : plans)
      std::printf("| %s | %.0f | %s | %.1f%% | %s | %.1f | %.0f |\n", format_traits(p.format).name,
                  p.summary_bytes_per_token, format_bytes(p.retrieval_bytes_read).c_str(),
                  100.0 * p.retrieval_bytes_read / (p.weight_bytes + p.cache_bytes_per_rank),
                  seconds_text(p.retrieval_decode_s).c_str(), 1.0 / p.retrieval_decode_s,
                  p.selection_bytes_per_token_layer);
    std::printf("\n");
  }
  std::printf("XQuant 3.4 on %s (ridge %.0f FLOP/B): K/V rebuild stays under the weights' stream up to %s tokens "
              "per rank at 2-bit X (%s formula)\n",
              in.device.name.c_str(), ridge,
              tokens_text((int64_t)(hp.n_head_kv == hp.n_head ? xquant_ridge_length_mha(ridge, hp.n_embd, 2)
                                                              : xquant_ridge_length_gqa(ridge, hp.n_embd, g, 2)))
                  .c_str(),
              hp.n_head_kv == hp.n_head ? "MHA eq. 3" : "GQA eq. 4");
  std::printf("sources: %s; %s\n", in.device.source.c_str(), in.network.source.c_str());
  return 0;
}

}  // namespace xctx
