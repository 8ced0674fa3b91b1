// Attention kernels: cpu (scalar and AVX2 paths; decode and prefill shapes; split-K) against
// the double-precision ref, and merge_partials against one-shot attention.
//
// Tolerance (per output row, derived; eps = FLT_EPSILON = 2u, so each term has a 2x margin):
//  * A score s = scale * q.k is a float dot product of length hd. Sums of n rounded terms are
//    bounded with the probabilistic bound of Higham & Mary (2019): |error| <= lambda sqrt(n) u
//    sum|terms|, failing with probability <= 2n exp(-lambda^2/2) (~1e-10 for lambda = 8,
//    n = 4096), instead of the worst case n u that would hide real bugs at n_kv = 4096. With
//    sum_d |q_d k_d| <= |q| |k| (Cauchy-Schwarz) and one more rounding for folding `scale` in:
//      ds = (lambda sqrt(hd) + 2) eps scale |q| max_j |k_j|.
//  * Each softmax weight p_j = exp(s_j - m) then has relative error
//      eta = 2 ds + exp_err + 2 eps      (exp_err = kFastExpMaxRelErr; the shift m is shared).
//  * o = sum p v / sum p is a convex combination, so relative weight errors eta move it by at
//    most 2 eta max|v|; the two length-n sums (numerator, denominator) add lambda sqrt(n) eps
//    max|v| each. Split-K merges re-weight chunks with exp (exp_err) and sum <= 16 parts:
//      tol_o   = max|v| (2 eta + 2 lambda sqrt(n) eps + merge),  merge = 2 (exp_err + 18 eps)
//      tol_lse = 2 ds + exp_err + lambda sqrt(n) eps + eps (|lse| + 1) + merge
//  f16 K/V adds nothing: both sides convert the same halves exactly.
#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/half.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/elementwise_attention_impl.h"
#include "kernels/ref/ref_ops.h"
#include "kernels/softmax_acc.h"

namespace xctx {
namespace {

using cpu::impl::isa;
constexpr double kEps = FLT_EPSILON;
constexpr double kLambda = 8.0;
constexpr double kExpErr = cpu::impl::kFastExpMaxRelErr;
constexpr double kMergeAllowance = 2.0 * (kExpErr + 18.0 * kEps);

std::vector<isa> available_isas() {
  std::vector<isa> v{isa::isa_scalar};
  if (cpu::has_avx2()) v.push_back(isa::isa_avx2);
  return v;
}

enum class causal_mode : uint8_t {
  causal_end,      // prefill: kv holds the queries themselves, queries are the last positions
  causal_partial,  // queries scattered inside the kv range (some keys masked), first sees none
  causal_none,     // every key is older than every query
};

struct attn_case {
  int64_t n_q = 1, n_kv = 0;
  int n_head = 9, n_head_kv = 3, hd = 64;
  kv_dtype type = kv_dtype::kv_f32;
  causal_mode mode = causal_mode::causal_end;
  std::string name() const {
    std::ostringstream os;
    os << "q" << n_q << "_kv" << n_kv << "_h" << n_head << "x" << n_head_kv << "_d" << hd
       << (type == kv_dtype::kv_f16 ? "_f16" : "_f32")
       << (mode == causal_mode::causal_end ? "_end" : mode == causal_mode::causal_partial ? "_partial" : "_none");
    return os.str();
  }
};

void PrintTo(const attn_case& c, std::ostream* os) { *os << c.name(); }

struct attn_inputs {
  attn_case c;
  float scale = 0.0f;
  std::vector<float> q, k, v;        // k/v hold the exact values the kernels read (f16-rounded)
  std::vector<uint16_t> k16, v16;    // [n_kv, n_head_kv, hd] when f16
  std::vector<int32_t> q_pos, kv_pos;

