// The engine, the fp caches and the exchanges on a backend whose memory is not the host's
// (tests/device_space_backend.h): what the CUDA backend needs of them, checked without a GPU.
// Host code touching backend memory faults there, host pointers handed to a kernel are errors,
// and attention runs as (o, lse) partials. Generation must match the CPU backend's exact path
// to the tolerance the partials' float merge and the 8-bit decode activations allow.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "cache/cache.h"
#include "cache/quant_test_util.h"
#include "cache/x_factors.h"
#include "comm/communicator.h"
#include "common/error.h"
#include "device_space_backend.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "registry/registry.h"
#include "require_gpu.h"
#include "test_util.h"
#include "tiny_model.h"
#include "worker/llama_engine.h"
#include "worker/memory_plan.h"
#include "worker/sequence_parallel.h"

namespace xctx {
namespace {

// The fit check counts the CPU kernels' workspace (kernel_workspace_bytes, registry/registry.h).
constexpr backend_kind kCpu = backend_kind::backend_cpu;

using test::some_tokens;
using test::tiny_hparams;
using test::write_and_load;

int32_t argmax(const std::vector<float>& v) { return (int32_t)(std::max_element(v.begin(), v.end()) - v.begin()); }

// The logits of a prefill of `prompt` (chunks of n_batch) and of n_steps greedy decode steps fed
// with `forced` (the reference run's tokens, so both runs see the same inputs): one vector per
// step, the prefill's first.
std::vector<std::vector<float>> run(const model_weights& w, backend& be, cache_format fmt, int n_batch,
                                    const std::vector<int32_t>& prompt, const std::vector<int32_t>& forced,
                                    test::self_extend_case se = {1, 0}) {
  run_params rp;
  rp.cache = fmt;
  rp.n_batch = n_batch;
  rp.se_group = se.group, rp.se_window = se.window;
  llama_engine engine(w, be, rp);
  const int64_t n = (int64_t)prompt.size();
  const cache_geometry g = engine.cache_geometry_for(n + (int64_t)forced.size());
  cache_options o;  // nuq: a calibration of the cache's shape (the same on both backends)
  o.group_size = 16, o.clkv_group = 8;  // kivi, xquant, clkv: windows encoded within the prompt
  o.cl_hi_layers = 2;                   // xquant-cl on 3 layers: X at 4 bits below, one delta layer
  if (format_traits(fmt).needs_calibration) o.calib = test::make_synthetic_calibration(g, 11);
  if (format_needs_x_factors(fmt)) o.factors = build_x_factors(w, x_factor_kind_for(fmt));
  auto cache = make_cache(cache_spec(fmt, o), g, be);
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
  std::vector<std::vector<float>> out(1, std::vector<float>(w.hp.n_vocab));
  engine.forward(prompt.data(), pos.data(), n, *cache, llama_engine::logits_for::logits_last, out[0].data());
  for (size_t s = 0; s < forced.size(); ++s) {
    const int32_t p = (int32_t)(n + s);
    out.emplace_back(w.hp.n_vocab);
    engine.forward(&forced[s], &p, 1, *cache, llama_engine::logits_for::logits_last, out.back().data());
  }
  return out;
}

struct space_case {
  const char* name;
  ggml_type type;
  bool tied, bias;
  cache_format format;
};

class device_space_engine : public ::testing::TestWithParam<space_case> {};

// Runs `fmt` on `other` and on the CPU backend, both teacher-forced with the CPU's greedy tokens,
// and checks every step. Bound, two terms:
//  - the CPU backend's own against the scalar oracle (test::engine_logit_bound, derived in
//    tests/worker/test_engine.cpp): a last-bit difference in the partials' merge can move a
//    decode activation by one rounding step (16-bit blocks by default; float weights never round);
//  - one code flip in the cache: the same last-bit difference can put a key or value element on
//    the other side of a rounding boundary when it is stored, moving it by one step of the format,
//    1 / (2^bits - 1) of its range (fp16: 2^-11). kFlipAmplification * step * max(1, max |logit|)
//    with kFlipAmplification = 1/8: measured at most 0.03 (clkv with AVX-512, kivi4 with AVX2
//    only, 2026-12-02; which elements flip depends on the ISA's float order), a margin of 4x.
// The worst observed/bound ratio is printed. The greedy token must agree wherever the reference's
// top two are further apart than twice the largest logit difference seen (closer, either may
// legitimately win).
constexpr double kFlipAmplification = 1.0 / 8;
double cache_code_step(cache_format fmt) {
  const int bits = format_traits(fmt).bits_per_element;
  if (bits >= 32) return 0;
  if (bits == 16) return std::ldexp(1.0, -11);
  return 1.0 / ((1 << bits) - 1);
}

void expect_generation_matches_the_cpu(const model_weights& w, bool quantized, backend& other, cache_format fmt,
                                       test::self_extend_case se = {1, 0}) {
  SCOPED_TRACE(format_traits(fmt).name + std::string(se.group > 1 ? " with SelfExtend" : ""));
  const auto prompt = some_tokens(45, w.hp.n_vocab);
  auto cpu = make_backend(backend_kind::backend_cpu);
  // The reference's own greedy continuation, fed to both runs.
  std::vector<int32_t> forced;
  {
    const auto probe = run(w, *cpu, fmt, 16, prompt, {}, se);
    forced.push_back(argmax(probe[0]));
    for (int s = 0; s < 11; ++s) {
      const auto more = run(w, *cpu, fmt, 16, prompt, forced, se);
      forced.push_back(argmax(more.back()));
    }
  }
  const auto ref = run(w, *cpu, fmt, 16, prompt, forced, se);
  const auto got = run(w, other, fmt, 16, prompt, forced, se);
  ASSERT_EQ(got.size(), ref.size());
  int compared = 0;
  double worst_ratio = 0, worst_abs = 0;
  for (size_t s = 0; s < ref.size(); ++s) {
    double max_abs = 0, max_ref = 0;
    for (size_t i = 0; i < ref[s].size(); ++i) {
      max_abs = test::worse(max_abs, (double)std::fabs(ref[s][i] - got[s][i]));
      max_ref = std::max(max_ref, (double)std::fabs(ref[s][i]));
    }
    const double bound =
        test::engine_logit_bound(quantized, max_ref, cpu->settings()) + kFlipAmplification * cache_code_step(fmt) * std::max(1.0, max_ref);
    worst_ratio = std::max(worst_ratio, max_abs / bound);
    worst_abs = std::max(worst_abs, max_abs);
    EXPECT_LE(max_abs, bound) << "step " << s;
    std::vector<float> sorted = ref[s];
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    if (sorted[0] - sorted[1] > 2 * max_abs) {  // no logit moved further: the order of the top two holds
      EXPECT_EQ(argmax(got[s]), argmax(ref[s])) << "step " << s;
      ++compared;
    }
  }
  EXPECT_GE(compared, 6) << "too few clear greedy choices to compare";
  std::printf("[device-space] %s: worst max |dlogit| %.3g, observed/bound %.3f over %zu steps\n", format_traits(fmt).name,
              worst_abs, worst_ratio, ref.size());
}

TEST_P(device_space_engine, generation_matches_the_cpu_backend) {
  const space_case c = GetParam();
  const model_weights w = write_and_load(tiny_hparams(c.tied, c.bias), c.type, 11);
  test::device_space_backend dev;
  expect_generation_matches_the_cpu(w, c.type != ggml_type::ggml_f32 && c.type != ggml_type::ggml_f16, dev, c.format);
  EXPECT_GT(dev.attention_calls, 0);
}

INSTANTIATE_TEST_SUITE_P(
    models, device_space_engine,
    ::testing::Values(space_case{"q4_1_tied_fp16", ggml_type::ggml_q4_1, true, false, cache_format::cache_fp16},
                      space_case{"q8_0_untied_fp32", ggml_type::ggml_q8_0, false, false, cache_format::cache_fp32},
                      space_case{"f32_bias_fp16", ggml_type::ggml_f32, true, true, cache_format::cache_fp16},
                      space_case{"q4_1_tied_kivi2", ggml_type::ggml_q4_1, true, false, cache_format::cache_kivi2},
                      space_case{"q8_0_untied_kivi4", ggml_type::ggml_q8_0, false, false, cache_format::cache_kivi4},
                      space_case{"q4_1_tied_nuq3_1pct", ggml_type::ggml_q4_1, true, false, cache_format::cache_nuq3_1pct},
                      space_case{"q8_0_untied_nuq4", ggml_type::ggml_q8_0, false, false, cache_format::cache_nuq4},
                      space_case{"q4_1_tied_xquant4", ggml_type::ggml_q4_1, true, false, cache_format::cache_xquant4},
                      space_case{"f32_bias_xquant3", ggml_type::ggml_f32, true, true, cache_format::cache_xquant3},
                      space_case{"q8_0_untied_clkv", ggml_type::ggml_q8_0, false, false, cache_format::cache_clkv},
                      space_case{"q4_1_tied_xquant_cl3", ggml_type::ggml_q4_1, true, false, cache_format::cache_xquant_cl3},
                      space_case{"f32_bias_xquant_cl2", ggml_type::ggml_f32, true, true, cache_format::cache_xquant_cl2}),
    [](const auto& info) { return std::string(info.param.name); });

// SelfExtend (G 4, W 16: most of the 45-token prompt is grouped) on the device-space backend,
// whose (o, lse) calls the CPU kernels run through an accumulator of the call's rows: generation
// matches the CPU backend's exact path for a plain, a quantized and an X cache.
TEST(device_space_engine_self_extend, generation_matches_the_cpu_backend) {
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_q4_1, 11);
  for (cache_format f : {cache_format::cache_fp16, cache_format::cache_nuq3_1pct, cache_format::cache_xquant2}) {
    test::device_space_backend dev;
    expect_generation_matches_the_cpu(w, true, dev, f, {4, 16});
    EXPECT_GT(dev.attention_calls, 0);
  }
}

// The same comparison on the CUDA backend (skipped without a usable device), fp16 and fp32
// caches, teacher-forced on the CPU's greedy tokens with the bound and the near-tie rule above
// (comparing two free-running generations would fail on the first near tie, which the GPU's other
// float order may legitimately break the other way). GEMMs in exact fp32 (XCTX_CUDA_TF32=0). The
// bound was derived on the device-space backend; no GPU has run this yet, so the printed
// observed/bound ratio of the first device run is the check of that derivation.
TEST(cuda_engine, greedy_generation_matches_the_cpu_backend) {
  setenv("XCTX_CUDA_TF32", "0", 1);
  XCTX_REQUIRE_CUDA();
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_q4_1, 11);
  auto gpu = make_backend(backend_kind::backend_cuda);
  for (cache_format f : {cache_format::cache_fp16, cache_format::cache_fp32}) expect_generation_matches_the_cpu(w, true, *gpu, f);
}

