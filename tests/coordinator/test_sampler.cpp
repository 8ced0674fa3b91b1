#include <gtest/gtest.h>

#include <map>

#include "common/error.h"
#include "coordinator/sampler.h"

namespace xctx {
namespace {

TEST(sampler, greedy_is_argmax_first_on_ties) {
  sampler s({0.0f, 1.0f, 1});
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f};
  EXPECT_EQ(s.sample(l.data(), 4), 1);
}

// With top_p below the top token's probability only that token can be drawn; with top_p = 1 the
// empirical frequencies follow softmax(l / T) within a binomial 5-sigma bound.
TEST(sampler, nucleus_and_temperature) {
  std::vector<float> l = {2.0f, 1.0f, 0.0f};
  sampler narrow({1.0f, 0.5f, 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(narrow.sample(l.data(), 3), 0);

  const uint64_t seed = 11;
  sampler s({1.0f, 1.0f, seed});
  std::map<int, int> count;
  const int n = 20000;
  for (int i = 0; i < n; ++i) count[s.sample(l.data(), 3)]++;
  const double z = std::exp(2.0) + std::exp(1.0) + 1.0;
  for (int t = 0; t < 3; ++t) {
    const double p = std::exp(l[t]) / z;
    const double sigma = std::sqrt(n * p * (1 - p));
    EXPECT_NEAR(count[t], n * p, 5 * sigma) << "token " << t << " seed " << seed;
  }
}

TEST(sampler, same_seed_same_draws_and_bad_params_rejected) {
  std::vector<float> l(50);
  for (int i = 0; i < 50; ++i) l[i] = std::sin(i * 0.7f);
  sampler a({0.8f, 0.9f, 5}), b({0.8f, 0.9f, 5});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.sample(l.data(), 50), b.sample(l.data(), 50));
  EXPECT_THROW(sampler({-1.0f, 1.0f, 0}), Error);
  EXPECT_THROW(sampler({1.0f, 0.0f, 0}), Error);
  EXPECT_THROW(sampler({1.0f, 1.5f, 0}), Error);
}

}  // namespace
}  // namespace xctx
