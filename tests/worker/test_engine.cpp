// The forward pass on tiny random models written by the test: chunked prefill and one-token
// decode agree with one batched pass, and the optimized CPU backend agrees with the scalar
// reference backend end to end.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "cache/cache.h"
#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "registry/registry.h"
#include "test_util.h"
#include "tiny_model.h"
#include "worker/llama_engine.h"

namespace xctx {
namespace {

using test::some_tokens;
using test::tiny_hparams;
using test::write_and_load;

std::vector<float> run_all_logits(const model_weights& w, backend_kind kind, cache_format fmt, int n_batch,
                                  const std::vector<int32_t>& tokens, const backend_settings& settings = {}) {
  auto be = make_backend(kind, settings);
  run_params rp;
  rp.cache = fmt;
  rp.n_batch = n_batch;
  llama_engine engine(w, *be, rp);
  auto cache = make_cache(fmt, engine.cache_geometry_for((int64_t)tokens.size()), *be);
  const int64_t n = (int64_t)tokens.size();
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
  std::vector<float> logits(n * w.hp.n_vocab);
  engine.forward(tokens.data(), pos.data(), n, *cache, llama_engine::logits_for::logits_all, logits.data());
  return logits;
}

struct engine_case {
  const char* name;
  ggml_type type;
  bool tied, bias;
};

class engine_test : public ::testing::TestWithParam<engine_case> {};

// Chunked prefill (n_batch 7) and token-by-token decode (n_batch 1) see exactly the same cache
// contents as one batch, so logits agree to float accumulation-order noise. The CPU backend
// switches matmul paths with the batch size (8-bit activations for small batches), hence the
// bound: relative 8-bit activation rounding (1/254 of a block max) through 3 layers.
TEST_P(engine_test, chunked_and_single_token_match_one_batch) {
  const engine_case c = GetParam();
  const model_weights w = write_and_load(tiny_hparams(c.tied, c.bias), c.type, 42);
  const auto tokens = some_tokens(61, w.hp.n_vocab);
  const auto whole = run_all_logits(w, backend_kind::backend_ref, cache_format::cache_fp32, 512, tokens);
  const auto chunked = run_all_logits(w, backend_kind::backend_ref, cache_format::cache_fp32, 7, tokens);
  const auto single = run_all_logits(w, backend_kind::backend_ref, cache_format::cache_fp32, 1, tokens);
  // The reference backend is deterministic per row, so chunking must not change anything beyond
  // the attention sums' order.
  for (size_t i = 0; i < whole.size(); ++i) {
    ASSERT_NEAR(chunked[i], whole[i], 1e-4f) << i;
    ASSERT_NEAR(single[i], whole[i], 1e-4f) << i;
  }
}

// End to end, the optimized backend against the scalar oracle, for each decode-activation mode.
// The few-token path (below the kernel's crossover, which depends on the weight type) rounds
// activations to blocks (act_q16, the default: step max|x_b| / 32767, a relative error u = 2^-16
// of the block max per element; act_q8: u = 1/254) or keeps floats (act_f32: float sums in
// another order, u = 8 * 2^-24, about log2 of a few hundred terms' roundings); above it, the
// prefill GEMM: f32 sgemm, or where the CPU has AVX-512 VNNI the integer GEMM with the process's
// prefill activations (q16 there by default: the same u as act_q16). test::engine_logit_bound is kEngineAmplification * u * max(1, max |ref
// logit|), kEngineAmplification covering one rounding's growth through three layers' matmuls,
// norms and softmax: measured here at ~3.9 for both block-rounded modes and ~1.6 for f32
// (2026-12-02; the observed/bound ratio is printed), so 16 leaves a margin of 4x.
TEST_P(engine_test, cpu_backend_matches_ref_backend) {
  const engine_case c = GetParam();
  const model_weights w = write_and_load(tiny_hparams(c.tied, c.bias), c.type, 7);
  const auto tokens = some_tokens(40, w.hp.n_vocab);
  const bool quantized = c.type != ggml_type::ggml_f32 && c.type != ggml_type::ggml_f16;
  for (const decode_activations act :
       {decode_activations::act_f32, decode_activations::act_q16, decode_activations::act_q8}) {
    backend_settings settings;
    settings.decode = act;  // prefill: the backend's default (or XCTX_PREFILL_ACT)
    const prefill_activations prefill = *make_backend(backend_kind::backend_cpu, settings)->settings().prefill;
    for (int n_batch : {1, 512}) {
      const auto r = run_all_logits(w, backend_kind::backend_ref, cache_format::cache_fp32, n_batch, tokens);
      const auto o = run_all_logits(w, backend_kind::backend_cpu, cache_format::cache_fp32, n_batch, tokens, settings);
      double max_abs = 0, max_ref = 0;
      for (size_t i = 0; i < r.size(); ++i) {
        max_abs = test::worse(max_abs, (double)std::fabs(r[i] - o[i]));
        max_ref = std::max(max_ref, (double)std::fabs(r[i]));
      }
      // One token per call never reaches the prefill GEMM, whatever its activations.
      const prefill_activations pre = n_batch == 1 ? prefill_activations::pre_f32 : prefill;
      const double bound = test::engine_logit_bound(quantized, max_ref, act, pre);
      std::printf("[engine] %s decode %s prefill %s n_batch %d: max |cpu - ref| %.3g, bound %.3g (observed/bound %.3f)\n",
                  c.name, decode_activations_name(act),
                  prefill_activations_name(pre), n_batch, max_abs, bound,
                  max_abs / bound);
      EXPECT_LE(max_abs, bound) << decode_activations_name(act) << " n_batch " << n_batch << " max |ref| "
                                << max_ref;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(models, engine_test,
                         ::testing::Values(engine_case{"q4_1_tied", ggml_type::ggml_q4_1, true, false},
                                           engine_case{"q8_0_untied", ggml_type::ggml_q8_0, false, false},
                                           engine_case{"f32_bias", ggml_type::ggml_f32, true, true},
                                           engine_case{"f16", ggml_type::ggml_f16, false, false}),
                         [](const auto& info) { return std::string(info.param.name); });

// SelfExtend's options reach the rope config, bad values are refused, and the reach is the
// docs' formula: the farthest pair (query L - 1, key 0) at relative distance
// floor((L - 1) / G) + W - floor(W / G) <= T - 1.
TEST(rope, selfextend_options_and_reach) {
  model_hparams hp;
  hp.head_dim = 64, hp.n_rot = 64, hp.n_ctx_train = 8192, hp.rope_freq_base = 1e5f;
  run_params rp;
  EXPECT_EQ(rope_reach(make_rope_config(hp, rp), hp.n_ctx_train), 8192);
  rp.rope_scale = rope_scaling::rope_scaling_linear, rp.rope_factor = 2.0f;
  EXPECT_EQ(rope_reach(make_rope_config(hp, rp), hp.n_ctx_train), 16384);
  rp = run_params{};
  rp.se_group = 4, rp.se_window = 1024;
  const rope_config r = make_rope_config(hp, rp);
  EXPECT_EQ(r.se_group, 4);
  EXPECT_EQ(r.se_window, 1024);
  const int64_t reach = rope_reach(r, hp.n_ctx_train);
  EXPECT_EQ(reach, 29696);
  for (int64_t L : {reach, reach + 1}) {
    const int64_t farthest = self_extend_query_pos(r, L - 1) - self_extend_key_pos(r, 0);
    EXPECT_EQ(farthest <= hp.n_ctx_train - 1, L == reach) << L;
  }
  EXPECT_EQ(describe_rope(r, hp.n_ctx_train), "selfextend G 4 W 1024 (reaches 29696 tokens)");
  rp.se_group = 1000000;
  EXPECT_THROW(make_rope_config(hp, rp), Error);
  rp.se_group = 4, rp.se_window = 8192;  // the window must leave room for groups
  EXPECT_THROW(make_rope_config(hp, rp), Error);
  rp.se_window = 0;
  EXPECT_THROW(make_rope_config(hp, rp), Error);
}

TEST(engine, rejects_tokens_outside_vocabulary_and_full_cache) {
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_f32, 1);
  auto be = make_backend(backend_kind::backend_cpu);
  llama_engine engine(w, *be, run_params{});
  auto cache = make_cache(cache_format::cache_fp16, engine.cache_geometry_for(4), *be);
  std::vector<float> logits(w.hp.n_vocab);
  int32_t bad = w.hp.n_vocab, pos0 = 0;
  EXPECT_THROW(engine.forward(&bad, &pos0, 1, *cache, llama_engine::logits_for::logits_last, logits.data()), Error);
  std::vector<int32_t> toks = {1, 2, 3, 4, 5}, pos = {0, 1, 2, 3, 4};
  EXPECT_THROW(engine.forward(toks.data(), pos.data(), 5, *cache, llama_engine::logits_for::logits_last, logits.data()),
               Error);
}

}  // namespace
}  // namespace xctx
