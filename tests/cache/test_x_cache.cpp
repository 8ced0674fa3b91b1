// The X caches (xquant*, xquant-cl*, clkv): SVD factors reproduce W_k and W_v, decode error
// within one (calibrated) quantization step, V-absorption equal to rebuilding V, the cross-layer
// accumulator equal to the sum of its decoded deltas, clkv's shared codes with per-layer scales,
// exact byte accounting, the fused CPU attention against the reference, exported blocks, errors.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <random>
#include <utility>

#include "cache/snapshot_check.h"
#include "cache/x_test_util.h"
#include "common/error.h"
#include "common/half.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ref/ref_ops.h"
#include "registry/registry.h"
#include "test_util.h"

namespace xctx {
namespace {

using test::make_layer_inputs;
using test::make_x_model;
using test::x_geometry;

constexpr double kEps = FLT_EPSILON;
constexpr double kFp16Rel = 1.0 / 2048.0;
constexpr double kFp16Abs = 1.0 / 33554432.0;
using test::case_name;
using test::fill;
using test::filled;
using test::kTestWindow;
using test::spec_for;
using test::x_case;

// |decoded - x| for a uniform code: half a step, the fp16 rounding of scale/zero/row, and with
// calibration eta the endpoints moved inward by eta * step * levels (ACL Eq. 12).
double step_bound(kvq_affine p, int bits, float eta, double x) {
  const double levels = (1 << bits) - 1;
  const double s_stored = fp16_to_fp32(p.scale), z = std::fabs(fp16_to_fp32(p.zero));
  const double s = s_stored / (1.0 - 2.0 * eta);  // the step the codes were computed with
  return s * (0.5 + eta * levels + levels * 2 * kFp16Rel) + 3 * kFp16Rel * (z + std::fabs(x)) + kFp16Abs * levels +
         8 * kEps * (z + std::fabs(x));
}

kvq_affine params_of(const xq_stream& s, int64_t t, int c) {
  return s.axis == xq_axis::xq_per_channel ? s.params[(t / s.group) * s.channels + c]
                                           : s.params[t * s.n_groups_per_row() + c / s.group];
}

// ---- factors ---------------------------------------------------------------------------------

// U·(Σ Bᵀ) reproduces W within the float rounding of U and ΣBᵀ (each element of the product
// is off by at most eps * Σ_j |u_ij||m_jc| plus the double SVD's own ~1e-15 relative error).
void expect_reproduces(const std::vector<float>& u, const std::vector<float>& m, int d, int r, int cols, int ldm,
                       int off, const float* w /*[cols, d] rows*/, const char* what) {
  double worst = 0;
  for (int i = 0; i < d; ++i)
    for (int c = 0; c < cols; ++c) {
      double s = 0, sa = 0;
      for (int j = 0; j < r; ++j) {
        const double p = (double)u[(size_t)i * r + j] * m[(size_t)j * ldm + off + c];
        s += p, sa += std::fabs(p);
      }
      const double err = std::fabs(s - w[(size_t)c * d + i]);
      worst = test::worse(worst, err / (2 * kEps * sa + 1e-12));
      ASSERT_LE(err, 2 * kEps * sa + 1e-12) << what << " element " << i << "," << c;
    }
  std::printf("[x-factors] %s: worst error %.2f of the float-rounding bound\n", what, worst);
}

TEST(x_factors, svd_reproduces_wk_wv_and_u_is_orthonormal) {
  const cache_geometry g = x_geometry(true, 16);
  const test::x_model m = make_x_model(g, 3, false);
  const int d = g.n_embd, C = g.n_head_kv * g.head_dim;
  auto lat = build_x_factors(m.w, x_factor_kind::xf_latent);
  auto cl = build_x_factors(m.w, x_factor_kind::xf_cross_layer);
  ASSERT_EQ(lat->rank, C);
  ASSERT_EQ(cl->rank, 2 * C);
  for (int l = 0; l < g.n_layer; ++l) {
    const auto& F = lat->layers[l];
    const auto* wk = static_cast<const float*>(m.w.layers[l].wk.data);
    const auto* wv = static_cast<const float*>(m.w.layers[l].wv.data);
    expect_reproduces(F.u_k, F.m_k, d, C, C, C, 0, wk, "U_k Σ_k B_kᵀ = W_k");
    expect_reproduces(F.u_v, F.m_v, d, C, C, C, 0, wv, "U_v Σ_v B_vᵀ = W_v");
    const auto& H = cl->layers[l];
    expect_reproduces(H.u_kv, H.m_kv, d, 2 * C, C, 2 * C, 0, wk, "U_kv Σ B_kvᵀ [:, :kv] = W_k");
    expect_reproduces(H.u_kv, H.m_kv, d, 2 * C, C, 2 * C, C, wv, "U_kv Σ B_kvᵀ [:, kv:] = W_v");
    // UᵀU = I: each entry is a d-term sum of products of float-rounded entries.
    for (int a = 0; a < 2 * C; ++a)
      for (int b = 0; b < 2 * C; ++b) {
        double s = 0;
        for (int i = 0; i < d; ++i) s += (double)H.u_kv[(size_t)i * 2 * C + a] * H.u_kv[(size_t)i * 2 * C + b];
        ASSERT_NEAR(s, a == b ? 1.0 : 0.0, 2 * d * kEps) << "layer " << l << " U_kvᵀU_kv[" << a << "," << b << "]";
      }
  }
}

TEST(x_factors, real_model_factors_reproduce_its_weights) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  auto f = build_x_factors(w, x_factor_kind::xf_latent);
  const int d = w.hp.n_embd, C = w.hp.kv_dim();
  for (int l : {0, w.hp.n_layer - 1}) {
    for (int k = 0; k < 2; ++k) {
      const weight_view& wv = k == 0 ? w.layers[l].wk : w.layers[l].wv;
      std::vector<float> rows((size_t)C * d);
      for (int r = 0; r < C; ++r)
        cpu::dequantize_row(wv.type, static_cast<const uint8_t*>(wv.data) + r * wv.row_bytes(), rows.data() + r * d, d);
      const auto& F = f->layers[l];
      expect_reproduces(k == 0 ? F.u_k : F.u_v, k == 0 ? F.m_k : F.m_v, d, C, C, C, 0, rows.data(),
                        k == 0 ? "SmolLM2 W_k" : "SmolLM2 W_v");
    }
  }
}

// The factors are a function of the weights: the same bits whatever OpenBLAS's thread count was
// when they were built (dgesdd on 2 threads once gave other bits than on 1, and one rank on 2
// threads then disagreed with two ranks on 1 thread each).
TEST(x_factors, same_bits_on_any_blas_thread_count) {
  XCTX_REQUIRE_MODEL(path);
  const model_weights w = load_model(path);
  const int saved = openblas_get_num_threads();
  for (x_factor_kind kind : {x_factor_kind::xf_latent, x_factor_kind::xf_cross_layer}) {
    openblas_set_num_threads(1);
    const uint64_t one = x_factors_digest(*build_x_factors(w, kind));
    openblas_set_num_threads(4);
    const uint64_t four = x_factors_digest(*build_x_factors(w, kind));
    EXPECT_EQ(one, four) << (kind == x_factor_kind::xf_latent ? "latent" : "cross-layer");
    EXPECT_EQ(openblas_get_num_threads(), 4) << "build_x_factors left OpenBLAS's thread count changed";
  }
  openblas_set_num_threads(saved);
}

// ---- per-format tests ---------------------------------------------------------------------------

class x_cache_test : public ::testing::TestWithParam<x_case> {};

// Every stored element decodes within one (calibrated) step of what the cache was given: the
// latent X·U (xquant GQA), X (xquant MHA), K/V (clkv, own-code layers). Window rows and the
// fp16 first channel decode to exactly the fp16 of the input.
TEST_P(x_cache_test, decode_error_within_one_step) {
  const x_case c = GetParam();
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(c.gqa, 300);
  const int64_t n = 3 * kTestWindow + 5;
  filled f = fill(*be, c, g, n, 1, {10, 33}, 5);
  // xquant-cl: the layers up to the base hold X at 4 bits (their deltas: cl_accumulator test).
  const bool cl = format_traits(c.format).family == cache_family::family_xquant_cl;
  const bool xq = cl || format_traits(c.format).family == cache_family::family_xquant;
  const int n_layer = cl ? f.spec.options.cl_hi_layers : g.n_layer;
  for (int l = 0; l < n_layer; ++l) {
    for (int k = 0; k < (cl || (xq && !c.gqa) ? 1 : 2); ++k) {
      const xq_stream s = x_cache_stream(*f.cache, l, k);
      std::vector<float> want((size_t)n * s.channels), got((size_t)n * s.channels);
      // The cache projected chunk by chunk in float (sgemm): a row's latent may differ from this
      // one by float accumulation over n_embd terms, d * eps * Σ|x_i u_ij|.
      std::vector<double> proj_err((size_t)n * s.channels, 0.0);
      if (xq && c.gqa && !cl) {
        const auto& F = f.spec.options.factors->layers[l];
        const std::vector<float>& u = k == 0 ? F.u_k : F.u_v;
        cpu::xq_project(f.x[l].data(), u.data(), n, g.n_embd, s.channels, want.data());
        for (int64_t t = 0; t < n; ++t)
          for (int ch = 0; ch < s.channels; ++ch) {
            double m = 0;
            for (int i = 0; i < g.n_embd; ++i) m += std::fabs((double)f.x[l][t * g.n_embd + i] * u[(size_t)i * s.channels + ch]);
            proj_err[t * s.channels + ch] = 2 * g.n_embd * kEps * m;
          }
      } else {
        want = xq ? f.x[l] : (k == 0 ? f.k[l] : f.v[l]);
      }
      ref::xq_decode_rows(s, 0, n, got.data());
      const clkv_layer cfg = clkv_layer_config(f.spec.options, g.n_layer, l);
      const bool shared = !xq && (k == 0 ? cfg.key_shared : cfg.value_shared);
      const float eta = xq ? 0.0f : (k == 0 ? cfg.key_eta : cfg.value_eta);
      if (shared) continue;  // codes of layer l-1: see clkv_shares_codes_and_keeps_layer_scales
      for (int64_t t = 0; t < n; ++t)
        for (int ch = 0; ch < s.channels; ++ch) {
          const float x = want[t * s.channels + ch], y = got[t * s.channels + ch];
          const double pe = proj_err[t * s.channels + ch];
          if (t >= s.nq || (ch == 0 && s.ch0 != nullptr)) {
            if (pe == 0.0) {
              ASSERT_EQ(y, fp16_to_fp32(fp32_to_fp16(x))) << "layer " << l << " row " << t << " ch " << ch;
            }
            ASSERT_NEAR(y, x, kFp16Rel * std::fabs(x) + kFp16Abs + 2 * pe) << "layer " << l << " row " << t;
            continue;
          }
          ASSERT_LE(std::fabs(y - x), step_bound(params_of(s, t, ch), s.bits, eta, x) + 2 * pe)
              << case_name(c) << " layer " << l << " stream " << k << " row " << t << " channel " << ch;
        }
    }
  }
}

// bytes_used() sums the arrays held; it must equal cache_bytes_for (the traits formula).
TEST_P(x_cache_test, bytes_used_equal_the_formula) {
  const x_case c = GetParam();
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(c.gqa, 400);
  for (int64_t n : {int64_t(1), int64_t(kTestWindow - 1), int64_t(kTestWindow), int64_t(kTestWindow + 1),
                    int64_t(333)}) {
    filled f = fill(*be, c, g, n, 2, {}, 9);
    EXPECT_EQ(f.cache->bytes_used(), cache_bytes_for(f.spec, g, n, 0, 0).total()) << case_name(c) << " n=" << n;
    EXPECT_GE(f.cache->bytes_allocated(), f.cache->bytes_used());
  }
}

// The fused CPU attention (decode: absorbed V; prefill: rebuilt blocks) equals the reference
// (explicit K and V in double) within float rounding: the rebuilt K/V differ by at most
// kRebuildRel * Σ_j |z_j m_jc| (float accumulation over the latent), RoPE by a few ulps; a score
// error delta moves the output by <= 2 delta max|v| plus the V error itself.
TEST_P(x_cache_test, fused_attention_equals_reference) {
  const x_case c = GetParam();
  auto be = make_backend(backend_kind::backend_cpu);
  auto rbe = make_backend(backend_kind::backend_ref);
  const int64_t n = 700;  // > one prefill block (512), many decode tiles (64)
  for (const test::self_extend_case se : test::self_extend_cases()) {
    cache_geometry g = x_geometry(c.gqa, n);
    g.rope = test::with_self_extend(g.rope, se);
    const int qd = g.n_head * g.head_dim;
    std::mt19937 rng(17);
    std::normal_distribution<float> nd;
    for (int32_t step : {1, 3}) {
      filled f = fill(*be, c, g, n, step, {512, 100}, 23);
      const int layer = g.n_layer - 1;
      // Magnitudes for the bound, from the reference's own view of K and V: run it once with
      // unit queries is not needed; |K|,|V| are bounded through the input K/V plus the step.
      double max_k = 0, max_v = 0;
      for (float x : f.k[layer]) max_k = std::max(max_k, (double)std::fabs(x));
      for (float x : f.v[layer]) max_v = std::max(max_v, (double)std::fabs(x));
      max_k *= 2, max_v *= 2;  // quantized rebuilds stay within twice the input range here
      const int ck = g.n_embd;  // longest latent sum (the cl accumulator: n_embd terms)
      const double k_err = (ck + 8) * kEps * max_k * 4, v_err = (ck + 8) * kEps * max_v * 4;
      for (int64_t n_q : {int64_t(1), int64_t(3), int64_t(40)}) {
        std::vector<float> q(n_q * qd);
        for (float& x : q) x = 0.3f * nd(rng);
        std::vector<int32_t> q_pos(n_q);
        for (int64_t i = 0; i < n_q; ++i) q_pos[i] = f.pos[(i * 997 + 50) % n] + (int32_t)(i % 2);
        q_pos[0] = f.pos[n - 1] + 1;
        double max_q = 0;
        for (float x : q) max_q = std::max(max_q, (double)std::fabs(x));
        const double scale = 1.0 / std::sqrt((double)g.head_dim);
        // SelfExtend's grouped side turns the query once more: a few ulps more per score.
        const double delta = scale * g.head_dim * max_q * (k_err + (se.group > 1 ? 24 : 16) * kEps * max_k);
        std::vector<float> o_r(n_q * qd), l_r(n_q * g.n_head);
        // The same cache content through the reference kernels: a ref-backend cache fed alike.
        filled fr = fill(*rbe, c, g, n, step, {512, 100}, 23);
        fr.cache->attend(layer, q.data(), q_pos.data(), n_q, o_r.data(), l_r.data());
        // Both CPU kernels: prefill (K and V rebuilt per unit) and decode (V absorbed; clkv's one
        // query: the fused quantized-KV kernel, AVX2 and scalar machines alike).
        for (const attend_path path : {attend_path::attend_prefill, attend_path::attend_decode})
          for (bool scalar : {false, true}) {
            SCOPED_TRACE(::testing::Message() << case_name(c) << " step " << step << " n_q " << n_q
                                              << " selfextend G " << se.group << " W " << se.window << " P " << se.period
                                              << (path == attend_path::attend_decode ? " decode" : " prefill")
                                              << (scalar ? " scalar" : " avx2") << " seeds 17/23");
            cpu::set_force_scalar(scalar);
            std::vector<float> o(n_q * qd), l(n_q * g.n_head);
            f.cache->attend(layer, q.data(), q_pos.data(), n_q, o.data(), l.data(), path);
            cpu::set_force_scalar(false);
            for (size_t i = 0; i < o.size(); ++i) ASSERT_NEAR(o[i], o_r[i], 2 * delta * max_v + v_err + 1e-6) << i;
            for (size_t i = 0; i < l.size(); ++i) ASSERT_NEAR(l[i], l_r[i], delta + 1e-5 * std::fabs(l_r[i])) << i;
          }
      }
  }
}
}

// export_layer / attend_exported: the ring's compressed blocks give the cache's own answer
// (xquant, clkv, and xquant-cl layers below the base: the same codes, bitwise; xquant-cl from
// the base on, deltas mode: bitwise, the receiver accumulates the stored deltas like the owner;
// latent mode: the fp16 latent X̂·U_kv, bounded by its fp16 rounding).
TEST_P(x_cache_test, exported_block_attends_like_the_cache) {
  const x_case c = GetParam();
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(c.gqa, 300);
  const int qd = g.n_head * g.head_dim;
  const bool cl = format_traits(c.format).family == cache_family::family_xquant_cl;
  std::vector<cl_ring_mode> rings = {cl_ring_mode::cl_ring_deltas};
  if (cl) rings.push_back(cl_ring_mode::cl_ring_latent);
  for (cl_ring_mode ring : rings) {
    filled f = fill(*be, c, g, 2 * kTestWindow + 9, 1, {}, 8, ring);
    kv_cache& src = *f.cache;
    auto other = make_cache(f.spec, g, *be);
    size_t block_total = 0, fp16_total = 0;
    for (int layer = 0; layer < g.n_layer; ++layer) {
      std::vector<uint8_t> block(src.exported_bytes(layer));
      src.export_layer(layer, block.data());
      block_total += block.size();
      fp16_total += (size_t)src.n_tokens(layer) * (4 + 2 * 2 * g.n_head_kv * g.head_dim);
      std::vector<float> q(2 * qd, 0.1f), o1(2 * qd), o2(2 * qd), l1(2 * g.n_head), l2(2 * g.n_head);
      const std::vector<int32_t> q_pos = {20, 1000};
      src.attend(layer, q.data(), q_pos.data(), 2, o1.data(), l1.data());
      other->attend_exported(layer, block.data(), block.size(), q.data(), q_pos.data(), 2, o2.data(), l2.data());
      if (cl && ring == cl_ring_mode::cl_ring_latent && layer >= f.spec.options.cl_hi_layers - 1) {
        double max_v = 0;
        for (float x : f.v[layer]) max_v = std::max(max_v, (double)std::fabs(x));
        // fp16 latent: K and V off by <= 2^-11 relative per latent term, summed over <= n_embd terms.
        const double dv = 4 * kFp16Rel * max_v * 4, dk = dv;
        const double delta = 0.1 * g.head_dim * dk / std::sqrt((double)g.head_dim);
        for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 2 * delta * 2 * max_v + dv) << i;
      } else {
        EXPECT_EQ(o1, o2) << "layer " << layer << " ring " << cl_ring_mode_name(ring);
        EXPECT_EQ(l1, l2) << "layer " << layer << " ring " << cl_ring_mode_name(ring);
      }
      EXPECT_THROW(other->attend_exported(layer, block.data(), block.size() - 8, q.data(), q_pos.data(), 2, o2.data(),
                                          l2.data()),
                   Error);
      std::vector<uint8_t> bad = block;
      bad[0] ^= 0x40;  // token count no longer matches the layout
      EXPECT_THROW(
          other->attend_exported(layer, bad.data(), bad.size(), q.data(), q_pos.data(), 2, o2.data(), l2.data()),
          Error);
    }
    std::printf("[x-ring] %s%s%s: exported blocks %zu bytes vs fp16 K/V blocks %zu bytes (%.3f)\n",
                case_name(c).c_str(), cl ? " ring " : "", cl ? cl_ring_mode_name(ring) : "", block_total, fp16_total,
                (double)block_total / fp16_total);
  }
}

