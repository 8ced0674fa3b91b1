// The exact accumulator of attention partials (kernels/softmax_acc.h): bitwise the same result
// for any order and grouping of the same deposits, and the merged softmax to float accuracy.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/error.h"
#include "kernels/softmax_acc.h"

namespace xctx {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct deposit {
  int64_t row;
  float lse;
  std::vector<float> o;
};

std::vector<deposit> random_deposits(int64_t rows, int width, int n, float lse_lo, float lse_hi, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> row(0, rows - 1);
  std::uniform_real_distribution<float> lse(lse_lo, lse_hi);
  std::normal_distribution<float> val(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-20.0f, 20.0f);
  std::vector<deposit> d(n);
  for (auto& x : d) {
    x.row = row(rng), x.lse = lse(rng);
    x.o.resize(width);
    const float scale = std::exp2(std::round(mag(rng)) / 4);  // values from ~1e-2 to ~30
    for (float& v : x.o) v = val(rng) * scale;
  }
  return d;
}

struct finished {
  std::vector<float> o, lse;
  bool operator==(const finished& b) const {
    return o.size() == b.o.size() && lse.size() == b.lse.size() &&
           std::memcmp(o.data(), b.o.data(), o.size() * sizeof(float)) == 0 &&
           std::memcmp(lse.data(), b.lse.data(), lse.size() * sizeof(float)) == 0;
  }
};
finished finish(const softmax_acc& a) {
  finished f;
  f.o.resize((size_t)a.rows() * a.width());
  f.lse.resize((size_t)a.rows());
  a.finish(f.o.data(), f.lse.data());
  return f;
}

TEST(softmax_acc, any_order_and_grouping_gives_the_same_bits) {
  const int64_t rows = 7;
  const int width = 64;
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    auto d = random_deposits(rows, width, 400, -40.0f, 40.0f, seed);
    softmax_acc ref(rows, width);
    for (const auto& x : d) ref.add_partial(x.row, x.lse, x.o.data());
    const finished want = finish(ref);

    std::mt19937 rng(seed + 100);
    std::shuffle(d.begin(), d.end(), rng);
    // Four groups of random sizes, merged in a random order, one of them through its byte image.
    std::vector<softmax_acc> parts(4, softmax_acc(rows, width));
    std::uniform_int_distribution<int> pick(0, 3);
    for (const auto& x : d) parts[pick(rng)].add_partial(x.row, x.lse, x.o.data());
    softmax_acc merged(rows, width);
    for (int p : {2, 0, 3}) merged.merge(parts[p]);
    std::vector<uint8_t> image(parts[1].serialized_bytes());
    parts[1].serialize(image.data());
    merged.merge_serialized(image.data(), image.size());
    EXPECT_TRUE(finish(merged) == want);
  }
}

// The merged softmax against long-double arithmetic. Each finished value is one float rounding
// of a sum that is exact to 2^-64 of the row's largest deposit, so the bound is a float
// rounding of the largest term's size; lse the same on its own scale.
TEST(softmax_acc, equals_the_softmax_merge_to_float_rounding) {
  const int64_t rows = 5;
  const int width = 32;
  auto d = random_deposits(rows, width, 300, -60.0f, 60.0f, 7);
  softmax_acc acc(rows, width);
  for (const auto& x : d) acc.add_partial(x.row, x.lse, x.o.data());
  const finished got = finish(acc);
  for (int64_t r = 0; r < rows; ++r) {
    long double m = -INFINITY;
    for (const auto& x : d)
      if (x.row == r) m = std::max<long double>(m, x.lse);
    long double L = 0, big = 0;
    std::vector<long double> O(width, 0.0L);
    for (const auto& x : d) {
      if (x.row != r) continue;
      const long double w = std::exp((long double)x.lse - m);
      L += w;
      for (int j = 0; j < width; ++j) {
        O[j] += w * x.o[j];
        big = std::max(big, std::fabs(w * x.o[j]));
      }
    }
    const double tol_o = 2.0 * FLT_EPSILON * (double)(big / L);
    for (int j = 0; j < width; ++j)
      EXPECT_NEAR(got.o[(size_t)r * width + j], (double)(O[j] / L), tol_o) << "row " << r << " value " << j;
    const double lse = (double)(m + std::log(L));
    EXPECT_NEAR(got.lse[(size_t)r], lse, 2.0 * FLT_EPSILON * std::fabs(lse) + 1e-7) << "row " << r;
  }
}

