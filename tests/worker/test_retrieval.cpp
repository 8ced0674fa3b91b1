// Retrieval attention's parts in one process: the kernels honour a unit selection exactly (every
// unit listed = no selection, bitwise; a selection's result = the exact sum of its parts; the
// CPU kernels against the reference backend's brute-force masking), the block summaries' bytes
// equal what the formula says, the top-k equals a brute-force scoring of the raw keys, and bad
// options name their flag.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "cache/block_summary.h"
#include "cache/quant_test_util.h"
#include "comm/communicator.h"
#include "common/half.h"
#include "registry/registry.h"
#include "test_util.h"
#include "worker/representative_tokens.h"
#include "worker/retrieval.h"
#include "worker/sequence_parallel.h"

namespace xctx {
namespace {

constexpr int64_t kTokens = 5 * 256 + 40;  // five whole units and part of a sixth
constexpr int kLocal = 300;

cache_spec spec_for(cache_format f, const cache_geometry& g, int64_t summary_block) {
  cache_options o;
  o.group_size = 32;
  if (format_traits(f).needs_calibration) o.calib = test::make_synthetic_calibration(g, 11);
  o.summary_block = summary_block;
  return cache_spec(f, o);
}

std::unique_ptr<kv_cache> filled(backend& be, cache_format f, const cache_geometry& g, const test::synthetic_kv& d,
                                 const std::vector<int32_t>& pos, int64_t summary_block = 0) {
  auto c = make_cache(spec_for(f, g, summary_block), g, be);
  const int C = g.n_head_kv * g.head_dim;
  for (int l = 0; l < g.n_layer; ++l)
    for (int64_t at = 0; at < kTokens; at += 500) {
      const int64_t m = std::min<int64_t>(500, kTokens - at);
      c->append(l, layer_input{nullptr, d.k.data() + at * C, d.v.data() + at * C, pos.data() + at, m});
    }
  return c;
}

using test::selection_of;

// One format's layer of synthetic keys at the fixed-distance rope on the CPU and the reference
// backends (bit-identical encoders), and three queries: two at the end, one at position 900.
struct kernel_case {
  cache_geometry g;
  int qd = 0;
  test::synthetic_kv d;
  std::unique_ptr<backend> cpu, ref;
  std::unique_ptr<kv_cache> c, r;
  static constexpr int64_t n_q = 3;
  std::vector<float> q;
  std::vector<int32_t> q_pos = {(int32_t)kTokens - 1, 900, (int32_t)kTokens - 1};
  kernel_case(cache_format f, uint32_t kv_seed, unsigned q_seed, int period = 0)
      : g(test::quant_geometry(kTokens + 8)) {
    g.rope = with_fixed_distance(g.rope, kLocal, period);
    const int C = g.n_head_kv * g.head_dim;
    qd = g.n_head * g.head_dim;
    d = test::make_synthetic_kv(kTokens, C, kv_seed);
    std::vector<int32_t> pos(kTokens);
    for (int64_t i = 0; i < kTokens; ++i) pos[i] = (int32_t)i;
    cpu = make_backend(backend_kind::backend_cpu);
    ref = make_backend(backend_kind::backend_ref);
    c = filled(*cpu, f, g, d, pos);
    r = filled(*ref, f, g, d, pos);
    std::mt19937 rng(q_seed);
    std::normal_distribution<float> nd;
    q.resize(n_q * qd);
    for (float& x : q) x = 0.4f * nd(rng);
  }
  // The CPU kernels' (o, lse) within float error of the reference backend's, which masks key by
  // key: the decoded caches are the same bits (bit-identical encoders), so the difference is the
  // kernels' float arithmetic, scores of head_dim products and a softmax. `same_empties`: every
  // row the reference saw nothing in (lse -inf) is empty in `o` too.
  void expect_near_reference(const std::vector<float>& o, const std::vector<float>& l, const std::vector<float>& o_ref,
                             const std::vector<float>& l_ref, bool same_empties) const {
    double max_v = 0;
    for (float x : d.v) max_v = std::max(max_v, (double)std::fabs(x));
    for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], o_ref[i], 2e-4 * max_v) << i;
    for (size_t i = 0; i < l.size(); ++i) {
      if (same_empties) {
        ASSERT_EQ(std::isinf(l[i]), std::isinf(l_ref[i])) << i;
      }
      if (!std::isinf(l_ref[i])) {
        ASSERT_NEAR(l[i], l_ref[i], 2e-4 * (1 + std::fabs(l_ref[i]))) << i;
      }
    }
  }
};