// Save and restore: a restored cache goes on like the original -- a residual window cut
// mid-window, clkv's shared codes, xquant-cl's accumulators rebuilt from the restored codes --
// and xquant-cl snapshots its codes in either ring mode (snapshot_check.h).
TEST_P(x_cache_test, snapshot_restores_the_same_cache) {
  const x_case c = GetParam();
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(c.gqa, 300);
  const bool cl = format_traits(c.format).family == cache_family::family_xquant_cl;
  std::vector<cl_ring_mode> rings = {cl_ring_mode::cl_ring_deltas};
  if (cl) rings.push_back(cl_ring_mode::cl_ring_latent);
  for (cl_ring_mode ring : rings) {
    const int64_t n = 2 * kTestWindow + 9;
    filled f = fill(*be, c, g, n, 1, {}, 8, ring);
    const std::vector<std::vector<float>> x = make_layer_inputs(g, kTestWindow, 19);  // closes the window
    std::vector<std::vector<float>> k(g.n_layer), v(g.n_layer);
    for (int l = 0; l < g.n_layer; ++l) test::project_kv(f.model, l, x[l], kTestWindow, k[l], v[l]);
    std::vector<int32_t> pos(kTestWindow);
    for (int i = 0; i < kTestWindow; ++i) pos[i] = (int32_t)(n + i);
    test::expect_restores_like(
        *f.cache, [&] { return make_cache(f.spec, g, *be); },
        [&](kv_cache& cache) {
          for (int l = 0; l < g.n_layer; ++l)
            cache.append(l, layer_input{x[l].data(), k[l].data(), v[l].data(), pos.data(), kTestWindow});
        });
    if (!cl) {  // header [n, nq, n_tail]: nq + n_tail overflowing
      test::expect_overflowing_counts_refused([&] { return make_cache(f.spec, g, *be); },
                                              test::snapshot_of(*f.cache, 0), 1);
    }
    if (cl || c.format == cache_format::cache_clkv) {  // a layer restored before the one below it
      auto out_of_order = make_cache(f.spec, g, *be);
      const std::vector<uint8_t> top = test::snapshot_of(*f.cache, g.n_layer - 1);
      EXPECT_THROW(out_of_order->restore_layer(g.n_layer - 1, top.data(), top.size()), Error)
          << case_name(c) << " ring " << cl_ring_mode_name(ring);
    }
  }
}