// Log-sum-exps far outside exp's float (and double) range: the deposit is kept as y·2^E.
TEST(softmax_acc, extreme_log_sum_exps_do_not_overflow) {
  softmax_acc acc(1, 2);
  const float a[2] = {1.0f, -2.0f}, b[2] = {3.0f, 5.0f};
  const float lse_a = 800.0f, lse_b = 800.0f - std::log(3.0f);  // lse_b as the float it is
  acc.add_partial(0, lse_a, a);
  acc.add_partial(0, lse_b, b);     // about a third of a's weight
  acc.add_partial(0, -900.0f, b);   // negligible
  const finished f = finish(acc);
  const double w = std::exp((double)lse_b - (double)lse_a);
  EXPECT_NEAR(f.o[0], (1.0 + 3.0 * w) / (1 + w), 4 * FLT_EPSILON);
  EXPECT_NEAR(f.o[1], (-2.0 + 5.0 * w) / (1 + w), 4 * FLT_EPSILON);
  EXPECT_NEAR(f.lse[0], 800.0 + std::log1p(w), 800 * 2 * FLT_EPSILON);
}

TEST(softmax_acc, empty_rows_and_masked_partials) {
  softmax_acc acc(2, 3);
  const float o[3] = {1, 2, 3};
  acc.add_partial(0, kNegInf, o);  // a partial that saw no key adds nothing
  acc.add_partial(1, 0.5f, o);
  const finished f = finish(acc);
  EXPECT_EQ(f.lse[0], kNegInf);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(f.o[j], 0.0f);
  EXPECT_FLOAT_EQ(f.lse[1], 0.5f);
  for (int j = 0; j < 3; ++j) EXPECT_EQ(f.o[3 + j], o[j]);
}

TEST(softmax_acc, rejects_mismatched_shapes_and_bad_input) {
  softmax_acc a(2, 4), b(3, 4);
  EXPECT_THROW(a.merge(b), Error);
  std::vector<uint8_t> image(a.serialized_bytes() - 1);
  EXPECT_THROW(a.merge_serialized(image.data(), image.size()), Error);
  const float nan_o[4] = {0, std::nanf(""), 0, 0};
  EXPECT_THROW(a.add_partial(0, 1.0f, nan_o), Error);
  const float o[4] = {0, 0, 0, 0};
  EXPECT_THROW(a.add_partial(0, std::nanf(""), o), Error);
}

// Finite values so far above the softmax sum that the sum drops below the kept bins (a damaged
// cache: the snapshot fuzzer's restored 4.3e16 key) are an Error naming the problem, not an
// abort; values a model produces are far inside the range.
TEST(softmax_acc, values_beyond_the_kept_bins_are_an_error) {
  softmax_acc a(1, 4);
  const float huge[4] = {1e30f, 0, 0, 0};
  a.add_partial(0, 0.0f, huge);
  float o[4], lse = 0;
  try {
    a.finish(o, &lse);
    FAIL() << "finish accepted a sum below the kept bins";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("too large for the exact accumulator"), std::string::npos) << e.what();
  }
  softmax_acc b(1, 4);
  const float big[4] = {1e6f, -3e5f, 0, 1};
  b.add_partial(0, 0.0f, big);
  b.finish(o, &lse);
  EXPECT_EQ(o[0], 1e6f);
  EXPECT_FLOAT_EQ(lse, 0.0f);
}

}  // namespace
}  // namespace xctx