class retrieval_kernels : public ::testing::TestWithParam<cache_format> {};

TEST_P(retrieval_kernels, a_selection_masks_exactly_units_and_nothing_else) {
  const cache_format f = GetParam();
  kernel_case k(f, 5, 7);
  // Query 0: units 0, 2, 5; query 1: units 1, 3 (3 holds its own position); query 2: none.
  const attn_selection sel = selection_of({{0, 2, 5}, {1, 3}, {}});
  const attn_selection sel_a = selection_of({{0, 5}, {1}, {}}), sel_b = selection_of({{2}, {3}, {}});
  const attn_selection all = selection_of({{0, 1, 2, 3, 4, 5}, {0, 1, 2, 3}, {0, 1, 2, 3, 4, 5}});
  for (const attend_path path : {attend_path::attend_prefill, attend_path::attend_decode}) {
    SCOPED_TRACE(std::string(format_traits(f).name) + (path == attend_path::attend_decode ? " decode" : " prefill"));
    const int64_t nq = path == attend_path::attend_decode ? 1 : kernel_case::n_q;  // decode steps carry one query
    const auto run = [&](kv_cache& cache, const attn_selection* s, std::vector<float>& o, std::vector<float>& l) {
      softmax_acc acc(nq * k.g.n_head, k.g.head_dim);
      attn_selection one;  // the first query's list only, for one-query calls
      if (s != nullptr && nq == 1) one = selection_of({{s->units.begin(), s->units.begin() + s->offsets[1]}});
      cache.attend(0, k.q.data(), k.q_pos.data(), nq, path, acc, s == nullptr ? nullptr : nq == 1 ? &one : s);
      o.resize(nq * k.qd), l.resize(nq * k.g.n_head);
      acc.finish(o.data(), l.data());
      return acc;
    };
    std::vector<float> o_none, l_none, o_all, l_all, o_sel, l_sel, o_ref, l_ref, o_ab, l_ab;
    run(*k.c, nullptr, o_none, l_none);
    run(*k.c, &all, o_all, l_all);
    EXPECT_EQ(std::memcmp(o_none.data(), o_all.data(), o_all.size() * 4), 0) << "every unit listed = no selection";
    softmax_acc a = run(*k.c, &sel, o_sel, l_sel);
    std::vector<float> tmp_o, tmp_l;
    softmax_acc parts = run(*k.c, &sel_a, tmp_o, tmp_l);
    parts.merge(run(*k.c, &sel_b, tmp_o, tmp_l));
    o_ab.resize(o_sel.size()), l_ab.resize(l_sel.size());
    parts.finish(o_ab.data(), l_ab.data());
    EXPECT_EQ(std::memcmp(o_sel.data(), o_ab.data(), o_ab.size() * 4), 0) << "A u B = A + B, exactly";
    EXPECT_NE(std::memcmp(o_sel.data(), o_none.data(), o_sel.size() * 4), 0) << "the selection changed nothing";
    if (nq == kernel_case::n_q) {  // an empty list sees nothing
      for (int h = 0; h < k.g.n_head; ++h) EXPECT_TRUE(std::isinf(l_sel[2 * k.g.n_head + h]) && l_sel[2 * k.g.n_head + h] < 0);
    }
    // Against the reference backend, which masks key by key (kernels/ref).
    run(*k.r, &sel, o_ref, l_ref);
    k.expect_near_reference(o_sel, l_sel, o_ref, l_ref, false);
  }
}

