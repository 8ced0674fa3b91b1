// The xctx binary: command-line front end of the coordinator.
#include <CLI/CLI.hpp>

#include <omp.h>

#include <charconv>
#include <cstdio>
#include <limits>
#include <map>

#include "common/error.h"
#include "common/sys.h"
#include "coordinator/jobs/jobs.h"
#include "coordinator/jobs/passkey.h"
#include "coordinator/service/service.h"
#include "coordinator/jobs/summarize.h"
#include "kernels/cpu/cpu_ops.h"

namespace {

// Validators whose messages read as the flag's rule ("--tflops: must be > 0, got -1"); CLI11's
// own NonNegativeNumber/PositiveNumber print the whole double range.
CLI::Validator number_above(double lo, bool inclusive) {
  const std::string rule = std::string(inclusive ? ">= " : "> ") + CLI::detail::to_string(lo);
  return CLI::Validator(
      [lo, inclusive, rule](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v)) return "'" + in + "' is not a number";
        return (inclusive ? v >= lo : v > lo) ? std::string() : "must be " + rule + ", got " + in;
      },
      rule);
}
CLI::Validator positive() { return number_above(0, false); }
CLI::Validator at_least(double lo) { return number_above(lo, true); }
// (0, 1]: nucleus mass.
CLI::Validator unit_mass() {
  return CLI::Validator(
      [](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v)) return "'" + in + "' is not a number";
        return v > 0 && v <= 1 ? std::string() : "must be in (0, 1], got " + in;
      },
      "in (0, 1]");
}
// Whole numbers in [lo, hi], parsed exactly (CLI11 saturates 64-bit overflow silently).
CLI::Validator integer_in(int64_t lo, int64_t hi) {
  const std::string rule = "in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, rule](std::string& in) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(in.data(), in.data() + in.size(), v);
        if (ec == std::errc::result_out_of_range) return "'" + in + "' is out of range (must be " + rule + ")";
        if (ec != std::errc() || end != in.data() + in.size()) return "'" + in + "' is not a whole number";
        return v >= lo && v <= hi ? std::string() : "must be " + rule + ", got " + in;
      },
      rule);
}
CLI::Validator seed_value() { return integer_in(0, std::numeric_limits<int64_t>::max()); }
// Numbers in [lo, hi] (NaN is not).
CLI::Validator number_in(double lo, double hi) {
  const std::string rule = "in [" + CLI::detail::to_string(lo) + ", " + CLI::detail::to_string(hi) + "]";
  return CLI::Validator(
      [lo, hi, rule](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v)) return "'" + in + "' is not a number";
        return v >= lo && v <= hi ? std::string() : "must be " + rule + ", got " + in;
      },
      rule);
}

// The sampler's options (coordinator/jobs/sampler.h says what each does and in which order), the same
// on every job that decodes. with_seed: false where --seed is the job's own (submit).
// defaults: the job's (summaries have a repetition guard, coordinator/jobs/summarize.h).
void add_sampling_options(CLI::App* cmd, xctx::sampler_params& s, bool with_seed = true,
                          const xctx::sampler_params& defaults = {}) {
  cmd->add_option("--temperature", s.temperature, "0 = greedy")->default_val(0.0f)->check(at_least(0));
  cmd->add_option("--top-p", s.top_p, "nucleus sampling mass")->default_val(1.0f)->check(unit_mass());
  cmd->add_option("--sample-top-k", s.top_k, "sample among the k most likely tokens (0 = all; --top-k is retrieval's)")
      ->default_val(0)
      ->check(integer_in(0, 1 << 30));
  cmd->add_option("--min-p", s.min_p, "drop tokens below this fraction of the most likely one's probability (0 = off)")
      ->default_val(0.0f)
      ->check(number_in(0, 1));
  cmd->add_option("--repeat-penalty", s.repetition_penalty,
                  "divide the positive logits (multiply the negative) of the last --repeat-last-n tokens by this (1 = off)")
      ->default_val(defaults.repetition_penalty)
      ->check(positive());
  cmd->add_option("--repeat-last-n", s.repeat_last_n, "tokens of prompt and output the repeat penalty sees")
      ->default_val(64)
      ->check(integer_in(0, 1 << 20));
  cmd->add_option("--frequency-penalty", s.frequency_penalty,
                  "OpenAI's: logit -= this x how often the token was generated")
      ->default_val(0.0f)
      ->check(number_in(-2, 2));
  cmd->add_option("--presence-penalty", s.presence_penalty, "OpenAI's: logit -= this if the token was generated")
      ->default_val(0.0f)
      ->check(number_in(-2, 2));
  cmd->add_option("--no-repeat-ngram", s.no_repeat_ngram, "never generate an n-gram of the output twice (0 = off)")
      ->default_val(defaults.no_repeat_ngram)
      ->check(integer_in(0, 1 << 10));
  if (with_seed) cmd->add_option("--seed", s.seed, "sampling seed")->default_val(0)->check(seed_value());
}

