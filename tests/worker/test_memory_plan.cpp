// The memory plan (worker/memory_plan.h): the cache bytes it predicts are what the caches
// allocate, the prefill parts follow the documented formula, and the fit check refuses what
// cannot fit with a message naming what would.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "cache/quant_test_util.h"
#include "cache/x_test_util.h"
#include "cache/x_factors.h"
#include "common/error.h"
#include "kernels/cuda/scratch.h"
#include "kernels/softmax_acc.h"
#include "model/weights.h"
#include "registry/registry.h"
#include "test_util.h"
#include "worker/memory_plan.h"

namespace xctx {
namespace {

// The fit check counts the CPU kernels' workspace (kernel_workspace_bytes, registry/registry.h).
constexpr backend_kind kCpu = backend_kind::backend_cpu;

model_hparams smollm2_like() {
  model_hparams hp;
  hp.n_layer = 30, hp.n_embd = 576, hp.n_ff = 1536, hp.n_head = 9, hp.n_head_kv = 3, hp.head_dim = 64;
  hp.n_rot = 64, hp.n_vocab = 49152, hp.n_ctx_train = 8192;
  return hp;
}

// Sets XCTX_MEMORY_LIMIT for one scope.
struct memory_limit {
  explicit memory_limit(const char* v) { setenv("XCTX_MEMORY_LIMIT", v, 1); }
  ~memory_limit() { unsetenv("XCTX_MEMORY_LIMIT"); }
};

TEST(memory_plan, cache_allocation_matches_the_caches) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  auto be = make_backend(backend_kind::backend_cpu);
  const int64_t cap = 4096;
  const cache_geometry g = make_cache_geometry(w.hp, rope_config{}, cap);
  const auto calib = test::make_synthetic_calibration(g, 7);
  for (const char* name : {"fp16", "fp32", "kivi2", "kivi4", "nuq3", "nuq3-1%", "nuq4-1%", "xquant2", "xquant-cl3", "clkv"}) {
    cache_spec spec(parse_cache_format(name));
    spec.options.calib = calib;
    if (format_needs_x_factors(spec.format)) spec.options.factors = build_x_factors(w, x_factor_kind_for(spec.format));
    const size_t predicted = cache_allocation_bytes(spec, w.hp, cap);
    const size_t allocated = make_cache(spec, g, *be)->bytes_allocated();
    // Exact up to the small fixed parts (kivi's residual window, per-layer tables).
    EXPECT_NEAR((double)predicted, (double)allocated, 0.02 * (double)allocated) << name;
  }
}

// What the fit check counts for the X factors' upload on a device is what build_x_factors holds,
// for both kinds, GQA (SVD factors) and MHA (identity), with and without q/k/v biases.
TEST(memory_plan, factor_bytes_match_the_built_factors) {
  for (bool gqa : {true, false})
    for (bool bias : {false, true}) {
      const test::x_model m = test::make_x_model(test::x_geometry(gqa, 16), 3, bias);
      for (x_factor_kind kind : {x_factor_kind::xf_latent, x_factor_kind::xf_cross_layer}) {
        x_factors built = *build_x_factors(m.w, kind);
        size_t floats = 0;
        for (const std::vector<float>* a : x_factor_arrays(built)) floats += a->size();
        EXPECT_EQ(x_factor_bytes(m.w.hp, kind), floats * sizeof(float))
            << (gqa ? "GQA" : "MHA") << (bias ? " bias" : "") << " kind " << (int)kind;
      }
    }
}

TEST(memory_plan, exact_ring_parts_follow_the_formula) {
  const model_hparams hp = smollm2_like();
  sequence_options opt;
  opt.mode = prefill_mode::prefill_exact;
  const int P = 8, n_batch = 512;
  const int64_t n = 1 << 20;
  const rank_memory m = estimate_rank_memory(hp, cache_format::cache_fp16, opt, n_batch, 1, n, 32, P, kCpu);
  const int64_t s = n / P;  // zigzag shards of a power of two
  EXPECT_NEAR((double)m.residual, (double)s * 576 * 4, 576.0 * 4 * 512);
  EXPECT_EQ(m.scratch, (size_t)512 * (2 * 576 + 2 * 576 + 2 * 192 + 2 * 1536) * 4);
  EXPECT_EQ(m.accumulators, (size_t)512 * 9 * (4 + kAccBins * 65 * 8));
  EXPECT_NEAR((double)m.ring_blocks, (double)n * (2 * 192 * 2 + 4) + 512.0 * P, 1.0);  // fp16 K and V + position
  EXPECT_EQ(m.foreign_acc, 0u);
  EXPECT_EQ(m.star_caches, 0u);
  // Kernel workspace, 1 thread: a 1 MiB weight panel and the decode path's near + grouped K/V
  // unit tiles (4 x 256 x 192 x 4 B), the prefill path's 4-unit batch of them, the chunk's queries.
  EXPECT_EQ(m.workspace, (size_t)(1048576 + 786432) + 4 * 786432 + 512 * 576 * 4);
  // Temporaries: the shard's residual stream and one layer of the context's blocks, not the
  // ~21 KB per shard token of holding every query's accumulator and q, o at once (0.41x here
  // for fp16; a 3-bit format holds a quarter of fp16's blocks).
  EXPECT_LT((double)(m.total() - m.cache), 0.45 * (double)s * 21000);
  EXPECT_LT((double)(m.scratch + m.accumulators), 0.01 * (double)s * 21000);
  // One rank runs chunk-major: no shard-sized residual, no ring.
  const rank_memory one = estimate_rank_memory(hp, cache_format::cache_fp16, opt, n_batch, 1, 100000, 32, 1, kCpu);
  EXPECT_EQ(one.residual, (size_t)512 * 576 * 4);
  EXPECT_EQ(one.ring_blocks, 0u);
}

// On the CUDA backend the workspace is the device scratch's bound for the job's shape
// (kernels/cuda/scratch.h): the split partials' cap and the fullest selection over the shard,
// counted whether or not this build has CUDA (the planner may plan for another machine).
TEST(memory_plan, cuda_workspace_is_the_device_scratch_bound) {
  const model_hparams hp = smollm2_like();
  sequence_options opt;
  const int P = 8, n_batch = 512;
  const int64_t n = 1 << 20;
  const rank_memory m =
      estimate_rank_memory(hp, cache_format::cache_fp16, opt, n_batch, 1, n, 32, P, backend_kind::backend_cuda);
  workspace_shape ws{1, n_batch, (int64_t)hp.kv_dim(), (int64_t)hp.n_head * hp.head_dim};
  ws.n_head = hp.n_head, ws.n_head_kv = hp.n_head_kv, ws.head_dim = hp.head_dim, ws.n_embd = hp.n_embd;
  ws.max_weight_cols = std::max<int64_t>(hp.n_embd, hp.n_ff);
  ws.capacity = n / P + 32;  // the shard and the new tokens
  EXPECT_GE(m.workspace, (size_t)256 << 20);  // the partials' cap at least
  EXPECT_LE(m.workspace, cuda::scratch_bound(ws) + ((size_t)1 << 20));
}

TEST(memory_plan, xquant_cl_auto_ring_switches_to_latent_past_the_budget) {
  const model_hparams hp = smollm2_like();
  cache_spec spec(parse_cache_format("xquant-cl3"));
  spec.options.cl_ring = cl_ring_mode::cl_ring_auto;
  sequence_options opt;
  const int64_t per_token = (576 + 1) * 4;
  const int64_t under = (int64_t)(kClDeltasBudget / per_token) - 1, over = under + 2;
  EXPECT_EQ(resolve_ring_mode(spec, hp, opt, under, 8).options.cl_ring, cl_ring_mode::cl_ring_deltas);
  EXPECT_EQ(resolve_ring_mode(spec, hp, opt, over, 8).options.cl_ring, cl_ring_mode::cl_ring_latent);
  EXPECT_EQ(resolve_ring_mode(spec, hp, opt, over, 1).options.cl_ring, cl_ring_mode::cl_ring_deltas) << "no ring";
  const cache_spec deltas = resolve_ring_mode(spec, hp, opt, under, 8);
  EXPECT_GT(estimate_rank_memory(hp, deltas, opt, 512, 1, under, 1, 8, kCpu).foreign_acc, 0u);
}

TEST(memory_plan, star_holds_anchor_and_block_caches_not_the_shard) {
  const model_hparams hp = smollm2_like();
  sequence_options opt;
  opt.mode = prefill_mode::prefill_auto;
  opt.block_tokens = 4096;
  const rank_memory m = estimate_rank_memory(hp, cache_format::cache_fp16, opt, 512, 1, 1 << 20, 32, 8, kCpu);
  EXPECT_EQ(m.residual, (size_t)512 * 576 * 4);
  EXPECT_EQ(m.ring_blocks, 0u);
  EXPECT_EQ(m.star_caches, 2 * cache_allocation_bytes(cache_format::cache_fp16, hp, 4096));
  // One block per rank: the block is attended in the own cache, only the anchor is extra.
  const rank_memory one = estimate_rank_memory(hp, cache_format::cache_fp16, opt, 512, 1, 8 * 4096 - 1, 32, 8, kCpu);
  EXPECT_EQ(one.star_caches, cache_allocation_bytes(cache_format::cache_fp16, hp, 4096));
}

// xquant-cl attends from its f32 cross-layer accumulator, one row per token of every cache it
// keeps (own, star's anchor and block view); the other formats have none.
TEST(memory_plan, xquant_cl_counts_its_accumulator_rows) {
  const model_hparams hp = smollm2_like();
  sequence_options opt;
  opt.mode = prefill_mode::prefill_star;
  opt.block_tokens = 4096;
  const int64_t n = 1 << 20;
  const int P = 8;
  const rank_memory cl = estimate_rank_memory(hp, cache_spec(parse_cache_format("xquant-cl3")), opt, 512, 1, n, 32, P, kCpu);
  const double row = 576 * 4 + 2;
  EXPECT_GE((double)cl.x_accumulator, (double)(n / P + 2 * 4096) * row);
  EXPECT_LE((double)cl.x_accumulator, (double)(n / P + 3 * 4096 + 64) * row);  // a rank may hold one block more
  EXPECT_EQ(estimate_rank_memory(hp, cache_spec(parse_cache_format("xquant3")), opt, 512, 1, n, 32, P, kCpu).x_accumulator, 0u);
  EXPECT_EQ(estimate_rank_memory(hp, cache_format::cache_fp16, opt, 512, 1, n, 32, P, kCpu).x_accumulator, 0u);
}

TEST(memory_plan, auto_mode_counts_the_suffix_like_the_runner) {
  // A context one short of the threshold plus its one-token suffix is a prompt at the threshold:
  // star, in the plan as in the runner and the run header.
  const model_hparams hp = smollm2_like();
  sequence_options opt;
  opt.mode = prefill_mode::prefill_auto;
  opt.star_from_tokens = 32768;
  opt.block_tokens = 4096;
  EXPECT_EQ(with_mode_resolved(opt, 32768).mode, prefill_mode::prefill_star);
  EXPECT_EQ(with_mode_resolved(opt, 32767).mode, prefill_mode::prefill_exact);
  EXPECT_EQ(estimate_rank_memory(hp, cache_format::cache_fp16, opt, 512, 1, 32767, 32, 8, kCpu).ring_blocks, 0u);
  EXPECT_GT(estimate_rank_memory(hp, cache_format::cache_fp16, opt, 512, 1, 32766, 32, 8, kCpu).ring_blocks, 0u);
  EXPECT_NE(describe_prefill(opt, 32768).find("star: blocks of 4096 tokens"), std::string::npos);
  EXPECT_NE(describe_prefill(opt, 32768).find("(auto: prompt >= 32768)"), std::string::npos);
}

TEST(memory_plan, fit_check_refuses_with_what_would_fit) {
  const model_hparams hp = smollm2_like();
  auto comm = make_local_communicator();
  sequence_options opt;
  const memory_limit limit("1G");
  // 64K tokens of fp16 on one rank: 64K x 30 layers x 768 B = 1.4 GiB of cache.
  try {
    check_sequence_fits(*comm, hp, cache_format::cache_fp16, opt, 512, 1, 65536, 32, kCpu);
    FAIL() << "expected a refusal";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("does not fit in memory"), std::string::npos) << m;
    EXPECT_NE(m.find("cache 1.4 GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("rank 0 may use 1.0 GiB"), std::string::npos) << m;
    EXPECT_NE(m.find("Formats that fit at 1 rank(s): "), std::string::npos) << m;
    EXPECT_NE(m.find("nuq3-1%"), std::string::npos) << m;
    EXPECT_EQ(m.find("fp32 ("), std::string::npos) << "fp32 does not fit: " << m;
    EXPECT_NE(m.find("fp16 fits from 2 ranks"), std::string::npos) << m;
  }
  EXPECT_NO_THROW(check_sequence_fits(*comm, hp, cache_format::cache_fp16, opt, 512, 1, 16384, 32, kCpu));
}

}  // namespace
}  // namespace xctx