// The compressed caches on a real device (skipped without one): every quantized family's
// generation against the CPU backend's, as on the device-space backend above (GEMMs in exact
// fp32, XCTX_CUDA_TF32=0).
TEST(cuda_engine, compressed_cache_generation_matches_the_cpu_backend) {
  setenv("XCTX_CUDA_TF32", "0", 1);
  XCTX_REQUIRE_CUDA();
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_q4_1, 11);
  auto gpu = make_backend(backend_kind::backend_cuda);
  for (cache_format f : {cache_format::cache_kivi2, cache_format::cache_nuq3_1pct, cache_format::cache_xquant2,
                         cache_format::cache_clkv, cache_format::cache_xquant_cl3})
    expect_generation_matches_the_cpu(w, true, *gpu, f);
}

// CUDA graphs replay the decode segments (skipped without a device): the same logits as eager
// launches (XCTX_CUDA_GRAPHS=0) bit for bit -- the same kernels with the same arguments.
TEST(cuda_engine, decode_graphs_match_eager_launches) {
  setenv("XCTX_CUDA_TF32", "0", 1);
  XCTX_REQUIRE_CUDA();
  const model_weights w = write_and_load(tiny_hparams(true, true), ggml_type::ggml_q4_1, 11);
  const auto prompt = some_tokens(45, w.hp.n_vocab);
  std::vector<int32_t> forced;
  for (int s = 0; s < 8; ++s) forced.push_back((int32_t)((7 + 13 * s) % w.hp.n_vocab));
  setenv("XCTX_CUDA_GRAPHS", "0", 1);
  auto eager = make_backend(backend_kind::backend_cuda);
  unsetenv("XCTX_CUDA_GRAPHS");
  auto graphs = make_backend(backend_kind::backend_cuda);
  for (cache_format f : {cache_format::cache_fp16, cache_format::cache_nuq3_1pct, cache_format::cache_xquant2}) {
    const auto want = run(w, *eager, f, 16, prompt, forced);
    const auto got = run(w, *graphs, f, 16, prompt, forced);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < want.size(); ++s) EXPECT_EQ(got[s], want[s]) << format_traits(f).name << " step " << s;
  }
}

