// Retrieval's unit selection on the X caches (xquant, xquant-cl, clkv), both CPU kernels (the
// per-unit rebuild of prefill, the absorbed / fused decode), at the fixed-distance rope: every unit
// listed gives the unselected attention bitwise, a selection's result is the exact sum of its
// parts' (so an unlisted unit adds nothing and a listed one all of its visible keys), and an empty
// list sees nothing. tests/worker/test_retrieval.cpp does the same for the KV formats and compares
// them with the reference backend's key-by-key masking.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "cache/x_test_util.h"
#include "kernels/softmax_acc.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

using test::selection_of;

// Four units and part of a fifth of one X format at the fixed-distance rope, and three queries:
// two at the end, one at position 700.
struct x_sel_case {
  std::unique_ptr<backend> be = make_backend(backend_kind::backend_cpu);
  static constexpr int64_t n = 4 * 256 + 30;
  cache_geometry g;
  test::filled f;
  int qd = 0;
  std::vector<float> q;
  std::vector<int32_t> q_pos = {(int32_t)n - 1, 700, (int32_t)n - 1};
  x_sel_case(const test::x_case& c, uint32_t fill_seed, unsigned q_seed) : g(test::x_geometry(c.gqa, n + 4)) {
    g.rope = with_fixed_distance(g.rope, 300);
    f = test::fill(*be, c, g, n, 1, {500, 200}, fill_seed);
    qd = g.n_head * g.head_dim;
    std::mt19937 rng(q_seed);
    std::normal_distribution<float> nd;
    q.resize(3 * qd);
    for (float& x : q) x = 0.3f * nd(rng);
  }
};

class x_selection : public ::testing::TestWithParam<test::x_case> {};

TEST_P(x_selection, units_are_masked_exactly) {
  const test::x_case c = GetParam();
  x_sel_case k(c, 41, 8);
  const attn_selection sel = selection_of({{0, 2, 4}, {1, 2}, {}});
  const attn_selection a = selection_of({{0, 4}, {2}, {}}), b = selection_of({{2}, {1}, {}});
  const attn_selection all = selection_of({{0, 1, 2, 3, 4}, {0, 1, 2}, {0, 1, 2, 3, 4}});
  for (int layer : {0, k.g.n_layer - 1})
    for (const attend_path path : {attend_path::attend_prefill, attend_path::attend_decode}) {
      SCOPED_TRACE(test::case_name(c) + " layer " + std::to_string(layer) +
                   (path == attend_path::attend_decode ? " decode" : " prefill"));
      const int64_t nq = path == attend_path::attend_decode ? 1 : 3;
      const auto first = [&](const attn_selection& s) { return selection_of({{s.units.begin(), s.units.begin() + s.offsets[1]}}); };
      const auto run = [&](const attn_selection* s) {
        softmax_acc acc(nq * k.g.n_head, k.g.head_dim);
        attn_selection one;
        if (s != nullptr && nq == 1) one = first(*s);
        k.f.cache->attend(layer, k.q.data(), k.q_pos.data(), nq, path, acc, s == nullptr ? nullptr : nq == 1 ? &one : s);
        return acc;
      };
      const auto finish = [&](const softmax_acc& acc, std::vector<float>& o, std::vector<float>& l) {
        o.resize(nq * k.qd), l.resize(nq * k.g.n_head);
        acc.finish(o.data(), l.data());
      };
      std::vector<float> o_none, l_none, o_all, l_all, o_sel, l_sel, o_ab, l_ab;
      finish(run(nullptr), o_none, l_none);
      finish(run(&all), o_all, l_all);
      EXPECT_EQ(std::memcmp(o_none.data(), o_all.data(), o_all.size() * 4), 0) << "every unit listed = no selection";
      EXPECT_EQ(std::memcmp(l_none.data(), l_all.data(), l_all.size() * 4), 0);
      finish(run(&sel), o_sel, l_sel);
      softmax_acc parts = run(&a);
      parts.merge(run(&b));
      finish(parts, o_ab, l_ab);
      EXPECT_EQ(std::memcmp(o_sel.data(), o_ab.data(), o_ab.size() * 4), 0) << "A u B = A + B, exactly";
      EXPECT_NE(std::memcmp(o_sel.data(), o_none.data(), o_sel.size() * 4), 0) << "the selection changed nothing";
      if (nq == 3) {
        for (int h = 0; h < k.g.n_head; ++h) EXPECT_TRUE(std::isinf(l_sel[2 * k.g.n_head + h])) << "empty list, head " << h;
      }
    }
}

// One list per KV head: each head's rows equal a shared selection's with its KV head's list.
TEST_P(x_selection, a_per_kv_head_selection_gives_each_head_its_own_list) {
  const test::x_case c = GetParam();
  x_sel_case k(c, 43, 10);
  const std::vector<std::vector<int64_t>> even = {{0, 2, 4}, {1, 2}, {}}, odd = {{1, 4}, {0}, {3}};
  for (int layer : {0, k.g.n_layer - 1})
    for (const attend_path path : {attend_path::attend_prefill, attend_path::attend_decode}) {
      SCOPED_TRACE(test::case_name(c) + " layer " + std::to_string(layer) +
                   (path == attend_path::attend_decode ? " decode" : " prefill"));
      const int64_t nq = path == attend_path::attend_decode ? 1 : 3;
      const auto first = [&](const std::vector<std::vector<int64_t>>& l) {
        return std::vector<std::vector<int64_t>>(l.begin(), l.begin() + nq);
      };
      const attn_selection heads = test::alternating_kv_head_selection(first(even), first(odd), k.g.n_head_kv);
      const attn_selection se = selection_of(first(even)), so = selection_of(first(odd));
      const auto run = [&](const attn_selection& s, std::vector<float>& o, std::vector<float>& l) {
        softmax_acc acc(nq * k.g.n_head, k.g.head_dim);
        k.f.cache->attend(layer, k.q.data(), k.q_pos.data(), nq, path, acc, &s);
        o.resize(nq * k.qd), l.resize(nq * k.g.n_head);
        acc.finish(o.data(), l.data());
      };
      std::vector<float> o_h, l_h, o_e, l_e, o_o, l_o;
      run(heads, o_h, l_h);
      run(se, o_e, l_e);
      run(so, o_o, l_o);
      test::expect_rows_of_kv_heads(o_h, l_h, o_e, l_e, o_o, l_o, nq, k.g.n_head, k.g.n_head_kv, k.g.head_dim);
    }
}

INSTANTIATE_TEST_SUITE_P(formats, x_selection,
                         ::testing::Values(test::x_case{cache_format::cache_xquant3, true, false},
                                           test::x_case{cache_format::cache_xquant_cl3, true, false},
                                           test::x_case{cache_format::cache_clkv, true, false}),
                         [](const auto& i) { return test::case_name(i.param); });

}  // namespace
}  // namespace xctx
