// clkv decode steps on the CPU: the K and V streams read through the quantized-KV layer view
// by the fused one-query kernel (kernels/cpu/kvq/xq.cpp attend_decode_as_kvq), at every key/value
// code width pair clkv's layers have, against the reference attention over the decoded cache,
// and bitwise the same for any unit-aligned split of the cache and any thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "cache/x_cache.h"
#include "cache/x_test_util.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"
#include "registry/registry.h"

namespace xctx {
namespace {

using test::x_geometry;

constexpr double kEps = FLT_EPSILON;

// SmolLM2's attention shape (9 query heads over 3 kv heads of 64) with clkv's layer widths
// chosen so the four layers cover every (key, value) code width pair the kernel takes:
// kq = 1, vq = 2 gives 2/2, 1/2, 1/1, 1/1; kq = 3, vq = 1 gives 2/2, 2/1, 2/1, 1/1 (values of
// layer 3 shared with layer 2 in both).
struct clkv_decode_fixture {
  cache_geometry g;
  cache_spec spec;
  std::vector<std::vector<float>> k, v;  // per layer [n, kv] pre-RoPE keys, values
  std::vector<int32_t> pos;
  clkv_decode_fixture(int key_2bit_layers, int value_2bit_layers, int64_t n, uint32_t seed, bool gap)
      : g(x_geometry(true, n)), spec(cache_format::cache_clkv) {
    g.n_head = 9, g.n_head_kv = 3, g.head_dim = 64, g.n_embd = 192;
    g.rope.head_dim = 64, g.rope.n_rot = 64;
    cache_options o;
    o.clkv_key_2bit_layers = key_2bit_layers, o.clkv_value_2bit_layers = value_2bit_layers;
    spec = cache_spec(cache_format::cache_clkv, o);
    const int C = g.n_head_kv * g.head_dim;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd;
    k.assign(g.n_layer, std::vector<float>((size_t)n * C)), v = k;
    for (int l = 0; l < g.n_layer; ++l)
      for (int64_t t = 0; t < n; ++t)
        for (int c = 0; c < C; ++c) {
          k[l][t * C + c] = nd(rng) * (c % 17 == 3 ? 6.0f : 1.0f) + (c % 5 == 1 ? 2.0f : 0.0f);  // outlier channels
          v[l][t * C + c] = nd(rng);
        }
    pos.resize(n);
    for (int64_t i = 0; i < n; ++i) pos[i] = (int32_t)(gap && i >= 300 ? i + 40 : i);  // a gap inside a unit
  }
  // Tokens [from, to) of every layer, in chunks of `chunk`.
  void append(kv_cache& c, int64_t from, int64_t to, int64_t chunk = 100) const {
    const int C = g.n_head_kv * g.head_dim;
    for (int64_t at = from; at < to; at += chunk) {
      const int64_t m = std::min(chunk, to - at);
      for (int l = 0; l < g.n_layer; ++l)
        c.append(l, layer_input{nullptr, k[l].data() + at * C, v[l].data() + at * C, pos.data() + at, m});
    }
  }
};

// Largest L2 norm of one head's row of a stream's decoded rows (RoPE keeps it), and max |x|.
std::pair<double, double> stream_magnitudes(const xq_stream& s, int64_t n, int head_dim) {
  std::vector<float> x((size_t)n * s.channels);
  ref::xq_decode_rows(s, 0, n, x.data());
  double max_norm = 0, max_abs = 0;
  for (size_t h = 0; h < x.size(); h += head_dim) {
    double s2 = 0;
    for (int e = 0; e < head_dim; ++e) s2 += (double)x[h + e] * x[h + e], max_abs = std::max(max_abs, (double)std::fabs(x[h + e]));
    max_norm = std::max(max_norm, std::sqrt(s2));
  }
  return {max_norm, max_abs};
}

// The decode step (one query) over every layer equals the reference attention over the decoded
// cache: the score error of the fused kernel (query rotated by the unit start, keys by their
// offset, ~head_dim/2 roundings of each dot product) is <= kScoreRel |q| |k| scale; the output
// moves by <= 2 delta max|v|, lse by delta. Both instruction sets where the CPU has AVX-512;
// on machines without AVX2 the absorbed path runs (same bound).
TEST(x_cache, clkv_decode_step_matches_the_reference_at_every_code_width) {
  auto be = make_backend(backend_kind::backend_cpu);
  auto rbe = make_backend(backend_kind::backend_ref);
  constexpr double kScoreRel = 32.0 * kEps;
  const int64_t n = 700;  // windows of 128, then a 60-row fp16 residual window
  for (const auto& [kq, vq] : {std::pair{1, 2}, std::pair{3, 1}}) {
    const clkv_decode_fixture fx(kq, vq, n, 61, true);
    auto cache = make_cache(fx.spec, fx.g, *be), rcache = make_cache(fx.spec, fx.g, *rbe);
    fx.append(*cache, 0, n), fx.append(*rcache, 0, n);
    const int qd = fx.g.n_head * fx.g.head_dim;
    std::mt19937 rng(67);
    std::normal_distribution<float> nd;
    std::vector<float> q(qd);
    for (float& x : q) x = 0.3f * nd(rng);
    double max_q = 0;
    for (int h = 0; h < fx.g.n_head; ++h) {
      double s2 = 0;
      for (int e = 0; e < fx.g.head_dim; ++e) s2 += (double)q[h * fx.g.head_dim + e] * q[h * fx.g.head_dim + e];
      max_q = std::max(max_q, std::sqrt(s2));
    }
    for (int l = 0; l < fx.g.n_layer; ++l) {
      const clkv_layer cfg = clkv_layer_config(fx.spec.options, fx.g.n_layer, l);
      const double max_k = stream_magnitudes(x_cache_stream(*cache, l, 0), n, fx.g.head_dim).first;
      const double max_v = stream_magnitudes(x_cache_stream(*cache, l, 1), n, fx.g.head_dim).second;
      const double delta = kScoreRel * max_q * max_k / std::sqrt((double)fx.g.head_dim);
      for (const int32_t q_pos : {fx.pos[n - 1] + 1, fx.pos[320]})
      for (const bool force_avx2 : {false, true}) {
        if (force_avx2 && !cpu::has_avx512()) continue;
        SCOPED_TRACE(::testing::Message() << "kq " << kq << " vq " << vq << " layer " << l << " (" << cfg.key_bits
                                          << "/" << cfg.value_bits << " bits) q_pos " << q_pos
                                          << (force_avx2 ? " avx2" : "") << " seeds 61/67");
        std::vector<float> o(qd), lse(fx.g.n_head), o_r(qd), l_r(fx.g.n_head);
        cpu::set_force_avx2(force_avx2);
        cache->attend(l, q.data(), &q_pos, 1, o.data(), lse.data(), attend_path::attend_decode);
        cpu::set_force_avx2(false);
        rcache->attend(l, q.data(), &q_pos, 1, o_r.data(), l_r.data(), attend_path::attend_decode);
        for (int i = 0; i < qd; ++i) ASSERT_NEAR(o[i], o_r[i], 2 * delta * max_v + 1e-6) << i;
        for (int h = 0; h < fx.g.n_head; ++h) ASSERT_NEAR(lse[h], l_r[h], delta + 1e-5 * std::fabs(l_r[h])) << h;
      }
    }
  }
}

// What np 1 vs np P relies on: one cache, the same tokens split on unit boundaries over two
// caches (one attended through its exported block), and any thread count give the same bits.
TEST(x_cache, clkv_decode_step_is_bitwise_the_same_for_any_split_and_threads) {
  auto be = make_backend(backend_kind::backend_cpu);
  const int64_t n = 3 * kAttnUnit + 77;
  const clkv_decode_fixture fx(3, 1, n, 71, false);  // slots = positions: unit-aligned splits
  auto whole = make_cache(fx.spec, fx.g, *be), a = make_cache(fx.spec, fx.g, *be), b = make_cache(fx.spec, fx.g, *be);
  fx.append(*whole, 0, n);
  fx.append(*a, 0, kAttnUnit), fx.append(*a, 2 * kAttnUnit, n);
  fx.append(*b, kAttnUnit, 2 * kAttnUnit);
  const int qd = fx.g.n_head * fx.g.head_dim;
  std::mt19937 rng(73);
  std::normal_distribution<float> nd;
  std::vector<float> q(qd);
  for (float& x : q) x = 0.3f * nd(rng);
  const int32_t q_pos = fx.pos[n - 1] + 1;
  for (int l = 0; l < fx.g.n_layer; ++l) {
    std::vector<uint8_t> block(b->exported_bytes(l));
    b->export_layer(l, block.data());
    const auto run = [&](bool split, int threads) {
      const int before = omp_get_max_threads();
      omp_set_num_threads(threads);
      softmax_acc acc(fx.g.n_head, fx.g.head_dim);
      if (split) {
        a->attend(l, q.data(), &q_pos, 1, attend_path::attend_decode, acc);
        a->attend_exported(l, block.data(), block.size(), q.data(), &q_pos, 1, attend_path::attend_decode, acc);
      } else {
        whole->attend(l, q.data(), &q_pos, 1, attend_path::attend_decode, acc);
      }
      omp_set_num_threads(before);
      std::vector<float> o(qd), lse(fx.g.n_head);
      acc.finish(o.data(), lse.data());
      o.insert(o.end(), lse.begin(), lse.end());
      return o;
    };
    for (const bool force_avx2 : {false, true}) {
      if (force_avx2 && !cpu::has_avx512()) continue;
      SCOPED_TRACE(::testing::Message() << "layer " << l << (force_avx2 ? " avx2" : "") << " seeds 71/73");
      cpu::set_force_avx2(force_avx2);
      const std::vector<float> ref = run(false, 1);
      EXPECT_EQ(run(false, 2), ref) << "2 threads";
      EXPECT_EQ(run(true, 1), ref) << "split over two caches";
      EXPECT_EQ(run(true, 2), ref) << "split, 2 threads";
      cpu::set_force_avx2(false);
    }
  }
}

}  // namespace
}  // namespace xctx
