// SuccessiveHalving: rung placement and the asynchronous keep-the-best-1/eta rule.
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "core/successive_halving.h"

namespace {

using hydra::core::SuccessiveHalving;

TEST(SuccessiveHalving, RungsGrowByTheFactorAndStopBeforeTheLastStep) {
  const SuccessiveHalving rule(10, 3);
  EXPECT_EQ(rule.rungs(100), (std::vector<int64_t>{10, 30, 90}));
  EXPECT_EQ(rule.rungs(90), (std::vector<int64_t>{10, 30}));
  EXPECT_TRUE(rule.rungs(10).empty());
  EXPECT_EQ(SuccessiveHalving(1, 2).rungs(int64_t{1} << 62).size(), 62u);  // no overflow
}

TEST(SuccessiveHalving, KeepsTheBestOfEveryFactorAndTheFirstAlways) {
  SuccessiveHalving rule(5, 2);
  EXPECT_TRUE(rule.report(0, 3.0).keep);   // alone: kept
  auto second = rule.report(0, 4.0);       // 2 results, keep 1: 4.0 ranks 2nd
  EXPECT_FALSE(second.keep);
  EXPECT_EQ(second.rank, 2);
  EXPECT_EQ(second.competitors, 2);
  EXPECT_EQ(second.kept, 1);
  EXPECT_TRUE(rule.report(0, 1.0).keep);   // 3 results, keep 1: the best
  EXPECT_TRUE(rule.report(0, 2.0).keep);   // 4 results, keep 2: 2nd
  EXPECT_FALSE(rule.report(0, 3.5).keep);  // 5 results, keep 2: 4th
  EXPECT_TRUE(rule.report(1, 9.0).keep);   // another rung starts afresh
}

TEST(SuccessiveHalving, NaNRanksLastAndTiesWithTheLastKeptContinue) {
  SuccessiveHalving rule(1, 2);
  rule.report(0, 1.0);
  EXPECT_FALSE(rule.report(0, std::nan("")).keep);
  EXPECT_TRUE(rule.report(0, 1.0).keep);  // 3 results, keep 1; ties the best
}

TEST(SuccessiveHalving, RejectsBadArguments) {
  EXPECT_THROW(SuccessiveHalving(0, 3), std::invalid_argument);
  EXPECT_THROW(SuccessiveHalving(1, 1), std::invalid_argument);
  SuccessiveHalving rule(1, 2);
  EXPECT_THROW(rule.report(-1, 0.0), std::invalid_argument);
}

}  // namespace
