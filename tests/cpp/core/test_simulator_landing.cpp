// The simulator's landing buffers and device-to-host lane (core/simulator_steps.h): a gradient's copy out waits for
// one of its task's buffers, and meanwhile leaves the lane to copies that can go.
#include <gtest/gtest.h>

#include "core/simulator_steps.h"

namespace {

using namespace hydra::core::simulated;

HostJob job(int task, int shard, double start, double seconds) {
  HostJob j{task, shard, start, seconds, true};
  j.start = start;
  return j;
}

TEST(SimulatorLanding, AGradientWaitsWhileItsTasksJobsHoldEveryBuffer) {
  const hydra::core::SimulationConfig config;
  StepState steps(config);
  // Task 0's jobs end at 1, 2, 3 and 4; task 1's one at 10.
  for (int shard = 0; shard < 4; ++shard) steps.host_jobs.push_back(job(0, shard, shard, 1.0));
  steps.host_jobs.push_back(job(1, 0, 4.0, 6.0));
  EXPECT_DOUBLE_EQ(landing_free(steps, 0, 0.5), 2.0) << "four held past 0.5: the second to end frees the third";
  EXPECT_DOUBLE_EQ(landing_free(steps, 0, 1.5), 2.0) << "three held past 1.5: the first to end frees one";
  EXPECT_DOUBLE_EQ(landing_free(steps, 0, 2.5), 2.5) << "two held: one is free";
  EXPECT_DOUBLE_EQ(landing_free(steps, 1, 0.0), 0.0) << "another task's jobs hold none of its buffers";
  // A job split by a lower one's (its first piece, then its rest) holds one buffer, not two.
  steps.host_jobs = {job(0, 3, 0.0, 1.0), job(0, 2, 1.0, 1.0), job(0, 3, 2.0, 1.0)};
  steps.host_jobs[0].split = true;
  EXPECT_DOUBLE_EQ(landing_free(steps, 0, 0.5), 0.5);
}

TEST(SimulatorLanding, ACopyThatWaitsLeavesTheLaneToCopiesThatCanGo) {
  CopyOutLane lane;
  EXPECT_DOUBLE_EQ(lane.place(0.0, 5.0, 1.0), 6.0);  // waits for a buffer until 5
  EXPECT_DOUBLE_EQ(lane.place(1.0, 1.0, 2.0), 3.0);  // fits before it
  EXPECT_DOUBLE_EQ(lane.place(2.0, 2.0, 2.5), 8.5);  // 3-5 is too short: after the waiting one
  EXPECT_DOUBLE_EQ(lane.place(3.0, 3.0, 1.0), 4.0);  // 3-4 is free
  EXPECT_DOUBLE_EQ(lane.last_end, 8.5);
  EXPECT_DOUBLE_EQ(lane.place(9.0, 9.0, 1.0), 10.0);
  EXPECT_EQ(lane.busy.size(), 1u) << "copies ended by the device's latest unit are forgotten";
}

}  // namespace
