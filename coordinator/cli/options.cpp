#include "coordinator/cli/options.h"

#include <charconv>
#include <limits>
#include <map>

#include "cache/format.h"
#include "common/error.h"
#include "common/sys.h"
#include "kernels/ops.h"
#include "registry/registry.h"

namespace xctx::cli {

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
CLI::Validator unit_mass() {
  return CLI::Validator(
      [](std::string& in) -> std::string {
        double v = 0;
        if (!CLI::detail::lexical_cast(in, v)) return "'" + in + "' is not a number";
        return v > 0 && v <= 1 ? std::string() : "must be in (0, 1], got " + in;
      },
      "in (0, 1]");
}
// Parsed exactly: CLI11 saturates 64-bit overflow silently.
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

CLI::Validator non_empty(const char* flag) {
  const std::string name = flag;
  return CLI::Validator(
      [name](std::string& in) { return in.empty() ? name + " needs a non-empty string" : std::string(); }, "non-empty");
}

CLI::Validator one_of(std::vector<std::string> choices) {
  std::string list;
  for (size_t i = 0; i < choices.size(); ++i)
    list += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  return CLI::Validator(
      [choices, list](std::string& in) -> std::string {
        for (const std::string& c : choices)
          if (in == c) return {};
        return "must be " + list + ", not '" + in + "'";
      },
      list);
}

CLI::Validator selection_scope_choice() { return one_of({"layer", "kv-head"}); }

void add_sampling_options(CLI::App* cmd, sampler_params& s, bool with_seed, const sampler_params& defaults) {
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

namespace {

void add_sequence_options(CLI::App* cmd, job_flags& f) {
  cmd->add_option("--prefill", f.prefill,
                  "under mpirun: exact (ring, same logits as one rank) | star (block-local: each block sees "
                  "[anchor | itself]) | auto (exact below --star-from tokens, star from there)")
      ->default_val("auto")
      ->check(one_of({"exact", "star", "auto"}));
  cmd->add_option("--layout", f.layout, "exact prefill shard layout: zigzag | contiguous")
      ->default_val("zigzag")
      ->check(one_of({"zigzag", "contiguous"}));
  cmd->add_option("--block", f.block, "star prefill: tokens per block (0: one block per rank)")->default_val("4K");
  cmd->add_option("--anchor", f.anchor, "star prefill: anchor tokens (default: one block)");
  cmd->add_option("--star-from", f.star_from, "auto prefill: context length from which star is used")
      ->default_val("32K");
  cmd->add_option("--attention", f.attention,
                  "full (every key) | retrieval (sink + local window + top-k blocks, far keys at distance --local; "
                  "docs/retrieval.md) | auto (full within the model's trained window, retrieval beyond)")
      ->default_val("auto")
      ->check(one_of({"full", "retrieval", "auto"}));
  cmd->add_option("--sink", f.sink, "retrieval: first positions every query sees")->default_val("256");
  cmd->add_option("--local", f.local, "retrieval: window at exact positions (< the trained window)")->default_val("4K");
  cmd->add_option("--block-size", f.block_size, "retrieval: positions per block (multiple of 256)")->default_val("256");
  cmd->add_option("--top-k", f.top_k, "retrieval: blocks retrieved per query and layer")->default_val("32");
  cmd->add_option("--block-score", f.block_score, "retrieval: minmax (Quest's bound) | mean (mean key)")
      ->default_val("minmax")
      ->check(one_of({"minmax", "mean"}));
  cmd->add_option("--select-per", f.select_per,
                  "retrieval: layer (one top-k per query, heads' scores summed) | kv-head (one per KV head)")
      ->default_val("layer")
      ->check(selection_scope_choice());
  cmd->add_option("--restart-skip", f.restart_skip,
                  "retrieval after a star prefill: first positions of each star block left out of its block "
                  "summary (they restart the sequence and outscore the blocks that matter)")
      ->default_val("64");
  cmd->add_option("--far-positions", f.far_positions,
                  "retrieval: fixed (every far key at distance --local, InfLLM) | ordered (a retrieved block's keys "
                  "keep their order, at distances --local+1 .. --local+--block-size)")
      ->default_val("fixed")
      ->check(one_of({"fixed", "ordered"}));
}

void apply_sequence_options(sequence_options& o, const job_flags& f) {
  o.mode = parse_prefill_mode(f.prefill);
  o.layout = parse_shard_layout(f.layout);
  o.block_tokens = f.block == "0" ? 0 : parse_count(f.block, "--block");
  if (!f.anchor.empty()) {
    o.anchor_tokens = parse_count(f.anchor, "--anchor");
    XCTX_CHECK(o.anchor_tokens >= 1, "--anchor must be at least 1 token (leave it out for one block), got ", f.anchor);
  }
  o.star_from_tokens = parse_count(f.star_from, "--star-from");
  XCTX_CHECK(o.star_from_tokens >= 1, "--star-from must be at least 1 token (--prefill star: always star), got ",
             f.star_from);
  o.attention = parse_attention_mode(f.attention);
  o.retrieval.sink = f.sink == "0" ? 0 : parse_count(f.sink, "--sink");
  o.retrieval.local = parse_count(f.local, "--local");
  o.retrieval.block = parse_count(f.block_size, "--block-size");
  o.retrieval.top_k = f.top_k;
  o.retrieval.rule = parse_block_score_rule(f.block_score);
  o.retrieval.scope = parse_selection_scope(f.select_per);
  o.retrieval.restart_skip = f.restart_skip == "0" ? 0 : parse_count(f.restart_skip, "--restart-skip");
  o.retrieval.far = parse_far_positions(f.far_positions);
  // What does not depend on the model is refused here, whether or not the job ends up retrieving;
  // the bound by the trained window is checked where the model is known (apply_attention_mode).
  check_retrieval_options(o.retrieval, std::numeric_limits<int64_t>::max());
}

std::string cache_format_list() {
  std::string s;
  for (cache_format f : all_cache_formats()) s += (s.empty() ? "" : " | ") + std::string(format_traits(f).name);
  return s;
}

void add_run_options(CLI::App* cmd, run_params& rp, job_flags& f) {
  cmd->add_option("--cache", f.cache, "cache format: " + cache_format_list())->default_val("fp16");
  cmd->add_option("--calib", rp.calib_path, "nuq formats: calibration file made by `xctx calibrate`");
  cmd->add_option("--group-size", rp.cache_opts.group_size, "kivi: tokens per key group = channels per value group")
      ->default_val(128);
  cmd->add_option("--qnorm", f.qnorm, "nuq: Q-Norm of the datatypes: auto (on at 2 bits, as KVQuant) | on | off")
      ->default_val("auto")
      ->check(one_of({"auto", "on", "off"}));
  cmd->add_flag("--no-sink", f.no_sink, "nuq: quantize the first token too (default keeps it fp16)");
  cmd->add_option("--cl-ring", f.cl_ring,
                  "xquant-cl exact ring prefill: deltas (stored codes; receiver keeps n*n_embd*4 bytes of "
                  "accumulators) | latent (fp16 latent, the bytes of fp16 K|V; O(block) memory) | auto (deltas "
                  "while those accumulators stay within 1 GiB per rank)")
      ->default_val("auto")
      ->check(one_of({"deltas", "latent", "auto"}));
  cmd->add_option("--ctx", f.ctx, "context capacity in tokens (e.g. 8192, 32K); default: the model's trained context");
  cmd->add_option("--backend", f.backend,
                  "cpu | cuda: where the forward, the cache and attention run (default: XCTX_BACKEND, else cpu); "
                  "cuda binds each rank to node-local rank mod the GPUs (XCTX_CUDA_DEVICE overrides); every cache "
                  "format runs on both");
  cmd->add_option("--threads", rp.n_threads, "CPU threads per rank (default: OMP_NUM_THREADS, else the node's cores / its ranks)")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--batch", rp.n_batch, "prefill chunk size in tokens")->default_val(512)->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--decode-act", f.decode_act,
                  "activations of the decode matmuls: q16 (16-bit blocks, default) | f32 (exact float) | q8 "
                  "(8-bit blocks, llama.cpp's rounding); default: XCTX_DECODE_ACT, else q16")
      ->check(one_of({"f32", "q16", "q8"}));
  cmd->add_option("--prefill-act", f.prefill_act,
                  "activations of the prefill matmuls: q16 (16-bit blocks) | q8 (8-bit blocks) | f32 (exact "
                  "float): the integer ones run as integer GEMMs on AVX-512 VNNI CPUs (AMX tiles where granted), "
                  "as f32 elsewhere; default: XCTX_PREFILL_ACT, else q16 on AVX-512 VNNI CPUs and f32 elsewhere")
      ->check(one_of({"f32", "q16", "q8"}));
  cmd->add_option("--rope-scaling", f.rope,
                  "positions past the trained context: none | linear | ntk (with --rope-factor) | selfextend "
                  "(grouped positions, with --group and --window)")
      ->default_val("none")
      ->check(one_of({"none", "linear", "ntk", "selfextend"}));
  cmd->add_option("--rope-factor", rp.rope_factor, "RoPE scaling factor (>= 1)")->default_val(1.0f)->check(at_least(1));
  // --se-window everywhere; --window too where the command has no window of its own (ppl has).
  const bool window_free = cmd->get_option_no_throw("--window") == nullptr;
  cmd->add_option("--group,--se-group", f.se_group,
                  "selfextend: keys beyond the window are attended at floor(pos / G) (default 4)")
      ->check(CLI::Range(2, 1 << 20));
  cmd->add_option(window_free ? "--window,--se-window" : "--se-window", f.se_window,
                  "selfextend: the nearest W positions keep exact positions (e.g. 1024, 2K; default 1024)");
}

void apply_run_options(run_params& rp, const job_flags& f) {
  rp.cache = parse_cache_format(f.cache);
  rp.backend = choose_backend(f.backend);
  // The backend is made with these (session.cpp); unset ones fall to XCTX_DECODE_ACT /
  // XCTX_PREFILL_ACT, then the backend's defaults (registry/registry.h).
  if (!f.decode_act.empty()) rp.settings.decode = parse_decode_activations(f.decode_act, "--decode-act");
  if (!f.prefill_act.empty()) rp.settings.prefill = parse_prefill_activations(f.prefill_act, "--prefill-act");
  rp.cache_opts.qnorm = f.qnorm == "auto" ? -1 : (f.qnorm == "on" ? 1 : 0);
  rp.cache_opts.sink = !f.no_sink;
  rp.cache_opts.cl_ring = parse_cl_ring_mode(f.cl_ring);
  if (!f.ctx.empty()) {
    rp.n_ctx = parse_count(f.ctx, "--ctx");
    XCTX_CHECK(rp.n_ctx >= 1, "--ctx must be at least 1 token, got ", f.ctx);
  }
  check_cache_options(cache_spec(rp.cache, rp.cache_opts));
  static const std::map<std::string, rope_scaling> ropes = {
      {"none", rope_scaling::rope_scaling_none},
      {"linear", rope_scaling::rope_scaling_linear},
      {"ntk", rope_scaling::rope_scaling_ntk},
      {"selfextend", rope_scaling::rope_scaling_none}};  // theta unchanged; positions grouped
  auto it = ropes.find(f.rope);
  XCTX_CHECK(it != ropes.end(), "--rope-scaling: unknown '", f.rope, "' (none, linear, ntk, selfextend)");
  rp.rope_scale = it->second;
  const bool self_extend = f.rope == "selfextend";
  XCTX_CHECK(self_extend || (f.se_group == 0 && f.se_window.empty()),
             "--group and --window (--se-group, --se-window) belong to --rope-scaling selfextend");
  if (self_extend) {
    rp.se_group = f.se_group == 0 ? 4 : f.se_group;
    rp.se_window = f.se_window.empty() ? 1024 : (int)parse_count(f.se_window, "--window");
    XCTX_CHECK(rp.se_group >= 2, "--group must be >= 2 for selfextend, got ", rp.se_group);
  }
}

}  // namespace

void add_model_options(CLI::App* cmd, std::string& model, std::string* tokenizer) {
  cmd->add_option("--model", model, "GGUF file or HF checkpoint directory (default: the fetched SmolLM2)");
  if (tokenizer != nullptr) {
    cmd->add_option("--tokenizer", *tokenizer, "GGUF to take the vocabulary from (default: the model file)");
  }
}

void add_job_options(CLI::App* cmd, run_params& rp, job_flags& f) {
  add_run_options(cmd, rp, f);
  add_sequence_options(cmd, f);
}

void apply_job_options(run_params& rp, sequence_options& seq, const job_flags& f) {
  apply_run_options(rp, f);
  apply_sequence_options(seq, f);
}

}  // namespace xctx::cli