struct sequence_flags {
  std::string prefill = "auto", layout = "zigzag", anchor, block = "4K", star_from = "32K";
  std::string attention = "auto", sink = "256", local = "4K", block_size = "256", block_score = "minmax";
  std::string select_per = "layer", restart_skip = "64";
  int top_k = 32;
};

void add_sequence_options(CLI::App* cmd, sequence_flags& f) {
  cmd->add_option("--prefill", f.prefill,
                  "under mpirun: exact (ring, same logits as one rank) | star (block-local: each block sees "
                  "[anchor | itself]) | auto (exact below --star-from tokens, star from there)")
      ->default_val("auto");
  cmd->add_option("--layout", f.layout, "exact prefill shard layout: zigzag | contiguous")->default_val("zigzag");
  cmd->add_option("--block", f.block, "star prefill: tokens per block (0: one block per rank)")->default_val("4K");
  cmd->add_option("--anchor", f.anchor, "star prefill: anchor tokens (default: one block)");
  cmd->add_option("--star-from", f.star_from, "auto prefill: context length from which star is used")
      ->default_val("32K");
  cmd->add_option("--attention", f.attention,
                  "full (every key) | retrieval (sink + local window + top-k blocks, far keys at distance --local; "
                  "docs/retrieval.md) | auto (full within the model's trained window, retrieval beyond)")
      ->default_val("auto");
  cmd->add_option("--sink", f.sink, "retrieval: first positions every query sees")->default_val("256");
  cmd->add_option("--local", f.local, "retrieval: window at exact positions (< the trained window)")->default_val("4K");
  cmd->add_option("--block-size", f.block_size, "retrieval: positions per block (multiple of 256)")->default_val("256");
  cmd->add_option("--top-k", f.top_k, "retrieval: blocks retrieved per query and layer")->default_val("32");
  cmd->add_option("--block-score", f.block_score, "retrieval: minmax (Quest's bound) | mean (mean key)")
      ->default_val("minmax");
  cmd->add_option("--select-per", f.select_per,
                  "retrieval: layer (one top-k per query, heads' scores summed) | kv-head (one per KV head)")
      ->default_val("layer");
  cmd->add_option("--restart-skip", f.restart_skip,
                  "retrieval after a star prefill: first positions of each star block left out of its block "
                  "summary (they restart the sequence and outscore the blocks that matter)")
      ->default_val("64");
}

void apply_sequence_options(xctx::sequence_options& o, const sequence_flags& f) {
  o.mode = xctx::parse_prefill_mode(f.prefill);
  o.layout = xctx::parse_shard_layout(f.layout);
  o.block_tokens = f.block == "0" ? 0 : xctx::parse_count(f.block, "--block");
  if (!f.anchor.empty()) {
    o.anchor_tokens = xctx::parse_count(f.anchor, "--anchor");
    XCTX_CHECK(o.anchor_tokens >= 1, "--anchor must be at least 1 token (leave it out for one block), got ", f.anchor);
  }
  o.star_from_tokens = xctx::parse_count(f.star_from, "--star-from");
  XCTX_CHECK(o.star_from_tokens >= 1, "--star-from must be at least 1 token (--prefill star: always star), got ",
             f.star_from);
  o.attention = xctx::parse_attention_mode(f.attention);
  o.retrieval.sink = f.sink == "0" ? 0 : xctx::parse_count(f.sink, "--sink");
  o.retrieval.local = xctx::parse_count(f.local, "--local");
  o.retrieval.block = xctx::parse_count(f.block_size, "--block-size");
  o.retrieval.top_k = f.top_k;
  o.retrieval.rule = xctx::parse_block_score_rule(f.block_score);
  o.retrieval.scope = xctx::parse_selection_scope(f.select_per);
  o.retrieval.restart_skip = f.restart_skip == "0" ? 0 : xctx::parse_count(f.restart_skip, "--restart-skip");
  // What does not depend on the model is refused here, whether or not the job ends up retrieving;
  // the bound by the trained window is checked where the model is known (apply_attention_mode).
  xctx::check_retrieval_options(o.retrieval, std::numeric_limits<int64_t>::max());
}

struct cache_flags {
  std::string qnorm = "auto", cl_ring = "auto";
  bool no_sink = false;
  int se_group = 0;        // 0: not given (given values are checked >= 2)
  std::string se_window;   // empty: not given
  std::string decode_act;  // empty: XCTX_DECODE_ACT, else q16
  std::string prefill_act;  // empty: XCTX_PREFILL_ACT, else f32
  std::string backend;     // empty: XCTX_BACKEND, else cpu
};

std::string cache_format_list() {
  std::string s;
  for (xctx::cache_format f : xctx::all_cache_formats()) s += (s.empty() ? "" : " | ") + std::string(xctx::format_traits(f).name);
  return s;
}