// One list per KV head: each head's rows are those of a shared selection with its KV head's list
// (the kernels compute a unit for every head of the query and deposit it only for the heads that
// listed it), and the reference's per-head masking agrees within float error.
TEST_P(retrieval_kernels, a_per_kv_head_selection_gives_each_head_its_own_list) {
  const cache_format f = GetParam();
  kernel_case k(f, 6, 9);
  const std::vector<std::vector<int64_t>> even = {{0, 2, 5}, {1, 3}, {}}, odd = {{1, 5}, {0, 3}, {4}};
  for (const attend_path path : {attend_path::attend_prefill, attend_path::attend_decode}) {
    SCOPED_TRACE(std::string(format_traits(f).name) + (path == attend_path::attend_decode ? " decode" : " prefill"));
    const int64_t nq = path == attend_path::attend_decode ? 1 : kernel_case::n_q;  // decode steps carry one query
    const auto first = [&](const std::vector<std::vector<int64_t>>& l) {
      return std::vector<std::vector<int64_t>>(l.begin(), l.begin() + nq);
    };
    const attn_selection heads = test::alternating_kv_head_selection(first(even), first(odd), k.g.n_head_kv);
    const attn_selection se = selection_of(first(even)), so = selection_of(first(odd));
    const auto run = [&](kv_cache& cache, const attn_selection& s, std::vector<float>& o, std::vector<float>& l) {
      softmax_acc acc(nq * k.g.n_head, k.g.head_dim);
      cache.attend(0, k.q.data(), k.q_pos.data(), nq, path, acc, &s);
      o.resize(nq * k.qd), l.resize(nq * k.g.n_head);
      acc.finish(o.data(), l.data());
    };
    std::vector<float> o_h, l_h, o_e, l_e, o_o, l_o, o_ref, l_ref;
    run(*k.c, heads, o_h, l_h);
    run(*k.c, se, o_e, l_e);
    run(*k.c, so, o_o, l_o);
    test::expect_rows_of_kv_heads(o_h, l_h, o_e, l_e, o_o, l_o, nq, k.g.n_head, k.g.n_head_kv, k.g.head_dim);
    run(*k.r, heads, o_ref, l_ref);
    k.expect_near_reference(o_h, l_h, o_ref, l_ref, true);
  }
}

// --far-positions ordered: a far key keeps its offset in its span of P positions and the query
// moves P further. Keys within W of a query are where they were (a unit wholly inside the window
// gives the same bits), far units are not, and the kernels agree with the reference's key-by-key
// rotation.
TEST_P(retrieval_kernels, ordered_far_positions_keep_near_keys_and_move_far_ones) {
  const cache_format f = GetParam();
  kernel_case fixed(f, 5, 7), ordered(f, 5, 7, kAttnUnit);
  // Query 0 (at the end) lists far units 0 and 2 and its window's unit 5; query 1 (at 900) far
  // unit 1; query 2 only its window's unit 5 (positions 1280.., all within W of it).
  const attn_selection sel = selection_of({{0, 2, 5}, {1}, {5}});
  for (const attend_path path : {attend_path::attend_prefill, attend_path::attend_decode}) {
    SCOPED_TRACE(std::string(format_traits(f).name) + (path == attend_path::attend_decode ? " decode" : " prefill"));
    const int64_t nq = path == attend_path::attend_decode ? 1 : kernel_case::n_q;
    const auto run = [&](kernel_case& k, kv_cache& cache, const attn_selection& s, std::vector<float>& o,
                         std::vector<float>& l) {
      softmax_acc acc(nq * k.g.n_head, k.g.head_dim);
      attn_selection one;
      if (nq == 1) one = selection_of({{s.units.begin(), s.units.begin() + s.offsets[1]}});
      cache.attend(0, k.q.data(), k.q_pos.data(), nq, path, acc, nq == 1 ? &one : &s);
      o.resize(nq * k.qd), l.resize(nq * k.g.n_head);
      acc.finish(o.data(), l.data());
    };
    std::vector<float> o_f, l_f, o_o, l_o, o_ref, l_ref;
    run(fixed, *fixed.c, sel, o_f, l_f);
    run(ordered, *ordered.c, sel, o_o, l_o);
    EXPECT_NE(std::memcmp(o_f.data(), o_o.data(), (size_t)fixed.qd * 4), 0) << "far keys did not move";
    if (nq == kernel_case::n_q) {
      const size_t q2 = 2 * (size_t)fixed.qd;
      EXPECT_EQ(std::memcmp(o_f.data() + q2, o_o.data() + q2, (size_t)fixed.qd * 4), 0) << "a near unit moved";
    }
    run(ordered, *ordered.r, sel, o_ref, l_ref);
    ordered.expect_near_reference(o_o, l_o, o_ref, l_ref, false);
  }
}

