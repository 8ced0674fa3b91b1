// The backend's settings (kernels/backend_settings.h): the matmul activations and the A/B
// switches reach the kernels through the backend they were made with (registry/registry.h);
// the environment fills only what the caller left unset, where the backend is made.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/matmul/matmul_impl.h"
#include "kernels/matmul_test_util.h"
#include "kernels/ops.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

using test::quantized_weights;
using test::random_activations;

// The settings reach cpu::matmul (decode-sized n_tok) and the CPU backend made with them
// (registry/registry.h); q16 is the default unless XCTX_DECODE_ACT says f32 or q8, read where the
// backend is made, not by the kernels.
TEST(matmul_activations, settings_select_the_decode_path) {
  const char* env = std::getenv("XCTX_DECODE_ACT");
  const std::string e = env != nullptr ? env : "";
  const auto made = make_backend(backend_kind::backend_cpu);
  ASSERT_TRUE(made->settings().decode.has_value());
  EXPECT_EQ(*made->settings().decode, e == "q8"    ? decode_activations::act_q8
                                      : e == "f32" ? decode_activations::act_f32
                                                   : decode_activations::act_q16);
  EXPECT_EQ(cpu::matmul_settings{}.decode, decode_activations::act_q16);
  const uint32_t seed = 92;
  std::printf("seed %u\n", seed);
  std::mt19937 rng(seed);
  const int64_t n_rows = 100, n_cols = 576, n_tok = 2;
  std::vector<uint8_t> w_data = quantized_weights(ggml_type::ggml_q4_1, n_rows, n_cols, rng);
  const weight_view w{ggml_type::ggml_q4_1, n_rows, n_cols, w_data.data()};
  std::vector<float> x = random_activations(n_tok, n_cols, rng);
  for (decode_activations act :
       {decode_activations::act_q8, decode_activations::act_f32, decode_activations::act_q16}) {
    std::vector<float> want((size_t)(n_tok * n_rows)), got(want.size()), via_backend(want.size());
    cpu::detail::matmul_decode(w, x.data(), n_tok, want.data(), act);
    cpu::matmul(w, x.data(), n_tok, got.data(), test::with_decode(act));
    backend_settings bs;
    bs.decode = act;
    const auto be = make_backend(backend_kind::backend_cpu, bs);
    EXPECT_EQ(be->settings().decode, act);
    be->matmul(w, x.data(), n_tok, via_backend.data());
    EXPECT_EQ(0, std::memcmp(want.data(), got.data(), want.size() * sizeof(float))) << "activations " << (int)act;
    EXPECT_EQ(0, std::memcmp(want.data(), via_backend.data(), want.size() * sizeof(float)))
        << "backend made with activations " << (int)act;
  }
}

// Unset settings come from the environment where the backend is made, an explicit one wins, and
// a value that is not a choice names the variable.
TEST(matmul_activations, environment_fills_only_unset_settings) {
  const test::env_scope decode("XCTX_DECODE_ACT", "f32");
  const test::env_scope prefill("XCTX_PREFILL_ACT", "q8");
  const backend_settings from_env = settings_with_environment({});
  EXPECT_EQ(from_env.decode, decode_activations::act_f32);
  EXPECT_EQ(from_env.prefill, prefill_activations::pre_q8);
  backend_settings given;
  given.decode = decode_activations::act_q8;
  const auto be = make_backend(backend_kind::backend_cpu, given);
  EXPECT_EQ(be->settings().decode, decode_activations::act_q8);
  EXPECT_EQ(be->settings().prefill, prefill_activations::pre_q8);
  const test::env_scope bad("XCTX_DECODE_ACT", "q4");
  EXPECT_NE(test::error_of([] { make_backend(backend_kind::backend_cpu); })
                .find("XCTX_DECODE_ACT must be f32, q16 or q8, not 'q4'"),
            std::string::npos);
}

// The A/B switches travel the same way: the environment fills what the caller left unset, the
// backend reports what it was made with, "0" is off and any other value on.
TEST(backend_switches, environment_fills_only_unset_switches) {
  const test::env_scope avx512("XCTX_ATTN_AVX512", "0");
  const test::env_scope graphs("XCTX_CUDA_GRAPHS", "yes");
  const backend_settings from_env = settings_with_environment({});
  EXPECT_EQ(from_env.attn_avx512_rows, false);
  EXPECT_EQ(from_env.cuda_graphs, true);
  EXPECT_FALSE(from_env.kvq_key_lanes.has_value());
  backend_settings given;
  given.kvq_key_lanes = false;
  given.attn_avx512_rows = true;  // set by the caller: the environment's 0 does not override it
  const auto be = make_backend(backend_kind::backend_cpu, given);
  EXPECT_EQ(be->settings().kvq_key_lanes, false);
  EXPECT_EQ(be->settings().attn_avx512_rows, true);
  const auto from_variables = make_backend(backend_kind::backend_cpu);
  EXPECT_EQ(from_variables->settings().attn_avx512_rows, false);
  EXPECT_EQ(from_variables->settings().kvq_key_lanes, true);  // unset everywhere: on
  EXPECT_FALSE(make_backend(backend_kind::backend_ref)->settings().attn_avx512_rows.has_value());
}

}  // namespace
}  // namespace xctx
