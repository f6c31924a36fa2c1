// Scheduling policies on their own: parsed by name, and which ready candidate each chooses (LRTF with its resident
// and cached-base preferences, FIFO, round robin, seeded random).
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "core/policy.h"

namespace {

using namespace hydra::core;

TEST(ParsePolicy, KnowsEveryNameAndListsThemOnError) {
  for (auto kind : {PolicyKind::kLrtf, PolicyKind::kFifo, PolicyKind::kRoundRobin, PolicyKind::kRandom}) {
    EXPECT_EQ(parse_policy(policy_name(kind)), kind);
  }
  try {
    parse_policy("shortest");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& error) {
    const std::string message = error.what();
    for (const char* name : {"shortest", "lrtf", "fifo", "round_robin", "random"}) {
      EXPECT_NE(message.find(name), std::string::npos) << message;
    }
  }
}

TEST(Policy, LrtfPrefersTheResidentTaskOnlyWithinOnePercent) {
  const Policy policy(PolicyKind::kLrtf, 3, 1, 0);
  const std::vector<Candidate> near = {{0, 100.0, 0, false}, {1, 99.5, 0, true}, {2, 50.0, 0, false}};
  EXPECT_EQ(near[policy.choose(0, near)].task, 1);
  const std::vector<Candidate> far = {{0, 100.0, 0, false}, {1, 98.0, 0, true}};
  EXPECT_EQ(far[policy.choose(0, far)].task, 0);
  const std::vector<Candidate> tie = {{2, 7.0, 0, false}, {1, 7.0, 0, false}, {0, 3.0, 0, false}};
  EXPECT_EQ(tie[policy.choose(0, tie)].task, 1);
}

TEST(Policy, LrtfRunsATaskReadingTheCachedBaseShardWithinFivePercentFirst) {
  const Policy policy(PolicyKind::kLrtf, 4, 1, 0);
  // The base's reader wins over the best, and over the task that ran here last, within 5%.
  const std::vector<Candidate> near = {
      {0, 100.0, 0, true, false}, {1, 96.0, 0, false, true}, {2, 97.0, 0, false, true}, {3, 99.9, 0, false, false}};
  EXPECT_EQ(near[policy.choose(0, near)].task, 2);
  const std::vector<Candidate> far = {{0, 100.0, 0, false, false}, {1, 94.0, 0, false, true}};
  EXPECT_EQ(far[policy.choose(0, far)].task, 0);
  const Policy fifo(PolicyKind::kFifo, 2, 1, 0);  // only LRTF knows it
  const std::vector<Candidate> ready = {{0, 100.0, 0, false, false}, {1, 100.0, 1, false, true}};
  EXPECT_EQ(ready[fifo.choose(0, ready)].task, 0);
}

TEST(Policy, FifoTakesTheEarliestReadyThenTheResidentTask) {
  const Policy policy(PolicyKind::kFifo, 3, 1, 0);
  const std::vector<Candidate> waiting = {{0, 9.0, 5, true}, {1, 1.0, 2, false}, {2, 1.0, 3, false}};
  EXPECT_EQ(waiting[policy.choose(0, waiting)].task, 1);
  const std::vector<Candidate> tie = {{0, 0.0, 1, false}, {2, 0.0, 1, true}};
  EXPECT_EQ(tie[policy.choose(0, tie)].task, 2);
}

TEST(Policy, RoundRobinCyclesPerDevice) {
  Policy policy(PolicyKind::kRoundRobin, 4, 2, 0);
  const std::vector<Candidate> all = {{0, 0, 0, false}, {1, 0, 0, false}, {2, 0, 0, false}, {3, 0, 0, false}};
  std::vector<int> picked;
  for (int i = 0; i < 5; ++i) {
    const int task = all[policy.choose(0, all)].task;
    policy.commit(0, task);
    picked.push_back(task);
  }
  EXPECT_EQ(picked, (std::vector<int>{0, 1, 2, 3, 0}));
  EXPECT_EQ(all[policy.choose(1, all)].task, 0);  // device 1 has its own position
  const std::vector<Candidate> some = {{0, 0, 0, false}, {3, 0, 0, false}};
  EXPECT_EQ(some[policy.choose(0, some)].task, 3);  // after 0 comes 1, 2 (absent), then 3
}

TEST(Policy, RandomIsDeterministicGivenTheSeedAndChooseHasNoSideEffects) {
  const std::vector<Candidate> all = {{0, 0, 0, false}, {1, 0, 0, false}, {2, 0, 0, false}, {3, 0, 0, false}};
  auto sequence = [&](uint64_t seed) {
    Policy policy(PolicyKind::kRandom, 4, 1, seed);
    std::vector<int> picked;
    for (int i = 0; i < 32; ++i) {
      const size_t first = policy.choose(0, all);
      EXPECT_EQ(policy.choose(0, all), first);
      policy.commit(0, all[first].task);
      picked.push_back(all[first].task);
    }
    return picked;
  };
  EXPECT_EQ(sequence(7), sequence(7));
  EXPECT_NE(sequence(7), sequence(8));
}

}  // namespace
