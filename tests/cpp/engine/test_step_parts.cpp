// A step taken part by part (step_parts): the parts cover the ranges exactly, and stepping them one after another
// gives the one call's result bit for bit, wherever the parts cut.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "device_engine_helpers.h"
#include "engine/optimizer_step.h"

namespace {

using hydra::engine::kPartElementsPerThread;
using hydra::engine::OptimizerSpec;
using hydra::engine::range_elements;
using hydra::engine::step_parts;
using hydra::engine::StepRange;

// Three ranges of different steps and groups, the second and third starting where a shard's padding leaves them.
// The process's thread count, set for one test and put back after it.
class Threads {
 public:
  explicit Threads(int threads) : before_(at::get_num_threads()) { at::set_num_threads(threads); }
  ~Threads() { at::set_num_threads(before_); }

 private:
  const int before_;
};

const std::vector<StepRange> kRanges = {
    {0, 100, 3, 1e-3, 0.01}, {112, 400112, 3, 2e-3, 0.0}, {400128, 700128, 1, 1e-3, 0.01}};

// A range of 2.1M elements: with one thread, parts of an eighth (262528 elements: 262500 rounded up to 64).
const std::vector<StepRange> kLong = {{16, 2100016, 2, 1e-3, 0.0}};

TEST(StepParts, CoverTheRangesInOrderInPartsOfAnEighthOrOfTheThreadsGrain) {
  for (const auto& [ranges, threads] : std::vector<std::pair<std::vector<StepRange>, int>>{
           {kRanges, 1}, {kRanges, 2}, {kLong, 1}}) {
    SCOPED_TRACE(threads);
    const Threads set(threads);
    const std::vector<std::vector<StepRange>> parts = step_parts(ranges);
    const int64_t total = range_elements(ranges);
    const int64_t part = (std::max(kPartElementsPerThread * threads, (total + 7) / 8) + 63) / 64 * 64;
    ASSERT_EQ(static_cast<int64_t>(parts.size()), (total + part - 1) / part);
    std::vector<StepRange> joined;
    for (size_t i = 0; i < parts.size(); ++i) {
      EXPECT_EQ(range_elements(parts[i]), i + 1 < parts.size() ? part : total - part * (parts.size() - 1));
      for (const StepRange& r : parts[i]) {
        if (!joined.empty() && joined.back().end == r.begin && joined.back().step == r.step &&
            joined.back().lr == r.lr) {
          joined.back().end = r.end;  // a range cut between parts, joined again
        } else {
          joined.push_back(r);
        }
      }
    }
    ASSERT_EQ(joined.size(), ranges.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
      EXPECT_EQ(joined[i].begin, ranges[i].begin);
      EXPECT_EQ(joined[i].end, ranges[i].end);
      EXPECT_EQ(joined[i].step, ranges[i].step);
      EXPECT_EQ(joined[i].lr, ranges[i].lr);
      EXPECT_EQ(joined[i].weight_decay, ranges[i].weight_decay);
    }
  }
  {
    const Threads one(1);
    EXPECT_EQ(step_parts(kLong).front().front().end - 16, 262528) << "an eighth of 2.1M, rounded up to 64";
  }
  EXPECT_TRUE(step_parts({}).empty());
}

TEST(StepParts, SteppedOneAfterAnotherTheyGiveTheOneCallsResultBitForBit) {
  ASSERT_TRUE(engine_test::op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  const Threads one(1);  // parts of 128k elements: several, and cut inside ranges
  OptimizerSpec spec;
  spec.decoupled_weight_decay = true;
  const int64_t numel = kRanges.back().end + 16;
  const at::Tensor grad = engine_test::values({numel}, 1.0);
  auto state = [&](double seed) {
    return std::vector<at::Tensor>{engine_test::values({numel}, seed),
                                   engine_test::values({numel}, seed + 1.0).abs()};
  };
  const at::Tensor master = engine_test::values({numel}, 4.0);
  at::Tensor whole = master.clone(), by_parts = master.clone();
  std::vector<at::Tensor> whole_states = state(2.0), part_states = state(2.0);
  at::Tensor whole_shadow = at::empty({numel}, at::kBFloat16), part_shadow = at::empty({numel}, at::kBFloat16);
  hydra::engine::step_ranges(spec, whole, grad, whole_states, whole_shadow, kRanges, 0.5, 0.9);
  for (const std::vector<StepRange>& part : step_parts(kRanges))
    hydra::engine::step_ranges(spec, by_parts, grad, part_states, part_shadow, part, 0.5, 0.9);
  EXPECT_TRUE(at::equal(whole, by_parts));
  EXPECT_FALSE(at::equal(whole, master)) << "the step changed nothing";
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(whole_states[k], part_states[k])) << "state " << k;
  for (const StepRange& r : kRanges)
    EXPECT_TRUE(at::equal(whole_shadow.narrow(0, r.begin, r.end - r.begin),
                          part_shadow.narrow(0, r.begin, r.end - r.begin)));
}

}  // namespace
