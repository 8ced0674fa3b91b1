// A job's sequences resolved once, before its engine is built: which attention runs (auto
// decided here and nowhere else), the prefill the longest prompt runs, the context and the
// positions they need, the cache spec (block summaries under retrieval), what the fullest rank
// needs in memory by part, and the run header line that says all of it. The jobs (generate,
// passkey, ppl, bench, summarize, serve) build their engine from plan.run and their runner
// from plan.seq and plan.cache; the runner's fit check counts each sequence with the same
// functions (worker/memory_plan.h); `xctx plan` prints the same decisions.
#pragma once

#include <cstdint>
#include <string>

#include "cache/cache.h"
#include "kernels/ops.h"
#include "model/hparams.h"
#include "worker/memory_plan.h"
#include "worker/run_params.h"
#include "worker/sequence_parallel.h"

namespace xctx {

// What a job's sequences look like, at their largest.
struct sequence_shape {
  int64_t prompt_tokens = 0;  // the longest prompt (context + suffix, saved tokens included)
  int64_t total_tokens = 0;   // prompt + generation: decides auto and a derived context
  int64_t new_tokens = 0;     // the room the runner reserves for generation (seq.max_new_tokens)
  // One cache sized for total_tokens and reused by every sequence (serve, summarize); otherwise
  // each sequence allocates its own shard.
  bool one_cache = false;
};

struct sequence_plan {
  sequence_options seq;  // attention resolved; prefill mode as given (auto resolves per prompt)
  run_params run;        // with the positions retrieval needs and the derived context
  cache_spec cache;      // with the block summaries under retrieval
  sequence_shape shape;
  int n_rank = 1;
  int64_t n_ctx_train = 0;
  int64_t n_ctx = 0;             // the context: --ctx, the derived one, or the trained window
  bool ctx_derived = false;      // n_ctx follows the sequence (retrieval without --ctx)
  prefill_mode prefill = prefill_mode::prefill_exact;  // what the longest prompt's prefill runs
  rope_config rope;              // the positions the engine runs
  rank_memory memory;            // the fullest rank's need for the longest sequence

  // "prefill star: ... | attention retrieval: ... | rope ... | context 131072 tokens (derived)"
  std::string header() const;
};

// The context a sequence of n_total tokens gets when --ctx is not given: n_total rounded up to
// a multiple of 1024. It bounds positions and checks; a per-sequence cache is still sized for
// its own shard.
int64_t derived_context(int64_t n_total);

// Resolves a job over n_rank ranks on a model of hp. Errors name the flags (retrieval options,
// retrieval with --rope-scaling, SelfExtend values).
sequence_plan plan_sequences(const model_hparams& hp, const sequence_options& seq, const run_params& rp,
                             const cache_spec& spec, const sequence_shape& shape, int n_rank);

}  // namespace xctx
