// Elementwise kernels: ref against first-principles formulas, cpu (scalar and AVX2 paths)
// against ref. Tolerances are derived from float epsilon; see each test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <complex>
#include <cstring>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/ref/ref_ops.h"

namespace xctx {
namespace {

using cpu::impl::isa;
constexpr double kEps = FLT_EPSILON;  // 2^-23, twice the unit roundoff: every bound below uses it as one rounding

std::vector<isa> available_isas() {
  std::vector<isa> v{isa::isa_scalar};
  if (cpu::has_avx2()) v.push_back(isa::isa_avx2);
  return v;
}

std::vector<float> uniform(size_t n, float lo, float hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ---- rms_norm ------------------------------------------------------------------------------

struct norm_case {
  int64_t n_tok, dim;
  std::string name() const {
    std::ostringstream os;  // not string operator+: GCC 12 raises a false -Wrestrict on it here
    os << "t" << n_tok << "_d" << dim;
    return os.str();
  }
};

void PrintTo(const norm_case& c, std::ostream* os) { *os << c.name(); }

class RmsNorm : public testing::TestWithParam<norm_case> {};

TEST_P(RmsNorm, CpuMatchesRef) {
  const auto c = GetParam();
  const uint32_t seed = 1000u + (uint32_t)(c.n_tok * 7 + c.dim);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto x = uniform((size_t)(c.n_tok * c.dim), -4.0f, 4.0f, seed);
  const auto w = uniform((size_t)c.dim, 0.5f, 1.5f, seed + 1);
  const float eps = 1e-5f;
  std::vector<float> ref(x.size()), got(x.size());
  ref::rms_norm(x.data(), w.data(), c.n_tok, c.dim, eps, ref.data());
  // Sum of squares: n positive terms in float, relative error <= n*eps (sequential bound; the
  // AVX2 path's 32 partial sums only make it smaller); sqrt halves it; the scale's rounding and
  // the two products add 3 roundings; the ref's own rounding one more.
  const double tol_rel = (0.5 * (double)c.dim + 4.0) * kEps;
  for (isa v : available_isas()) {
    std::fill(got.begin(), got.end(), NAN);
    cpu::impl::rms_norm(v, x.data(), w.data(), c.n_tok, c.dim, eps, got.data());
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_NEAR(got[i], ref[i], tol_rel * std::fabs(ref[i]) + 1e-30) << cpu::impl::isa_name(v) << " at " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNorm,
                         testing::Values(norm_case{1, 576}, norm_case{3, 7}, norm_case{5, 64}, norm_case{64, 576},
                                         norm_case{2, 1536}),
                         [](const auto& info) { return info.param.name(); });

TEST(RmsNormRef, MatchesDefinition) {
  const std::vector<float> x{3.0f, 4.0f}, w{1.0f, 2.0f};
  std::vector<float> y(2);
  ref::rms_norm(x.data(), w.data(), 1, 2, 0.0f, y.data());
  const double rms = std::sqrt((9.0 + 16.0) / 2.0);
  EXPECT_FLOAT_EQ(y[0], (float)(3.0 / rms));
  EXPECT_FLOAT_EQ(y[1], (float)(8.0 / rms));
}

// ---- rope ----------------------------------------------------------------------------------

rope_config make_rope(int head_dim, int n_rot, float base, rope_scaling s, float factor) {
  rope_config c;
  c.head_dim = head_dim, c.n_rot = n_rot, c.freq_base = base, c.scaling = s, c.scaling_factor = factor;
  return c;
}

TEST(RopeRef, MatchesComplexRotation) {
  // Pair (2i, 2i+1) read as the complex number x0 + i x1, multiplied by e^{i pos w_i} with
  // w_i = 1 / base^(2i/n_rot); dims >= n_rot untouched.
  const int hd = 64, n_rot = 48, n_head = 3;
  const auto cfg = make_rope(hd, n_rot, 10000.0f, rope_scaling::rope_scaling_none, 1.0f);
  const std::vector<int32_t> pos{0, 1, 17, 4095, 100000};
  const auto x0 = uniform(pos.size() * n_head * hd, -2.0f, 2.0f, 11);
  auto x = x0;
  ref::rope(x.data(), pos.data(), (int64_t)pos.size(), n_head, cfg);
  for (size_t t = 0; t < pos.size(); ++t)
    for (int h = 0; h < n_head; ++h) {
      const size_t base = (t * n_head + h) * hd;
      for (int i = 0; i < n_rot / 2; ++i) {
        const double w = 1.0 / std::pow(10000.0, (2.0 * i) / n_rot);
        const std::complex<double> z = std::complex<double>(x0[base + 2 * i], x0[base + 2 * i + 1]) *
                                       std::polar(1.0, (double)pos[t] * w);
        // The ref rounds a double result to float once: half an ulp of |z| per component.
        const double tol = 0.5 * kEps * std::abs(z) + 1e-30;
        EXPECT_NEAR(x[base + 2 * i], z.real(), tol) << "t " << t << " pair " << i;
        EXPECT_NEAR(x[base + 2 * i + 1], z.imag(), tol) << "t " << t << " pair " << i;
      }
      for (int d = n_rot; d < hd; ++d) EXPECT_EQ(x[base + d], x0[base + d]) << "pass-through dim " << d;
    }
}

TEST(RopeRef, LinearScalingIsPositionOverFactor) {
  const auto none = make_rope(64, 64, 100000.0f, rope_scaling::rope_scaling_none, 1.0f);
  const auto lin = make_rope(64, 64, 100000.0f, rope_scaling::rope_scaling_linear, 4.0f);
  for (int32_t p : {0, 4, 40, 4096, 65536})
    for (int i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(ref::rope_theta(lin, p, i), ref::rope_theta(none, p / 4, i));
  // Whole rows: linear at 4k equals none at k exactly (same thetas in double).
  const std::vector<int32_t> pl{4, 400, 40000}, pn{1, 100, 10000};
  auto a = uniform(3 * 2 * 64, -1.0f, 1.0f, 12), b = a;
  ref::rope(a.data(), pl.data(), 3, 2, lin);
  ref::rope(b.data(), pn.data(), 3, 2, none);
  EXPECT_EQ(a, b);
}

TEST(RopeRef, NtkBaseFormula) {
  const int d = 64;
  const double base = 10000.0, f = 8.0;
  const auto none = make_rope(d, d, (float)base, rope_scaling::rope_scaling_none, 1.0f);
  const auto ntk = make_rope(d, d, (float)base, rope_scaling::rope_scaling_ntk, (float)f);
  const double base_eff = base * std::pow(f, (double)d / (d - 2));
  for (int32_t p : {1, 1000, 32768})
    for (int i = 0; i < d / 2; ++i) {
      const double want = p * std::pow(base_eff, -2.0 * i / d);
      EXPECT_NEAR(ref::rope_theta(ntk, p, i), want, 1e-12 * want) << "pos " << p << " pair " << i;
    }
  // The point of the exponent: the highest frequency is untouched, the lowest is divided by f.
  EXPECT_DOUBLE_EQ(ref::rope_theta(ntk, 1000, 0), 1000.0);
  const double lowest = ref::rope_theta(none, 1000, d / 2 - 1) / f;
  EXPECT_NEAR(ref::rope_theta(ntk, 1000, d / 2 - 1), lowest, 1e-12 * lowest);
}

TEST(RopeRef, DotDependsOnlyOnRelativePosition) {
  const int hd = 64;
  const auto cfg = make_rope(hd, hd, 100000.0f, rope_scaling::rope_scaling_none, 1.0f);
  const auto q0 = uniform(hd, -1.0f, 1.0f, 13), k0 = uniform(hd, -1.0f, 1.0f, 14);
  auto dot_at = [&](int32_t m, int32_t n, double* abs_sum) {
    auto q = q0, k = k0;
    ref::rope(q.data(), &m, 1, 1, cfg);
    ref::rope(k.data(), &n, 1, 1, cfg);
    double s = 0.0, a = 0.0;
    for (int d = 0; d < hd; ++d) s += (double)q[d] * k[d], a += std::fabs((double)q[d] * k[d]);
    *abs_sum = a;
    return s;
  };
  double a0, a1;
  for (int32_t delta : {0, 3, 250}) {
    const double ref_dot = dot_at(7 + delta, 7, &a0);
    for (int32_t shift : {1000, 70000}) {
      const double dot = dot_at(7 + delta + shift, 7 + shift, &a1);
      // Each rotated element carries half an ulp from the ref's final rounding, so each product
      // at most one eps relative; both dots together.
      EXPECT_NEAR(dot, ref_dot, kEps * (a0 + a1)) << "delta " << delta << " shift " << shift;
    }
  }
}

struct rope_case {
  int head_dim, n_rot, n_head;
  rope_scaling scaling;
  float factor;
  std::string name() const {
    const char* s = scaling == rope_scaling::rope_scaling_none ? "none"
                    : scaling == rope_scaling::rope_scaling_linear ? "linear" : "ntk";
    std::ostringstream os;
    os << "hd" << head_dim << "_rot" << n_rot << "_h" << n_head << "_" << s;
    return os.str();
  }
};

void PrintTo(const rope_case& c, std::ostream* os) { *os << c.name(); }

class Rope : public testing::TestWithParam<rope_case> {};

TEST_P(Rope, CpuMatchesRef) {
  const auto c = GetParam();
  const auto cfg = make_rope(c.head_dim, c.n_rot, 100000.0f, c.scaling, c.factor);
  const std::vector<int32_t> pos{0, 1, 2, 63, 64, 1000, 8191, 65535, 131071, 3};
  const uint32_t seed = 2000u + (uint32_t)(c.head_dim + c.n_rot);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto x0 = uniform(pos.size() * c.n_head * c.head_dim, -3.0f, 3.0f, seed);
  auto want = x0;
  ref::rope(want.data(), pos.data(), (int64_t)pos.size(), c.n_head, cfg);
  for (isa v : available_isas()) {
    auto got = x0;
    cpu::impl::rope(v, got.data(), pos.data(), (int64_t)pos.size(), c.n_head, cfg);
    for (size_t row = 0; row < pos.size() * c.n_head; ++row) {
      const float* in = x0.data() + row * c.head_dim;
      for (int d = 0; d < c.head_dim; ++d) {
        const size_t k = row * c.head_dim + d;
        if (d >= c.n_rot) {
          ASSERT_EQ(got[k], x0[k]) << "pass-through dim " << d;
          continue;
        }
        // cos and sin rounded to float (1 eps each, relative), the products and the sum (or the
        // FMA) 2 more, the ref's rounding half: 3.5 eps of (|x0| + |x1|). The angle itself is
        // formed in double by both, so large positions cost nothing extra.
        const int p = d & ~1;
        const double tol = 3.5 * kEps * (std::fabs(in[p]) + std::fabs(in[p + 1]));
        ASSERT_NEAR(got[k], want[k], tol) << cpu::impl::isa_name(v) << " row " << row << " dim " << d;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, Rope,
                         testing::Values(rope_case{64, 64, 9, rope_scaling::rope_scaling_none, 1.0f},
                                         rope_case{128, 128, 2, rope_scaling::rope_scaling_linear, 4.0f},
                                         rope_case{64, 32, 3, rope_scaling::rope_scaling_ntk, 8.0f},
                                         rope_case{64, 20, 1, rope_scaling::rope_scaling_none, 1.0f},
                                         rope_case{10, 6, 2, rope_scaling::rope_scaling_none, 1.0f}),
                         [](const auto& info) { return info.param.name(); });

TEST(RopeChecks, BadConfigThrows) {
  std::vector<float> x(64);
  const int32_t pos = 0;
  for (isa v : available_isas()) {
    EXPECT_THROW(cpu::impl::rope(v, x.data(), &pos, 1, 1, make_rope(64, 65, 1e4f, rope_scaling::rope_scaling_none, 1.0f)),
                 Error);
    EXPECT_THROW(cpu::impl::rope(v, x.data(), &pos, 1, 1, make_rope(64, 64, 1e4f, rope_scaling::rope_scaling_linear, 0.0f)),
                 Error);
  }
  EXPECT_THROW(ref::rope(x.data(), &pos, 1, 1, make_rope(64, 2, 1e4f, rope_scaling::rope_scaling_ntk, 2.0f)), Error);
}

// ---- swiglu / fast exp ---------------------------------------------------------------------

TEST(FastExp, MaxRelativeErrorWithinStatedBound) {
  if (!cpu::has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU";
  // Every 61st float bit pattern between the accurate range's ends (~17M values: each binade
  // sampled densely), plus exact integers and the range ends.
  std::vector<float> x;
  auto sweep = [&](float a, float b) {  // a < b, same sign
    uint32_t ua, ub;
    std::memcpy(&ua, &a, 4), std::memcpy(&ub, &b, 4);
    const uint32_t lo = std::min(ua, ub), hi = std::max(ua, ub);
    for (uint64_t u = lo; u <= hi; u += 61) {
      const uint32_t u32 = (uint32_t)u;
      float f;
      std::memcpy(&f, &u32, 4);
      x.push_back(f);
    }
  };
  sweep(1e-30f, cpu::impl::kFastExpHi);
  sweep(-1e-30f, cpu::impl::kFastExpLo);
  for (int i = -87; i <= 88; ++i) x.push_back((float)i);
  x.push_back(0.0f), x.push_back(cpu::impl::kFastExpLo), x.push_back(cpu::impl::kFastExpHi);
  std::vector<float> y(x.size());
  cpu::impl::avx2::exp_fast(x.data(), (int64_t)x.size(), y.data());
  double worst = 0.0;
  float worst_x = 0.0f;
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::exp((double)x[i]);
    const double rel = std::fabs((double)y[i] - want) / want;
    if (rel > worst) worst = rel, worst_x = x[i];
  }
  std::printf("fast exp: %zu samples, max relative error %.3g (%.2f eps) at x = %.9g\n", x.size(), worst,
              worst / kEps, worst_x);
  EXPECT_LE(worst, cpu::impl::kFastExpMaxRelErr);
  // Outside the accurate range: exactly 0 below, +inf above.
  const std::vector<float> out_x{-88.0f, -1000.0f, -INFINITY, 88.5f, 1000.0f, INFINITY};
  std::vector<float> out_y(out_x.size());
  cpu::impl::avx2::exp_fast(out_x.data(), (int64_t)out_x.size(), out_y.data());
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(out_y[i], 0.0f) << out_x[i];
  for (size_t i = 3; i < 6; ++i) EXPECT_EQ(out_y[i], INFINITY) << out_x[i];
}

TEST(Swiglu, CpuMatchesDouble) {
  const uint32_t seed = 3000;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int64_t n = 100003;  // odd: exercises the vector tail
  auto g = uniform((size_t)n, -80.0f, 80.0f, seed);
  for (int64_t i = 0; i < n / 2; ++i) g[i] *= 0.05f;  // most mass where silu bends
  const auto u = uniform((size_t)n, -2.0f, 2.0f, seed + 1);
  std::vector<float> want(n), got(n);
  ref::swiglu(g.data(), u.data(), n, want.data());
  // exp's relative error e reaches 1 + e^-g scaled by e^-g/(1+e^-g) <= 1, then the division
  // and the product round once each and the ref once (half): exp bound + 2.5 eps relative.
  const double tol_rel = cpu::impl::kFastExpMaxRelErr + 2.5 * kEps;
  for (isa v : available_isas()) {
    cpu::impl::swiglu(v, g.data(), u.data(), n, got.data());
    for (int64_t i = 0; i < n; ++i) {
      const double exact = (double)g[i] / (1.0 + std::exp(-(double)g[i])) * u[i];
      ASSERT_NEAR(got[i], exact, tol_rel * std::fabs(exact) + 1e-37) << cpu::impl::isa_name(v) << " g=" << g[i];
    }
  }
  // Far tails: silu(g) -> g above, -> 0 below, never NaN.
  const std::vector<float> tg{100.0f, 1e4f, -100.0f, -1e4f}, tu{1.0f, 1.0f, 1.0f, 1.0f};
  std::vector<float> to(4);
  for (isa v : available_isas()) {
    cpu::impl::swiglu(v, tg.data(), tu.data(), 4, to.data());
    EXPECT_EQ(to[0], 100.0f);
    EXPECT_EQ(to[1], 1e4f);
    EXPECT_LE(std::fabs(to[2]), 1e-35f);
    EXPECT_LE(std::fabs(to[3]), 1e-35f);
  }
}

TEST(Add, Exact) {
  const int64_t n = 70001;
  auto y = uniform((size_t)n, -1.0f, 1.0f, 4000), y_ref = y;
  const auto x = uniform((size_t)n, -1.0f, 1.0f, 4001);
  ref::add(y_ref.data(), x.data(), n);
  cpu::add(y.data(), x.data(), n);
  EXPECT_EQ(y, y_ref);  // one IEEE addition per element: bit-identical
}

}  // namespace
}  // namespace xctx