void add_run_options(CLI::App* cmd, xctx::run_params& rp, std::string& cache, std::string& ctx, std::string& rope,
                     cache_flags& cf) {
  cmd->add_option("--cache", cache, "cache format: " + cache_format_list())->default_val("fp16");
  cmd->add_option("--calib", rp.calib_path, "nuq formats: calibration file made by `xctx calibrate`");
  cmd->add_option("--group-size", rp.cache_opts.group_size, "kivi: tokens per key group = channels per value group")
      ->default_val(128);
  cmd->add_option("--qnorm", cf.qnorm, "nuq: Q-Norm of the datatypes: auto (on at 2 bits, as KVQuant) | on | off")
      ->default_val("auto");
  cmd->add_flag("--no-sink", cf.no_sink, "nuq: quantize the first token too (default keeps it fp16)");
  cmd->add_option("--cl-ring", cf.cl_ring,
                  "xquant-cl exact ring prefill: deltas (stored codes; receiver keeps n*n_embd*4 bytes of "
                  "accumulators) | latent (fp16 latent, the bytes of fp16 K|V; O(block) memory) | auto (deltas "
                  "while those accumulators stay within 1 GiB per rank)")
      ->default_val("auto");
  cmd->add_option("--ctx", ctx, "context capacity in tokens (e.g. 8192, 32K); default: the model's trained context");
  cmd->add_option("--backend", cf.backend,
                  "cpu | cuda: where the forward, the cache and attention run (default: XCTX_BACKEND, else cpu); "
                  "cuda binds each rank to node-local rank mod the GPUs (XCTX_CUDA_DEVICE overrides); every cache "
                  "format runs on both");
  cmd->add_option("--threads", rp.n_threads, "CPU threads per rank (default: OMP_NUM_THREADS, else the node's cores / its ranks)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--batch", rp.n_batch, "prefill chunk size in tokens")->default_val(512)->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--decode-act", cf.decode_act,
                  "activations of the decode matmuls: q16 (16-bit blocks, default) | f32 (exact float) | q8 "
                  "(8-bit blocks, llama.cpp's rounding); default: XCTX_DECODE_ACT, else q16");
  cmd->add_option("--prefill-act", cf.prefill_act,
                  "activations of the prefill matmuls: q16 (16-bit blocks) | q8 (8-bit blocks) | f32 (exact "
                  "float): the integer ones run as integer GEMMs on AVX-512 VNNI CPUs (AMX tiles where granted), "
                  "as f32 elsewhere; default: XCTX_PREFILL_ACT, else q16 on AVX-512 VNNI CPUs and f32 elsewhere");
  cmd->add_option("--rope-scaling", rope,
                  "positions past the trained context: none | linear | ntk (with --rope-factor) | selfextend "
                  "(grouped positions, with --group and --window)")
      ->default_val("none");
  cmd->add_option("--rope-factor", rp.rope_factor, "RoPE scaling factor (>= 1)")->default_val(1.0f)->check(at_least(1));
  // --se-window everywhere; --window too where the command has no window of its own (ppl has).
  const bool window_free = cmd->get_option_no_throw("--window") == nullptr;
  cmd->add_option("--group,--se-group", cf.se_group,
                  "selfextend: keys beyond the window are attended at floor(pos / G) (default 4)")
      ->check(CLI::Range(2, 1 << 20));
  cmd->add_option(window_free ? "--window,--se-window" : "--se-window", cf.se_window,
                  "selfextend: the nearest W positions keep exact positions (e.g. 1024, 2K; default 1024)");
}

void apply_run_options(xctx::run_params& rp, const std::string& cache, const std::string& ctx, const std::string& rope,
                       const cache_flags& cf) {
  rp.cache = xctx::parse_cache_format(cache);
  rp.backend = xctx::choose_backend(cf.backend);
  if (!cf.decode_act.empty()) {  // process-wide: every rank parses the same command line
    xctx::cpu::set_decode_activations(xctx::cpu::parse_decode_activations(cf.decode_act, "--decode-act"));
  }
  if (!cf.prefill_act.empty()) {
    xctx::cpu::set_prefill_activations(xctx::cpu::parse_prefill_activations(cf.prefill_act, "--prefill-act"));
  }
  XCTX_CHECK(cf.qnorm == "auto" || cf.qnorm == "on" || cf.qnorm == "off", "--qnorm: unknown '", cf.qnorm,
             "' (auto, on, off)");
  rp.cache_opts.qnorm = cf.qnorm == "auto" ? -1 : (cf.qnorm == "on" ? 1 : 0);
  rp.cache_opts.sink = !cf.no_sink;
  XCTX_CHECK(cf.cl_ring == "deltas" || cf.cl_ring == "latent" || cf.cl_ring == "auto", "--cl-ring: unknown '",
             cf.cl_ring, "' (deltas, latent, auto)");
  rp.cache_opts.cl_ring = xctx::parse_cl_ring_mode(cf.cl_ring);
  if (!ctx.empty()) {
    rp.n_ctx = xctx::parse_count(ctx, "--ctx");
    XCTX_CHECK(rp.n_ctx >= 1, "--ctx must be at least 1 token, got ", ctx);
  }
  xctx::check_cache_options(xctx::cache_spec(rp.cache, rp.cache_opts));
  static const std::map<std::string, xctx::rope_scaling> ropes = {
      {"none", xctx::rope_scaling::rope_scaling_none},
      {"linear", xctx::rope_scaling::rope_scaling_linear},
      {"ntk", xctx::rope_scaling::rope_scaling_ntk},
      {"selfextend", xctx::rope_scaling::rope_scaling_none}};  // theta unchanged; positions grouped
  auto it = ropes.find(rope);
  XCTX_CHECK(it != ropes.end(), "--rope-scaling: unknown '", rope, "' (none, linear, ntk, selfextend)");
  rp.rope_scale = it->second;
  const bool self_extend = rope == "selfextend";
  XCTX_CHECK(self_extend || (cf.se_group == 0 && cf.se_window.empty()),
             "--group and --window (--se-group, --se-window) belong to --rope-scaling selfextend");
  if (self_extend) {
    rp.se_group = cf.se_group == 0 ? 4 : cf.se_group;
    rp.se_window = cf.se_window.empty() ? 1024 : (int)xctx::parse_count(cf.se_window, "--window");
    XCTX_CHECK(rp.se_group >= 2, "--group must be >= 2 for selfextend, got ", rp.se_group);
  }
}

}  // namespace

