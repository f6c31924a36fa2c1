// DeviceLoop: a unit's shard visit as one begin() and one end(), models found by the scheduler's task ids.
#include <chrono>
#include <optional>
#include <stdexcept>
#include <utility>

#include "core/scheduler.h"
#include "device_engine_helpers.h"
#include "engine/device_loop.h"
#include "engine/spilled_model.h"
#include "manual_fence.h"

namespace {

using namespace engine_test;
using hydra::core::Phase;
using hydra::core::PolicyKind;
using hydra::core::Scheduler;
using hydra::core::TaskSpec;
using hydra::core::Unit;
using hydra::engine::BackwardDone;
using hydra::engine::DeviceLoop;
using hydra::engine::HostWorker;
using hydra::engine::LoopOptions;
using hydra::engine::testing::ManualFence;
using namespace std::chrono_literals;

constexpr int kShards = 4;

bool is_backward(const Unit& unit) { return unit.phase == Phase::kForwardBackward || unit.phase == Phase::kBackward; }

// How a backward's step is taken: at the backward, or by clip_and_step after the last one, the gradients kept
// as they landed (one micro-batch a step) or summed (several).
enum class Clipping { kNone, kKept, kSummed };

// Runs `unit` through the loop, its parameters bound to the master values (but a resident shard's, which steps on
// the device and not in the master), writing a backward's gradients as run_step does and stepping (clipped:
// leaving the step to clip_and_step); then completes it.
void run_unit(Scheduler& scheduler, DeviceLoop& loop, ShardStore& store, const Unit& unit,
              Clipping clipping = Clipping::kNone, bool resident = false) {
  loop.begin(unit);
  if (!resident) expect_bound_to_master(store, unit.shard);
  std::optional<BackwardDone> backward;
  if (is_backward(unit)) {
    write_grads(store, unit.shard);
    const bool clipped = clipping != Clipping::kNone;
    backward = BackwardDone{/*step=*/!clipped, /*lr_scale=*/1.0, /*keep=*/clipping == Clipping::kKept,
                            /*clip_follows=*/clipped};
  }
  loop.end(unit, backward);
  scheduler.complete(0, unit, 0.01);
}

// Runs every unit the scheduler hands device 0 through the loop; steps at the end of every micro-batch.
void run_through_loop(Scheduler& scheduler, DeviceLoop& loop, DeviceEngine& engine, const std::vector<int>& task_models,
                      const std::vector<ShardStore*>& stores) {
  while (std::optional<Unit> unit = scheduler.try_next(0)) run_unit(scheduler, loop, *stores[unit->task], *unit);
  for (int model : task_models) engine.finish(model);
}

// One spilled model of kShards shards as task 0 (no task: `task` -1), on a roomy CPU engine, and its loop.
struct OneTask {
  explicit OneTask(int64_t budget = 1 << 20, int task = 0)
      : engine(kCpu, budget), model(engine.add_model(store, DeviceEngine::Residency::kSpilled, task)) {}
  std::shared_ptr<ShardStore> store = equal_shards(kShards);
  DeviceEngine engine;
  const int model;
  Scheduler scheduler{{TaskSpec{kShards, 1, std::nullopt}}, 1, PolicyKind::kLrtf};
  DeviceLoop loop{scheduler, engine, 0, LoopOptions{}};
  const Unit first = *scheduler.try_next(0);  // F(0)
};

TEST(DeviceLoop, TrainsAsTheEngineCallsItStandsFor) {
  if (!op_registered("hydra::adam_step")) GTEST_SKIP() << "hydra::adam_step is not registered in this build";
  auto direct = equal_shards(kShards);
  auto looped = equal_shards(kShards);
  DeviceEngine reference(kCpu, tight_budget(*direct) + 1024);
  const int r = reference.add_model(direct, DeviceEngine::Residency::kSpilled);
  run_step(reference, r, *direct, 1, /*check_values=*/true, /*step=*/true);
  run_step(reference, r, *direct, 1, /*check_values=*/true, /*step=*/true);
  reference.finish(r);

  DeviceEngine engine(kCpu, tight_budget(*looped) + 1024);
  const int m = engine.add_model(looped, DeviceEngine::Residency::kSpilled, /*task=*/0);
  Scheduler scheduler({TaskSpec{kShards, /*micro_batches=*/2, std::nullopt}}, 1, PolicyKind::kLrtf);
  DeviceLoop loop(scheduler, engine, 0, LoopOptions{});
  run_through_loop(scheduler, loop, engine, {m}, {looped.get()});

  for (int s = 0; s < kShards; ++s) {
    EXPECT_TRUE(at::equal(looped->master(s), direct->master(s))) << "shard " << s;
    EXPECT_FALSE(at::equal(looped->master(s), equal_shards(kShards)->master(s))) << "shard " << s << " stepped";
  }
}

TEST(DeviceLoop, FindsEachTasksModelByTheSchedulersId) {
  if (!op_registered("hydra::adam_step")) GTEST_SKIP() << "hydra::adam_step is not registered in this build";
  auto first = equal_shards(kShards), second = equal_shards(kShards, 20);
  DeviceEngine engine(kCpu, 1 << 20);
  // Registered in the opposite order to their tasks: model ids and task ids differ.
  const int model_of_task1 = engine.add_model(second, DeviceEngine::Residency::kSpilled, 1);
  const int model_of_task0 = engine.add_model(first, DeviceEngine::Residency::kSpilled, 0);
  ASSERT_EQ(engine.model_of(0), model_of_task0);
  ASSERT_EQ(engine.model_of(1), model_of_task1);
  EXPECT_EQ(engine.model_of(2), -1);

  Scheduler scheduler({TaskSpec{kShards, 1, std::nullopt}, TaskSpec{kShards, 1, std::nullopt}}, 1, PolicyKind::kFifo);
  DeviceLoop loop(scheduler, engine, 0, LoopOptions{});
  run_through_loop(scheduler, loop, engine, {model_of_task0, model_of_task1}, {first.get(), second.get()});
  // Each store saw exactly its own task's visits: a forward and a backward per shard, the last shard once.
  EXPECT_EQ(engine.shard_loads(model_of_task0), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(engine.shard_loads(model_of_task1), (std::vector<int64_t>{1, 1, 1, 1}));

  engine.release_model(model_of_task1);
  EXPECT_EQ(engine.model_of(1), -1) << "a released model is no task's any more";
  EXPECT_EQ(engine.model_of(0), model_of_task0);
}

TEST(DeviceLoop, BeginPlansAndPrefetchesTheNextPlannedShard) {
  // Room for two shards' weights beside one shard's gradients: the next planned shard can come in.
  const auto sized = equal_shards(kShards);
  OneTask t(tight_budget(*sized) + DeviceEngine::min_spilled_bytes(*sized) + 2048);
  t.loop.begin(t.first);
  EXPECT_EQ(t.engine.shard_loads(t.model), (std::vector<int64_t>{1, 1, 0, 0})) << "shard 1's forward is planned next";
  EXPECT_GT(t.loop.end(t.first, std::nullopt), 0) << "the bytes copied in since begin";
}

// A spilled task whose step was just queued cannot start its next forward before the step is done: the loop
// holds it, and the device runs another task meanwhile. Once the step is done the task is released.
// Stepping at its last backward or, clipped, at clip_and_step right after it, whether its gradients were kept
// as they landed or summed; with every shard spilled, or with shard 0 resident (stepped on the device, so the
// forward first waits at shard 1, the first stepped on the host).
TEST(DeviceLoop, ATaskWhoseStepIsRunningWaitsWhileAnotherTaskRuns) {
  if (!op_registered("hydra::adam_step")) GTEST_SKIP() << "hydra::adam_step is not registered in this build";
  for (const bool resident_first : {false, true})
  for (const bool hold : {false, true})
  for (const Clipping clipping : {Clipping::kNone, Clipping::kKept, Clipping::kSummed}) {
    const bool clipped = clipping != Clipping::kNone;
    SCOPED_TRACE(testing::Message() << (resident_first ? "shard 0 resident, " : "")
                                    << (hold ? "holding" : "not holding")
                                    << (clipped ? (clipping == Clipping::kKept ? ", clipped, kept" : ", clipped, summed")
                                                : ""));
    auto first = equal_shards(kShards), second = equal_shards(kShards, 20);
    auto host_steps = std::make_shared<HostWorker>(1);
    DeviceEngine engine(kCpu, 1 << 20, host_steps);
    const std::vector<int> resident = resident_first ? std::vector<int>{0} : std::vector<int>{};
    engine.add_model(first, DeviceEngine::Residency::kSpilled, 0, resident);
    engine.add_model(second, DeviceEngine::Residency::kSpilled, 1);
    const int first_on_host = resident_first ? 1 : 0;  // the first shard the next forward copies in
    // Task 0 has the longer chain: LRTF goes back to it after its first step, unless it is held.
    Scheduler scheduler({TaskSpec{kShards, 3, std::nullopt}, TaskSpec{kShards, 1, std::nullopt}}, 1,
                        PolicyKind::kLrtf);
    LoopOptions options;
    options.hold_for_steps = hold;
    DeviceLoop loop(scheduler, engine, 0, options);
    scheduler.hold(1, true);  // the test's own hold: task 0's first micro-batch runs alone
    ManualFence gate;
    for (;;) {
      const Unit unit = *scheduler.try_next(0);
      ASSERT_EQ(unit.task, 0);
      const bool last = unit.phase == Phase::kBackward && unit.shard == 0;
      if (!clipped && unit.phase == Phase::kBackward && unit.shard == first_on_host) {
        // That shard's host step waits behind the gate: urgent, so that it is the front job, which the worker's one
        // thread takes in turn (a chained job that can start may otherwise be taken out of turn before it).
        host_steps->submit([fence = gate.fence]() -> hydra::engine::DeviceEvent {
          fence.wait();
          return nullptr;
        }, /*urgent=*/true);
      }
      run_unit(scheduler, loop, *first, unit, clipping, resident_first && unit.shard == 0);
      // As the runner: the norm of the gradients kept, then every shard's step, queued behind the gradient jobs
      // (ungated by the loss: the runner reads it first). The task is held from its last backward until its next
      // begin at least.
      if (last && clipped) engine.clip_and_step(0, /*max_norm=*/1.0, 1.0);
      if (last) break;
    }
    scheduler.hold(1, false);
    const Unit next = *scheduler.try_next(0);
    EXPECT_EQ(next.task, hold ? 1 : 0) << "while task 0's step runs, task 1 goes first";
    gate.finish();
    ASSERT_TRUE(hydra::engine::testing::ready_within(first->last_step(first_on_host), 10s));
    run_unit(scheduler, loop, next.task == 0 ? *first : *second, next, Clipping::kNone,
             resident_first && next.task == 0 && next.shard == 0);  // its begin releases task 0
    if (hold) EXPECT_EQ(scheduler.try_next(0)->task, 0) << "released, the longer task comes back first";
    engine.synchronize(0);
    engine.synchronize(1);
  }
}

TEST(DeviceLoop, EndReleasesTheShardEvenWhenTheBackwardReportFails) {
  OneTask t;
  ASSERT_EQ(t.first.phase, Phase::kForward);
  t.loop.begin(t.first);
  // A forward holds no gradients: reporting a backward for it is refused...
  EXPECT_THROW(t.loop.end(t.first, BackwardDone{}), c10::Error);
  // ...and the shard is released all the same: it can be acquired again.
  EXPECT_NO_THROW(t.engine.acquire(t.model, t.first.shard, false));
  t.engine.release(t.model, t.first.shard);
}

TEST(DeviceLoop, BeginRefusesATaskWithoutAModelHereHoldingNothing) {
  OneTask t(1 << 20, /*task=*/-1);  // as a model a test drives by hand
  EXPECT_THROW(t.loop.begin(t.first), c10::Error);
  EXPECT_EQ(t.loop.end(t.first, std::nullopt), 0) << "no visit is open: the worker's end after a failure does nothing";
  EXPECT_THROW(t.loop.end(t.first, BackwardDone{}), c10::Error) << "a backward of a shard never acquired";
  EXPECT_THROW(DeviceLoop(t.scheduler, t.engine, 1, LoopOptions{}), c10::Error) << "the scheduler runs one device";
}

TEST(DeviceLoop, AVisitEndsBeforeTheNextBegins) {
  OneTask t;
  t.loop.begin(t.first);
  EXPECT_THROW(t.loop.begin(t.first), c10::Error);
  Unit other = t.first;
  other.shard = 1;
  EXPECT_THROW(t.loop.end(other, std::nullopt), c10::Error) << "another shard's unit cannot end this visit...";
  EXPECT_NO_THROW(t.engine.acquire(t.model, t.first.shard, false)) << "...and the shard it held is released";
  t.engine.release(t.model, t.first.shard);
  EXPECT_EQ(t.loop.end(t.first, std::nullopt), 0) << "the visit is closed";
}

// Every shard of a spilled model stepped on the device after each backward, through the loop (the state prefetched
// as each backward's unit begins, before its weights and gradients are placed), at a budget of exactly the working
// set add_model counts for a unit and its step: where the prefetched state leaves the shard no room in one piece, it
// goes and the acquire is tried again, and where the step then finds no room for its state, that step runs on the
// host. The model ends as one stepped on the host throughout, and every step ran once.
TEST(DeviceLoop, AtTheExactBudgetForDeviceStepsEveryStepRunsOnceOnTheDeviceOrTheHost) {
  if (!op_registered("hydra::adam_step")) GTEST_SKIP() << "hydra::adam_step is not registered in this build";
  const std::vector<int> device{0, 1, 2, 3};
  auto run = [&](const std::vector<int>& stepped, int64_t budget) {
    auto store = equal_shards(kShards);
    store->set_steps_after_each_backward(true);
    DeviceEngine engine(kCpu, budget > 0 ? budget : hydra::engine::SpilledModel::spilled_need(*store, {}, nullptr,
                                                                                              stepped));
    const int m = engine.add_model(store, DeviceEngine::Residency::kSpilled, /*task=*/0, {}, -1, stepped);
    Scheduler scheduler({TaskSpec{kShards, /*micro_batches=*/3, std::nullopt}}, 1, PolicyKind::kLrtf);
    DeviceLoop loop(scheduler, engine, 0, LoopOptions{});
    while (std::optional<Unit> unit = scheduler.try_next(0)) {
      loop.begin(*unit, /*step_follows=*/is_backward(*unit));
      std::optional<BackwardDone> backward;
      if (is_backward(*unit)) {
        write_grads(*store, unit->shard);
        backward = BackwardDone{/*step=*/true, /*lr_scale=*/1.0, /*keep=*/false, /*clip_follows=*/false};
      }
      loop.end(*unit, backward);
      scheduler.complete(0, *unit, 0.01);
    }
    engine.finish(m);  // every step done and logged
    int64_t on_host = 0;
    for (const hydra::engine::StepRecord& r : engine.step_log()) on_host += r.place == hydra::engine::StepPlace::kHost;
    EXPECT_EQ(engine.stats().device_steps + on_host, 3 * kShards) << "every step once";
    return std::pair{store, on_host};
  };
  const auto [host, all_on_host] = run({}, 1 << 20);
  EXPECT_EQ(all_on_host, 3 * kShards);
  const auto [tight, fell_back] = run(device, 0);
  EXPECT_GT(fell_back, 0) << "the exact budget fragments: some step fell back on the host";
  for (int s = 0; s < kShards; ++s) EXPECT_TRUE(at::equal(tight->master(s), host->master(s))) << "shard " << s;
}

}  // namespace