std::vector<x_case> all_cases() {
  std::vector<x_case> out;
  for (cache_format f : x_cache_formats())
    for (bool gqa : {true, false}) {
      out.push_back({f, gqa, false});
      if (gqa && format_traits(f).family == cache_family::family_xquant) out.push_back({f, gqa, true});
    }
  return out;
}
INSTANTIATE_TEST_SUITE_P(formats, x_cache_test, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return case_name(info.param); });

// ---- absorption, accumulator, sharing ------------------------------------------------------------

// o = (Σ p_t z_t)·M_v + b_v equals Σ p_t (z_t·M_v + b_v): both in double in the reference, so
// they agree to the float rounding of the explicit V (eps/2 relative) and of the outputs.
TEST(x_cache, v_absorption_equals_explicit_v) {
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(true, 200);
  filled f = fill(*be, {cache_format::cache_xquant3, true, false}, g, 150, 1, {}, 41);
  const int layer = 2, qd = g.n_head * g.head_dim;
  const auto& F = f.spec.options.factors->layers[layer];
  xq_attn_args a;
  a.n = f.cache->n_tokens(layer), a.pos = f.pos.data();
  a.zk = x_cache_stream(*f.cache, layer, 0), a.zv = x_cache_stream(*f.cache, layer, 1);
  a.m_k = F.m_k.data(), a.ld_mk = 32, a.m_v = F.m_v.data(), a.ld_mv = 32, a.b_k = F.b_k.data(), a.b_v = F.b_v.data();
  a.n_head = g.n_head, a.n_head_kv = g.n_head_kv, a.head_dim = g.head_dim;
  a.scale = 0.25f, a.rope = g.rope;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  const int64_t n_q = 5;
  std::vector<float> q(n_q * qd);
  for (float& x : q) x = nd(rng);
  const std::vector<int32_t> q_pos = {0, 30, 77, 149, 400};
  std::vector<float> o1(n_q * qd), o2(n_q * qd), o3(n_q * qd), l1(n_q * g.n_head), l2(n_q * g.n_head),
      l3(n_q * g.n_head);
  a.q = q.data(), a.q_pos = q_pos.data(), a.n_q = n_q;
  a.o = o1.data(), a.lse = l1.data();
  ref::attention_xq(a, false);
  a.o = o2.data(), a.lse = l2.data();
  ref::attention_xq(a, true);
  a.o = o3.data(), a.lse = l3.data();
  cpu::attention_xq(a);  // the decode driver (n_q <= 8) absorbs V in float
  double max_v = 0;
  for (float x : f.v[layer]) max_v = std::max(max_v, (double)std::fabs(x));
  for (size_t i = 0; i < o1.size(); ++i) {
    ASSERT_NEAR(o1[i], o2[i], 4 * kEps * 2 * max_v) << "explicit vs absorbed (ref), element " << i;
    // float: 64 latent terms, ~150 rows, exp: (r + n) eps relative of max|v|
    ASSERT_NEAR(o3[i], o1[i], (32 + 150 + 64) * kEps * 2 * max_v) << "cpu absorbed vs explicit, element " << i;
  }
  for (size_t i = 0; i < l1.size(); ++i) ASSERT_NEAR(l1[i], l2[i], 1e-6 * (1 + std::fabs(l1[i])));
}

