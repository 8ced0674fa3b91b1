// The engine against two independent implementations run on the same GGUF
// (tests/data/make_logits_golden.py):
//   llama.cpp (llama-cpp-python): top-8 logits at every prompt position, greedy continuation;
//   an exact float64 numpy forward over the gguf package's dequantized weights (np_reference.py).
//
// Why two. llama.cpp rounds every activation vector to 8-bit blocks (Q8_1/Q8_0, step 1/127 of
// the block's max) before its quantized matmuls and rounds q to fp16 for K·q; that alone moves
// its logits away from exact arithmetic by up to 1.3 (mean ~0.14) on these prompts, enough to
// flip top-1 at 54 of 1,506 Austen positions where the top two are within ~0.2. xctx's matmuls
// take f32 activations or, by default, 16-bit blocks (step 1/32767 of the block's max, 1/256 of
// llama.cpp's): always in decode (fewer than ~32 tokens), and in the batched (prefill) matmuls
// where the CPU runs the integer GEMM (AVX-512 VNNI); elsewhere the batched ones dequantize the
// weights and never round activations. So it tracks exact arithmetic far more closely. Each case
// names its cache and its decode and prefill activations; the test asserts:
//   * vs exact: |Δlogit| <= kExactTol and top-1 equal wherever the exact top-2 gap > 2·kExactTol;
//     greedy continuation equal to the exact one.
//   * vs llama.cpp: |Δlogit| <= (llama.cpp's own distance from exact, recorded per prompt) +
//     kExactTol; top-1 equal at every position where llama.cpp's top-1 is the exact top-1, and
//     where it is not, xctx's top-1 is the exact one; the greedy continuation shares at least the
//     prefix that exact arithmetic shares with llama.cpp's.
// kExactTol, from the measured error with a stated margin (the maxima are printed):
//   fp32 cache, f32 activations: float32 accumulation over 30 layers (sums of <= 1536 terms,
//     relative ~1e-6 each); measured max 1.0e-4 over the four prompts (prefill and decode):
//     tolerance 1e-3 (10x);
//   fp32 cache, q16 activations: the 16-bit rounding (relative <= 1.5e-5 of a block's max)
//     through 30 layers; measured max 0.0045 (the 5-token prompt, all on the decode path),
//     0.0042 decode: tolerance 0.01 (2.2x). With q16 prefill activations as well (the integer
//     GEMM, AVX-512 VNNI hosts): max 0.0070 (austen_long prefill), 0.0033 decode (1.4x;
//     2026-12-04, AMD EPYC family 25 model 17);
//   fp16 cache (q16 activations): K and V rounded to fp16 (relative 2^-11) perturb each
//     attention output by ~5e-4 relative; measured max 0.035 (austen_long prefill) with f32
//     prefill activations and 0.047 with q16 ones, 0.020 decode: tolerance 0.07 (1.5x).
// act_q8 (llama.cpp's rounding) is not held to exact arithmetic: measured on these prompts (fp32
// cache) its decode logits are up to 0.89 (mean 0.12-0.20) from exact, top-1 differs at 7 of 124
// teacher-forced steps, and its greedy continuation of `capital` is llama.cpp's, not exact's.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cache/cache.h"
#include "kernels/cpu/cpu_ops.h"
#include "coordinator/jobs/sampler.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "registry/registry.h"
#include "test_util.h"
#include "worker/llama_engine.h"

