// CostModel: priors, warm-up rejection, convergence without drift, and the cached remaining time.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/cost_model.h"

namespace {

using namespace hydra::core;

TaskSpec spec(int shards, int64_t micro_batches) { return TaskSpec{shards, micro_batches, std::nullopt}; }

double brute_force_remaining(const CostModel& model, int task, int64_t next_index) {
  const TaskSpec& s = model.spec(task);
  double sum = 0.0;
  for (int64_t i = next_index; i < total_units(s); ++i) {
    const Unit unit = unit_at(task, s, i);
    sum += model.estimate(task, unit.shard, unit.phase);
  }
  return sum;
}

TEST(CostModel, UnobservedUnitsUseTheDefaultScaledByPhase) {
  const CostModel model({spec(3, 2)}, 0.5);
  EXPECT_DOUBLE_EQ(model.estimate(0, 0, Phase::kForward), 0.5);
  EXPECT_DOUBLE_EQ(model.estimate(0, 2, Phase::kForwardBackward), 1.5);
  EXPECT_DOUBLE_EQ(model.estimate(0, 1, Phase::kBackward), 1.5);
  // Per micro-batch: 2 forwards + FB + 2 backwards = 0.5 * (1 + 1 + 3 + 3 + 3).
  EXPECT_DOUBLE_EQ(model.remaining_seconds(0, 0), 2 * 5.5);
  EXPECT_DOUBLE_EQ(model.remaining_seconds(0, 3), 5.5 + 1.5 + 1.5);
  EXPECT_DOUBLE_EQ(model.remaining_seconds(0, 10), 0.0);
}

TEST(CostModel, PriorsComeFromTheSamePhaseThenTheTaskThenEveryTask) {
  CostModel model({spec(4, 1), spec(2, 1)});
  model.observe(0, 0, Phase::kForward, 2.0);
  model.observe(0, 0, Phase::kForward, 2.0);
  EXPECT_DOUBLE_EQ(model.estimate(0, 2, Phase::kForward), 2.0);      // same phase of the task
  EXPECT_DOUBLE_EQ(model.estimate(0, 1, Phase::kBackward), 6.0);     // the task's forward x 3
  EXPECT_DOUBLE_EQ(model.estimate(1, 0, Phase::kForward), 2.0);      // every task's forward-equivalent
  EXPECT_DOUBLE_EQ(model.estimate(1, 1, Phase::kForwardBackward), 6.0);
  model.observe(0, 1, Phase::kBackward, 4.0);
  EXPECT_DOUBLE_EQ(model.estimate(0, 2, Phase::kBackward), 4.0);
  // The global prior moved (2, 2, 4/3 forward-equivalent): unobserved task 1 follows, cache or not.
  EXPECT_NEAR(model.estimate(1, 0, Phase::kForward), (2.0 + 2.0 + 4.0 / 3.0) / 3.0, 1e-12);
}

TaskSpec costed(int shards, int64_t micro_batches, std::vector<double> costs) {
  return TaskSpec{shards, micro_batches, std::nullopt, std::move(costs)};
}

TEST(CostModel, AnUntimedTaskIsRankedByItsShardCostsAgainstTheTimedOnes) {
  // Task 1's shards cost 4x task 0's (four times the parameters, say). Once task 0 is timed, task 1's prior
  // is four times task 0's, where without costs it would be the same as task 0's.
  CostModel model({costed(2, 1, {1.0, 1.0}), costed(2, 1, {4.0, 4.0})});
  model.observe(0, 0, Phase::kForward, 0.5);
  model.observe(0, 0, Phase::kForward, 0.5);
  model.observe(0, 1, Phase::kForwardBackward, 1.5);
  EXPECT_DOUBLE_EQ(model.estimate(1, 0, Phase::kForward), 2.0);
  EXPECT_DOUBLE_EQ(model.estimate(1, 1, Phase::kForwardBackward), 6.0);
  EXPECT_DOUBLE_EQ(model.remaining_seconds(1, 0), 4.0 * model.remaining_seconds(0, 0));
  const CostModel uncosted({spec(2, 1), spec(2, 1)});
  EXPECT_DOUBLE_EQ(uncosted.remaining_seconds(0, 0), uncosted.remaining_seconds(1, 0));
}

TEST(CostModel, AnUntimedShardOfATimedTaskScalesByItsCost) {
  CostModel model({costed(4, 1, {1.0, 3.0, 2.0, 1.0})});
  model.observe(0, 0, Phase::kForward, 1.0);
  EXPECT_DOUBLE_EQ(model.estimate(0, 1, Phase::kForward), 3.0);    // same phase, 3x the cost
  EXPECT_DOUBLE_EQ(model.estimate(0, 2, Phase::kForward), 2.0);
  EXPECT_DOUBLE_EQ(model.estimate(0, 1, Phase::kBackward), 9.0);   // the task's forward rate x 3 x cost 3
  EXPECT_DOUBLE_EQ(model.remaining_seconds(0, 0), brute_force_remaining(model, 0, 0));
}

TEST(CostModel, ShardCostsOnlyScaleRelativelyAndMixWithUncostedTasks) {
  // The scale of the costs does not matter (they are normalised to mean 1 over the costed shards), and a
  // task without costs counts its shards as average ones.
  const CostModel small({costed(2, 1, {1.0, 3.0}), spec(2, 1)}, 1.0);
  const CostModel large({costed(2, 1, {1e6, 3e6}), spec(2, 1)}, 1.0);
  for (const CostModel* model : {&small, &large}) {
    EXPECT_DOUBLE_EQ(model->estimate(0, 0, Phase::kForward), 0.5);  // {1, 3} over their mean 2
    EXPECT_DOUBLE_EQ(model->estimate(0, 1, Phase::kForwardBackward), 3.0 * 1.5);
    EXPECT_DOUBLE_EQ(model->estimate(1, 0, Phase::kForward), 1.0);
  }
}

TEST(CostModel, BadShardCostsAreRefused) {
  auto message = [](std::vector<double> costs) {
    try {
      CostModel model({spec(2, 1), costed(2, 1, std::move(costs))});
    } catch (const std::invalid_argument& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({1.0}).find("task 1 has 1 shard costs for 2 shards"), std::string::npos);
  EXPECT_NE(message({1.0, 0.0}).find("positive and finite"), std::string::npos);
  EXPECT_NE(message({-1.0, 1.0}).find("positive and finite"), std::string::npos);
  EXPECT_NE(message({1.0, std::nan("")}).find("positive and finite"), std::string::npos);
  EXPECT_NE(message({1.0, INFINITY}).find("positive and finite"), std::string::npos);
}

TEST(CostModel, TheFirstSampleIsDroppedOnceASecondArrives) {
  CostModel model({spec(2, 1)});
  model.observe(0, 0, Phase::kForward, 100.0);  // warm-up: lazy init, autotuning
  EXPECT_DOUBLE_EQ(model.estimate(0, 0, Phase::kForward), 100.0);
  model.observe(0, 0, Phase::kForward, 1.0);
  model.observe(0, 0, Phase::kForward, 3.0);
  EXPECT_DOUBLE_EQ(model.estimate(0, 0, Phase::kForward), 2.0);
  EXPECT_EQ(model.observations(0, 0, Phase::kForward), 3);
}

TEST(CostModel, ConvergesOnNoisyTimingsAndDoesNotDriftAcrossEpochs) {
  const int shards = 6;
  CostModel model({spec(shards, 1000)});
  std::vector<double> truth;
  for (int p = 0; p < 2 * shards - 1; ++p) truth.push_back(0.01 * (1 + p % 4));
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<double> noise(-0.25, 0.25);
  for (int epoch = 0; epoch < 60; ++epoch) {
    // One epoch in the middle runs 2x slow (an eval pass sharing the device): a transient, not the truth.
    const double slowdown = epoch == 30 ? 2.0 : 1.0;
    for (int step = 0; step < 10; ++step) {
      for (int p = 0; p < 2 * shards - 1; ++p) {
        const Unit unit = unit_at(0, shards, p);
        model.observe(0, unit.shard, unit.phase, truth[static_cast<size_t>(p)] * slowdown * (1.0 + noise(rng)));
      }
    }
    if (epoch < 10) continue;
    // Error bound: noise ~ 0.25/sqrt(3 * 100) ~ 1.5% at epoch 10, plus the transient's 1/epochs share.
    const double tolerance = epoch < 30 ? 0.04 : 0.04 + 1.0 / epoch;
    for (int p = 0; p < 2 * shards - 1; ++p) {
      const Unit unit = unit_at(0, shards, p);
      const double estimate = model.estimate(0, unit.shard, unit.phase);
      EXPECT_NEAR(estimate / truth[static_cast<size_t>(p)], 1.0, tolerance) << "epoch " << epoch << " position " << p;
    }
  }
  // Sixty epochs in, the transient is diluted to well under the noise: no lasting drift.
  for (int p = 0; p < 2 * shards - 1; ++p) {
    const Unit unit = unit_at(0, shards, p);
    EXPECT_NEAR(model.estimate(0, unit.shard, unit.phase) / truth[static_cast<size_t>(p)], 1.0, 0.04);
  }
}

TaskSpec evaluated(int shards, int64_t micro_batches, std::vector<int64_t> after, int64_t batches) {
  TaskSpec s = spec(shards, micro_batches);
  s.eval_after = std::move(after);
  s.eval_batches = batches;
  return s;
}

TEST(CostModel, CachedRemainingTimeMatchesTheBruteForceSum) {
  // With evaluation passes at the start, in the middle, back to back with the end, and none.
  CostModel model({spec(5, 3), spec(1, 4), evaluated(3, 4, {0, 2, 4}, 2), evaluated(1, 3, {1, 3}, 3)});
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> seconds(0.001, 0.1);
  for (int round = 0; round < 200; ++round) {
    const int task = static_cast<int>(rng() % 4);
    const TaskSpec& s = model.spec(task);
    const Unit unit = unit_at(task, s, static_cast<int64_t>(rng() % total_units(s)));
    model.observe(task, unit.shard, unit.phase, seconds(rng));
    for (int t = 0; t < 4; ++t) {
      for (int64_t i = 0; i <= total_units(model.spec(t)); ++i) {
        ASSERT_NEAR(model.remaining_seconds(t, i), brute_force_remaining(model, t, i), 1e-9);
      }
    }
  }
}

TEST(CostModel, RejectsBadObservations) {
  CostModel model({spec(3, 1)});
  EXPECT_THROW(model.observe(1, 0, Phase::kForward, 1.0), std::invalid_argument);
  EXPECT_THROW(model.observe(0, 3, Phase::kForward, 1.0), std::invalid_argument);
  EXPECT_THROW(model.observe(0, 1, Phase::kForwardBackward, 1.0), std::invalid_argument);
  EXPECT_THROW(model.observe(0, 2, Phase::kBackward, 1.0), std::invalid_argument);
  EXPECT_THROW(model.observe(0, 3, Phase::kEvaluate, 1.0), std::invalid_argument);
  EXPECT_THROW(model.observe(0, 0, Phase::kForward, -1.0), std::invalid_argument);
  EXPECT_THROW(model.observe(0, 0, Phase::kForward, std::nan("")), std::invalid_argument);
  EXPECT_THROW(CostModel({spec(0, 1)}), std::invalid_argument);
  EXPECT_THROW(CostModel({evaluated(2, 3, {1, 1}, 1)}), std::invalid_argument);  // not ascending
  EXPECT_THROW(CostModel({evaluated(2, 3, {4}, 1)}), std::invalid_argument);     // past the last micro-batch
  EXPECT_THROW(CostModel({evaluated(2, 3, {1}, 0)}), std::invalid_argument);     // a pass of no batches
}

TEST(CostModel, AnEvaluationUnitCostsAForwardUntilTimedAndEveryShardHasOne) {
  CostModel model({evaluated(3, 2, {2}, 4)}, 0.5);
  EXPECT_DOUBLE_EQ(model.estimate(0, 2, Phase::kEvaluate), 0.5);  // the last shard too
  model.observe(0, 2, Phase::kEvaluate, 0.2);
  EXPECT_DOUBLE_EQ(model.estimate(0, 2, Phase::kEvaluate), 0.2);
  EXPECT_DOUBLE_EQ(model.estimate(0, 0, Phase::kEvaluate), 0.2);  // same phase of the task first
}

}  // namespace