// Weights go up once, when the engine is made; a decode step then moves a handful of small
// arrays up (token id, positions for rope, the cache's slots and the queries' positions: the
// same for every layer, so uploaded once) and only the logits down -- nothing per layer.
TEST(device_space, a_decode_step_has_no_per_layer_transfers) {
  const model_weights w = write_and_load(tiny_hparams(false, false), ggml_type::ggml_q8_0, 5);
  test::device_space_backend dev;
  run_params rp;
  llama_engine engine(w, dev, rp);
  const int64_t uploads_of_weights = dev.uploads;
  // Every matrix and vector (3 layers x 9 pieces, embedding, output, output norm): one upload each.
  EXPECT_EQ(uploads_of_weights, 3 * 9 + 3);
  auto cache = make_cache(cache_format::cache_fp16, engine.cache_geometry_for(64), dev);
  const auto prompt = some_tokens(20, w.hp.n_vocab);
  std::vector<int32_t> pos(prompt.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = (int32_t)i;
  std::vector<float> logits(w.hp.n_vocab);
  engine.forward(prompt.data(), pos.data(), (int64_t)prompt.size(), *cache, llama_engine::logits_for::logits_last,
                 logits.data());
  for (int s = 0; s < 4; ++s) {
    const int64_t up = dev.uploads, down = dev.downloads;
    const uint64_t up_bytes = dev.upload_bytes;
    const int32_t tok = argmax(logits), p = (int32_t)(prompt.size() + s);
    engine.forward(&tok, &p, 1, *cache, llama_engine::logits_for::logits_last, logits.data());
    EXPECT_EQ(dev.uploads - up, 4) << "step " << s;  // id, rope positions, cache slot, query positions
    EXPECT_EQ(dev.upload_bytes - up_bytes, 4u * sizeof(int32_t)) << "step " << s;
    EXPECT_EQ(dev.downloads - down, 1) << "step " << s;  // the logits
  }
}

// Decode steps with their segments recorded once and replayed (what CUDA graphs do on the CUDA
// backend, emulated: tests/device_space_backend.h) compute the same bits as the eager steps, for
// caches of every family: nothing a segment's calls read is moved between steps, and the host
// work between segments (cache appends, attention) stays outside them.
TEST(device_space, decode_segments_replayed_from_a_record_match_eager_steps) {
  const model_weights w = write_and_load(tiny_hparams(true, true), ggml_type::ggml_q4_1, 11);
  const auto prompt = some_tokens(45, w.hp.n_vocab);
  std::vector<int32_t> forced;
  for (int s = 0; s < 8; ++s) forced.push_back((int32_t)((7 + 13 * s) % w.hp.n_vocab));
  for (cache_format f : {cache_format::cache_fp16, cache_format::cache_nuq3_1pct, cache_format::cache_xquant2,
                         cache_format::cache_xquant_cl3}) {
    SCOPED_TRACE(format_traits(f).name);
    test::device_space_backend eager, replayed;
    replayed.record_segments = true;
    const auto want = run(w, eager, f, 16, prompt, forced);
    const auto got = run(w, replayed, f, 16, prompt, forced);
    ASSERT_EQ(got.size(), want.size());
    for (size_t s = 0; s < want.size(); ++s) EXPECT_EQ(got[s], want[s]) << "step " << s;
    // Two segments per layer, recorded at the second decode step and replayed from then on.
    EXPECT_EQ(replayed.segments_recorded, 2 * w.hp.n_layer);
    EXPECT_EQ(replayed.segment_replays, 2 * w.hp.n_layer * ((int64_t)forced.size() - 1));
  }
}

// An engine made where an earlier one lived (the same address, scratch mapped at the same
// places) does not replay the earlier engine's segments, whose calls hold the other weights.
TEST(device_space, a_new_engine_does_not_replay_an_old_engines_segments) {
  const model_weights a = write_and_load(tiny_hparams(true, false), ggml_type::ggml_q4_1, 11);
  const model_weights b = write_and_load(tiny_hparams(true, false), ggml_type::ggml_q4_1, 12);
  const auto prompt = some_tokens(45, a.hp.n_vocab);
  const std::vector<int32_t> forced = {3, 14, 15, 92, 65};
  test::device_space_backend eager, replayed;
  replayed.record_segments = true;
  run(a, replayed, cache_format::cache_fp16, 16, prompt, forced);  // a's segments recorded
  const auto want = run(b, eager, cache_format::cache_fp16, 16, prompt, forced);
  const auto got = run(b, replayed, cache_format::cache_fp16, 16, prompt, forced);
  for (size_t s = 0; s < want.size(); ++s) EXPECT_EQ(got[s], want[s]) << "step " << s;
  EXPECT_EQ(replayed.segments_recorded, 2 * 2 * a.hp.n_layer);  // each engine its own
}

// What a graph cannot hold is refused while a segment is recorded, naming the operation.
TEST(device_space, a_segment_that_moves_memory_is_refused) {
  test::device_space_backend dev;
  dev.record_segments = true;
  backend_buffer buf(dev);
  float* p = buf.reserve_as<float>(4);
  const float x[4] = {1, 2, 3, 4};
  const auto f = [&] { dev.upload(p, x, sizeof x); };
  dev.run_segment(7, f);  // the first use runs eagerly
  try {
    dev.run_segment(7, f);
    FAIL() << "an upload was recorded into a segment";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("upload inside a decode segment"), std::string::npos) << e.what();
  }
}