INSTANTIATE_TEST_SUITE_P(formats, retrieval_kernels,
                         ::testing::Values(cache_format::cache_fp16, cache_format::cache_kivi2,
                                           cache_format::cache_nuq3_1pct),
                         [](const auto& i) {
                           std::string s = format_traits(i.param).name;
                           for (char& ch : s)
                             if (ch == '-' || ch == '%') ch = '_';
                           return s;
                         });

TEST(block_summaries, bytes_equal_the_formula_and_snapshots_carry_them) {
  cache_geometry g = test::quant_geometry(kTokens + 8);
  const int C = g.n_head_kv * g.head_dim;
  const test::synthetic_kv d = test::make_synthetic_kv(kTokens, C, 5);
  std::vector<int32_t> pos(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) pos[i] = (int32_t)i;
  auto be = make_backend(backend_kind::backend_cpu);
  auto plain = filled(*be, cache_format::cache_fp16, g, d, pos);
  auto c = filled(*be, cache_format::cache_fp16, g, d, pos, 512);
  EXPECT_EQ(c->bytes_allocated() - plain->bytes_allocated(), summary_bytes_for(g, g.capacity, 512));
  EXPECT_EQ(cache_bytes_for(spec_for(cache_format::cache_fp16, g, 512), g, g.capacity, 0, 0).summaries,
            summary_bytes_for(g, g.capacity, 512));
  const block_summary_view v = summaries_of(*c, 1);
  ASSERT_EQ(v.n_blocks, 3);  // 1320 positions: blocks of 512 at 0, 512, 1024
  for (int64_t b = 0; b < v.n_blocks; ++b) {
    EXPECT_EQ(v.ids[b], b);
    EXPECT_EQ(v.count[b], std::min<int64_t>(512, kTokens - b * 512));
    for (int ch = 0; ch < C; ++ch) {  // against the raw keys: bf16, min rounded down, max up
      float mn = INFINITY, mx = -INFINITY;
      for (int64_t t = b * 512; t < std::min<int64_t>(kTokens, (b + 1) * 512); ++t)
        mn = std::min(mn, d.k[t * C + ch]), mx = std::max(mx, d.k[t * C + ch]);
      ASSERT_EQ(v.kmin[b * C + ch], bf16_round_down(mn));
      ASSERT_EQ(v.kmax[b * C + ch], bf16_round_up(mx));
      ASSERT_LE(bf16_to_fp32(v.kmin[b * C + ch]), mn);
      ASSERT_GE(bf16_to_fp32(v.kmax[b * C + ch]), mx);
      ASSERT_LE(mx - mn, 1.02f * (bf16_to_fp32(v.kmax[b * C + ch]) - bf16_to_fp32(v.kmin[b * C + ch])) + 1e-6f);
    }
  }
  // A snapshot restores them bit for bit; a damaged record is refused naming the layer.
  std::vector<uint8_t> snap(c->snapshot_bytes(1));
  c->snapshot_layer(1, snap.data());
  auto back = make_cache(spec_for(cache_format::cache_fp16, g, 512), g, *be);
  back->restore_layer(1, snap.data(), snap.size());
  const block_summary_view w = summaries_of(*back, 1);
  ASSERT_EQ(w.n_blocks, v.n_blocks);
  EXPECT_EQ(std::memcmp(w.kmax, v.kmax, (size_t)v.n_blocks * C * 2), 0);
  EXPECT_EQ(std::memcmp(w.kmean, v.kmean, (size_t)v.n_blocks * C * 2), 0);
  // The open block goes on growing after a restore exactly as in the original.
  const int32_t next = (int32_t)kTokens;
  c->append(1, layer_input{nullptr, d.k.data(), d.v.data(), &next, 1});
  back->append(1, layer_input{nullptr, d.k.data(), d.v.data(), &next, 1});
  EXPECT_EQ(std::memcmp(summaries_of(*back, 1).kmean, summaries_of(*c, 1).kmean, (size_t)v.n_blocks * C * 2), 0);
  auto again = make_cache(spec_for(cache_format::cache_fp16, g, 512), g, *be);
  test::expect_error_contains([&] { again->restore_layer(1, snap.data(), snap.size() - 4); }, "layer 1");
}

