#include "worker/sequence_plan.h"

#include <algorithm>

#include "common/error.h"
#include "common/sys.h"
#include "worker/llama_engine.h"

namespace xctx {

int64_t derived_context(int64_t n_total) {
  XCTX_CHECK(n_total >= 1 && n_total <= ((int64_t)1 << 50), "a sequence of ", n_total, " tokens");
  return (n_total + 1023) / 1024 * 1024;
}

sequence_plan plan_sequences(const model_hparams& hp, const sequence_options& seq, const run_params& rp,
                             const cache_spec& spec, const sequence_shape& shape, int n_rank) {
  XCTX_CHECK(n_rank >= 1, "a plan over ", n_rank, " ranks");
  XCTX_CHECK(shape.total_tokens >= 1 && shape.prompt_tokens >= 0 && shape.prompt_tokens <= shape.total_tokens &&
                 shape.new_tokens >= 0,
             "a sequence of ", shape.prompt_tokens, " prompt tokens in ", shape.total_tokens, " (", shape.new_tokens,
             " new)");
  sequence_plan p;
  p.seq = seq, p.run = rp, p.cache = spec, p.shape = shape, p.n_rank = n_rank, p.n_ctx_train = hp.n_ctx_train;
  // The one place auto is decided: full attention inside the trained window, retrieval past it.
  apply_attention_mode(p.seq, p.run, p.cache, shape.total_tokens, hp.n_ctx_train);
  if (p.seq.attention == attention_mode::attention_retrieval && p.run.n_ctx == 0) {
    p.run.n_ctx = derived_context(shape.total_tokens);
    p.ctx_derived = true;
  }
  p.n_ctx = p.run.n_ctx > 0 ? p.run.n_ctx : hp.n_ctx_train;
  p.rope = make_rope_config(hp, p.run);
  p.seq.max_new_tokens = shape.new_tokens;
  p.prefill = effective_prefill_mode(p.seq, std::max<int64_t>(1, shape.prompt_tokens));

  // What the runner's fit check will count for the longest sequence (prepare_cache / reserve).
  const int n_threads = p.run.n_threads > 0 ? p.run.n_threads : default_threads();
  if (shape.one_cache) {
    p.seq.capacity_per_rank = sequence_capacity_per_rank(shape.total_tokens, n_rank, p.cache, p.seq);
    const int64_t longest = p.seq.capacity_per_rank * n_rank;
    p.memory = estimate_rank_memory(hp, resolve_ring_mode(p.cache, hp, p.seq, longest, n_rank), p.seq, p.run.n_batch,
                                    n_threads, longest, 0, n_rank, p.run.backend);
  } else {
    // A prefill keeps the prompt's last token for the merged path (sequence_parallel_runner::prefill).
    const int64_t n_context = std::max<int64_t>(0, shape.prompt_tokens - 1);
    const sequence_options resolved = with_mode_resolved(p.seq, std::max<int64_t>(1, shape.prompt_tokens));
    p.memory = estimate_rank_memory(hp, resolve_ring_mode(p.cache, hp, resolved, n_context, n_rank), resolved,
                                    p.run.n_batch, n_threads, n_context, shape.total_tokens - n_context, n_rank,
                                    p.run.backend);
  }
  return p;
}

std::string sequence_plan::header() const {
  std::string s = "prefill " + describe_prefill(seq, std::max<int64_t>(1, shape.prompt_tokens)) + " | attention " +
                  describe_attention(seq) + " | rope " + describe_rope(rope, n_ctx_train) + " | context " +
                  std::to_string(n_ctx) + " tokens";
  if (ctx_derived) s += " (derived from the sequence)";
  return s;
}

}  // namespace xctx