// A layer exported from a device cache (ring block, snapshot) restores into another and attends
// there as it did in the first; a ring block attends through attend_exported_partial as the own
// tokens do.
TEST(device_space, fp_cache_blocks_round_trip_through_the_host) {
  test::device_space_backend dev;
  cache_geometry g;
  g.n_layer = 1, g.n_head = 4, g.n_head_kv = 2, g.head_dim = 32, g.n_embd = 128, g.capacity = 40;
  g.rope.head_dim = g.rope.n_rot = 32;
  const int64_t n = 37, kv = n * g.n_head_kv * g.head_dim, nq = 3, qe = nq * g.n_head * g.head_dim;
  std::vector<float> k(kv), v(kv), q(qe);
  for (int64_t i = 0; i < kv; ++i) k[i] = std::sin(0.37f * i), v[i] = std::cos(0.11f * i);
  for (int64_t i = 0; i < qe; ++i) q[i] = std::sin(0.05f * i + 1.0f);
  std::vector<int32_t> pos(n), q_pos = {5, 20, 36};
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
  backend_buffer dk(dev), dv(dev), dq(dev), dout(dev), dlse(dev);
  dev.upload(dk.reserve(kv * 4), k.data(), kv * 4);
  dev.upload(dv.reserve(kv * 4), v.data(), kv * 4);
  dev.upload(dq.reserve(qe * 4), q.data(), qe * 4);
  float* o = dout.reserve_as<float>(3 * qe);  // own, restored, exported
  float* lse_dev = dlse.reserve_as<float>(nq * g.n_head);
  for (cache_format f : {cache_format::cache_fp16, cache_format::cache_fp32}) {
    auto a = make_cache(cache_spec(f, cache_options{}), g, dev);
    layer_input in;
    in.k = dk.as<float>(), in.v = dv.as<float>(), in.pos = pos.data(), in.n = n;
    a->append(0, in);
    std::vector<uint8_t> block(a->exported_bytes(0));
    a->export_layer(0, block.data());
    auto b = make_cache(cache_spec(f, cache_options{}), g, dev);
    b->restore_layer(0, block.data(), block.size());
    auto empty = make_cache(cache_spec(f, cache_options{}), g, dev);
    a->attend_partial(0, dq.as<float>(), q_pos.data(), nq, attend_path::attend_prefill, o, lse_dev);
    b->attend_partial(0, dq.as<float>(), q_pos.data(), nq, attend_path::attend_prefill, o + qe, lse_dev);
    empty->attend_exported_partial(0, block.data(), block.size(), dq.as<float>(), q_pos.data(), nq,
                                   attend_path::attend_prefill, o + 2 * qe, lse_dev);
    std::vector<float> host(3 * qe);
    dev.download(host.data(), o, host.size() * 4);
    for (int64_t i = 0; i < qe; ++i) {
      ASSERT_EQ(host[qe + i], host[i]) << format_traits(f).name << " restored, element " << i;
      ASSERT_EQ(host[2 * qe + i], host[i]) << format_traits(f).name << " exported, element " << i;
    }
    // And the exact CPU path over the same keys agrees to float rounding.
    auto cpu = make_backend(backend_kind::backend_cpu);
    auto c = make_cache(cache_spec(f, cache_options{}), g, *cpu);
    layer_input hin;
    hin.k = k.data(), hin.v = v.data(), hin.pos = pos.data(), hin.n = n;
    c->append(0, hin);
    std::vector<float> ref(qe), lse(nq * g.n_head);
    c->attend(0, q.data(), q_pos.data(), nq, ref.data(), lse.data());
    for (int64_t i = 0; i < qe; ++i) ASSERT_NEAR(host[i], ref[i], 1e-5f) << format_traits(f).name << " " << i;
  }
}