// X̂_i = deq(X_base) + Σ_{j=base+1..i} δ̂_j·U_jᵀ for every token (the accumulator the cache keeps
// equals the sum of its decoded deltas), and each stored delta is the quantized
// (X_i - X̂_{i-1})·U_i within one step: the error does not accumulate across layers.
TEST(x_cache, cl_accumulator_equals_sum_of_decoded_deltas) {
  for (bool gqa : {true, false}) {
    auto be = make_backend(backend_kind::backend_cpu);
    const cache_geometry g = x_geometry(gqa, 200);
    const x_case c{cache_format::cache_xquant_cl2, gqa, false};
    const int64_t n = 77;
    filled f = fill(*be, c, g, n, 1, {30, 7}, 13);
    const int base = f.spec.options.cl_hi_layers - 1, d = g.n_embd, r = xquant_cl_rank(g);
    std::vector<double> sum((size_t)n * d), mag((size_t)n * d);
    {
      std::vector<float> x0((size_t)n * d);
      ref::xq_decode_rows(x_cache_stream(*f.cache, base, 0), 0, n, x0.data());
      for (size_t e = 0; e < sum.size(); ++e) sum[e] = x0[e], mag[e] = std::fabs(x0[e]);
    }
    std::vector<float> prev((size_t)n * d), acc((size_t)n * d);
    x_cl_accumulator(*f.cache, base, prev.data());
    for (int i = base + 1; i < g.n_layer; ++i) {
      const xq_stream s = x_cache_stream(*f.cache, i, 0);
      ASSERT_EQ(s.channels, gqa ? r : d);
      std::vector<float> delta((size_t)n * s.channels), exact((size_t)n * s.channels), diff((size_t)n * d);
      ref::xq_decode_rows(s, 0, n, delta.data());
      const auto& F = f.spec.options.factors->layers[i];
      for (size_t e = 0; e < diff.size(); ++e) diff[e] = f.x[i][e] - prev[e];
      if (gqa)
        ref::xq_project(diff.data(), F.u_kv.data(), n, d, r, exact.data());
      else
        exact = diff;
      for (int64_t t = 0; t < n; ++t)
        for (int ch = 0; ch < s.channels; ++ch) {
          const double x = exact[t * s.channels + ch];
          // The cache projected in float (sgemm) where this test used double: d terms of eps.
          const double proj = gqa ? d * kEps * 4 * (1 + std::fabs(x)) : 0.0;
          ASSERT_LE(std::fabs(delta[t * s.channels + ch] - x), step_bound(params_of(s, t, ch), s.bits, 0.0f, x) + proj)
              << "layer " << i << " row " << t << " channel " << ch;
          for (int e = 0; e < d; ++e) {
            const double u = gqa ? F.u_kv[(size_t)e * r + ch] : (e == ch ? 1.0 : 0.0);
            sum[t * d + e] += delta[t * s.channels + ch] * u;
            mag[t * d + e] += std::fabs(delta[t * s.channels + ch] * u);
          }
        }
      x_cl_accumulator(*f.cache, i, acc.data());
      for (size_t e = 0; e < acc.size(); ++e)  // float sums of <= r terms per layer
        ASSERT_NEAR(acc[e], sum[e], (r + 2) * kEps * mag[e] + 1e-30)
            << (gqa ? "gqa" : "mha") << " layer " << i << " element " << e;
      prev = acc;
    }
  }
}