// Rows an append marks (layer_input::summary_skip) are stored and attended but left out of the
// summaries: the summaries equal those of a cache fed the other rows alone. A block whose every
// key was left out has count 0 and is never a candidate of the selector; star_attention marks
// the rows below its position.
TEST(block_summaries, skipped_rows_are_stored_but_not_summarized) {
  cache_geometry g = test::quant_geometry(kTokens + 8);
  g.rope = with_fixed_distance(g.rope, kLocal);
  const int C = g.n_head_kv * g.head_dim;
  const test::synthetic_kv d = test::make_synthetic_kv(kTokens, C, 8);
  std::vector<int32_t> pos(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) pos[i] = (int32_t)i;
  auto be = make_backend(backend_kind::backend_cpu);
  const int64_t skip = 300, B = 256;
  auto marked = make_cache(spec_for(cache_format::cache_fp16, g, B), g, *be);
  auto rest = make_cache(spec_for(cache_format::cache_fp16, g, B), g, *be);
  for (int l = 0; l < g.n_layer; ++l) {
    layer_input in{nullptr, d.k.data(), d.v.data(), pos.data(), kTokens};
    in.summary_skip = skip;
    marked->append(l, in);
    rest->append(l, layer_input{nullptr, d.k.data() + skip * C, d.v.data() + skip * C, pos.data() + skip,
                                kTokens - skip});
  }
  EXPECT_EQ(marked->n_tokens(1), kTokens);
  const block_summary_view m = summaries_of(*marked, 1), r = summaries_of(*rest, 1);
  ASSERT_EQ(m.n_blocks, r.n_blocks + 1);  // block 0 is opened, with nothing summarized
  EXPECT_EQ(m.ids[0], 0);
  EXPECT_EQ(m.count[0], 0);
  for (int64_t b = 0; b < r.n_blocks; ++b) {
    EXPECT_EQ(m.ids[b + 1], r.ids[b]);
    EXPECT_EQ(m.count[b + 1], r.count[b]);
  }
  EXPECT_EQ(m.count[1], 2 * B - skip);
  EXPECT_EQ(std::memcmp(m.kmin + C, r.kmin, (size_t)r.n_blocks * C * 2), 0);
  EXPECT_EQ(std::memcmp(m.kmax + C, r.kmax, (size_t)r.n_blocks * C * 2), 0);
  EXPECT_EQ(std::memcmp(m.kmean + C, r.kmean, (size_t)r.n_blocks * C * 2), 0);

  // Block 0 (no summarized key) is never ranked; every other far block is, with a sink of 0.
  auto comm = make_local_communicator();
  retrieval_options o;
  o.sink = 0, o.local = kLocal, o.block = B, o.top_k = 8;
  retrieval_selector sel(o, g.rope, g.n_head, *be, *comm);
  std::vector<float> q((size_t)g.n_head * g.head_dim, 0.5f);
  const int32_t q_pos = (int32_t)kTokens - 1;
  const auto scored = sel.score_blocks(*marked, 1, q.data(), &q_pos, 1, 8);
  ASSERT_EQ(scored.size(), 1u);
  EXPECT_FALSE(scored[0].empty());
  for (const auto& sb : scored[0]) EXPECT_NE(sb.id, 0);

  // star_attention marks the rows below its position, however the rows are split into appends.
  auto starred = make_cache(spec_for(cache_format::cache_fp16, g, B), g, *be);
  star_attention star(*starred, nullptr, nullptr, *be, skip);
  for (int l = 0; l < g.n_layer; ++l)
    for (int64_t at = 0; at < kTokens; at += 100) {
      const int64_t n = std::min<int64_t>(100, kTokens - at);
      star.store(l, layer_input{nullptr, d.k.data() + at * C, d.v.data() + at * C, pos.data() + at, n});
    }
  const block_summary_view s = summaries_of(*starred, 1);
  ASSERT_EQ(s.n_blocks, m.n_blocks);
  EXPECT_EQ(std::memcmp(s.count, m.count, (size_t)m.n_blocks * 4), 0);
  EXPECT_EQ(std::memcmp(s.kmax, m.kmax, (size_t)m.n_blocks * C * 2), 0);
  EXPECT_EQ(std::memcmp(s.kmean, m.kmean, (size_t)m.n_blocks * C * 2), 0);
}