int main(int argc, char** argv) {
  xctx::init_logging(argv[0]);
  // Loading and every job's threads: the node's cores shared among its ranks (common/sys.h), so a
  // plain `mpirun -np 4` on 4 cores runs 4 x 1 threads, not 4 x 4.
  omp_set_num_threads(xctx::default_threads());
  CLI::App app{"xctx: long-context LLM inference over compressed, sequence-parallel caches"};
  app.require_subcommand(1);

  xctx::generate_options gen;
  cache_flags gen_cf;
  std::string gen_cache, gen_ctx, gen_rope;
  auto* g = app.add_subcommand("generate", "continue a prompt, streaming the text");
  g->add_option("--model", gen.model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  g->add_option("--tokenizer", gen.tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  g->add_option("--prompt", gen.prompt, "prompt text");
  g->add_option("--prompt-file", gen.prompt_file, "file holding the prompt");
  g->add_flag("--chat", gen.chat, "wrap the prompt in the model's chat template as a user message");
  g->add_option("--system", gen.system, "system message for --chat");
  g->add_option("--max-tokens,-n", gen.max_tokens, "tokens to generate")->default_val(128);
  add_sampling_options(g, gen.sampling);
  g->add_option("--stop", gen.stop, "end before the first of these strings; the output holds none of it (repeatable)")
      ->check([](const std::string& v) { return v.empty() ? std::string("--stop needs a non-empty string") : std::string(); });
  g->add_flag("!--no-stats", gen.show_stats, "do not print speed and memory at the end");
  g->add_option("--save-cache", gen.save_cache,
                "save every rank's cache shard to this directory once the prompt is in (-n 0: only save)");
  g->add_option("--load-cache", gen.load_cache,
                "resume from a saved cache: the prompt continues the saved sequence (same ranks, model, --cache)")
      ->excludes("--save-cache");
  add_run_options(g, gen.run, gen_cache, gen_ctx, gen_rope, gen_cf);
  sequence_flags gen_seq;
  add_sequence_options(g, gen_seq);

  xctx::info_options info;
  std::string info_ctx;
  xctx::plan_options plan;
  std::string plan_ctx = "1M", plan_block = "4K", plan_select_per = "layer";
  auto* pl = app.add_subcommand("plan", "cache bytes, fit, longest context and projected speed per cache format on a cluster");
  pl->add_option("--model", plan.model, "preset (llama-2-7b, llama-3-8b, llama-3.1-8b, llama-3-70b, smollm2-135m), GGUF or HF directory")
      ->default_val("llama-3-8b");
  pl->add_option("--context", plan_ctx, "tokens of the sequence (e.g. 128K, 10M)")->default_val("1M");
  pl->add_option("--gpus", plan.gpus, "ranks, one per GPU")->default_val(8);
  pl->add_option("--gpu", plan.gpu, "h100 | h100-pcie | h200 | a100-80gb")->default_val("h100");
  pl->add_option("--network", plan.network, "nvlink4 | nvlink3 | ib-ndr | ib-hdr | eth-100g | eth-10g")->default_val("nvlink4");
  pl->add_option("--formats", plan.formats, "comma-separated cache formats");
  pl->add_option("--weight-bits", plan.weight_bits, "bits per weight as the devices hold them")->default_val(16);
  pl->add_option("--block", plan_block, "star prefill block (= anchor) tokens")->default_val("4K");
  pl->add_option("--memory-gib", plan.memory_gib, "override the device's memory (GiB)")->check(positive());
  pl->add_option("--bandwidth-gbs", plan.bandwidth_gbs, "override the device's memory bandwidth (GB/s)")->check(positive());
  pl->add_option("--tflops", plan.tflops, "override the device's dense 16-bit TFLOP/s")->check(positive());
  pl->add_option("--cpu-profile", plan.cpu_profile,
                 "project for ranks sharing one CPU machine, from costs benchmarks/scaling.py measured (JSON)");
  pl->add_option("--hosts", plan.hosts, "with --cpu-profile: hosts the ranks span (network namespaces on that machine)")
      ->default_val(1)
      ->needs("--cpu-profile");
  pl->add_flag("--json", plan.json, "one JSON object instead of the table");
  pl->add_option("--top-k", plan.retrieval.top_k, "retrieval (contexts past the trained window): blocks per query")
      ->default_val(32);
  pl->add_option("--local", plan.retrieval.local, "retrieval: local window tokens")->default_val(4096);
  pl->add_option("--block-size", plan.retrieval.block, "retrieval: tokens per block")->default_val(256);
  pl->add_option("--sink", plan.retrieval.sink, "retrieval: sink tokens")->default_val(256);
  pl->add_option("--select-per", plan_select_per, "retrieval: layer | kv-head (one top-k per KV head)")
      ->default_val("layer");
  xctx::doctor_options doc;
  auto* dr = app.add_subcommand("doctor", "backends, CPU kernels, BLAS/MPI/NCCL/CUDA versions, devices and what each rank binds to");
  dr->add_option("--json", doc.json_path, "also write the report to this JSON file");
  dr->add_flag("--probe", doc.probe,
               "also measure this host's limits on rank 0: read bandwidth, fp32 FMA and int8 dot-product peaks (~10 s)");
  auto* i = app.add_subcommand("info", "hyper-parameters, metadata and tensors of a model file");
  i->add_option("model", info.model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  i->add_option("--cache", info.cache, "also print the byte breakdown of this cache format");
  i->add_option("--context", info_ctx, "tokens for the cache total (default 8K)");
  i->add_flag("--all", info.all_metadata, "print metadata arrays in full");

  xctx::bench_options bench;
  cache_flags bench_cf;
  std::string bench_cache, bench_ctx, bench_rope, bench_prompt;
  auto* b = app.add_subcommand("bench", "timed prefill + decode on real text; prints JSON");
  b->add_option("--model", bench.model, "model (default: the fetched SmolLM2)");
  b->add_option("--text", bench.text_file, "text to tokenize for the prompt: a file, austen:NAME[,NAME] or austen:all")->required();
  b->add_option("--prompt-tokens", bench_prompt, "prompt length in tokens (e.g. 512, 8K)")->default_val("512");
  b->add_option("--gen-tokens", bench.gen_tokens, "greedy decode steps after the prompt")->default_val(0);
  add_run_options(b, bench.run, bench_cache, bench_ctx, bench_rope, bench_cf);
  sequence_flags bench_seq;
  add_sequence_options(b, bench_seq);

  xctx::passkey_options pk;
  cache_flags pk_cf;
  std::string pk_cache, pk_ctx, pk_rope, pk_context = "4K", pk_depths = "0,0.25,0.5,0.75,1";
  auto* pkc = app.add_subcommand("passkey", "passkey retrieval: find a 5-digit key hidden at several depths");
  pkc->add_option("--model", pk.model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  pkc->add_option("--tokenizer", pk.tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  pkc->add_option("--context", pk_context, "prompt length in tokens (e.g. 4K)")->default_val("4K");
  pkc->add_option("--trials", pk.trials, "trials per depth (trial t uses seed + t)")->default_val(3);
  pkc->add_option("--depths", pk_depths, "comma-separated key depths in [0, 1]")->default_val("0,0.25,0.5,0.75,1");
  pkc->add_option("--seed", pk.seed, "seed of the keys and the filler start")->default_val(1)->check(seed_value());
  pkc->add_option("--filler", pk.filler, "classic (repeated grass/sky/sun lines) | austen (the novels)")
      ->default_val("classic");
  pkc->add_flag("--chat", pk.chat, "wrap the prompt in the model's chat template");
  pkc->add_option("--max-answer-tokens", pk.max_answer_tokens, "greedy tokens decoded at most per answer (stops at a complete 5-digit number)")->default_val(24);
  pkc->add_option("--json", pk.json_path, "also write per-trial results and the summary to this JSON file");
  pkc->add_flag("--needle-rank", pk.needle_rank,
                "retrieval, one rank: report per layer and KV head the rank of the key's block under each scoring "
                "rule (in --json)");
  add_run_options(pkc, pk.run, pk_cache, pk_ctx, pk_rope, pk_cf);
  sequence_flags pk_seq;
  add_sequence_options(pkc, pk_seq);

  xctx::ppl_options ppl;
  cache_flags ppl_cf;
  std::string ppl_cache, ppl_ctx_cap, ppl_rope, ppl_window = "2048", ppl_stride, ppl_max_tokens;
  auto* pc = app.add_subcommand("ppl", "teacher-forced perplexity with attention reading the compressed cache");
  pc->add_option("--model", ppl.model, "model (default: the fetched SmolLM2)");
  pc->add_option("--tokenizer", ppl.tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  pc->add_option("--text", ppl.text, "evaluation text: a file, austen:NAME[,NAME] or kjv:BOOK[,BOOK]")->required();
  pc->add_option("--window", ppl_window, "tokens per window (the perplexity context)")->default_val("2048");
  pc->add_option("--stride", ppl_stride, "tokens between window starts (default: the window; smaller = sliding)");
  pc->add_option("--max-windows", ppl.max_windows, "stop after this many windows (0 = all)")->default_val(0)->check(integer_in(0, int64_t(1) << 40));
  pc->add_option("--max-tokens", ppl_max_tokens, "use only the first N tokens of the text");
  pc->add_option("--json", ppl.json_path, "also write the result as JSON");
  add_run_options(pc, ppl.run, ppl_cache, ppl_ctx_cap, ppl_rope, ppl_cf);
  sequence_flags ppl_seq;
  add_sequence_options(pc, ppl_seq);

  xctx::calibrate_cmd_options cal;
  auto* cc = app.add_subcommand("calibrate", "derive the nuq datatypes, key scales and outlier thresholds (KVQuant)");
  cc->add_option("--model", cal.model, "model (default: the fetched SmolLM2)");
  cc->add_option("--text", cal.text, "calibration text: a file, or austen:NAME[,NAME] (e.g. austen:sensesensibility)")
      ->required();
  cc->add_option("--samples", cal.calib.n_samples, "calibration windows")->default_val(16)->check(CLI::Range(1, 1 << 20));
  cc->add_option("--seq-len", cal.calib.seq_len, "tokens per window")->default_val(2048)->check(CLI::Range(2, 1 << 24));
  cc->add_option("--seed", cal.calib.seed, "seed of the window offsets and sampled queries")->default_val(1)->check(seed_value());
  cc->add_option("--weighting", cal.weighting, "k-means weights: attention (output sensitivity) | none")
      ->default_val("attention");
  cc->add_option("--queries", cal.calib.queries_per_sample, "query positions sampled per window for the weights")
      ->default_val(64)
      ->check(CLI::Range(1, 1 << 20));
  cc->add_option("--out", cal.out, "calibration file to write")->required();
  cc->add_option("--threads", cal.run.n_threads, "CPU threads")->check(CLI::Range(1, 4096));
  cc->add_option("--batch", cal.run.n_batch, "forward chunk size in tokens")->default_val(512)->check(CLI::Range(1, 1 << 20));

  xctx::summarize_options sum;
  cache_flags sum_cf;
  std::string sum_cache, sum_ctx, sum_rope, sum_chunk;
  auto* sc = app.add_subcommand("summarize", "summarize the documents of a JSONL file, one result line each");
  sc->add_option("--model", sum.model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  sc->add_option("--tokenizer", sum.tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  sc->add_option("--in", sum.in, "input JSONL: {\"id\", \"text\" | \"path\", \"instruction\"?, \"max_tokens\"?} per line")
      ->required();
  sc->add_option("--out", sum.out, "output JSONL, one line per document, appended and fsync'd as each ends")->required();
  sc->add_flag("--resume", sum.resume, "continue an interrupted run: skip the ids --out holds already");
  sc->add_option("--instruction", sum.settings.instruction, "default instruction (a line's \"instruction\" wins)")
      ->default_val(xctx::kDefaultSummaryInstruction);
  sc->add_option("--max-tokens,-n", sum.settings.max_tokens, "summary tokens (a line's \"max_tokens\" wins)")
      ->default_val(200);
  sc->add_option("--chunk-tokens", sum_chunk, "map-reduce: text tokens per chunk (default: as many as fit --ctx)");
  sc->add_option("--map-tokens", sum.settings.map_tokens, "map-reduce: tokens of each chunk summary")->default_val(160)->check(CLI::Range(1, 1 << 20));
  add_sampling_options(sc, sum.settings.sampling, true, xctx::summary_sampling_defaults());
  sc->add_option("--stop", sum.settings.stop, "end each summary before the first of these strings (repeatable)")
      ->check([](const std::string& v) { return v.empty() ? std::string("--stop needs a non-empty string") : std::string(); });
  add_run_options(sc, sum.run, sum_cache, sum_ctx, sum_rope, sum_cf);
  sequence_flags sum_seq;
  add_sequence_options(sc, sum_seq);

  xctx::serve_options srv;
  cache_flags srv_cf;
  std::string srv_cache, srv_ctx, srv_rope, srv_max_context, srv_max_bytes = "8M";
  auto* sv = app.add_subcommand("serve", "run the coordinator as a Thrift service and, with --http-port, an OpenAI-compatible HTTP one (rank 0 listens; docs/service.md)");
  sv->add_option("--model", srv.model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  sv->add_option("--tokenizer", srv.tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  sv->add_option("--bind", srv.bind, "address to listen on")->default_val("127.0.0.1");
  sv->add_option("--port", srv.port, "TCP port (0: any free port; see --port-file)")->default_val(9090);
  sv->add_option("--port-file", srv.port_file, "write the bound port here once listening");
  sv->add_option("--http-port", srv.http_port,
                 "also serve HTTP here: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics "
                 "(0: any free port, see --http-port-file; default: off)")
      ->check(CLI::Range(0, 65535));
  sv->add_option("--http-port-file", srv.http_port_file, "write the bound HTTP port here once listening");
  sv->add_option("--http-threads", srv.http_threads, "HTTP connections served at once (a stream holds one)")
      ->default_val(64)->check(CLI::Range(1, 4096));
  sv->add_option("--http-io-timeout", srv.http_io_timeout_s,
                 "seconds an HTTP client may send or read nothing before it is dropped (slow clients)")
      ->default_val(30)->check(number_in(0.1, 3600));
  sv->add_option("--token-file", srv.token_file, "shared secret every request must carry (>= 8 characters; HTTP: Authorization: Bearer)");
  sv->add_option("--max-request-bytes", srv_max_bytes, "largest request accepted (e.g. 8M)")->default_val("8M");
  sv->add_option("--max-context", srv_max_context, "prompt + output tokens of one sequence (default: --ctx)");
  sv->add_option("--max-output-tokens", srv.limits.max_output_tokens, "largest max_tokens a job may ask")
      ->default_val(1024);
  sv->add_option("--max-queue", srv.max_queue, "jobs waiting at most")->default_val(16);
  sv->add_option("--journal", srv.journal_dir,
                 "directory of the job journal: accepted jobs are fsync'd there before they are acknowledged and "
                 "survive a restart (launch/xctx-serve restarts a service whose rank died)");
  std::string srv_on_interrupt = "retry";
  sv->add_option("--on-interrupt", srv_on_interrupt,
                 "--journal: a job that was running when the service stopped: retry (once) | fail")
      ->default_val("retry")->check(CLI::IsMember({"retry", "fail"}));
  sv->add_option("--log-dir", srv.log_dir, "write glog files there (default: log to stderr)");
  sv->add_option("--verbose,-v", srv.verbose, "glog verbosity (1: every status/info call too)")->default_val(0)->check(CLI::Range(0, 9));
  add_run_options(sv, srv.run, srv_cache, srv_ctx, srv_rope, srv_cf);
  sequence_flags srv_seq;
  add_sequence_options(sv, srv_seq);

  xctx::client_options cl;
  const auto add_client_options = [&cl](CLI::App* cmd) {
    cmd->add_option("--server", cl.server, "HOST:PORT of `xctx serve`")->default_val("127.0.0.1:9090");
    cmd->add_option("--token-file", cl.token_file, "file holding the service's shared secret");
  };
  auto* sub = app.add_subcommand("submit", "queue a job on a running service; prints its id (--wait: its result)");
  add_client_options(sub);
  sub->add_option("--kind", cl.kind, "generate | passkey | summarize | batch")->default_val("generate");
  sub->add_option("--prompt", cl.prompt, "generate: prompt text");
  sub->add_option("--prompt-file", cl.prompt_file, "generate: file holding the prompt");
  sub->add_flag("--chat", cl.chat, "generate: wrap the prompt in the chat template");
  sub->add_option("--system", cl.system, "generate: chat system message");
  sub->add_option("--max-tokens,-n", cl.max_tokens, "tokens to generate (summaries: 0 = the service's default)")
      ->default_val(128)
      ->check(integer_in(0, 1 << 30));
  add_sampling_options(sub, cl.sampling, false);  // generate
  sub->add_option("--stop", cl.stop, "generate: end before the first of these strings (repeatable)");
  sub->add_option("--seed", cl.seed, "sampling / passkey seed")->default_val(0)->check(seed_value());
  sub->add_option("--context", cl.context, "passkey: prompt tokens")->default_val(4096)->check(integer_in(64, int64_t(1) << 40));
  sub->add_option("--trials", cl.trials, "passkey: trials per depth")->default_val(1)->check(integer_in(1, 1 << 20));
  sub->add_option("--depths", cl.depths, "passkey: comma-separated depths")->default_val("0,0.5,1");
  sub->add_option("--filler", cl.filler, "passkey: classic | austen")->default_val("classic");
  sub->add_option("--in", cl.in, "summarize: text file; batch: JSONL file");
  sub->add_option("--id", cl.doc_id, "summarize: the document's id (default: the file name)");
  sub->add_option("--instruction", cl.instruction, "summarize: instruction (default: the service's)");
  sub->add_flag("--wait", cl.wait, "wait for the end with progress on stderr, then print the result");
  sub->add_flag("--json", cl.json, "with --wait: print the result's details JSON");
  sub->add_option("--timeout", cl.timeout_s, "with --wait: give up waiting after this many seconds")->check(positive());
  auto* st = app.add_subcommand("status", "a job's phase and progress; without an id, the service's info and metrics");
  add_client_options(st);
  st->add_option("id", cl.id, "job id");
  auto* res = app.add_subcommand("result", "print a job's result (exit 1: failed, 3: cancelled)");
  add_client_options(res);
  res->add_option("id", cl.id, "job id")->required();
  res->add_flag("--wait", cl.wait, "wait for the end with progress on stderr");
  res->add_flag("--json", cl.json, "print the details JSON instead of the text");
  res->add_option("--timeout", cl.timeout_s, "with --wait: give up waiting after this many seconds")->check(positive());
  auto* can = app.add_subcommand("cancel", "cancel a queued or running job");
  add_client_options(can);
  can->add_option("id", cl.id, "job id")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // Jobs that may run under mpirun get the world communicator (local without mpirun). A bad
  // input on any rank ends every rank at once instead of leaving the others in a collective.
  std::unique_ptr<xctx::communicator> comm;
  try {
    if (*g) {
      comm = xctx::make_default_communicator();
      apply_run_options(gen.run, gen_cache, gen_ctx, gen_rope, gen_cf);
      apply_sequence_options(gen.seq, gen_seq);
      return xctx::run_generate(gen, *comm);
    }
    if (*pkc) {
      comm = xctx::make_default_communicator();
      apply_run_options(pk.run, pk_cache, pk_ctx, pk_rope, pk_cf);
      apply_sequence_options(pk.seq, pk_seq);
      pk.context = xctx::parse_count(pk_context, "--context");
      pk.depths = xctx::parse_depths(pk_depths);
      return xctx::run_passkey(pk, *comm);
    }
    if (*b) {
      comm = xctx::make_default_communicator();
      apply_run_options(bench.run, bench_cache, bench_ctx, bench_rope, bench_cf);
      apply_sequence_options(bench.seq, bench_seq);
      bench.prompt_tokens = xctx::parse_count(bench_prompt, "--prompt-tokens");
      return xctx::run_bench(bench, *comm);
    }
    if (*sc) {
      comm = xctx::make_default_communicator();
      apply_run_options(sum.run, sum_cache, sum_ctx, sum_rope, sum_cf);
      apply_sequence_options(sum.seq, sum_seq);
      if (!sum_chunk.empty()) {
        sum.settings.chunk_tokens = xctx::parse_count(sum_chunk, "--chunk-tokens");
        XCTX_CHECK(sum.settings.chunk_tokens >= 1, "--chunk-tokens must be at least 1 token, got ", sum_chunk);
      }
      return xctx::run_summarize(sum, *comm);
    }
    if (*sv) {
      comm = xctx::make_default_communicator();
      apply_run_options(srv.run, srv_cache, srv_ctx, srv_rope, srv_cf);
      apply_sequence_options(srv.seq, srv_seq);
      srv.limits.max_request_bytes = xctx::parse_count(srv_max_bytes, "--max-request-bytes");
      srv.on_interrupt = srv_on_interrupt == "fail" ? xctx::interrupted_policy::fail : xctx::interrupted_policy::retry_once;
      srv.limits.max_context = srv_max_context.empty() ? 0 : xctx::parse_count(srv_max_context, "--max-context");
      XCTX_CHECK(srv_max_context.empty() || srv.limits.max_context >= 2, "--max-context must be at least 2 tokens, got ",
                 srv_max_context);
      return xctx::run_serve(srv, *comm);
    }
    for (auto [cmd, name] : {std::pair{sub, "submit"}, {st, "status"}, {res, "result"}, {can, "cancel"}})
      if (*cmd) {
        cl.command = name;
        if (cmd == sub) xctx::parse_depths(cl.depths);  // refused here, not by the service
        return xctx::run_client(cl);
      }
    if (*cc) return xctx::run_calibrate(cal);
    if (*pc) {
      comm = xctx::make_default_communicator();
      apply_run_options(ppl.run, ppl_cache, ppl_ctx_cap, ppl_rope, ppl_cf);
      apply_sequence_options(ppl.seq, ppl_seq);
      XCTX_CHECK(ppl.seq.mode != xctx::prefill_mode::prefill_star, "ppl scores with the exact ring prefill only (--prefill exact or auto)");
      ppl.ctx = xctx::parse_count(ppl_window, "--window");
      ppl.stride = ppl_stride.empty() ? ppl.ctx : xctx::parse_count(ppl_stride, "--stride");
      if (!ppl_max_tokens.empty()) ppl.max_tokens = xctx::parse_count(ppl_max_tokens, "--max-tokens");
      return xctx::run_ppl(ppl, *comm);
    }
    if (*pl) {
      plan.context = xctx::parse_count(plan_ctx, "--context");
      plan.block = xctx::parse_count(plan_block, "--block");
      plan.retrieval.scope = xctx::parse_selection_scope(plan_select_per);
      return xctx::run_plan(plan);
    }
    if (*dr) {
      comm = xctx::make_default_communicator();
      return xctx::run_doctor(doc, *comm);
    }
    if (*i) {
      if (!info_ctx.empty()) info.context = xctx::parse_count(info_ctx, "--context");
      return xctx::run_info(info);
    }
  } catch (const xctx::Error& e) {
    if (comm && comm->size() > 1) comm->abort(std::string("error: ") + e.what());
    std::fprintf(stderr, "xctx: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    if (comm && comm->size() > 1) comm->abort(std::string("unexpected error: ") + e.what());
    std::fprintf(stderr, "xctx: unexpected error: %s\n", e.what());
    return 2;
  }
  return 0;
}