// clkv: odd layers from the sharing threshold on store no codes and decode layer l-1's codes with
// their own scale and zero, which are the calibrated min/max parameters of their own input.
TEST(x_cache, clkv_shares_codes_and_keeps_layer_scales) {
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(true, 200);
  const x_case c{cache_format::cache_clkv, true, false};
  const int64_t n = 2 * kTestWindow + 3;
  filled f = fill(*be, c, g, n, 1, {}, 19);
  int n_shared = 0;
  for (int l = 0; l < g.n_layer; ++l) {
    const clkv_layer cfg = clkv_layer_config(f.spec.options, g.n_layer, l);
    const xq_stream v = x_cache_stream(*f.cache, l, 1);
    if (!cfg.value_shared) continue;
    ++n_shared;
    const xq_stream lower = x_cache_stream(*f.cache, l - 1, 1);
    EXPECT_EQ(v.codes, lower.codes) << "layer " << l << " must read layer " << l - 1 << "'s codes";
    EXPECT_NE(v.params, lower.params);
    const int C = v.channels, n_g = v.n_groups_per_row();
    for (int64_t t = 0; t < v.nq; ++t)
      for (int gi = 0; gi < n_g; ++gi) {
        float lo = INFINITY, hi = -INFINITY;  // the encoder sees the fp16 window rows
        for (int ch = gi * v.group; ch < std::min(C, (gi + 1) * v.group); ++ch) {
          const float x = fp16_to_fp32(fp32_to_fp16(f.v[l][t * C + ch]));
          lo = std::min(lo, x), hi = std::max(hi, x);
        }
        const kvq_affine want = xq_calibrate(kvq_uniform_params(lo, hi, v.bits), v.bits, cfg.value_eta);
        const kvq_affine got = v.params[t * n_g + gi];
        ASSERT_EQ(got.scale, want.scale) << "layer " << l << " row " << t << " group " << gi;
        ASSERT_EQ(got.zero, want.zero) << "layer " << l << " row " << t << " group " << gi;
      }
  }
  EXPECT_EQ(n_shared, 1);  // 4 layers, sharing from layer 2: layer 3 reuses layer 2
  // The paper's configuration on SmolLM2's depth and width stays under 1.4 code bits per element.
  cache_geometry s = x_geometry(true, 1);
  s.n_layer = 30, s.n_head = 9, s.n_head_kv = 3, s.head_dim = 64, s.n_embd = 576;
  const cache_spec spec(cache_format::cache_clkv);
  const int64_t n_big = 1 << 20;
  const double code_bits = cache_bytes_for(spec, s, n_big, 0, 0).codes * 8.0 / (2.0 * 30 * 192 * n_big);
  std::printf("[clkv] SmolLM2: %.4f code bits per K/V element, %.3f all-in\n", code_bits,
              cache_bytes_per_token(spec, s) * 8 / (2.0 * 30 * 192));
  EXPECT_LT(code_bits, 1.4);
}