// The runner as jobs use it (one rank): exact and star prefill, then merged decode steps, on the
// device space against the CPU backend.
TEST(device_space, sequence_runner_prefill_modes_match_the_cpu_backend) {
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_f16, 3);
  const auto prompt = some_tokens(150, w.hp.n_vocab);
  for (prefill_mode mode : {prefill_mode::prefill_exact, prefill_mode::prefill_star}) {
    std::vector<std::vector<float>> out[2];
    for (int which = 0; which < 2; ++which) {
      std::unique_ptr<backend> cpu = make_backend(backend_kind::backend_cpu);
      test::device_space_backend dev;
      backend& be = which == 0 ? *cpu : static_cast<backend&>(dev);
      run_params rp;
      rp.n_batch = 32;
      llama_engine engine(w, be, rp);
      auto comm = make_local_communicator();
      sequence_options opt;
      opt.mode = mode;
      opt.block_tokens = 64;  // star: the 149-token context is three blocks, anchor = the first
      opt.max_new_tokens = 4;
      sequence_parallel_runner runner(engine, *comm, be, cache_spec(cache_format::cache_fp16, cache_options{}), opt);
      out[which].emplace_back(w.hp.n_vocab);
      runner.prefill(prompt, {}, out[which].back().data());
      for (int s = 0; s < 3; ++s) {
        const int32_t tok = (int32_t)(s * 13 + 2);
        out[which].emplace_back(w.hp.n_vocab);
        runner.step(&tok, 1, out[which].back().data());
      }
    }
    for (size_t s = 0; s < out[0].size(); ++s) {
      double max_abs = 0, max_ref = 0;
      for (size_t i = 0; i < out[0][s].size(); ++i) {
        max_abs = test::worse(max_abs, (double)std::fabs(out[0][s][i] - out[1][s][i]));
        max_ref = std::max(max_ref, (double)std::fabs(out[0][s][i]));
      }
      EXPECT_LE(max_abs, 1e-3 * std::max(1.0, max_ref)) << prefill_mode_name(mode) << " step " << s;
    }
  }
}

