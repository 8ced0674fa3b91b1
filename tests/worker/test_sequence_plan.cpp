// The sequence plan (worker/sequence_plan.h): auto decided by the length, the context and
// positions retrieval needs derived from the sequence, the caches' summaries, the prefill the
// longest prompt runs, and the memory figure the runner's fit check will count for it.
#include <gtest/gtest.h>

#include "common/error.h"
#include "common/sys.h"
#include "test_util.h"
#include "worker/sequence_plan.h"

namespace xctx {
namespace {

// The fit check counts the CPU kernels' workspace (kernel_workspace_bytes, registry/registry.h).
constexpr backend_kind kCpu = backend_kind::backend_cpu;

model_hparams smollm2_like() {
  model_hparams hp;
  hp.n_layer = 30, hp.n_embd = 576, hp.n_ff = 1536, hp.n_head = 9, hp.n_head_kv = 3, hp.head_dim = 64;
  hp.n_rot = 64, hp.n_vocab = 49152, hp.n_ctx_train = 8192, hp.rope_freq_base = 100000.0f;
  return hp;
}

using test::error_of;

sequence_options job_defaults() {  // what the CLI passes (coordinator/cli/options.h)
  sequence_options seq;
  seq.attention = attention_mode::attention_auto;
  seq.mode = prefill_mode::prefill_auto;
  seq.block_tokens = 4096;
  return seq;
}

TEST(sequence_plan, inside_the_trained_window_auto_is_full_attention) {
  const model_hparams hp = smollm2_like();
  const sequence_plan p = plan_sequences(hp, job_defaults(), run_params{}, cache_spec(cache_format::cache_fp16),
                                         {4000, 4100, 101, false}, 2);
  EXPECT_EQ(p.seq.attention, attention_mode::attention_full);
  EXPECT_EQ(p.n_ctx, hp.n_ctx_train);
  EXPECT_FALSE(p.ctx_derived);
  EXPECT_EQ(p.cache.options.summary_block, 0);
  EXPECT_EQ(p.prefill, prefill_mode::prefill_exact);
  EXPECT_FALSE(fixed_distance_on(p.rope));
  EXPECT_EQ(p.seq.max_new_tokens, 101);
  EXPECT_NE(p.header().find("attention full"), std::string::npos) << p.header();
}

TEST(sequence_plan, past_the_window_retrieval_with_a_derived_context) {
  const model_hparams hp = smollm2_like();
  const int64_t n = 1 << 20;
  const sequence_plan p = plan_sequences(hp, job_defaults(), run_params{}, cache_spec(cache_format::cache_nuq3_1pct),
                                         {n, n + 33, 33, false}, 8);
  EXPECT_EQ(p.seq.attention, attention_mode::attention_retrieval);
  EXPECT_TRUE(p.ctx_derived);
  EXPECT_GE(p.n_ctx, n + 33);
  EXPECT_EQ(p.n_ctx % 1024, 0);
  EXPECT_LT(p.n_ctx, n + 33 + 1024);
  EXPECT_EQ(p.cache.options.summary_block, p.seq.retrieval.block);
  EXPECT_TRUE(fixed_distance_on(p.rope));
  EXPECT_EQ(p.rope.se_window, p.seq.retrieval.local);
  EXPECT_EQ(p.prefill, prefill_mode::prefill_star);  // the prompt leaves the local window
  EXPECT_NE(p.header().find("(derived from the sequence)"), std::string::npos) << p.header();
  // A given --ctx is kept.
  run_params rp;
  rp.n_ctx = 2 * n;
  EXPECT_EQ(plan_sequences(hp, job_defaults(), rp, cache_spec(cache_format::cache_fp16), {n, n + 33, 33, false}, 8).n_ctx,
            2 * n);
}

// The figure the plan reports is the runner's own: estimate_rank_memory for the resolved
// sequence (per-sequence caches) or for the capacity the one cache reserves.
TEST(sequence_plan, memory_is_what_the_fit_check_counts) {
  const model_hparams hp = smollm2_like();
  const int64_t n = 100000;
  run_params rp;
  rp.n_threads = 2;
  const sequence_plan p =
      plan_sequences(hp, job_defaults(), rp, cache_spec(cache_format::cache_kivi2), {n, n + 64, 64, false}, 4);
  const sequence_options resolved = with_mode_resolved(p.seq, n);
  const cache_spec ring = resolve_ring_mode(p.cache, hp, resolved, n - 1, 4);
  EXPECT_EQ(p.memory.total(), estimate_rank_memory(hp, ring, resolved, rp.n_batch, 2, n - 1, 65, 4, kCpu).total());
  EXPECT_GT(p.memory.cache, 0u);

  const sequence_plan one =
      plan_sequences(hp, job_defaults(), rp, cache_spec(cache_format::cache_kivi2), {n - 64, n, 64, true}, 4);
  EXPECT_EQ(one.seq.capacity_per_rank, sequence_capacity_per_rank(n, 4, one.cache, one.seq));
  const int64_t longest = one.seq.capacity_per_rank * 4;
  EXPECT_EQ(one.memory.total(),
            estimate_rank_memory(hp, resolve_ring_mode(one.cache, hp, one.seq, longest, 4), one.seq, rp.n_batch, 2,
                                 longest, 0, 4, kCpu)
                .total());
}

TEST(sequence_plan, the_users_own_positions_keep_full_attention_and_retrieval_refuses_them) {
  const model_hparams hp = smollm2_like();
  run_params rp;
  rp.rope_scale = rope_scaling::rope_scaling_linear, rp.rope_factor = 4.0f;
  const sequence_plan p =
      plan_sequences(hp, job_defaults(), rp, cache_spec(cache_format::cache_fp16), {30000, 30100, 100, false}, 1);
  EXPECT_EQ(p.seq.attention, attention_mode::attention_full);
  sequence_options forced = job_defaults();
  forced.attention = attention_mode::attention_retrieval;
  const std::string scaled = error_of(
      [&] { plan_sequences(hp, forced, rp, cache_spec(cache_format::cache_fp16), {30000, 30100, 100, false}, 1); });
  EXPECT_NE(scaled.find("--rope-scaling"), std::string::npos) << scaled;
  forced.retrieval.top_k = 0;
  const std::string top_k = error_of([&] {
    plan_sequences(hp, forced, run_params{}, cache_spec(cache_format::cache_fp16), {30000, 30100, 100, false}, 1);
  });
  EXPECT_NE(top_k.find("--top-k"), std::string::npos) << top_k;
}

TEST(sequence_plan, impossible_shapes_are_refused) {
  const model_hparams hp = smollm2_like();
  EXPECT_THROW(plan_sequences(hp, job_defaults(), run_params{}, cache_spec(cache_format::cache_fp16), {10, 5, 1, false}, 1),
               Error);
  EXPECT_THROW(plan_sequences(hp, job_defaults(), run_params{}, cache_spec(cache_format::cache_fp16), {1, 2, 1, false}, 0),
               Error);
}

}  // namespace
}  // namespace xctx
