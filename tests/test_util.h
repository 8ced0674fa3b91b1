// Shared helpers for the test binaries.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"

namespace xctx::test {

// The attention tests' SelfExtend settings: off, a power-of-two group with a window of whole
// units and one that is neither (units cut by the window's edge, groups across unit seams).
struct self_extend_case {
  int group, window;
};
// G >= 16 lets whole blocks of consecutive keys share a rotation (the fused kernels turn the query).
inline std::vector<self_extend_case> self_extend_cases() { return {{1, 0}, {4, 256}, {3, 77}, {32, 200}}; }
inline rope_config with_self_extend(rope_config r, self_extend_case c) {
  r.se_group = c.group, r.se_window = c.window;
  return r;
}

// A running maximum error with a new one, keeping NaN: std::max(worst, NaN) is worst, which would
// let a NaN result pass the tolerance check that follows.
template <class T>
T worse(T worst, T err) {
  return std::isnan(err) || err > worst ? err : worst;
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

// Selects the CPU decode matmuls' activations (process-wide) for the scope's lifetime.
class decode_activations_scope {
 public:
  explicit decode_activations_scope(cpu::decode_activations act) : saved_(cpu::get_decode_activations()) {
    cpu::set_decode_activations(act);
  }
  ~decode_activations_scope() { cpu::set_decode_activations(saved_); }
  decode_activations_scope(const decode_activations_scope&) = delete;
  decode_activations_scope& operator=(const decode_activations_scope&) = delete;

 private:
  cpu::decode_activations saved_;
};

}  // namespace xctx::test
