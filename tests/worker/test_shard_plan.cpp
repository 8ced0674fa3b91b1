#include <gtest/gtest.h>

#include <set>

#include "common/error.h"
#include "worker/shard_plan.h"

namespace xctx {
namespace {

struct plan_case {
  int64_t n;
  int p;
  shard_layout layout;
};

class shard_plan_test : public ::testing::TestWithParam<plan_case> {};

// Every position is held by exactly one rank, ranges ascend, the tail holds the last position.
TEST_P(shard_plan_test, covers_every_position_once) {
  const plan_case c = GetParam();
  const shard_plan plan = make_shard_plan(c.n, c.p, c.layout);
  std::set<int32_t> seen;
  int64_t total = 0;
  for (int r = 0; r < c.p; ++r) {
    const auto pos = plan.positions_of(r);
    EXPECT_EQ((int64_t)pos.size(), plan.tokens_of(r));
    for (size_t i = 1; i < pos.size(); ++i) ASSERT_LT(pos[i - 1], pos[i]);
    for (int32_t x : pos) EXPECT_TRUE(seen.insert(x).second) << "position " << x << " held twice";
    total += (int64_t)pos.size();
    // Shards differ by at most one piece's rounding.
    EXPECT_LE(std::abs(plan.tokens_of(r) - c.n / c.p), 2);
  }
  EXPECT_EQ(total, c.n);
  if (c.n > 0) {
    const auto tail = plan.positions_of(plan.tail_rank);
    ASSERT_FALSE(tail.empty());
    EXPECT_EQ(tail.back(), c.n - 1);
  }
}

// Under a causal mask the work of a rank is the number of (query, key) pairs it computes:
// Σ over its positions of (position + 1). Zigzag keeps ranks within a few percent of each
// other; contiguous gives the last rank ~(2P−1)x the first's.
TEST(shard_plan, zigzag_balances_causal_work) {
  const int64_t n = 1 << 16;
  for (int p : {2, 4, 8}) {
    const auto work = [&](const shard_plan& plan, int r) {
      double w = 0;
      for (int32_t x : plan.positions_of(r)) w += x + 1.0;
      return w;
    };
    const shard_plan z = make_shard_plan(n, p, shard_layout::shard_zigzag);
    const shard_plan c = make_shard_plan(n, p, shard_layout::shard_contiguous);
    double zmin = 1e300, zmax = 0;
    for (int r = 0; r < p; ++r) zmin = std::min(zmin, work(z, r)), zmax = std::max(zmax, work(z, r));
    EXPECT_LT(zmax / zmin, 1.01) << p << " ranks";
    EXPECT_GT(work(c, p - 1) / work(c, 0), 2.0 * p - 1.5) << p << " ranks";
  }
}

TEST(shard_plan, tail_and_errors) {
  EXPECT_EQ(make_shard_plan(100, 4, shard_layout::shard_contiguous).tail_rank, 3);
  EXPECT_EQ(make_shard_plan(100, 4, shard_layout::shard_zigzag).tail_rank, 0);
  EXPECT_THROW(make_shard_plan(10, 0, shard_layout::shard_zigzag), Error);
  EXPECT_THROW(parse_shard_layout("diagonal"), Error);
  EXPECT_EQ(parse_shard_layout("zigzag"), shard_layout::shard_zigzag);
}

INSTANTIATE_TEST_SUITE_P(plans, shard_plan_test,
                         ::testing::Values(plan_case{0, 2, shard_layout::shard_zigzag},
                                           plan_case{3, 4, shard_layout::shard_zigzag},
                                           plan_case{7, 3, shard_layout::shard_contiguous},
                                           plan_case{1000, 1, shard_layout::shard_zigzag},
                                           plan_case{1001, 4, shard_layout::shard_zigzag},
                                           plan_case{1001, 4, shard_layout::shard_contiguous},
                                           plan_case{4096, 8, shard_layout::shard_zigzag}),
                         [](const auto& info) {
                           return std::string(shard_layout_name(info.param.layout)) + "_n" +
                                  std::to_string(info.param.n) + "_p" + std::to_string(info.param.p);
                         });

}  // namespace
}  // namespace xctx
