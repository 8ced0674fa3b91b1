// The jobs the xctx binary runs. Each returns a process exit code and throws xctx::Error on
// bad input; main() turns errors into a message and exit code 1.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "coordinator/jobs/sampler.h"
#include "worker/run_params.h"
#include "worker/sequence_parallel.h"

namespace xctx {

struct generate_options {
  std::string model;      // empty: default_model_path()
  std::string tokenizer;  // empty: the model file
  std::string prompt;
  std::string prompt_file;
  bool chat = false;
  std::string system;     // chat system prompt (empty: the template's default)
  int max_tokens = 128;
  sampler_params sampling;
  std::vector<std::string> stop;  // end before the first of these strings (OpenAI's `stop`)
  run_params run;
  sequence_options seq;  // prefill mode and shard layout under mpirun
  bool show_stats = true;
  // Cache snapshots (worker/cache_snapshot.h): save every rank's shard once the prompt is in;
  // or resume from one, the prompt continuing the saved sequence (with --chat: as a further
  // user turn, the saved one being a finished user turn).
  std::string save_cache, load_cache;
};
// Collective under mpirun: rank 0 tokenizes, drives and writes; every rank holds a shard.
int run_generate(const generate_options& opt, communicator& comm);

struct info_options {
  std::string model;
  std::string cache;        // non-empty: print that cache format's byte breakdown
  bool all_metadata = false;
  int64_t context = 8192;   // tokens, for the cache breakdown
};
int run_info(const info_options& opt);

// `xctx doctor`: backends, kernels, library versions, devices and per-rank binding (collective
// under mpirun; rank 0 prints).
struct doctor_options {
  std::string json_path;  // non-empty: also write the report there
  bool probe = false;     // also measure the host's limits (kernels/cpu/simd/roofline.h) on rank 0
};
int run_doctor(const doctor_options& opt, communicator& comm);

// `xctx plan` (coordinator/tools/cluster_plan.h): a model's needs and projected speed per cache format
// at a context on a cluster, before anything runs.
struct plan_options {
  std::string model = "llama-3-8b";  // preset, .gguf or HF directory
  int64_t context = 1 << 20;
  int gpus = 8;
  std::string gpu = "h100", network = "nvlink4";
  std::string formats = "fp16,kivi2,nuq4-1%,nuq3-1%,nuq2-1%,xquant2,xquant-cl3,xquant-cl2,clkv";
  double weight_bits = 16;
  int64_t block = 4096;
  double memory_gib = 0, bandwidth_gbs = 0, tflops = 0;  // > 0: override the device table
  std::string cpu_profile;  // set: one CPU machine measured by benchmarks/scaling.py instead of GPUs
  int hosts = 1;            // with cpu_profile: hosts (network namespaces) the ranks span
  bool json = false;
  retrieval_options retrieval;  // projected too when the context is past the model's trained window
};
int run_plan(const plan_options& opt);

}  // namespace xctx

namespace xctx {

// `xctx bench`: timed prefill of exactly prompt_tokens tokens of real text followed by
// gen_tokens greedy decode steps; prints one JSON object (for benchmarks/engine_speed.py).
struct bench_options {
  std::string model;
  std::string text_file;    // tokenized and repeated as needed to reach prompt_tokens
  int64_t prompt_tokens = 512;
  int gen_tokens = 0;
  run_params run;
  sequence_options seq;
};
int run_bench(const bench_options& opt, communicator& comm);

}  // namespace xctx

#include "worker/calibrate.h"

namespace xctx {

// `xctx calibrate`: one process (no mpirun needed); writes the nuqX calibration file.
struct calibrate_cmd_options {
  std::string model;
  std::string text;   // file or austen:NAME (model/corpus.h)
  std::string out;
  std::string weighting = "attention";  // attention | none
  calibrate_options calib;
  run_params run;     // threads, batch
};
int run_calibrate(const calibrate_cmd_options& opt);

}  // namespace xctx

namespace xctx {

// `xctx ppl`: teacher-forced perplexity through the cache format (coordinator/jobs/ppl.cpp says
// exactly which tokens are compressed when). Collective under mpirun.
struct ppl_options {
  std::string model;
  std::string tokenizer;
  std::string text;        // file, austen:NAME, kjv:BOOKS (model/corpus.h)
  int64_t ctx = 2048;      // tokens per window
  int64_t stride = 0;      // 0: ctx (non-overlapping windows)
  int64_t max_windows = 0; // 0: the whole text
  int64_t max_tokens = 0;  // 0: the whole text
  std::string json_path;
  run_params run;
  sequence_options seq;
};
struct ppl_result {
  double nll_sum = 0.0;
  int64_t n_scored = 0;
  int64_t n_windows = 0;
  size_t cache_bytes = 0;  // largest bytes_used of this rank's cache over the windows
  double ppl = 0.0;
  std::vector<double> window_nll;  // per window: its mean NLL over its targets (paired comparisons)
};
ppl_result perplexity(llama_engine& engine, communicator& comm, backend& be, const cache_spec& spec,
                      const sequence_options& seq, const std::vector<int32_t>& ids, int64_t ctx, int64_t stride,
                      int64_t max_windows, const std::function<void(int64_t, int64_t)>& progress = {});
int run_ppl(const ppl_options& opt, communicator& comm);

}  // namespace xctx
