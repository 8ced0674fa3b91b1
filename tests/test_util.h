// Shared helpers for the test binaries.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/backend_settings.h"
#include "kernels/cpu/simd/cpu_features.h"
#include "kernels/ops.h"

namespace xctx::test {

// The attention tests' SelfExtend settings: off, a power-of-two group with a window of whole
// units and one that is neither (units cut by the window's edge, groups across unit seams), and
// retrieval's two far placements (every far key at distance W; far keys in order within spans of
// `period` positions).
struct self_extend_case {
  int group, window;
  int period = 0;
};
// G >= 16 lets whole blocks of consecutive keys share a rotation (the fused kernels turn the query).
inline std::vector<self_extend_case> self_extend_cases() {
  return {{1, 0}, {4, 256}, {3, 77}, {32, 200}, {kFixedDistanceGroup, 300}, {kFixedDistanceGroup, 300, 256}};
}
inline rope_config with_self_extend(rope_config r, self_extend_case c) {
  r.se_group = c.group, r.se_window = c.window, r.se_period = c.period;
  return r;
}

// A running maximum error with a new one, keeping NaN: std::max(worst, NaN) is worst, which would
// let a NaN result pass the tolerance check that follows.
template <class T>
T worse(T worst, T err) {
  return std::isnan(err) || err > worst ? err : worst;
}

// End-to-end logit bounds for the tiny random models (tests/worker/test_engine.cpp derives them):
// a logit difference of at most kEngineAmplification * u * max(1, max |logit|), where u is the
// relative rounding of one decode-path activation -- 2^-16 of a block max for act_q16 (the
// default), 1/254 for act_q8, float sums (8 * 2^-24) for act_f32 and for float weights, which
// never round activations. Measured amplification through three layers: ~3.9 (2026-12-02), so 16
// leaves a margin of 4x.
inline constexpr double kEngineAmplification = 16;
inline double float_sum_rounding() { return 8 * std::ldexp(1.0, -24); }
inline double decode_rounding(decode_activations act) {
  switch (act) {
    case decode_activations::act_q16: return std::ldexp(1.0, -16);
    case decode_activations::act_q8: return 1.0 / 254;
    case decode_activations::act_f32: break;
  }
  return float_sum_rounding();
}
// The batched (prefill) matmuls' activations: f32 (float sums only), or the integer GEMM's 16- or
// 8-bit blocks -- the decode grids' steps -- where the CPU runs it (AVX-512 VNNI).
inline double prefill_rounding(prefill_activations pre) {
  if (!cpu::prefill_q8_supported()) return float_sum_rounding();
  switch (pre) {
    case prefill_activations::pre_q16: return decode_rounding(decode_activations::act_q16);
    case prefill_activations::pre_q8: return decode_rounding(decode_activations::act_q8);
    case prefill_activations::pre_f32: break;
  }
  return float_sum_rounding();
}
inline double engine_logit_bound(bool quantized_weights, double max_abs_logit, decode_activations act,
                                 prefill_activations pre) {
  const double u = quantized_weights
                       ? std::max({decode_rounding(act), prefill_rounding(pre), float_sum_rounding()})
                       : float_sum_rounding();
  return kEngineAmplification * u * std::max(1.0, max_abs_logit);
}
// The bound for a backend made with `s` (backend::settings(); unset: exact float arithmetic).
inline double engine_logit_bound(bool quantized_weights, double max_abs_logit, const backend_settings& s) {
  return engine_logit_bound(quantized_weights, max_abs_logit, s.decode.value_or(decode_activations::act_f32),
                            s.prefill.value_or(prefill_activations::pre_f32));
}

// The worst observed/bound ratio of a named tolerance check in this process, printed at exit:
// how much room a derived bound leaves on this machine (a ratio near 1 is a bound about to trip,
// one near 0 a bound too loose to catch a regression).
inline void record_ratio(const char* check, double ratio) {
  static struct table {
    std::map<std::string, double> worst;
    ~table() {
      for (const auto& [name, r] : worst) std::printf("[bound] %s: worst observed/bound %.3g\n", name.c_str(), r);
    }
  } t;
  double& w = t.worst[check];
  w = worse(w, ratio);
}

// f() must throw xctx::Error whose message contains `part`.
template <class F>
void expect_error_contains(F&& f, const std::string& part) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one containing: " << part;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

// A retrieval selection from per-query unit lists (kernels/ops.h, attn_selection).
inline attn_selection selection_of(const std::vector<std::vector<int64_t>>& per_query) {
  attn_selection s;
  s.offsets.push_back(0);
  for (const auto& u : per_query) {
    s.units.insert(s.units.end(), u.begin(), u.end());
    s.offsets.push_back((int64_t)s.units.size());
  }
  return s;
}

// A selection with one list per KV head: KV head g of query i reads (g % 2 == 0 ? even : odd)[i].
inline attn_selection alternating_kv_head_selection(const std::vector<std::vector<int64_t>>& even,
                                                   const std::vector<std::vector<int64_t>>& odd, int n_head_kv) {
  attn_selection s;
  s.lists_per_query = n_head_kv;
  s.offsets.push_back(0);
  for (size_t i = 0; i < even.size(); ++i)
    for (int g = 0; g < n_head_kv; ++g) {
      const std::vector<int64_t>& u = (g % 2 == 0 ? even : odd)[i];
      s.units.insert(s.units.end(), u.begin(), u.end());
      s.offsets.push_back((int64_t)s.units.size());
    }
  return s;
}

// Per-KV-head selection = each head's own list: rows (query i, head h) of o/lse from the per-head
// run equal, bitwise, those of the shared run with KV head h / (n_head / n_head_kv)'s list
// (even: KV heads 0, 2, ...; odd: 1, 3, ...).
inline void expect_rows_of_kv_heads(const std::vector<float>& o_heads, const std::vector<float>& l_heads,
                                    const std::vector<float>& o_even, const std::vector<float>& l_even,
                                    const std::vector<float>& o_odd, const std::vector<float>& l_odd, int64_t n_q,
                                    int n_head, int n_head_kv, int head_dim) {
  const int g = n_head / n_head_kv;
  for (int64_t i = 0; i < n_q; ++i)
    for (int h = 0; h < n_head; ++h) {
      const bool even = (h / g) % 2 == 0;
      const std::vector<float>& o = even ? o_even : o_odd;
      const std::vector<float>& l = even ? l_even : l_odd;
      const size_t r = (size_t)(i * n_head + h);
      EXPECT_EQ(std::memcmp(&l_heads[r], &l[r], sizeof(float)), 0) << "lse of query " << i << " head " << h;
      EXPECT_EQ(std::memcmp(&o_heads[r * head_dim], &o[r * head_dim], sizeof(float) * head_dim), 0)
          << "o of query " << i << " head " << h;
    }
}

inline std::string source_path(const std::string& rel) { return std::string(XCTX_SOURCE_DIR) + "/" + rel; }
inline std::string data_path(const std::string& rel) { return source_path("tests/data/" + rel); }

// A scratch directory unique to the running test, removed by the caller if wanted.
inline std::filesystem::path scratch_dir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  auto dir = std::filesystem::temp_directory_path() / "xctx-tests" /
             (std::string(info->test_suite_name()) + "." + info->name());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// The embedded default model (launch/fetch-model puts it there). Under CI its absence is a
// failure, elsewhere the test is skipped with a hint.
inline const char* kDefaultModelRel = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
inline std::string default_model_path() {
  if (const char* env = std::getenv("XCTX_MODEL")) return env;
  return source_path(kDefaultModelRel);
}
#define XCTX_REQUIRE_MODEL(path_var)                                                         \
  const std::string path_var = ::xctx::test::default_model_path();                           \
  if (!std::filesystem::exists(path_var)) {                                                  \
    if (std::getenv("CI")) FAIL() << "model missing under CI: " << path_var;                 \
    GTEST_SKIP() << "model not fetched (run launch/fetch-model): " << path_var;              \
  }

// Sets an environment variable for the scope's lifetime, restoring what was there.
class env_scope {
 public:
  env_scope(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~env_scope() {
    if (old_) {
      setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  env_scope(const env_scope&) = delete;
  env_scope& operator=(const env_scope&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// The message of the xctx::Error that `f` throws, or "(no error)".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace xctx::test
