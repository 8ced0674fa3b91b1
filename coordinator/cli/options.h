// The command line's shared pieces: validators whose messages name the flag's rule, and the
// option bundles several subcommands take (sampling, the run and cache settings, the sequence
// and retrieval settings), each option declared once here and applied (parsed, checked, turned
// into the jobs' structs) once here. coordinator/cli/commands.cpp declares the subcommands.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "coordinator/jobs/sampler.h"
#include "worker/run_params.h"
#include "worker/sequence_parallel.h"

namespace xctx::cli {

// "--tflops: must be > 0, got -1" (CLI11's own NonNegativeNumber/PositiveNumber print the whole
// double range). Numbers are parsed exactly; NaN and 64-bit overflow are refused.
CLI::Validator number_above(double lo, bool inclusive);
CLI::Validator positive();
CLI::Validator at_least(double lo);
CLI::Validator unit_mass();                       // (0, 1]: nucleus mass
CLI::Validator integer_in(int64_t lo, int64_t hi);  // whole numbers in [lo, hi]
CLI::Validator seed_value();                      // [0, INT64_MAX]
CLI::Validator number_in(double lo, double hi);   // [lo, hi], NaN refused
CLI::Validator non_empty(const char* flag);       // a string option that must not be ""
// A choice among `choices`, refused where it is parsed: "must be a, b or c, not 'x'".
CLI::Validator one_of(std::vector<std::string> choices);
// --select-per's choices (the jobs' and `plan`'s option): layer or kv-head.
CLI::Validator selection_scope_choice();

// The sampler's options (coordinator/jobs/sampler.h says what each does and in which order), the
// same on every job that decodes. with_seed: false where --seed is the job's own (submit).
// defaults: the job's (summaries have a repetition guard, coordinator/jobs/summarize.h).
void add_sampling_options(CLI::App* cmd, sampler_params& s, bool with_seed = true, const sampler_params& defaults = {});

// --model, and --tokenizer where tokenizer is given.
void add_model_options(CLI::App* cmd, std::string& model, std::string* tokenizer);

// What every job that runs the model takes: the cache and its options, the context, RoPE
// handling, backend, threads, batch, matmul activations, and the sequence's prefill, layout and
// attention (retrieval) settings. As text where the value has a suffix or a choice, turned into
// run_params / sequence_options by apply_job_options.
struct job_flags {
  std::string cache, ctx, rope;
  std::string qnorm = "auto", cl_ring = "auto";
  bool no_sink = false;
  int se_group = 0;         // 0: not given (given values are checked >= 2)
  std::string se_window;    // empty: not given
  std::string decode_act;   // empty: XCTX_DECODE_ACT, else q16
  std::string prefill_act;  // empty: XCTX_PREFILL_ACT, else q16 on AVX-512 VNNI CPUs, f32 elsewhere
  std::string backend;      // empty: XCTX_BACKEND, else cpu
  // Sequence (prefill and attention).
  std::string prefill = "auto", layout = "zigzag", anchor, block = "4K", star_from = "32K";
  std::string attention = "auto", sink = "256", local = "4K", block_size = "256", block_score = "minmax";
  std::string select_per = "layer", restart_skip = "64", far_positions = "fixed";
  int top_k = 32;
};
void add_job_options(CLI::App* cmd, run_params& rp, job_flags& f);
void apply_job_options(run_params& rp, sequence_options& seq, const job_flags& f);

}  // namespace xctx::cli