  // Arguments for keys [j0, j1) (a chunk of the cache) writing to o / lse.
  attn_args args(float* o, float* lse, int64_t j0 = 0, int64_t j1 = -1) const {
    if (j1 < 0) j1 = c.n_kv;
    const int64_t off = j0 * c.n_head_kv * c.hd;
    attn_args a;
    a.q = q.data(), a.q_pos = q_pos.data(), a.n_q = c.n_q;
    if (c.type == kv_dtype::kv_f16)
      a.k = k16.data() + off, a.v = v16.data() + off;
    else
      a.k = k.data() + off, a.v = v.data() + off;
    a.kv_pos = kv_pos.data() + j0, a.n_kv = j1 - j0, a.kv_type = c.type;
    a.n_head = c.n_head, a.n_head_kv = c.n_head_kv, a.head_dim = c.hd, a.scale = scale;
    a.o = o, a.lse = lse;
    return a;
  }
};

attn_inputs make_inputs(const attn_case& c, uint32_t seed, float q_gain = 1.0f) {
  attn_inputs in;
  in.c = c;
  in.scale = 1.0f / std::sqrt((float)c.hd);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uq(-3.0f, 3.0f), ukv(-1.0f, 1.0f);
  in.q.resize((size_t)(c.n_q * c.n_head * c.hd));
  for (auto& x : in.q) x = uq(rng) * q_gain;
  const size_t n_kv_elem = (size_t)(c.n_kv * c.n_head_kv * c.hd);
  in.k.resize(n_kv_elem), in.v.resize(n_kv_elem);
  for (auto& x : in.k) x = ukv(rng);
  for (auto& x : in.v) x = ukv(rng);
  if (c.type == kv_dtype::kv_f16) {
    in.k16.resize(n_kv_elem), in.v16.resize(n_kv_elem);
    for (size_t e = 0; e < n_kv_elem; ++e) {
      in.k16[e] = fp32_to_fp16(in.k[e]), in.k[e] = fp16_to_fp32(in.k16[e]);
      in.v16[e] = fp32_to_fp16(in.v[e]), in.v[e] = fp16_to_fp32(in.v16[e]);
    }
  }
  in.kv_pos.resize((size_t)c.n_kv), in.q_pos.resize((size_t)c.n_q);
  switch (c.mode) {
    case causal_mode::causal_end:
      for (int64_t j = 0; j < c.n_kv; ++j) in.kv_pos[j] = (int32_t)j;
      for (int64_t i = 0; i < c.n_q; ++i) in.q_pos[i] = (int32_t)(c.n_kv - c.n_q + i);  // < 0: sees nothing
      break;
    case causal_mode::causal_partial: {
      for (int64_t j = 0; j < c.n_kv; ++j) in.kv_pos[j] = (int32_t)(j / 2 * 3);  // gaps and repeats
      const int32_t last = c.n_kv > 0 ? in.kv_pos.back() : 10;
      std::uniform_int_distribution<int32_t> up(0, last);
      for (auto& p : in.q_pos) p = up(rng);
      std::sort(in.q_pos.begin(), in.q_pos.end());
      in.q_pos[0] = -1;
      break;
    }
    case causal_mode::causal_none:
      for (int64_t j = 0; j < c.n_kv; ++j) in.kv_pos[j] = (int32_t)j;
      for (int64_t i = 0; i < c.n_q; ++i) in.q_pos[i] = (int32_t)(c.n_kv + 100 + i);
      break;
  }
  return in;
}

struct attn_out {
  std::vector<float> o, lse;
  explicit attn_out(const attn_case& c)
      : o((size_t)(c.n_q * c.n_head * c.hd), NAN), lse((size_t)(c.n_q * c.n_head), NAN) {}
};

double norm(const float* x, int n) {
  double s = 0.0;
  for (int i = 0; i < n; ++i) s += (double)x[i] * x[i];
  return std::sqrt(s);
}

// Checks o / lse against the ref's with the tolerance derived at the top of this file.
testing::AssertionResult close_to_ref(const attn_inputs& in, const attn_out& got, const attn_out& want) {
  const auto& c = in.c;
  const int g = c.n_head / c.n_head_kv;
  std::vector<double> k_max((size_t)c.n_head_kv, 0.0), v_max((size_t)c.n_head_kv, 0.0);  // over all keys
  for (int64_t j = 0; j < c.n_kv; ++j)
    for (int h = 0; h < c.n_head_kv; ++h) {
      const float* kr = in.k.data() + (j * c.n_head_kv + h) * c.hd;
      const float* vr = in.v.data() + (j * c.n_head_kv + h) * c.hd;
      k_max[h] = std::max(k_max[h], norm(kr, c.hd));
      for (int d = 0; d < c.hd; ++d) v_max[h] = std::max(v_max[h], (double)std::fabs(vr[d]));
    }
  for (int64_t i = 0; i < c.n_q; ++i) {
    const int64_t n_vis =
        std::upper_bound(in.kv_pos.begin(), in.kv_pos.end(), in.q_pos[i]) - in.kv_pos.begin();
    for (int h = 0; h < c.n_head; ++h) {
      const int64_t row = i * c.n_head + h;
      const float* o = got.o.data() + row * c.hd;
      const float* o_ref = want.o.data() + row * c.hd;
      if (n_vis == 0) {
        for (int d = 0; d < c.hd; ++d)
          if (o[d] != 0.0f) return testing::AssertionFailure() << "query " << i << " head " << h << " sees no key but o[" << d << "]=" << o[d];
        if (!(got.lse[row] == -INFINITY)) return testing::AssertionFailure() << "query " << i << " head " << h << " sees no key but lse=" << got.lse[row];
        continue;
      }
      const int kvh = h / g;
      const double ds = (kLambda * std::sqrt((double)c.hd) + 2.0) * kEps * in.scale *
                        norm(in.q.data() + row * c.hd, c.hd) * k_max[kvh];
      const double eta = 2.0 * ds + kExpErr + 2.0 * kEps;
      const double acc = kLambda * std::sqrt((double)n_vis) * kEps;
      const double tol_o = v_max[kvh] * (2.0 * eta + 2.0 * acc + kMergeAllowance);
      const double tol_lse = 2.0 * ds + kExpErr + acc + kEps * (std::fabs(want.lse[row]) + 1.0) + kMergeAllowance;
      for (int d = 0; d < c.hd; ++d)
        if (!(std::fabs((double)o[d] - o_ref[d]) <= tol_o))
          return testing::AssertionFailure() << "query " << i << " head " << h << " dim " << d << ": o=" << o[d]
                                             << " ref=" << o_ref[d] << " tol=" << tol_o << " (n_vis " << n_vis << ")";
      if (!(std::fabs((double)got.lse[row] - want.lse[row]) <= tol_lse))
        return testing::AssertionFailure() << "query " << i << " head " << h << ": lse=" << got.lse[row]
                                           << " ref=" << want.lse[row] << " tol=" << tol_lse;
    }
  }
  return testing::AssertionSuccess();
}

uint32_t seed_of(const attn_case& c) {
  return (uint32_t)(c.n_q * 1000003 + c.n_kv * 7919 + c.n_head * 101 + c.hd * 13 + (int)c.type * 3 + (int)c.mode);
}

// ---- cpu vs ref over shapes ----------------------------------------------------------------

class Attention : public testing::TestWithParam<attn_case> {};

TEST_P(Attention, CpuMatchesRef) {
  const auto c = GetParam();
  const uint32_t seed = seed_of(c);
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto in = make_inputs(c, seed);
  attn_out want(c);
  ref::attention_partial(in.args(want.o.data(), want.lse.data()));
  for (isa v : available_isas()) {
    attn_out got(c);
    cpu::impl::attention_partial(v, in.args(got.o.data(), got.lse.data()));
    EXPECT_TRUE(close_to_ref(in, got, want)) << cpu::impl::isa_name(v);
  }
}

std::vector<attn_case> attention_cases() {
  struct heads { int n_head, n_head_kv; };
  const heads head_cfgs[] = {{9, 3}, {8, 8}, {4, 1}};
  const int hds[] = {64, 128};
  const kv_dtype types[] = {kv_dtype::kv_f32, kv_dtype::kv_f16};
  const causal_mode modes[] = {causal_mode::causal_end, causal_mode::causal_partial, causal_mode::causal_none};
  std::vector<attn_case> out;
  std::set<std::string> seen;
  auto push = [&](const attn_case& c) {
    if (seen.insert(c.name()).second) out.push_back(c);
  };
  // Every (n_q, n_kv, mode); the other axes rotate so each value meets each size, and the
  // biggest shapes take the cheapest head layout to keep the ref (double, scalar) to seconds.
  int idx = 0;
  for (int64_t n_q : {1, 3, 64, 300})
    for (int64_t n_kv : {0, 1, 17, 1000, 4096})
      for (causal_mode mode : modes) {
        attn_case c;
        c.n_q = n_q, c.n_kv = n_kv, c.mode = mode;
        const heads hc = head_cfgs[idx % 3];
        c.n_head = hc.n_head, c.n_head_kv = hc.n_head_kv;
        c.hd = hds[(idx / 3) % 2];
        c.type = types[(idx + idx / 6) % 2];
        if (n_q * c.n_head * n_kv * c.hd > 40'000'000) c.n_head = 4, c.n_head_kv = 1, c.hd = 64;
        push(c);
        ++idx;
      }
  // Full cross of heads x head_dim x kv type for a decode and a prefill shape.
  for (const heads& hc : head_cfgs)
    for (int hd : hds)
      for (kv_dtype t : types)
        for (int64_t n_q : {1, 3, 64}) {
          attn_case c;
          c.n_q = n_q, c.n_kv = n_q == 64 ? 300 : 1000, c.n_head = hc.n_head, c.n_head_kv = hc.n_head_kv, c.hd = hd,
          c.type = t, c.mode = causal_mode::causal_end;
          push(c);
        }
  // Path boundaries (8 queries: last decode; 9: first prefill), an odd head size the AVX2
  // decode kernel hands to the scalar one, and long decode with many split-K chunks.
  for (int64_t n_q : {8, 9}) {
    attn_case c;
    c.n_q = n_q, c.n_kv = 700, c.mode = causal_mode::causal_partial;
    push(c);
  }
  {
    attn_case c;
    c.n_q = 2, c.n_kv = 300, c.hd = 20, c.type = kv_dtype::kv_f16, c.mode = causal_mode::causal_partial;
    push(c);
    c.n_q = 70;
    push(c);
  }
  for (kv_dtype t : types) {
    attn_case c;
    c.n_q = 1, c.n_kv = 4096, c.n_head = 4, c.n_head_kv = 1, c.type = t, c.mode = causal_mode::causal_none;
    push(c);
  }
  // The AVX2 decode kernel works on blocks of up to 3 rows per kv head and 24-dim slices:
  // 8 rows per head (3 + 3 + 2) and a head size that is neither 64 nor 128.
  {
    attn_case c;
    c.n_q = 2, c.n_kv = 1000, c.n_head = 4, c.n_head_kv = 1, c.type = kv_dtype::kv_f16, c.mode = causal_mode::causal_partial;
    push(c);
    c.n_q = 4, c.n_head = 9, c.n_head_kv = 3, c.hd = 40, c.type = kv_dtype::kv_f32, c.mode = causal_mode::causal_end;
    push(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, Attention, testing::ValuesIn(attention_cases()),
                         [](const auto& info) { return info.param.name(); });

// The tolerance is not vacuous: showing one more key (an off-by-one causal mask) is caught.
TEST(AttentionTolerance, DetectsOffByOneMask) {
  attn_case c;
  c.n_q = 3, c.n_kv = 17;
  const auto in = make_inputs(c, 77);
  auto shifted = in;
  for (auto& p : shifted.q_pos) p -= 1;
  attn_out want(c), wrong(c);
  ref::attention_partial(in.args(want.o.data(), want.lse.data()));
  ref::attention_partial(shifted.args(wrong.o.data(), wrong.lse.data()));
  EXPECT_FALSE(close_to_ref(in, wrong, want));
}

TEST(AttentionChecks, BadInputThrows) {
  attn_case c;
  c.n_q = 1, c.n_kv = 4;
  auto in = make_inputs(c, 5);
  attn_out out(c);
  in.kv_pos[2] = 0;  // decreasing
  EXPECT_THROW(ref::attention_partial(in.args(out.o.data(), out.lse.data())), Error);
  EXPECT_THROW(cpu::attention_partial(in.args(out.o.data(), out.lse.data())), Error);
  in.kv_pos = {0, 1, 2, 3};
  auto a = in.args(out.o.data(), out.lse.data());
  a.n_head_kv = 2;  // 9 % 2 != 0
  EXPECT_THROW(ref::attention_partial(a), Error);
  EXPECT_THROW(cpu::attention_partial(a), Error);
}

// ---- merge_partials ------------------------------------------------------------------------

struct merge_case {
  attn_case c;
  float q_gain = 1.0f;  // 3000: scores around +-1e4, lse of that size
  std::string name() const { return c.name() + (q_gain != 1.0f ? "_huge" : ""); }
};

void PrintTo(const merge_case& m, std::ostream* os) { *os << m.name(); }

class MergeChunks : public testing::TestWithParam<merge_case> {};

// Cutting the cache into 1..8 random chunks, attending to each and merging equals one shot.
TEST_P(MergeChunks, EqualsOneShot) {
  const auto mc = GetParam();
  const auto& c = mc.c;
  const uint32_t seed = seed_of(c) + 17;
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto in = make_inputs(c, seed, mc.q_gain);
  attn_out want(c);
  ref::attention_partial(in.args(want.o.data(), want.lse.data()));
  std::mt19937 rng(seed);
  const int64_t n_row = c.n_q * c.n_head;
  for (int trial = 0; trial < 3; ++trial) {
    const int n_part = 1 + (int)(rng() % 8);
    std::vector<int64_t> cuts{0, c.n_kv};
    for (int p = 1; p < n_part; ++p) cuts.push_back(c.n_kv > 0 ? (int64_t)(rng() % (uint64_t)(c.n_kv + 1)) : 0);
    std::sort(cuts.begin(), cuts.end());  // repeated cuts make empty chunks
    SCOPED_TRACE("parts " + std::to_string(n_part));
    // The ref merge of ref partials agrees with the ref one-shot to float storage precision.
    std::vector<float> ro_parts((size_t)(n_part * n_row * c.hd)), rlse_parts((size_t)(n_part * n_row));
    for (int p = 0; p < n_part; ++p)
      ref::attention_partial(
          in.args(ro_parts.data() + p * n_row * c.hd, rlse_parts.data() + p * n_row, cuts[p], cuts[p + 1]));
    attn_out ref_merged(c);
    ref::merge_partials(ro_parts.data(), rlse_parts.data(), n_part, n_row, c.hd, ref_merged.o.data(),
                        ref_merged.lse.data());
    for (int64_t r = 0; r < n_row; ++r) {
      if (want.lse[r] == -INFINITY) {
        EXPECT_EQ(ref_merged.lse[r], -INFINITY);
        continue;
      }
      // Each stored partial is rounded once (o, and lse whose error |lse| eps scales the
      // weights), the merge in double rounds once more.
      const double tol = 3.0 * kEps * (std::fabs(want.lse[r]) + 1.0);
      EXPECT_NEAR(ref_merged.lse[r], want.lse[r], tol) << "row " << r;
      for (int d = 0; d < c.hd; ++d)
        ASSERT_NEAR(ref_merged.o[r * c.hd + d], want.o[r * c.hd + d], 2.0 * tol) << "row " << r << " dim " << d;
    }
    for (isa v : available_isas()) {
      SCOPED_TRACE(cpu::impl::isa_name(v));
      std::vector<float> o_parts(ro_parts.size()), lse_parts(rlse_parts.size());
      for (int p = 0; p < n_part; ++p)
        cpu::impl::attention_partial(
            v, in.args(o_parts.data() + p * n_row * c.hd, lse_parts.data() + p * n_row, cuts[p], cuts[p + 1]));
      attn_out got(c);
      cpu::impl::merge_partials(v, o_parts.data(), lse_parts.data(), n_part, n_row, c.hd, got.o.data(), got.lse.data());
      EXPECT_TRUE(close_to_ref(in, got, want));
      // In place: o / lse alias part 0.
      cpu::impl::merge_partials(v, o_parts.data(), lse_parts.data(), n_part, n_row, c.hd, o_parts.data(),
                                lse_parts.data());
      EXPECT_TRUE(std::equal(got.o.begin(), got.o.end(), o_parts.begin()));
      EXPECT_TRUE(std::equal(got.lse.begin(), got.lse.end(), lse_parts.begin()));
    }
  }
}

std::vector<merge_case> merge_cases() {
  std::vector<merge_case> out;
  for (auto [n_q, n_kv, mode] : {std::tuple<int64_t, int64_t, causal_mode>{1, 1000, causal_mode::causal_end},
                                 {3, 17, causal_mode::causal_partial},
                                 {64, 600, causal_mode::causal_end},
                                 {20, 300, causal_mode::causal_partial},
                                 {2, 0, causal_mode::causal_none}}) {
    merge_case m;
    m.c.n_q = n_q, m.c.n_kv = n_kv, m.c.mode = mode;
    m.c.type = n_q == 64 ? kv_dtype::kv_f16 : kv_dtype::kv_f32;
    out.push_back(m);
  }
  merge_case huge;
  huge.c.n_q = 3, huge.c.n_kv = 500, huge.c.mode = causal_mode::causal_partial, huge.q_gain = 3000.0f;
  out.push_back(huge);
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, MergeChunks, testing::ValuesIn(merge_cases()),
                         [](const auto& info) { return info.param.name(); });

// Synthetic partials: lse from -1e4 to 1e4 and -inf, cpu merge against the ref merge.
TEST(MergePartials, ExtremeAndEmptyParts) {
  const int n_part = 5, hd = 64;
  const int64_t n_row = 7;
  const uint32_t seed = 99;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> o_parts((size_t)(n_part * n_row * hd)), lse_parts((size_t)(n_part * n_row));
  for (auto& x : o_parts) x = u(rng);
  // Row r: a pattern of magnitudes; -inf parts carry o = 0 as the kernels produce them.
  const float inf = INFINITY;
  const float rows[7][5] = {{1e4f, 1e4f - 1.0f, -1e4f, 3.0f, -inf},
                            {-1e4f, -1e4f + 0.5f, -1e4f - 2.0f, -inf, -inf},
                            {-inf, -inf, -inf, -inf, -inf},
                            {0.0f, 0.0f, 0.0f, 0.0f, 0.0f},
                            {-inf, 5.0f, -inf, -inf, -inf},
                            {1e-30f, -1e-30f, 80.0f, -80.0f, 1e4f + 1e-3f},
                            {-inf, -inf, -inf, -inf, 1e4f}};
  for (int64_t r = 0; r < n_row; ++r)
    for (int p = 0; p < n_part; ++p) {
      lse_parts[p * n_row + r] = rows[r][p];
      if (rows[r][p] == -inf) std::fill_n(o_parts.begin() + (p * n_row + r) * hd, hd, 0.0f);
    }
  std::vector<float> o_ref((size_t)(n_row * hd)), lse_ref((size_t)n_row);
  ref::merge_partials(o_parts.data(), lse_parts.data(), n_part, n_row, hd, o_ref.data(), lse_ref.data());
  EXPECT_EQ(lse_ref[2], -inf);
  for (int d = 0; d < hd; ++d) EXPECT_EQ(o_ref[2 * hd + d], 0.0f);
  for (isa v : available_isas()) {
    std::vector<float> o((size_t)(n_row * hd), NAN), lse((size_t)n_row, NAN);
    cpu::impl::merge_partials(v, o_parts.data(), lse_parts.data(), n_part, n_row, hd, o.data(), lse.data());
    for (int64_t r = 0; r < n_row; ++r) {
      if (lse_ref[r] == -inf) {
        EXPECT_EQ(lse[r], -inf) << "row " << r;
        for (int d = 0; d < hd; ++d) ASSERT_EQ(o[r * hd + d], 0.0f) << "row " << r;
        continue;
      }
      // lse differences are exact (Sterbenz) or dominated by the max; the weights carry the exp
      // error plus normalisation over n_part terms; |o_p| <= 1.
      const double w_err = kExpErr + (n_part + 2) * kEps;
      EXPECT_NEAR(lse[r], lse_ref[r], kEps * std::fabs(lse_ref[r]) + w_err) << "row " << r;
      for (int d = 0; d < hd; ++d) ASSERT_NEAR(o[r * hd + d], o_ref[r * hd + d], 2.0 * w_err) << "row " << r;
    }
    // A lone part passes through unchanged.
    for (int d = 0; d < hd; ++d) EXPECT_EQ(o[4 * hd + d], o_parts[(1 * n_row + 4) * hd + d]);
    EXPECT_EQ(lse[4], 5.0f);
  }
}

// ---- the AVX-512 many-row decode kernel: bitwise the AVX2 kernel's results -------------------
// The unit path's invariance needs every row's arithmetic to be the same whichever kernel runs
// it (attention_avx512.cpp): compared bit for bit over row counts that leave every row-block
// remainder, every head_dim it takes, both key types, ragged causal ends (tails of every
// length mod the key blocks), a job starting mid-cache, and large scores (softmax rescaling).
struct avx512_case {
  int rows_per_head, n_kvh, hd;
  kv_dtype type;
  int64_t j0, j1;
  float q_scale;
};

TEST(AttentionAvx512, ManyRowKernelGivesTheAvx2KernelsBits) {
  if (!cpu::has_avx512()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const std::vector<avx512_case> cases = {
      {48, 3, 64, kv_dtype::kv_f16, 0, 256, 1.0f},   {48, 3, 64, kv_dtype::kv_f32, 0, 256, 1.0f},
      {7, 2, 64, kv_dtype::kv_f16, 0, 100, 1.0f},    {8, 1, 32, kv_dtype::kv_f32, 5, 77, 1.0f},
      {6, 3, 128, kv_dtype::kv_f16, 0, 200, 1.0f},   {10, 2, 128, kv_dtype::kv_f32, 32, 190, 1.0f},
      {12, 3, 64, kv_dtype::kv_f16, 0, 256, 30.0f},  {16, 2, 32, kv_dtype::kv_f16, 3, 41, 1.0f},
      {9, 1, 64, kv_dtype::kv_f16, 0, 33, 1.0f},     {24, 3, 64, kv_dtype::kv_f16, 17, 18, 1.0f},
  };
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const avx512_case& c : cases) {
    const int R = c.rows_per_head * c.n_kvh, hd = c.hd;
    const int64_t ld = (int64_t)c.n_kvh * hd, n_tok = c.j1 + 8;
    std::vector<float> q((size_t)R * hd), kf((size_t)(n_tok * ld)), vf(kf.size());
    std::vector<uint16_t> kh(kf.size()), vh(kf.size());
    for (float& x : q) x = c.q_scale * u(rng);
    for (size_t e = 0; e < kf.size(); ++e) {
      kh[e] = fp32_to_fp16(u(rng)), vh[e] = fp32_to_fp16(u(rng));
      kf[e] = fp16_to_fp32(kh[e]), vf[e] = fp16_to_fp32(vh[e]);
    }
    std::vector<int64_t> row_end((size_t)R);
    for (int r = 0; r < R; ++r) {  // ragged: every end in [j0 - 1, j1 + 2], some rows seeing nothing
      const int64_t span = c.j1 - c.j0 + 4;
      row_end[(size_t)r] = c.j0 - 1 + (int64_t)(rng() % (uint64_t)span);
    }
    row_end[0] = c.j1;  // one row sees the whole job
    cpu::impl::decode_job jb;
    jb.q = q.data(), jb.row_end = row_end.data(), jb.R = R, jb.n_kvh = c.n_kvh, jb.hd = hd;
    jb.k = c.type == kv_dtype::kv_f16 ? (const void*)kh.data() : (const void*)kf.data();
    jb.v = c.type == kv_dtype::kv_f16 ? (const void*)vh.data() : (const void*)vf.data();
    jb.type = c.type, jb.ld = ld, jb.j0 = c.j0, jb.j1 = c.j1;
    ASSERT_TRUE(cpu::impl::avx512::decode_block_supported(jb));
    std::vector<float> o2((size_t)R * hd, NAN), l2((size_t)R, NAN), o5 = o2, l5 = l2;
    std::vector<float> scratch((size_t)cpu::impl::decode_scratch_floats(R, hd) + 1);
    jb.scratch = scratch.data() + 1;  // misaligned on purpose: the kernel aligns its tiles itself
    jb.o = o2.data(), jb.lse = l2.data();
    cpu::impl::avx2::decode_block(jb);
    jb.o = o5.data(), jb.lse = l5.data();
    cpu::impl::avx512::decode_block(jb);
    const std::string what = "rows/head " + std::to_string(c.rows_per_head) + ", kv heads " +
                             std::to_string(c.n_kvh) + ", hd " + std::to_string(hd) +
                             (c.type == kv_dtype::kv_f16 ? ", f16" : ", f32");
    EXPECT_EQ(std::memcmp(o2.data(), o5.data(), o2.size() * sizeof(float)), 0) << what;
    EXPECT_EQ(std::memcmp(l2.data(), l5.data(), l2.size() * sizeof(float)), 0) << what;
    for (int r = 0; r < R && !HasFailure(); ++r)
      for (int d = 0; d < hd; ++d)
        ASSERT_EQ(o2[(size_t)r * hd + d], o5[(size_t)r * hd + d]) << what << ", row " << r << " d " << d;
  }
}

// ---- the unit path (args.acc: exact per-unit deposits) ---------------------------------------

attn_out run_units(const attn_inputs& in, int64_t j0 = 0, int64_t j1 = -1, softmax_acc* shared = nullptr,
                   const cpu::attention_switches& sw = {}) {
  attn_out out(in.c);
  softmax_acc own(in.c.n_q * in.c.n_head, in.c.hd);
  softmax_acc& acc = shared != nullptr ? *shared : own;
  attn_args a = in.args(nullptr, nullptr, j0, j1);
  a.acc = &acc;
  cpu::attention_partial(a, sw);
  acc.finish(out.o.data(), out.lse.data());
  return out;
}

bool same_bits(const attn_out& a, const attn_out& b) {
  return std::memcmp(a.o.data(), b.o.data(), a.o.size() * sizeof(float)) == 0 &&
         std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

std::vector<attn_case> unit_cases() {
  std::vector<attn_case> v;
  for (kv_dtype t : {kv_dtype::kv_f32, kv_dtype::kv_f16})
    for (causal_mode m : {causal_mode::causal_end, causal_mode::causal_partial, causal_mode::causal_none})
      for (int64_t n_q : {1, 5, 40}) {
        attn_case c;
        c.n_q = n_q, c.n_kv = 700, c.type = t, c.mode = m;
        v.push_back(c);
      }
  return v;
}

class attention_units_test : public ::testing::TestWithParam<attn_case> {};

// Same tolerance as the one-shot kernels: a unit is one decode-kernel call, and the exact sum of
// the unit partials adds less than one float rounding (kernels/softmax_acc.h).
TEST_P(attention_units_test, matches_ref) {
  const attn_inputs in = make_inputs(GetParam(), seed_of(GetParam()));
  attn_out want(in.c);
  ref::attention_partial(in.args(want.o.data(), want.lse.data()));
  EXPECT_TRUE(close_to_ref(in, run_units(in), want));
}

// The AVX2 switch (backend_settings::attn_avx512_rows off, the benchmarks' baseline) keeps
// every job on the AVX2 kernel: the same bits as the default, which takes AVX-512 for blocks of
// many rows per kv head on CPUs that have it.
TEST_P(attention_units_test, the_avx2_switch_gives_the_same_bits) {
  const attn_inputs in = make_inputs(GetParam(), seed_of(GetParam()));
  EXPECT_TRUE(same_bits(run_units(in, 0, -1, nullptr, {false, true}), run_units(in)));
}

// Splitting the keys at unit boundaries (as shard plans do), the thread count, and which other
// queries share the call change no bit of the result.
TEST_P(attention_units_test, any_split_threads_and_batch_give_the_same_bits) {
  const attn_inputs in = make_inputs(GetParam(), seed_of(GetParam()));
  const attn_out whole = run_units(in);
  std::vector<int64_t> starts;  // unit starts: where kv_pos / kAttnUnit changes
  for (int64_t j = 1; j < in.c.n_kv; ++j)
    if (in.kv_pos[j] / kAttnUnit != in.kv_pos[j - 1] / kAttnUnit) starts.push_back(j);
  ASSERT_GE(starts.size(), 2u);
  std::mt19937 rng(seed_of(GetParam()) + 1);
  for (int trial = 0; trial < 3; ++trial) {
    std::vector<int64_t> cuts{0};
    for (int64_t s : starts)
      if (rng() % 2) cuts.push_back(s);
    cuts.push_back(in.c.n_kv);
    std::shuffle(cuts.begin() + 1, cuts.end() - 1, rng);  // shards visited in any order
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::pair<int64_t, int64_t>> shards;
    for (size_t i = 0; i + 1 < cuts.size(); ++i) shards.push_back({cuts[i], cuts[i + 1]});
    std::shuffle(shards.begin(), shards.end(), rng);
    softmax_acc acc(in.c.n_q * in.c.n_head, in.c.hd);
    attn_out split(in.c);
    for (const auto& [a, b] : shards) split = run_units(in, a, b, &acc);
    EXPECT_TRUE(same_bits(split, whole)) << shards.size() << " shards, trial " << trial;
  }
  const int threads = omp_get_max_threads();
  omp_set_num_threads(threads == 1 ? 2 : 1);
  const attn_out other_threads = run_units(in);
  omp_set_num_threads(threads);
  EXPECT_TRUE(same_bits(other_threads, whole)) << "thread count";
  // Each query alone (the decode path of the driver) gives its rows of the batched call.
  for (int64_t i = 0; i < in.c.n_q; i += std::max<int64_t>(1, in.c.n_q / 4)) {
    attn_inputs one = in;
    one.c.n_q = 1;
    one.q.assign(in.q.begin() + i * in.c.n_head * in.c.hd, in.q.begin() + (i + 1) * in.c.n_head * in.c.hd);
    one.q_pos = {in.q_pos[i]};
    const attn_out alone = run_units(one);
    EXPECT_EQ(std::memcmp(alone.o.data(), whole.o.data() + i * in.c.n_head * in.c.hd, alone.o.size() * sizeof(float)), 0)
        << "query " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(cases, attention_units_test, ::testing::ValuesIn(unit_cases()),
                         [](const auto& info) { return info.param.name(); });

}  // namespace
}  // namespace xctx
