// The fp16/fp32 baseline caches: byte accounting, capacity errors, and attention over the
// cache equal to reference attention over the same keys (rotated) and values.
#include <gtest/gtest.h>

#include <random>

#include "cache/cache.h"
#include "cache/snapshot_check.h"
#include "common/error.h"
#include "common/half.h"
#include "kernels/ref/ref_ops.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

cache_geometry small_geometry(int64_t capacity) {
  cache_geometry g;
  g.n_layer = 2;
  g.n_head = 4;
  g.n_head_kv = 2;
  g.head_dim = 16;
  g.n_embd = 64;
  g.rope.head_dim = 16;
  g.rope.n_rot = 16;
  g.rope.freq_base = 10000.0f;
  g.capacity = capacity;
  return g;
}

class fp_cache_test : public ::testing::TestWithParam<cache_format> {};

TEST_P(fp_cache_test, bytes_are_exact) {
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = small_geometry(100);
  auto c = make_cache(GetParam(), g, *be);
  const size_t elem = GetParam() == cache_format::cache_fp32 ? 4 : 2;
  const size_t per_token = 2 * 2 * 2 * 16 * elem + 4;  // layers x (K,V) x kv heads x dim + position
  EXPECT_EQ(cache_bytes_per_token(GetParam(), g), (double)per_token);
  EXPECT_EQ(c->bytes_allocated(), per_token * 100);
  EXPECT_EQ(c->bytes_used(), 0u);
}

TEST_P(fp_cache_test, attention_over_cache_equals_reference) {
  const uint32_t seed = 7;
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  auto be = make_backend(backend_kind::backend_cpu);
  // SelfExtend: 37 keys leave both sides small, so the window and group are scaled down alike.
  for (const test::self_extend_case se : {test::self_extend_case{1, 0}, {3, 5}, {2, 16}}) {
    SCOPED_TRACE(::testing::Message() << "selfextend G " << se.group << " W " << se.window);
    cache_geometry g = small_geometry(64);
    g.rope = test::with_self_extend(g.rope, se);
    auto c = make_cache(GetParam(), g, *be);
    const int64_t n = 37;
    const int kv = g.n_head_kv * g.head_dim, qd = g.n_head * g.head_dim;
    std::vector<float> k(n * kv), v(n * kv), q(n * qd);
    for (auto* vec : {&k, &v, &q})
      for (float& x : *vec) x = nd(rng);
    std::vector<int32_t> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = 100 + i;
    // Append in two pieces to cross the boundary between calls.
    for (int l = 0; l < g.n_layer; ++l) {
      layer_input a{nullptr, k.data(), v.data(), pos.data(), 20};
      layer_input b{nullptr, k.data() + 20 * kv, v.data() + 20 * kv, pos.data() + 20, n - 20};
      c->append(l, a);
      c->append(l, b);
    }
    EXPECT_EQ(c->n_tokens(1), n);
    EXPECT_EQ(c->bytes_used(), cache_bytes_for(GetParam(), g, n, 0, 0).total());

    std::vector<float> o(n * qd), lse(n * g.n_head);
    c->attend(1, q.data(), pos.data(), n, o.data(), lse.data());

    // Reference: rotate keys, round K and V as the format stores them, plain attention.
    std::vector<float> kr = k;
    ref::rope(kr.data(), pos.data(), n, g.n_head_kv, g.rope);
    std::vector<float> vr = v;
    if (GetParam() == cache_format::cache_fp16) {
      for (float& x : kr) x = fp16_to_fp32(fp32_to_fp16(x));
      for (float& x : vr) x = fp16_to_fp32(fp32_to_fp16(x));
    }
    std::vector<float> o_ref(n * qd), lse_ref(n * g.n_head);
    attn_args a;
    a.q = q.data();
    a.q_pos = pos.data();
    a.n_q = n;
    a.k = kr.data();
    a.v = vr.data();
    a.kv_pos = pos.data();
    a.n_kv = n;
    a.n_head = g.n_head;
    a.n_head_kv = g.n_head_kv;
    a.head_dim = g.head_dim;
    a.scale = 0.25f;
    a.o = o_ref.data();
    a.lse = lse_ref.data();
    a.rope = g.rope;
    ref::attention_partial(a);
    // Float rounding of the rotation (cos/sin in float) and of the sums over <= 37 keys.
    const float tol = 1e-4f;
    for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], o_ref[i], tol) << i;
    for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], lse_ref[i], tol) << i;
    // One query alone (the few-query driver: threads split the units).
    const int64_t last = n - 1;
    std::vector<float> o1(qd), l1(g.n_head);
    c->attend(1, q.data() + last * qd, pos.data() + last, 1, o1.data(), l1.data(), attend_path::attend_decode);
    for (int i = 0; i < qd; ++i) ASSERT_NEAR(o1[i], o_ref[last * qd + i], tol) << i;
    for (int h = 0; h < g.n_head; ++h) ASSERT_NEAR(l1[h], lse_ref[last * g.n_head + h], tol) << h;
  }
}

TEST_P(fp_cache_test, capacity_overflow_is_a_clear_error) {
  auto be = make_backend(backend_kind::backend_cpu);
  auto c = make_cache(GetParam(), small_geometry(8), *be);
  std::vector<float> k(10 * 32), v(10 * 32);
  std::vector<int32_t> pos(10);
  for (int i = 0; i < 10; ++i) pos[i] = i;
  layer_input in{nullptr, k.data(), v.data(), pos.data(), 10};
  try {
    c->append(0, in);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity of 8"), std::string::npos) << e.what();
  }
}