// The selector's top-k against scores computed here from the raw keys in double: Quest's bound
// and the mean key, the query turned to the fixed distance by the reference rope.
TEST(retrieval_selector, top_k_equals_brute_force_scoring) {
  cache_geometry g = test::quant_geometry(4096);
  g.rope = with_fixed_distance(g.rope, kLocal);
  const int C = g.n_head_kv * g.head_dim, hd = g.head_dim, H = g.n_head, grp = H / g.n_head_kv;
  const int64_t n = 3000;
  const test::synthetic_kv d = test::make_synthetic_kv(n, C, 9);
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
  auto be = make_backend(backend_kind::backend_cpu);
  auto ref = make_backend(backend_kind::backend_ref);
  auto c = make_cache(spec_for(cache_format::cache_fp32, g, 256), g, *be);
  for (int l = 0; l < g.n_layer; ++l) c->append(l, layer_input{nullptr, d.k.data(), d.v.data(), pos.data(), n});
  auto comm = make_local_communicator();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(2 * H * hd);
  for (float& x : q) x = nd(rng);
  const std::vector<int32_t> q_pos = {2999, 1800};
  for (const selection_scope scope : {selection_scope::select_per_layer, selection_scope::select_per_kv_head})
  for (const block_score_rule rule : {block_score_rule::score_minmax, block_score_rule::score_mean}) {
    SCOPED_TRACE(selection_scope_name(scope));
    retrieval_options o;
    o.sink = 256, o.local = kLocal, o.block = 256, o.top_k = 3, o.rule = rule, o.scope = scope;
    retrieval_selector sel(o, g.rope, H, *be, *comm);
    const attn_selection& s = sel.select(*c, 0, q.data(), q_pos.data(), 2);
    const int L = scope == selection_scope::select_per_kv_head ? g.n_head_kv : 1;
    ASSERT_EQ(s.lists_per_query, L);
    for (int64_t i = 0; i < 2; ++i)
    for (int list = 0; list < L; ++list) {
      std::vector<float> qf(q.begin() + i * H * hd, q.begin() + (i + 1) * H * hd);
      const int32_t turn = kLocal - q_pos[i];
      rope_config plain = g.rope;
      plain.se_group = 1, plain.se_window = 0;
      ref->rope(qf.data(), &turn, 1, H, plain);
      std::vector<std::pair<double, int64_t>> scored;
      for (int64_t b = 0; b * 256 <= q_pos[i]; ++b) {
        if (!sel.candidate(b, q_pos[i])) continue;
        double s_b = 0;
        for (int h = list * (H / L); h < (list + 1) * (H / L); ++h)
          for (int ch = 0; ch < hd; ++ch) {
            const int col = (h / grp) * hd + ch;
            // The summary as stored: bf16 min rounded down, max up, the f32 mean to nearest.
            float mn = INFINITY, mx = -INFINITY, sum = 0;
            const int64_t e = std::min<int64_t>(n, (b + 1) * 256);
            for (int64_t t = b * 256; t < e; ++t)
              mn = std::min(mn, d.k[t * C + col]), mx = std::max(mx, d.k[t * C + col]), sum += d.k[t * C + col];
            const double lo = bf16_to_fp32(bf16_round_down(mn)), hi = bf16_to_fp32(bf16_round_up(mx));
            const double mean = bf16_to_fp32(fp32_to_bf16(sum * (1.0f / (float)(e - b * 256))));
            const double qc = qf[h * hd + ch];
            s_b += rule == block_score_rule::score_minmax ? std::max(qc * lo, qc * hi) : qc * mean;
          }
        scored.push_back({-s_b, b});
      }
      std::sort(scored.begin(), scored.end());
      std::vector<int64_t> expect;
      sel.fixed_units(q_pos[i], expect);
      for (size_t k = 0; k < 3 && k < scored.size(); ++k) expect.push_back(scored[k].second);
      std::sort(expect.begin(), expect.end());
      expect.erase(std::unique(expect.begin(), expect.end()), expect.end());
      const int64_t li = i * L + list;
      const std::vector<int64_t> got(s.units.begin() + s.offsets[li], s.units.begin() + s.offsets[li + 1]);
      EXPECT_EQ(got, expect) << block_score_rule_name(rule) << " query " << i << " list " << list;
      if (i == 1 && L == 1) {  // the needle-rank probe ranks a block as the brute force does, for the last query
        for (const size_t at : {size_t(0), size_t(2), scored.size() - 1}) {
          retrieval_selector probe(o, g.rope, H, *be, *comm);
          probe.set_probe(scored[at].second * 256 + 17);
          probe.select(*c, 0, q.data(), q_pos.data(), 2);
          ASSERT_EQ(probe.probe_results().size(), 1u);
          const auto& r = probe.probe_results()[0];
          EXPECT_EQ(rule == block_score_rule::score_minmax ? r.rank_minmax : r.rank_mean, (int64_t)at + 1)
              << block_score_rule_name(rule) << " block " << scored[at].second;
          EXPECT_EQ(r.candidates, (int64_t)scored.size());
          std::vector<int64_t> best;  // the brute force's best blocks, best first
          for (size_t k = 0; k < scored.size() && k < (size_t)retrieval_selector::kProbeTop; ++k)
            best.push_back(scored[k].second);
          EXPECT_EQ(rule == block_score_rule::score_minmax ? r.top_minmax : r.top_mean, best);
        }
      }
    }
  }
}