// ---- xquant-cl exact ring, deltas mode ------------------------------------------------------------

size_t pad8(size_t b) { return (b + 7) / 8 * 8; }

// Rows idx of x [n, width], in order.
std::vector<float> gather_rows(const std::vector<float>& x, const std::vector<int64_t>& idx, int width) {
  std::vector<float> out(idx.size() * width);
  for (size_t i = 0; i < idx.size(); ++i) std::copy_n(x.begin() + idx[i] * width, width, out.begin() + i * width);
  return out;
}

// Two ranks of a zigzag-like plan split on 256-position units (a: units 0 and 2 with the tail,
// b: unit 1), fed layer by layer from layer 0 (the base first among the accumulated layers): each
// rank attending its own shard and the other's exported block into one exact accumulator gives
// bitwise the o/lse of one cache holding every token, because the receiver's foreign accumulator
// is the owner's X̂ bit for bit. The blocks carry the stored codes, fewer bytes than fp16 K|V.
TEST(x_cache, cl_deltas_ring_blocks_attend_like_one_cache) {
  auto be = make_backend(backend_kind::backend_cpu);
  for (cache_format fmt : formats_of({cache_family::family_xquant_cl}))
    for (bool gqa : {true, false}) {
      const x_case c{fmt, gqa, false};
      SCOPED_TRACE(case_name(c) + " seeds 61/62/63");
      const int64_t n = 2 * kAttnUnit + 57;
      const cache_geometry g = x_geometry(gqa, n);
      const test::x_model m = make_x_model(g, 61, true);
      const cache_spec spec = spec_for(c, m.w);
      ASSERT_EQ(spec.options.cl_ring, cl_ring_mode::cl_ring_deltas);  // the default
      const auto x = make_layer_inputs(g, n, 62);
      const int d = g.n_embd, kv = g.n_head_kv * g.head_dim, qd = g.n_head * g.head_dim;
      struct shard {
        std::unique_ptr<kv_cache> cache;
        std::vector<int64_t> idx;
        std::vector<int32_t> pos;  // [idx.size()]
      };
      shard w{make_cache(spec, g, *be), {}, {}}, a{make_cache(spec, g, *be), {}, {}},
          b{make_cache(spec, g, *be), {}, {}}, fb{make_cache(cache_format::cache_fp16, g, *be), {}, {}};
      for (int64_t t = 0; t < n; ++t) {
        w.idx.push_back(t);
        (t / kAttnUnit == 1 ? b : a).idx.push_back(t);
      }
      fb.idx = b.idx;
      for (shard* s : {&w, &a, &b, &fb})
        for (int64_t t : s->idx) s->pos.push_back((int32_t)t);
      std::mt19937 rng(63);
      std::normal_distribution<float> nd;
      const int64_t n_q = 12;
      std::vector<float> q(n_q * qd);
      for (float& v : q) v = 0.3f * nd(rng);
      std::vector<int32_t> q_pos(n_q);
      for (int64_t i = 0; i < n_q; ++i) q_pos[i] = (int32_t)(i * (n + 20) / n_q + 7);
      const int64_t nb = (int64_t)b.idx.size();
      size_t block_total = 0, fp16_total = 0;
      for (int l = 0; l < g.n_layer; ++l) {
        std::vector<float> kl, vl;
        test::project_kv(m, l, x[l], n, kl, vl);
        for (shard* s : {&w, &a, &b, &fb}) {
          const auto xs = gather_rows(x[l], s->idx, d), ks = gather_rows(kl, s->idx, kv),
                     vs = gather_rows(vl, s->idx, kv);
          s->cache->append(l, layer_input{xs.data(), ks.data(), vs.data(), s->pos.data(), (int64_t)s->idx.size()});
        }
        std::vector<float> o_w(n_q * qd), l_w(n_q * g.n_head);
        w.cache->attend(l, q.data(), q_pos.data(), n_q, o_w.data(), l_w.data());
        // What ring_attention does on each rank: own shard + the peer's block, one accumulator.
        for (auto [own, peer] : {std::pair(&a, &b), std::pair(&b, &a)}) {
          std::vector<uint8_t> block(peer->cache->exported_bytes(l));
          peer->cache->export_layer(l, block.data());
          softmax_acc acc(n_q * g.n_head, g.head_dim);
          own->cache->attend(l, q.data(), q_pos.data(), n_q, attend_path::attend_prefill, acc);
          own->cache->attend_exported(l, block.data(), block.size(), q.data(), q_pos.data(), n_q,
                                      attend_path::attend_prefill, acc);
          std::vector<float> o(n_q * qd), lse(n_q * g.n_head);
          acc.finish(o.data(), lse.data());
          EXPECT_EQ(o, o_w) << "layer " << l << (own == &a ? " rank a" : " rank b");
          EXPECT_EQ(lse, l_w) << "layer " << l << (own == &a ? " rank a" : " rank b");
        }
        // b's block: int64 n, positions, the layer's codes and fp16 scale/zero per channel group.
        const int C = xquant_cl_channels(g, spec.options, l), bits = xquant_cl_bits(fmt, spec.options, g.n_layer, l);
        const int n_g = (C + kTestWindow - 1) / kTestWindow;
        const size_t want = 8 + pad8(nb * 4) + pad8(nb * kvq_row_bytes(C, bits)) + pad8(nb * n_g * sizeof(kvq_affine));
        EXPECT_EQ(b.cache->exported_bytes(l), want) << "layer " << l;
        EXPECT_LT(b.cache->exported_bytes(l), fb.cache->exported_bytes(l)) << "layer " << l;
        block_total += b.cache->exported_bytes(l), fp16_total += fb.cache->exported_bytes(l);
      }
      std::printf("[x-ring] %s deltas: %lld-token block, all layers %zu bytes vs fp16 K/V %zu (%.3f)\n",
                  case_name(c).c_str(), (long long)nb, block_total, fp16_total, (double)block_total / fp16_total);
      // The foreign accumulators are working memory: in bytes_allocated, not bytes_used, and gone
      // after release_ring_state (the next block of that source then has nothing to continue).
      const size_t used = a.cache->bytes_used(), alloc = a.cache->bytes_allocated();
      EXPECT_EQ(used, cache_bytes_for(spec, g, (int64_t)a.idx.size(), 0, 0).total());
      a.cache->release_ring_state();
      EXPECT_EQ(a.cache->bytes_used(), used);
      EXPECT_GE(alloc - a.cache->bytes_allocated(), (size_t)nb * (d + 1) * 4);
      std::vector<uint8_t> last(b.cache->exported_bytes(g.n_layer - 1));
      b.cache->export_layer(g.n_layer - 1, last.data());
      std::vector<float> of(n_q * qd), lf(n_q * g.n_head);
      EXPECT_THROW(a.cache->attend_exported(g.n_layer - 1, last.data(), last.size(), q.data(), q_pos.data(), n_q,
                                            of.data(), lf.data()),
                   Error);
    }
}