// A NaN value in the cache (a damaged snapshot or block) reaches softmax_acc's finiteness check
// inside the parallel attention loops, decode and prefill alike: it must come out as an Error on
// the calling thread, not terminate the process from inside the OpenMP region.
TEST_P(fp_cache_test, non_finite_values_are_an_error_not_an_abort) {
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = small_geometry(2048);
  auto c = make_cache(GetParam(), g, *be);
  const int64_t n = 1500;  // several attention units, so the loops run on every thread
  const int kv = g.n_head_kv * g.head_dim, qd = g.n_head * g.head_dim;
  std::vector<float> k((size_t)n * kv, 0.25f), v((size_t)n * kv, 0.5f), q((size_t)8 * qd, 0.1f);
  v[(size_t)1300 * kv + 3] = std::nanf("");
  std::vector<int32_t> pos(n), q_pos(8);
  for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)i;
  for (int i = 0; i < 8; ++i) q_pos[i] = (int32_t)(n + i);
  c->append(0, layer_input{nullptr, k.data(), v.data(), pos.data(), n});
  std::vector<float> o(q.size()), lse((size_t)8 * g.n_head);
  for (const int64_t n_q : {int64_t(1), int64_t(8)})
    for (const attend_path path : {attend_path::attend_decode, attend_path::attend_prefill}) {
      try {
        c->attend(0, q.data(), q_pos.data(), n_q, o.data(), lse.data(), path);
        ADD_FAILURE() << n_q << " queries: a NaN value went through";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("non-finite"), std::string::npos) << e.what();
      }
    }
}

// The ring passes exported blocks: attention over a received block must equal attention over
// the cache it came from, and a block whose size disagrees with its header is rejected.
TEST_P(fp_cache_test, exported_block_attends_like_the_cache) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = small_geometry(32);
  auto src = make_cache(GetParam(), g, *be);
  auto dst = make_cache(GetParam(), g, *be);
  const int64_t n = 21;
  const int kv = g.n_head_kv * g.head_dim, qd = g.n_head * g.head_dim;
  std::vector<float> k(n * kv), v(n * kv), q(5 * qd);
  for (auto* vec : {&k, &v, &q})
    for (float& x : *vec) x = nd(rng);
  std::vector<int32_t> pos(n), q_pos = {3, 40, 45, 50, 200};
  for (int i = 0; i < n; ++i) pos[i] = 40 + i;  // the first query sees nothing
  for (int l = 0; l < g.n_layer; ++l) src->append(l, layer_input{nullptr, k.data(), v.data(), pos.data(), n});
  std::vector<uint8_t> block(src->exported_bytes(1));
  src->export_layer(1, block.data());
  std::vector<float> o1(5 * qd), o2(5 * qd), l1(5 * g.n_head), l2(5 * g.n_head);
  src->attend(1, q.data(), q_pos.data(), 5, o1.data(), l1.data());
  dst->attend_exported(1, block.data(), block.size(), q.data(), q_pos.data(), 5, o2.data(), l2.data());
  for (size_t i = 0; i < o1.size(); ++i) ASSERT_EQ(o1[i], o2[i]) << i;
  for (size_t i = 0; i < l1.size(); ++i) ASSERT_EQ(l1[i], l2[i]) << i;
  EXPECT_TRUE(std::isinf(l1[0]) && l1[0] < 0);
  EXPECT_THROW(dst->attend_exported(1, block.data(), block.size() - 2, q.data(), q_pos.data(), 5, o2.data(), l2.data()),
               Error);
}

// Save and restore: the restored cache is the original (snapshot_check.h).
TEST_P(fp_cache_test, snapshot_restores_the_same_cache) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = small_geometry(40);
  auto src = make_cache(GetParam(), g, *be);
  const int kv = g.n_head_kv * g.head_dim;
  std::vector<float> k(30 * kv), v(30 * kv);
  for (auto* vec : {&k, &v})
    for (float& x : *vec) x = nd(rng);
  std::vector<int32_t> pos(30);
  for (int i = 0; i < 30; ++i) pos[i] = 7 + 2 * i;
  for (int l = 0; l < g.n_layer; ++l) src->append(l, layer_input{nullptr, k.data(), v.data(), pos.data(), 21});
  test::expect_restores_like(
      *src, [&] { return make_cache(GetParam(), g, *be); },
      [&](kv_cache& c) {
        for (int l = 0; l < g.n_layer; ++l)
          c.append(l, layer_input{nullptr, k.data() + 21 * kv, v.data() + 21 * kv, pos.data() + 21, 9});
      });
}

INSTANTIATE_TEST_SUITE_P(formats, fp_cache_test, ::testing::Values(cache_format::cache_fp32, cache_format::cache_fp16),
                         [](const auto& info) { return std::string(format_traits(info.param).name); });

TEST(cache_format, names_parse_and_unknown_is_listed) {
  EXPECT_EQ(parse_cache_format("fp16"), cache_format::cache_fp16);
  EXPECT_EQ(parse_cache_format("fp32"), cache_format::cache_fp32);
  try {
    parse_cache_format("nuq9");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp16"), std::string::npos);
  }
}

}  // namespace
}  // namespace xctx