// InfLLM's representative tokens against a scalar reference in double: each key's mean logit
// from the later queries within W (rotated at the true positions by the reference rope), the
// top kPerBlock eligible keys of each block and KV head. Keys and queries arrive in uneven
// chunks, and the first rows of the star block are stored but not eligible (restart_skip).
TEST(representative_tokens, choose_what_a_brute_force_chooses) {
  const cache_geometry g = test::quant_geometry(4096, 1);
  const int C = g.n_head_kv * g.head_dim, hd = g.head_dim, H = g.n_head, grp = H / g.n_head_kv;
  constexpr int64_t kBlock = 256, kSkip = 5, kFirst = 512;  // a star block at [512, 1536)
  const int64_t n = 1024;
  const test::synthetic_kv d = test::make_synthetic_kv(n, C, 21);
  std::vector<int32_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)(kFirst + i);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> q((size_t)n * H * hd);
  for (float& x : q) x = nd(rng);
  auto be = make_backend(backend_kind::backend_cpu);
  auto ref = make_backend(backend_kind::backend_ref);
  representative_tokens rt(H, g.n_head_kv, hd, kBlock, kLocal, g.rope, *be);
  rt.begin_star_block();
  for (const auto& [at, m] : {std::pair<int64_t, int64_t>{0, 600}, {600, 424}}) {
    layer_input in{nullptr, d.k.data() + at * C, d.v.data() + at * C, pos.data() + at, m};
    in.summary_skip = at == 0 ? kSkip : 0;
    rt.keys(0, in);
  }
  for (const auto& [at, m] : {std::pair<int64_t, int64_t>{0, 700}, {700, 324}})
    rt.queries(0, q.data() + at * H * hd, pos.data() + at, m);

  std::vector<float> kr(d.k.begin(), d.k.begin() + n * C);
  rope_config plain = g.rope;
  ref->rope(kr.data(), pos.data(), n, g.n_head_kv, plain);
  for (int64_t b = 0; b < n / kBlock; ++b) {
    const int64_t id = (kFirst + b * kBlock) / kBlock;
    const representative_tokens::block_keys* got = rt.of(0, id);
    ASSERT_NE(got, nullptr) << "block " << id;
    for (int kvh = 0; kvh < g.n_head_kv; ++kvh) {
      std::vector<std::pair<double, int64_t>> mean;  // (-mean, row)
      for (int64_t m = b * kBlock; m < (b + 1) * kBlock; ++m) {
        if (m < kSkip) continue;
        double s = 0;
        int64_t seen = 0;
        for (int64_t j = m + 1; j < n && j - m <= kLocal; ++j, ++seen)
          for (int h = kvh * grp; h < (kvh + 1) * grp; ++h)
            for (int c = 0; c < hd; ++c) s += (double)q[(j * H + h) * hd + c] * kr[m * C + kvh * hd + c];
        if (seen > 0) mean.push_back({-s / (double)seen, m});
      }
      std::sort(mean.begin(), mean.end());
      const size_t top = std::min<size_t>(mean.size(), representative_tokens::kPerBlock);
      ASSERT_EQ(got->count[(size_t)kvh], (int)top);
      for (size_t j = 0; j < top; ++j) {
        const float* expect = d.k.data() + mean[j].second * C + kvh * hd;  // pre-RoPE, as stored
        EXPECT_EQ(std::memcmp(got->k.data() + ((size_t)kvh * representative_tokens::kPerBlock + j) * hd, expect,
                              (size_t)hd * sizeof(float)),
                  0)
            << "block " << id << " KV head " << kvh << " representative " << j << " (row " << mean[j].second << ")";
      }
    }
  }
  EXPECT_EQ(rt.of(0, 0), nullptr);  // not prefilled here
}