namespace xctx {
namespace {

struct golden_param {
  cache_format cache;
  decode_activations act;
  prefill_activations pre;  // the batched matmuls' (integer GEMM on AVX-512 VNNI hosts)
};

float exact_tolerance(const golden_param& p) {
  if (p.cache != cache_format::cache_fp32) return 0.07f;
  const bool float_only = p.act == decode_activations::act_f32 &&
                          (p.pre == prefill_activations::pre_f32 || !cpu::prefill_q8_supported());
  return float_only ? 1e-3f : 0.01f;
}

std::string param_name(const golden_param& p) {
  return std::string(format_traits(p.cache).name) + " cache, decode " + decode_activations_name(p.act) +
         ", prefill " + prefill_activations_name(p.pre);
}

// The decode path against llama.cpp's own decode logits: llama.cpp is up to 1.3 logits from
// exact arithmetic on these prompts (recorded per prompt); xctx's decode path is within
// exact_tolerance of exact, so the two differ by at most about that much.
constexpr float kLlamaDecodeTol = 1.5f;

struct golden_case {
  std::string name, text;
  bool parse_special = false;
  std::vector<int32_t> ids;
  std::vector<std::vector<int32_t>> top_ids, exact_top_ids;
  std::vector<std::vector<float>> top_logits, exact_top_logits;
  std::vector<int32_t> continuation, exact_continuation;
  // logits (top-K) each implementation chose its continuation tokens from
  std::vector<std::vector<int32_t>> cont_top_ids, exact_cont_top_ids;
  std::vector<std::vector<float>> cont_top_logits, exact_cont_top_logits;
  float llama_vs_exact = 0;
};

std::vector<golden_case> load_golden() {
  std::ifstream in(test::data_path("logits_golden.json"));
  nlohmann::json j = nlohmann::json::parse(in);
  std::vector<golden_case> out;
  for (const auto& c : j["cases"]) {
    golden_case g;
    g.name = c["name"];
    g.text = c["text"];
    g.parse_special = c["parse_special"];
    g.ids = c["ids"].get<std::vector<int32_t>>();
    g.top_ids = c["top_ids"].get<std::vector<std::vector<int32_t>>>();
    g.top_logits = c["top_logits"].get<std::vector<std::vector<float>>>();
    g.exact_top_ids = c["exact_top_ids"].get<std::vector<std::vector<int32_t>>>();
    g.exact_top_logits = c["exact_top_logits"].get<std::vector<std::vector<float>>>();
    g.continuation = c["greedy_continuation"].get<std::vector<int32_t>>();
    g.exact_continuation = c["exact_greedy_continuation"].get<std::vector<int32_t>>();
    g.llama_vs_exact = c["llama_vs_exact_max_abs"];
    g.cont_top_ids = c["continuation_top_ids"].get<std::vector<std::vector<int32_t>>>();
    g.cont_top_logits = c["continuation_top_logits"].get<std::vector<std::vector<float>>>();
    g.exact_cont_top_ids = c["exact_continuation_top_ids"].get<std::vector<std::vector<int32_t>>>();
    g.exact_cont_top_logits = c["exact_continuation_top_logits"].get<std::vector<std::vector<float>>>();
    out.push_back(std::move(g));
  }
  return out;
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

class engine_golden : public ::testing::TestWithParam<golden_param> {};

TEST_P(engine_golden, logits_and_greedy_continuations) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  backend_settings settings;
  settings.decode = GetParam().act;
  settings.prefill = GetParam().pre;
  auto be = make_backend(backend_kind::backend_cpu, settings);
  run_params rp;
  rp.cache = GetParam().cache;
  llama_engine engine(w, *be, rp);
  const int32_t n_vocab = w.hp.n_vocab;
  const float tol = exact_tolerance(GetParam());

  for (const golden_case& g : load_golden()) {
    SCOPED_TRACE(g.name);
    const int64_t n = (int64_t)g.ids.size();
    auto cache = make_cache(rp.cache, engine.cache_geometry_for(n + 64), *be);
    std::vector<int32_t> pos(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
    std::vector<float> logits(n * n_vocab);
    engine.forward(g.ids.data(), pos.data(), n, *cache, llama_engine::logits_for::logits_all, logits.data());

    float worst_exact = 0, worst_llama = 0;
    int llama_wrong = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* row = logits.data() + i * n_vocab;
      for (size_t k = 0; k < g.exact_top_ids[i].size(); ++k)
        worst_exact = test::worse(worst_exact, std::fabs(row[g.exact_top_ids[i][k]] - g.exact_top_logits[i][k]));
      for (size_t k = 0; k < g.top_ids[i].size(); ++k)
        worst_llama = test::worse(worst_llama, std::fabs(row[g.top_ids[i][k]] - g.top_logits[i][k]));
      const int32_t top = argmax(row, n_vocab);
      const int32_t exact_top = g.exact_top_ids[i][0];
      const bool exact_clear = g.exact_top_logits[i][0] - g.exact_top_logits[i][1] > 2 * tol;
      if (exact_clear) {
        ASSERT_EQ(top, exact_top) << "position " << i;
      }
      if (g.top_ids[i][0] == exact_top) {
        if (exact_clear) {
          ASSERT_EQ(top, g.top_ids[i][0]) << "position " << i << " (llama.cpp agrees with exact)";
        }
      } else {
        ++llama_wrong;
      }
    }
    EXPECT_LE(worst_exact, tol);
    EXPECT_LE(worst_llama, g.llama_vs_exact + tol);

    // Greedy continuation through the one-token decode path.
    std::vector<float> last(logits.end() - n_vocab, logits.end());
    std::vector<int32_t> got;
    int32_t p = (int32_t)n;
    for (size_t t = 0; t < g.exact_continuation.size(); ++t) {
      const int32_t id = argmax(last.data(), n_vocab);
      got.push_back(id);
      engine.forward(&id, &p, 1, *cache, llama_engine::logits_for::logits_last, last.data());
      ++p;
    }
    EXPECT_EQ(got, g.exact_continuation);
    const size_t with_llama = common_prefix(got, g.continuation);
    const size_t exact_with_llama = common_prefix(g.exact_continuation, g.continuation);
    EXPECT_GE(with_llama, exact_with_llama);
    std::printf("[golden] %s, %s: %lld positions | max |Δ| vs exact %.4f (tol %.3f) | vs llama.cpp %.4f "
                "(llama.cpp vs exact %.4f) | llama.cpp top-1 off exact at %d | continuation = exact: %s, "
                "shares %zu/%zu with llama.cpp (exact shares %zu)\n",
                param_name(GetParam()).c_str(), g.name.c_str(), (long long)n,
                worst_exact, tol, worst_llama,
                g.llama_vs_exact, llama_wrong, got == g.exact_continuation ? "yes" : "no", with_llama,
                g.continuation.size(), exact_with_llama);
  }
}

// The one-token decode path (weights quantized, the case's activations), teacher-forced along each
// implementation's own continuation: logits compared with the logits that implementation chose
// each token from.
TEST_P(engine_golden, decode_path_teacher_forced) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  backend_settings settings;
  settings.decode = GetParam().act;
  settings.prefill = GetParam().pre;
  auto be = make_backend(backend_kind::backend_cpu, settings);
  run_params rp;
  rp.cache = GetParam().cache;
  llama_engine engine(w, *be, rp);
  const int32_t n_vocab = w.hp.n_vocab;
  for (const golden_case& g : load_golden()) {
    for (int which = 0; which < 2; ++which) {
      const bool exact = which == 0;
      const auto& toks = exact ? g.exact_continuation : g.continuation;
      const auto& ref_ids = exact ? g.exact_cont_top_ids : g.cont_top_ids;
      const auto& ref_logits = exact ? g.exact_cont_top_logits : g.cont_top_logits;
      const int64_t n = (int64_t)g.ids.size();
      auto cache = make_cache(rp.cache, engine.cache_geometry_for(n + 64), *be);
      std::vector<int32_t> pos(n);
      for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
      std::vector<float> last(n_vocab);
      engine.forward(g.ids.data(), pos.data(), n, *cache, llama_engine::logits_for::logits_last, last.data());
      const float tol = exact ? exact_tolerance(GetParam()) : kLlamaDecodeTol;
      float worst = 0;
      double sum = 0;
      int cnt = 0, top1_diff = 0;
      for (size_t t = 0; t < toks.size(); ++t) {
        if (t > 0) {  // step 0's logits come from the prefill
          int32_t p = (int32_t)(n + t - 1);
          engine.forward(&toks[t - 1], &p, 1, *cache, llama_engine::logits_for::logits_last, last.data());
          for (size_t k = 0; k < ref_ids[t].size(); ++k) {
            const float d = std::fabs(last[ref_ids[t][k]] - ref_logits[t][k]);
            worst = test::worse(worst, d);
            sum += d;
            ++cnt;
          }
          const int32_t top = argmax(last.data(), n_vocab);
          top1_diff += top != ref_ids[t][0];
          if (exact && ref_logits[t][0] - ref_logits[t][1] > 2 * tol) {
            EXPECT_EQ(top, ref_ids[t][0]) << g.name << " step " << t;
          }
        }
      }
      EXPECT_LE(worst, tol) << g.name << (exact ? " vs exact" : " vs llama.cpp");
      std::printf("[golden-decode] %s, %s vs %s: max |Δ| %.4f mean %.4f, top-1 differs at %d of %zu\n",
                  param_name(GetParam()).c_str(), g.name.c_str(), exact ? "exact" : "llama.cpp", worst,
                  sum / std::max(1, cnt), top1_diff, toks.size() - 1);
    }
  }
}

// The default (fp16 cache, q16 activations for decode and, on AVX-512 VNNI hosts, for prefill),
// the engine's float arithmetic alone (fp32, f32, f32) and what 16-bit activations add to it: in
// decode alone (fp32, q16, f32), and in both (fp32, q16, q16).
INSTANTIATE_TEST_SUITE_P(
    caches, engine_golden,
    ::testing::Values(
        golden_param{cache_format::cache_fp16, decode_activations::act_q16, prefill_activations::pre_q16},
        golden_param{cache_format::cache_fp32, decode_activations::act_f32, prefill_activations::pre_f32},
        golden_param{cache_format::cache_fp32, decode_activations::act_q16, prefill_activations::pre_f32},
        golden_param{cache_format::cache_fp32, decode_activations::act_q16, prefill_activations::pre_q16}),
    [](const auto& info) {
      return std::string(format_traits(info.param.cache).name) + "_" + decode_activations_name(info.param.act) +
             "_prefill_" + prefill_activations_name(info.param.pre);
    });

TEST(engine_golden_tokens, tokenizer_reproduces_golden_prompt_ids) {
  XCTX_REQUIRE_MODEL(path);
  auto f = gguf_file::open(path);
  auto tok = make_tokenizer(read_gguf_vocab(*f));
  for (const golden_case& g : load_golden()) {
    EXPECT_EQ(tok->encode(g.text, tok->vocab().add_bos, g.parse_special), g.ids) << g.name;
  }
}

}  // namespace
}  // namespace xctx