// Deltas mode: a block with a bad size, positions out of order, positions that differ from the
// source block accumulated so far, or a skipped layer is a clear error naming the layer and the
// values; a rejected block leaves the accumulator where it was.
TEST(x_cache, cl_deltas_ring_block_errors_are_clear) {
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(true, 64);
  const x_case c{cache_format::cache_xquant_cl3, true, false};
  const int64_t n = 40;
  filled f = fill(*be, c, g, n, 1, {}, 71);
  const int base = f.spec.options.cl_hi_layers - 1;  // 1
  ASSERT_EQ(base, 1);
  std::vector<std::vector<uint8_t>> blk(g.n_layer);
  for (int l = 0; l < g.n_layer; ++l) {
    blk[l].resize(f.cache->exported_bytes(l));
    f.cache->export_layer(l, blk[l].data());
  }
  auto rx = make_cache(f.spec, g, *be);
  const int qd = g.n_head * g.head_dim;
  std::vector<float> q(qd, 0.1f), o(qd), lse(g.n_head);
  const int32_t q_pos = 100;
  const auto attend = [&](int l, const std::vector<uint8_t>& b) {
    rx->attend_exported(l, b.data(), b.size(), q.data(), &q_pos, 1, o.data(), lse.data());
  };
  const auto expect_error = [&](int l, const std::vector<uint8_t>& b, std::initializer_list<const char*> parts) {
    try {
      attend(l, b);
      ADD_FAILURE() << "layer " << l << ": no error";
    } catch (const Error& e) {
      for (const char* p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
    }
  };
  expect_error(2, blk[2], {"layer 2", "no foreign accumulator", "positions 0..39"});
  attend(0, blk[0]);
  attend(1, blk[1]);
  expect_error(3, blk[3], {"layer 3", "holds layer 1, not 2", "skipped"});
  std::vector<uint8_t> bad = blk[2];
  bad.resize(bad.size() - 8);
  expect_error(2, bad, {"layer 2", "claims 40 tokens"});
  bad = blk[2];
  auto* pos = reinterpret_cast<int32_t*>(bad.data() + 8);
  std::swap(pos[3], pos[4]);
  expect_error(2, bad, {"layer 2", "not increasing at index 4 (4 then 3)"});
  bad = blk[2];
  pos = reinterpret_cast<int32_t*>(bad.data() + 8);
  pos[n - 1] = 1000;
  expect_error(2, bad, {"layer 2", "has position 1000 at index 39 where that block has 39"});
  attend(2, blk[2]);  // the rejected blocks changed nothing
  attend(3, blk[3]);
  rx->clear();  // drops the foreign accumulators too
  expect_error(3, blk[3], {"layer 3", "no foreign accumulator"});
}

// ---- errors ------------------------------------------------------------------------------------

TEST(x_cache, bad_input_is_a_clear_error) {
  auto be = make_backend(backend_kind::backend_cpu);
  const cache_geometry g = x_geometry(true, 64);
  try {
    make_cache(cache_spec(cache_format::cache_xquant2), g, *be);
    FAIL() << "xquant without factors must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rebuild factors"), std::string::npos) << e.what();
  }
  const test::x_model m = make_x_model(x_geometry(true, 64, 3), 1, false);  // 3 layers, cache has 4
  cache_options o;
  o.factors = build_x_factors(m.w, x_factor_kind::xf_latent);
  EXPECT_THROW(make_cache(cache_spec(cache_format::cache_xquant4, o), g, *be), Error);
  EXPECT_THROW(make_cache(cache_spec(cache_format::cache_xquant_cl4, o), x_geometry(true, 64, 3), *be), Error);
  cache_options k;
  k.clkv_group = 10;  // does not divide the 128-token window
  EXPECT_THROW(make_cache(cache_spec(cache_format::cache_clkv, k), g, *be), Error);
  k.clkv_group = 32, k.clkv_eta1 = 0.5f;
  EXPECT_THROW(make_cache(cache_spec(cache_format::cache_clkv, k), g, *be), Error);
  // xquant-cl: a layer before the previous one holds the tokens; xquant: no layer input x.
  const test::x_model m4 = make_x_model(g, 2, false);
  cache_options c;
  c.factors = build_x_factors(m4.w, x_factor_kind::xf_cross_layer);
  auto cl = make_cache(cache_spec(cache_format::cache_xquant_cl3, c), g, *be);
  std::vector<float> x(g.n_embd, 0.5f), kv(32, 0.1f);
  const int32_t p = 0;
  EXPECT_THROW(cl->append(1, layer_input{x.data(), kv.data(), kv.data(), &p, 1}), Error);
  EXPECT_THROW(cl->append(0, layer_input{nullptr, kv.data(), kv.data(), &p, 1}), Error);
  EXPECT_THROW(parse_cache_format("xquant5"), Error);
  EXPECT_EQ(parse_cache_format("xquant-cl2"), cache_format::cache_xquant_cl2);
  EXPECT_EQ(parse_cache_format("clkv"), cache_format::cache_clkv);
  // 1-bit codes and eta are accepted by the encoder, 5 bits and eta >= 0.5 are not.
  std::vector<float> rows(16, 1.0f);
  std::vector<uint8_t> codes(16);
  std::vector<kvq_affine> prm(16);
  xq_encode_job j;
  j.bits = 5, j.channels = 8, j.group = 8, j.n = 2, j.x = rows.data(), j.codes = codes.data(), j.params = prm.data();
  EXPECT_THROW(ref::xq_encode(j), Error);
  j.bits = 1, j.eta = 0.5f;
  EXPECT_THROW(ref::xq_encode(j), Error);
}

}  // namespace
}  // namespace xctx