// auto's one rule: full inside the trained window or with the user's own positions, retrieval
// beyond; explicit modes pass through.
TEST(retrieval_options, auto_resolves_by_the_trained_window) {
  using m = attention_mode;
  EXPECT_EQ(resolve_attention_mode(m::attention_auto, 8192, 8192, false), m::attention_full);
  EXPECT_EQ(resolve_attention_mode(m::attention_auto, 8193, 8192, false), m::attention_retrieval);
  EXPECT_EQ(resolve_attention_mode(m::attention_auto, 1 << 20, 8192, true), m::attention_full);
  EXPECT_EQ(resolve_attention_mode(m::attention_full, 1 << 20, 8192, false), m::attention_full);
  EXPECT_EQ(resolve_attention_mode(m::attention_retrieval, 100, 8192, false), m::attention_retrieval);
}

TEST(retrieval_options, bad_values_name_the_flag) {
  retrieval_options o;
  o.top_k = 0;
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--top-k");
  o = {};
  o.block = 0;
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--block-size");
  o.block = 300;
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--block-size");
  o = {};
  o.local = 8192;
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--local");
  o = {};
  o.sink = -1;
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--sink");
  o = {};
  o.restart_skip = o.block;
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--restart-skip");
  test::expect_error_contains([] { parse_attention_mode("fast"); }, "--attention");
  test::expect_error_contains([] { parse_selection_scope("head"); }, "--select-per");
  test::expect_error_contains([] { parse_far_positions("sorted"); }, "--far-positions");
  o = {};
  o.far = far_positions::far_ordered, o.local = 4096, o.block = 4096;  // W + B reaches the window
  test::expect_error_contains([&] { check_retrieval_options(o, 8192); }, "--far-positions ordered");
  o.block = 3840;
  check_retrieval_options(o, 8192);
}

}  // namespace
}  // namespace xctx