// On a device backend the fit check weighs the sequence against the device's share, not the
// host's memory, and says so.
TEST(device_space, the_fit_check_uses_the_devices_memory) {
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_f16, 3);
  test::device_space_backend dev;
  dev.memory_share = 64 << 10;  // 64 KiB: less than the cache of 150 tokens alone
  run_params rp;
  llama_engine engine(w, dev, rp);
  auto comm = make_local_communicator();
  sequence_options opt;
  opt.max_new_tokens = 4;
  sequence_parallel_runner runner(engine, *comm, dev, cache_spec(cache_format::cache_fp16, cache_options{}), opt);
  std::vector<float> logits(w.hp.n_vocab);
  test::expect_error_contains([&] { runner.prefill(some_tokens(150, w.hp.n_vocab), {}, logits.data()); },
                              "may use 64.0 KiB (its share of its GPU's free memory, the device-space backend)");
  dev.memory_share = 64 << 20;
  runner.reset();
  EXPECT_NO_THROW(runner.prefill(some_tokens(150, w.hp.n_vocab), {}, logits.data()));
}

// What the emulation itself must catch, or the tests above prove nothing: a host pointer handed
// to a kernel, and host code reading backend memory.
// On a device the X formats' rebuild factors are one more upload (host model data otherwise):
// the fit check counts them until a cache on that backend holds them.
TEST(device_space, the_fit_check_counts_the_factor_upload) {
  const model_weights w = write_and_load(tiny_hparams(true, false), ggml_type::ggml_f16, 3);
  test::device_space_backend dev;
  auto comm = make_local_communicator();
  sequence_options opt;
  cache_spec spec(cache_format::cache_xquant2, cache_options{});
  spec.options.factors = build_x_factors(w, x_factor_kind::xf_latent);
  const int64_t n = 150, extra = 4;
  const size_t without = estimate_rank_memory(w.hp, spec, opt, 512, 1, n, extra, 1, kCpu).total();
  const size_t factors = x_factor_bytes(w.hp, x_factor_kind::xf_latent);
  ASSERT_GT(factors, 0u);
  const auto check = [&] { check_sequence_fits(*comm, w.hp, spec, opt, 512, 1, n, extra, kCpu, &dev); };
  dev.memory_share = without + factors / 2;
  test::expect_error_contains(check, "rebuild factors");
  dev.memory_share = without + factors;
  EXPECT_NO_THROW(check());
  dev.memory_share = without;  // a cache on the device holds them: not counted again
  run_params rp;
  llama_engine engine(w, dev, rp);
  auto cache = make_cache(spec, engine.cache_geometry_for(16), dev);
  EXPECT_NO_THROW(check());
  cache.reset();
  EXPECT_THROW(check(), Error);
}

TEST(device_space, the_emulation_catches_host_pointers_and_host_access) {
  test::device_space_backend dev;
  std::vector<float> host(16, 1.0f);
  backend_buffer b(dev);
  float* d = b.reserve_as<float>(16);
  test::expect_error_contains([&] { dev.add(d, host.data(), 16); }, "add got x");
  test::expect_error_contains([&] { dev.add(host.data(), d, 16); }, "add got y");
  dev.upload(d, host.data(), 16 * 4);
  EXPECT_DEATH({ volatile float x = d[3]; (void)x; }, "");
}

}  // namespace
}  // namespace xctx
