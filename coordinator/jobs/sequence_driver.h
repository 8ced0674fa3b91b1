// Rank 0 drives sequences; the other ranks follow. Every job (generate, passkey trials,
// summaries, a service's queue) is a series of sequences -- prefill a prompt, then decode --
// whose prompts and tokens rank 0 alone decides. The other ranks need no job logic: they run
// whatever rank 0 broadcasts, so a job that fails on rank 0 before a sequence starts (a bad file,
// a prompt too long) leaves them waiting for the next command, not stuck in a collective.
//
// Commands, broadcast from rank 0:
//   run:  the sequence's token budget, context tokens, suffix tokens, the snapshot directories
//         to save to / load from (empty: none), then one token id per decode step and -1 to end it
//   idle: nothing to do (a service's heartbeat: keeps every rank's stall watchdog fed)
//   end:  the followers return
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "coordinator/jobs/sampler.h"
#include "model/tokenizer.h"
#include "worker/sequence_parallel.h"

namespace xctx {

struct sequence_request {
  std::vector<int32_t> context;  // prefilled with the runner's mode
  std::vector<int32_t> suffix;   // through the merged path (may be empty: see runner.prefill)
  int max_tokens = 128;          // tokens to generate at most
  sampler_params sampling;       // temperature 0: greedy
  // Cache snapshots (worker/cache_snapshot.h). save: every rank writes its shard once the
  // prompt is in, before decoding. load: no prefill -- the sequence resumes from the snapshot
  // (context must be empty) and the suffix (at least one token) continues it.
  std::string save_cache_dir = {}, load_cache_dir = {};
};

// Called on rank 0 only.
struct sequence_hooks {
  llama_engine::progress_fn prefill_progress;   // (prompt tokens done, prompt tokens) of the prefill
  std::function<void(int32_t id)> on_token;     // each generated token, as it comes
  std::function<bool()> should_stop;            // polled before each decode step; true ends it
  std::function<void(bool decoding)> on_phase;  // false as the prefill starts, true as decoding does
};

struct sequence_outcome {
  std::vector<int32_t> ids;  // generated tokens (end-of-generation token excluded)
  int64_t prompt_tokens = 0;
  int decode_steps = 0;      // forward passes of one token (the first token comes from prefill)
  double prefill_s = 0.0, decode_s = 0.0;
  prefill_mode prefill = prefill_mode::prefill_exact;  // what the prefill ran (auto resolved)
  bool stopped = false;      // should_stop ended it
  int64_t restored_tokens = 0;  // load: the snapshot's tokens (prompt_tokens counts them too)
  uint64_t snapshot_bytes = 0;  // save: all ranks' files
};

class sequence_driver {
 public:
  // `runner` is reset before every sequence; `tok` decides end of generation.
  sequence_driver(sequence_parallel_runner& runner, communicator& comm, const tokenizer& tok, int32_t n_vocab);

  // Rank 0: one sequence on every rank. Throws (on every rank alike) when the runner refuses it.
  sequence_outcome run(const sequence_request& req, const sequence_hooks& hooks = {});
  // Rank 0: a heartbeat while waiting for work.
  void idle();
  // Rank 0: releases the followers. Once only.
  void finish();
  // Other ranks: runs rank 0's sequences until finish(). An error that every rank hits alike
  // (a sequence the runner refuses) is rank 0's to report; followers go on to the next command.
  void follow();

  sequence_parallel_runner& runner() { return runner_; }

 private:
  void run_sequence(const std::vector<int32_t>& context, const std::vector<int32_t>& suffix, int max_tokens,
                    const std::string& save_dir, const std::string& load_dir, const sequence_request* req,
                    const sequence_hooks* hooks, sequence_outcome& out);

  sequence_parallel_runner& runner_;
  communicator& comm_;
  const tokenizer& tok_;
  std::vector<float> logits_;  // [n_vocab]
  bool finished_ = false;
};

}  // namespace xctx
