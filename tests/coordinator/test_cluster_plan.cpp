// xctx plan's arithmetic: the papers' own figures reproduced, the presets against a real file,
// and the plan's fit, longest context and decode projection consistent with the cache layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "cache/format.h"
#include "common/error.h"
#include "coordinator/tools/cluster_plan.h"
#include "model/gguf.h"
#include "model/weights.h"
#include "test_util.h"

namespace xctx {
namespace {

model_hparams preset(const std::string& name) { return plan_model_hparams(name); }

// KVQuant Table 6 (LLaMA-7B; GB at 128K, 1M, 10M) and Table 1's 32K fp16 entry, as printed:
// one decimal, so each must come out within half a unit of the last digit.
TEST(cluster_plan, kvquant_table6_llama7b_sizes_are_reproduced) {
  const model_hparams hp = preset("llama-2-7b");
  struct row {
    int bits;
    double frac;
    double gib_128k, gib_1m, gib_10m;
  };
  const row rows[] = {{16, 0.0, 32.0, 244.1, 2441.4},
                      {4, 0.01, 8.6, 66.0, 659.8},
                      {3, 0.01, 6.6, 50.7, 507.2},
                      {2, 0.01, 4.6, 35.5, 354.6}};
  for (const row& r : rows) {
    EXPECT_NEAR(kvquant_table_gib(hp, r.bits, r.frac, 128 * 1024), r.gib_128k, 0.05) << r.bits << " bits";
    EXPECT_NEAR(kvquant_table_gib(hp, r.bits, r.frac, 1000000), r.gib_1m, 0.05) << r.bits << " bits";
    EXPECT_NEAR(kvquant_table_gib(hp, r.bits, r.frac, 10000000), r.gib_10m, 0.05) << r.bits << " bits";
  }
  EXPECT_NEAR(kvquant_table_gib(hp, 16, 0.0, 32 * 1024), 8.0, 0.05);  // Table 1, BS 1
  // What the tables count is one n_embd-vector per layer and token: xctx's K+V fp16 cache of
  // the same model holds twice that (plus 4 bytes of position).
  const double fp16_per_token = kvquant_table_gib(hp, 16, 0.0, 1) * 1024.0 * 1024.0 * 1024.0;
  plan_inputs in;
  in.hp = hp, in.context = 1 << 20, in.ranks = 1, in.device = find_device("a100-80gb"), in.network = find_network("nvlink3");
  EXPECT_DOUBLE_EQ(plan_format(in, cache_format::cache_fp16).bytes_per_token, 2.0 * fp16_per_token + 4.0);
}

// Retrieval's projection: the fullest rank reads the weights, the min/max of its blocks'
// summaries and S + W + k·B tokens of its cache, so the step stops growing with the context.
TEST(cluster_plan, retrieval_step_reads_the_weights_summaries_and_the_selected_tokens) {
  plan_inputs in;
  in.hp = preset("llama-3-8b"), in.ranks = 8, in.device = find_device("h100"), in.network = find_network("nvlink4");
  retrieval_options r;  // sink 256, local 4096, top-32 blocks of 256
  in.retrieval = &r;
  double last = 0;
  for (const int64_t ctx : {int64_t(1) << 20, int64_t(10) << 20}) {
    in.context = ctx;
    const format_plan p = plan_format(in, cache_format::cache_nuq3_1pct);
    const double C = (double)in.hp.n_head_kv * in.hp.head_dim;
    const double summaries = (double)p.tokens_per_rank / 256 * in.hp.n_layer * (2 * C * 2 + 12);
    EXPECT_NEAR(p.retrieval_bytes_read, p.weight_bytes + summaries + (256 + 4096 + 32 * 256) * p.bytes_per_token,
                1e-6 * p.retrieval_bytes_read);
    EXPECT_NEAR(p.summary_bytes_per_token, (12.0 + 3 * C * 2) * in.hp.n_layer / 256, 1e-9);
    EXPECT_DOUBLE_EQ(p.selection_bytes_per_token_layer, 32.0 * 16);
    EXPECT_LT(p.retrieval_decode_s, p.decode_s) << ctx;
    if (last > 0) {
      EXPECT_LT(p.retrieval_decode_s, 1.5 * last) << "10x the context, the step nearly flat";
    }
    last = p.retrieval_decode_s;
  }
  // Per KV head: n_head_kv lists of k records per query, and at most n_head_kv·k blocks read.
  r.scope = selection_scope::select_per_kv_head;
  in.context = int64_t(1) << 20;
  const format_plan p = plan_format(in, cache_format::cache_nuq3_1pct);
  const double C = (double)in.hp.n_head_kv * in.hp.head_dim;
  const double summaries = (double)p.tokens_per_rank / 256 * in.hp.n_layer * (2 * C * 2 + 12);
  EXPECT_DOUBLE_EQ(p.selection_bytes_per_token_layer, 32.0 * 16 * in.hp.n_head_kv);
  EXPECT_NEAR(p.retrieval_bytes_read,
              p.weight_bytes + summaries +
                  std::min<double>((double)p.tokens_per_rank, 256 + 4096 + 32.0 * 256 * in.hp.n_head_kv) *
                      p.bytes_per_token,
              1e-6 * p.retrieval_bytes_read);
}

// XQuant §3.4: H100 (756 TFLOPs / 2 TB/s = ridge 378), d = 4K, 2-bit X: 2.3K tokens for
// Llama-2-7B (MHA, eq. 3) and 40.6K for Llama-3.1-8B (GQA g = 4, eq. 4). The paper's K is 1000.
TEST(cluster_plan, xquant_ridge_lengths_are_reproduced) {
  const device_spec h100 = find_device("h100-pcie");
  const double ridge = h100.peak_flops / h100.bandwidth;
  EXPECT_DOUBLE_EQ(ridge, 378.0);
  const model_hparams mha = preset("llama-2-7b"), gqa = preset("llama-3.1-8b");
  const double l_mha = xquant_ridge_length_mha(ridge, mha.n_embd, 2);
  const double l_gqa = xquant_ridge_length_gqa(ridge, gqa.n_embd, (double)gqa.n_head / gqa.n_head_kv, 2);
  EXPECT_EQ(std::lround(l_mha / 100.0), 23) << l_mha;
  EXPECT_EQ(std::lround(l_gqa / 100.0), 406) << l_gqa;
  // Above the ridge the rebuild never stays memory-bound.
  EXPECT_TRUE(std::isinf(xquant_ridge_length_mha(1e6, 4096, 2)));
}

TEST(cluster_plan, preset_parameter_counts_match_the_published_sizes) {
  EXPECT_NEAR(model_parameters(preset("llama-2-7b")) / 1e9, 6.74, 0.01);
  EXPECT_NEAR(model_parameters(preset("llama-3-8b")) / 1e9, 8.03, 0.01);
  EXPECT_NEAR(model_parameters(preset("llama-3-70b")) / 1e9, 70.55, 0.05);
  EXPECT_NEAR(model_parameters(preset("smollm2-135m")) / 1e9, 0.1346, 0.0005);
}

TEST(cluster_plan, smollm2_preset_equals_the_shipped_gguf) {
  XCTX_REQUIRE_MODEL(path);
  const model_hparams file = plan_model_hparams(path), p = preset("smollm2-135m");
  EXPECT_EQ(file.n_layer, p.n_layer);
  EXPECT_EQ(file.n_embd, p.n_embd);
  EXPECT_EQ(file.n_ff, p.n_ff);
  EXPECT_EQ(file.n_head, p.n_head);
  EXPECT_EQ(file.n_head_kv, p.n_head_kv);
  EXPECT_EQ(file.head_dim, p.head_dim);
  EXPECT_EQ(file.n_vocab, p.n_vocab);
  EXPECT_EQ(file.n_ctx_train, p.n_ctx_train);
  EXPECT_EQ(file.tied_output, p.tied_output);
  EXPECT_FLOAT_EQ(file.rope_freq_base, p.rope_freq_base);
}

using test::error_of;

TEST(cluster_plan, unknown_names_are_listed_in_the_error) {
  EXPECT_NE(error_of([] { plan_model_hparams("llama-9-1t"); }).find("llama-2-7b"), std::string::npos);
  EXPECT_NE(error_of([] { find_device("tpu"); }).find("h100-pcie"), std::string::npos);
  EXPECT_NE(error_of([] { find_network("carrier-pigeon"); }).find("ib-ndr"), std::string::npos);
}

plan_inputs eight_h100(const std::string& model, int64_t context) {
  plan_inputs in;
  in.hp = preset(model), in.context = context, in.ranks = 8;
  in.device = find_device("h100"), in.network = find_network("nvlink4");
  return in;
}

// The longest context is the edge of `fits`: it fits, one more token per rank does not.
TEST(cluster_plan, max_context_is_where_fit_ends) {
  for (cache_format f : {cache_format::cache_fp16, cache_format::cache_nuq3_1pct, cache_format::cache_kivi2,
                         cache_format::cache_xquant_cl3}) {
    const plan_inputs probe = eight_h100("llama-3-8b", 1 << 20);
    const int64_t max_ctx = plan_format(probe, f).max_context;
    ASSERT_GT(max_ctx, 0) << format_traits(f).name;
    EXPECT_EQ(max_ctx % probe.ranks, 0);
    EXPECT_TRUE(plan_format(eight_h100("llama-3-8b", max_ctx), f).fits) << format_traits(f).name;
    EXPECT_FALSE(plan_format(eight_h100("llama-3-8b", max_ctx + probe.ranks), f).fits) << format_traits(f).name;
  }
  // A model bigger than the budget fits no context at all.
  plan_inputs big = eight_h100("llama-3-70b", 1024);
  const format_plan p = plan_format(big, cache_format::cache_fp16);
  EXPECT_FALSE(p.fits);
  EXPECT_EQ(p.max_context, 0);
}

// The decode projection: weights + the rank's cache at the effective bandwidth, compute hidden
// under it when smaller, plus P-1 all-gather steps per layer.
TEST(cluster_plan, decode_projection_is_the_stated_roofline) {
  const plan_inputs in = eight_h100("llama-3-8b", 1 << 20);
  const format_plan p = plan_format(in, cache_format::cache_nuq3_1pct);
  const double bw = in.device.bandwidth * in.bandwidth_efficiency;
  EXPECT_DOUBLE_EQ(p.decode_memory_s, (p.weight_bytes + p.cache_bytes_per_rank) / bw);
  // GPU ranks merge (o, lse) partials (the CUDA backend has no exact accumulator).
  const double merge = in.hp.n_layer * 7 * (in.network.latency_s + merge_bytes_o_lse(in.hp) / in.network.bandwidth);
  EXPECT_DOUBLE_EQ(p.decode_merge_s, merge);
  EXPECT_DOUBLE_EQ(p.decode_s, std::max(p.decode_memory_s, p.decode_rebuild_s) + merge);
  // Fewer bytes per token, shorter memory term; 1 rank has no merge.
  EXPECT_LT(p.decode_memory_s, plan_format(in, cache_format::cache_fp16).decode_memory_s);
  plan_inputs one = in;
  one.ranks = 1;
  EXPECT_EQ(plan_format(one, cache_format::cache_nuq3_1pct).decode_merge_s, 0.0);
  // The exact accumulator's bytes (worker/sequence_parallel.h) against a plain (o, lse) merge.
  EXPECT_EQ(merge_bytes_o_lse(in.hp), 32.0 * 129 * 4);
  EXPECT_GT(merge_bytes_exact(in.hp), merge_bytes_o_lse(in.hp));
}

// The cache per rank is the exact layout of ceil(context / P) tokens, the key-outlier reserve
// of the nuq -1% caches included -- what xctx's own fit check counts.
TEST(cluster_plan, cache_per_rank_is_the_exact_layout) {
  const plan_inputs in = eight_h100("smollm2-135m", 1000003);
  const format_plan p = plan_format(in, cache_format::cache_kivi2);
  EXPECT_EQ(p.tokens_per_rank, 125001);
  cache_geometry g;
  g.n_layer = 30, g.n_head = 9, g.n_head_kv = 3, g.head_dim = 64, g.n_embd = 576, g.capacity = 125001;
  EXPECT_DOUBLE_EQ(p.cache_bytes_per_rank, (double)cache_bytes_for(cache_format::cache_kivi2, g, 125001, 0, 0).total());
}

// A measured CPU machine (benchmarks/scaling.py's profile): ranks share its cores, work is
// conserved at the core seconds of the rank's thread count (max(1, cores / P)); its cores all
// work unless P single-thread ranks leave some idle (3 ranks on 4 cores); all ranks' caches
// share its memory.
TEST(cluster_plan, cpu_profile_projection_shares_the_cores) {
  const std::string path = ::testing::TempDir() + "/xctx_cpu_profile.json";
  {
    std::ofstream f(path);
    f << R"({"machine": "test CPU", "cores": 2, "memory_bytes": 1e9, "n_layer": 30, "n_embd": 576,
             "formats": {"fp16": {
               "2": {"decode_fixed_core_s": 0.03, "decode_core_s_per_token": 2e-6,
                     "prefill_core_s_per_token": 0.005, "prefill_core_s_per_token2": 2e-7},
               "1": {"decode_fixed_core_s": 0.02, "decode_core_s_per_token": 1e-6,
                     "prefill_core_s_per_token": 0.004, "prefill_core_s_per_token2": 1e-7}}}})";
  }
  const cpu_profile prof = read_cpu_profile(path);
  ASSERT_EQ(prof.costs(cache_format::cache_fp16).by_threads.front().first, 1);  // sorted
  plan_inputs in;
  in.hp = preset("smollm2-135m"), in.context = 8192, in.cpu = &prof, in.weight_bits = 5;
  for (int P : {1, 2, 4, 8}) {
    in.ranks = P;
    const format_plan p = plan_format(in, cache_format::cache_fp16);
    // One rank runs 2 threads at the 2-thread costs; more ranks run one thread each.
    const double fixed = P == 1 ? 0.03 : 0.02, per_tok = P == 1 ? 2e-6 : 1e-6;
    const double lin = P == 1 ? 0.005 : 0.004, att = P == 1 ? 2e-7 : 1e-7;
    EXPECT_DOUBLE_EQ(p.decode_s, (P * fixed + 8192 * per_tok) / 2) << P;
    EXPECT_DOUBLE_EQ(p.prefill_ring_s, (8192 * lin + 8192.0 * 8192.0 * att) / 2) << P;
    // Every rank's cache and the weights once fit in 90% of the machine.
    EXPECT_EQ(p.fits, p.weight_bytes + P * p.cache_bytes_per_rank <= 0.9e9) << P;
  }
  // A collective's price (n_layer merges per step, P-1 ring steps per layer) and the work lost
  // by ranks taking turns on the cores (P > C only), by ranks per core: measured at 2 and 4,
  // linear from 1 at P = C, and past 4 along the last segment.
  cpu_profile sync = prof;
  sync.collective_s = 1e-4;
  sync.oversubscribed = {{4, 1.9, 1.3}, {2, 1.3, 1.1}};  // read_cpu_profile sorts; turns_at needs it
  std::sort(sync.oversubscribed.begin(), sync.oversubscribed.end(),
            [](const auto& a, const auto& b) { return a.ranks_per_core < b.ranks_per_core; });
  const std::map<double, std::pair<double, double>> expect_turns = {
      {0.5, {1, 1}}, {1, {1, 1}}, {1.5, {1.15, 1.05}}, {2, {1.3, 1.1}}, {3, {1.6, 1.2}}, {4, {1.9, 1.3}},
      {8, {3.1, 1.7}}};
  for (const auto& [rpc, f] : expect_turns) {
    EXPECT_NEAR(sync.turns_at(rpc).decode, f.first, 1e-12) << rpc;
    EXPECT_NEAR(sync.turns_at(rpc).prefill, f.second, 1e-12) << rpc;
  }
  in.cpu = &sync;
  for (int P : {1, 2, 4, 8, 16}) {
    in.ranks = P;
    const double each = P == 1 ? 0 : 1e-4, fixed = P == 1 ? 0.03 : 0.02, tok = P == 1 ? 2e-6 : 1e-6;
    const double lin = P == 1 ? 0.005 : 0.004, att = P == 1 ? 2e-7 : 1e-7;
    const auto [fd, fp] = expect_turns.at(P / 2.0);
    const format_plan p = plan_format(in, cache_format::cache_fp16);
    EXPECT_DOUBLE_EQ(p.decode_merge_s, 30 * each) << P;
    EXPECT_NEAR(p.decode_s, (P * fixed + 8192 * tok) / 2 * fd + 30 * each, 1e-12) << P;
    EXPECT_NEAR(p.prefill_ring_s, (8192 * lin + 8192.0 * 8192.0 * att) / 2 * fp + 30 * (P - 1) * each, 1e-9) << P;
  }
  // Over several hosts a collective costs the across-hosts price, plus its turns term per rank
  // per core past the first; one host keeps the one-host price. Without that calibration a
  // multi-host projection is refused.
  sync.has_across_hosts = true, sync.across_collective_s = 3e-4, sync.across_turns_collective_s = 2e-3;
  for (int P : {2, 4, 8}) {
    in.ranks = P;
    for (int H : {1, 2}) {
      in.hosts = H;
      const double each = H == 1 ? 1e-4 : 3e-4 + 2e-3 * std::max(0.0, P / 2.0 - 1);
      const format_plan p = plan_format(in, cache_format::cache_fp16);
      EXPECT_NEAR(p.decode_merge_s, 30 * each, 1e-12) << P << " ranks, " << H << " hosts";
      const auto [fd, fp] = expect_turns.at(P / 2.0);
      EXPECT_NEAR(p.prefill_ring_s, (8192 * 0.004 + 8192.0 * 8192.0 * 1e-7) / 2 * fp + 30 * (P - 1) * each, 1e-9)
          << P << " ranks, " << H << " hosts";
    }
  }
  in.hosts = 3, in.ranks = 2;
  EXPECT_NE(error_of([&] { plan_format(in, cache_format::cache_fp16); }).find("--hosts must be in 1..2"),
            std::string::npos);
  in.hosts = 2, in.cpu = &prof;
  EXPECT_NE(error_of([&] { plan_format(in, cache_format::cache_fp16); }).find("no across-hosts calibration"),
            std::string::npos);
  in.hosts = 1;
  cpu_profile four = prof;  // 4 cores: 3 single-thread ranks leave one idle; 1 rank's 4 threads
  four.cores = 4, in.cpu = &four, in.ranks = 3;  // run at the 2-thread costs, scaled ideally
  EXPECT_DOUBLE_EQ(plan_format(in, cache_format::cache_fp16).decode_s, (3 * 0.02 + 8192 * 1e-6) / 3);
  in.ranks = 1;
  EXPECT_DOUBLE_EQ(plan_format(in, cache_format::cache_fp16).decode_s, (0.03 + 8192 * 2e-6) / 4);
  in.cpu = &prof;
  EXPECT_NE(error_of([&] { plan_format(in, cache_format::cache_kivi2); }).find("has: fp16"), std::string::npos);
  const auto refusal = [&](const char* formats) {
    std::ofstream(path) << R"({"cores": 2, "memory_bytes": 1e9, "n_layer": 30, "n_embd": 576, "formats": )" << formats
                        << "}";
    return error_of([&] { read_cpu_profile(path); });
  };
  EXPECT_NE(refusal(R"({"fp16": {"1": {"decode_fixed_core_s": -1}}})").find("formats.fp16.1.decode_fixed_core_s"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"fp16": {"one": {}}})").find("'one' is not a thread count"), std::string::npos);
  EXPECT_NE(refusal(R"({"fp16": {}})").find("must map thread counts"), std::string::npos);
  EXPECT_NE(refusal(R"({"fp16": {"1": {"decode_fixed_core_s": 0, "decode_core_s_per_token": 0,
      "prefill_core_s_per_token": 0, "prefill_core_s_per_token2": 0}}}, "oversubscribed":
      {"2": {"decode_factor": 0.5, "prefill_factor": 1}})").find("oversubscribed.2.*: the factors are measured time over conserved work (>= 1)"),
            std::string::npos);
  EXPECT_NE(refusal(R"({"fp16": {"1": {"decode_fixed_core_s": 0, "decode_core_s_per_token": 0,
      "prefill_core_s_per_token": 0, "prefill_core_s_per_token2": 0}}}, "oversubscribed":
      {"1": {"decode_factor": 2, "prefill_factor": 1}})").find("'1' is not a count of ranks per core above 1"),
            std::string::npos);
  EXPECT_NE(error_of([] { read_cpu_profile("/nonexistent/profile.json"); }).find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace xctx
