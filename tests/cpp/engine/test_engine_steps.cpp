// DeviceEngine on the CPU device: resident models, errors of queued host work, the smallest budget, and
// optimizer steps (spilled and resident, scheduled rates, the landed gradient read once).
#include "device_engine_helpers.h"

namespace {

using namespace engine_test;

// ---------------------------------------------------------------------------------------------------------
// DeviceEngine: resident models

TEST(DeviceEngine, ResidentModelLoadsEachShardOnce) {
  TiedModel t;
  auto store = make_store(t.shards());
  const int64_t budget = 1 << 24;
  DeviceEngine engine(kCpu, budget);
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{0, 0, 0})) << "nothing is uploaded before first use";
  for (int cycle = 0; cycle < 5; ++cycle) {
    for (int s = 0; s < 3; ++s) {
      engine.acquire(m, s, cycle % 2 == 1);
      expect_bound_to_master(*store, s);
      engine.prefetch(m, (s + 1) % 3);  // a no-op for resident models
      engine.release(m, s);
    }
  }
  EXPECT_EQ(engine.shard_loads(m), (std::vector<int64_t>{1, 1, 1}));
  // One copy of the tied weight on the device: bound from shard 0 and shard 2 to the same memory.
  engine.acquire(m, 0, false);
  const void* from_owner = t.e.data_ptr();
  engine.release(m, 0);
  engine.acquire(m, 2, false);
  EXPECT_EQ(t.e.data_ptr(), from_owner);
  engine.release(m, 2);
  const auto stats = engine.stats();
  EXPECT_LE(stats.high_water_bytes, budget);
  EXPECT_LE(stats.capacity_bytes, budget);
  EXPECT_GE(stats.high_water_bytes, DeviceEngine::resident_bytes(*store));
  EXPECT_EQ(stats.host_to_device_copies, 3);
}

TEST(DeviceEngine, ResidentGradientsStayOnTheDevice) {
  TiedModel t;
  auto store = make_store(t.shards());
  DeviceEngine engine(kCpu, 1 << 24);
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  engine.acquire(m, 2, true);
  // A tied parameter's gradient is the owner's gradient buffer: one accumulator for every use.
  t.e.mutable_grad().fill_(1.0f);
  engine.backward_done(m, 2, false);
  engine.release(m, 2);
  engine.acquire(m, 0, true);
  EXPECT_TRUE(at::equal(t.e.grad(), at::full({10, 4}, 1.0f)));
  t.e.mutable_grad().add_(2.0f);
  engine.backward_done(m, 0, false);
  engine.release(m, 0);
  engine.synchronize(m);
  EXPECT_TRUE(at::equal(store->grad(0), at::zeros_like(store->grad(0)))) << "the host gradients are not used";
  engine.discard_grads(m);
  engine.acquire(m, 0, true);
  EXPECT_TRUE(at::equal(t.e.grad(), at::zeros({10, 4})));
  engine.release(m, 0);
}

// ---------------------------------------------------------------------------------------------------------
// Errors of queued host work

// A host job that fails: the optimizer step of a spilled shard, while no optimizer op is registered.
// A store whose optimizer step always fails: the op rejects a negative learning rate. Python validates
// hyperparameters first, so only this test can reach the engine with one.
std::shared_ptr<ShardStore> failing_step_shards(int n) {
  std::vector<std::vector<at::Tensor>> shards;
  for (int s = 0; s < n; ++s) shards.push_back(linear_shard(s, 30));
  OptimizerSpec bad;
  bad.lr = -1.0;
  return make_store(shards, /*bf16=*/false, bad);
}

TEST(DeviceEngine, FailedHostStepSurfacesOnSynchronize) {
  auto store = failing_step_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  engine.plan(m, {1, 0});
  engine.acquire(m, 1, true);
  write_grads(*store, 1);  // a step with nothing to update would not reach the op
  engine.backward_done(m, 1, /*step=*/true);
  engine.release(m, 1);
  EXPECT_THROW(engine.synchronize(m), c10::Error);
  EXPECT_NO_THROW(engine.synchronize(m)) << "an error is reported once";
}

TEST(DeviceEngine, FailedHostStepSurvivesLaterSubmissions) {
  auto store = failing_step_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  engine.plan(m, {1, 0});
  engine.acquire(m, 1, true);
  write_grads(*store, 1);
  engine.backward_done(m, 1, /*step=*/true);  // queues a job that throws
  engine.release(m, 1);
  engine.acquire(m, 0, true);  // queues shard 0's copy and waits for it: the failed job has run by now
  engine.backward_done(m, 0, /*step=*/false);  // queues another job for the same model
  engine.release(m, 0);
  EXPECT_THROW(engine.synchronize(m), c10::Error)
      << "the failed step's error was lost: DeviceEngine::submit drops finished fences, failed ones included";
}

// ---------------------------------------------------------------------------------------------------------
// Fragmentation: the smallest accepted budget must be enough to train

TEST(DeviceEngine, SmallestAcceptedBudgetTrainsMixedShardSizes) {
  // Three small shards, then a large one: the forward pass caches the small ones below the large one's
  // weights, leaving the large shard's gradients no contiguous range although the budget was accepted.
  std::vector<std::vector<at::Tensor>> shards = {linear_shard(0, 12), linear_shard(1, 12), linear_shard(2, 12),
                                                 linear_shard(3, 112)};
  auto store = make_store(shards);
  const int64_t budget = tight_budget(*store);
  DeviceEngine engine(kCpu, budget);
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  EXPECT_NO_THROW(run_step(engine, m, *store, 1));
  engine.synchronize(m);
  EXPECT_LE(engine.stats().high_water_bytes, budget);
}

// ---------------------------------------------------------------------------------------------------------
// Optimizer steps: only when the op registrations are linked in

TEST(DeviceEngine, SpilledSgdStepUpdatesTheMasterAndReloads) {
  ASSERT_TRUE(op_registered("hydra::sgd_step")) << "the engine tests link the op registrations";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.5;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30)}, false, sgd);
  std::vector<at::Tensor> before;
  for (int s = 0; s < 3; ++s) before.push_back(store->master(s).clone());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  ASSERT_FALSE(engine.resident(m));
  run_step(engine, m, *store, 1, /*check_values=*/true, /*step=*/true);
  engine.synchronize(m);
  const auto grads = expected_grads(*store, 1);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(store->steps_taken(s), 1);
    EXPECT_TRUE(at::allclose(store->master(s), before[s] - grads[s] * 0.5, 1e-6, 1e-6)) << "shard " << s;
    EXPECT_TRUE(at::equal(store->grad(s), at::zeros_like(store->grad(s))));
  }
  const auto loads = engine.shard_loads(m);
  engine.acquire(m, 1, false);  // the device copy predates the step: reloaded with the new weights
  expect_bound_to_master(*store, 1);
  engine.release(m, 1);
  EXPECT_EQ(engine.shard_loads(m)[1], loads[1] + 1);
}

TEST(DeviceEngine, ResidentSgdStepIsWrittenBackByFinish) {
  ASSERT_TRUE(op_registered("hydra::sgd_step")) << "the engine tests link the op registrations";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.25;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, false, sgd);
  std::vector<at::Tensor> before;
  for (int s = 0; s < 2; ++s) before.push_back(store->master(s).clone());
  DeviceEngine engine(kCpu, 1 << 24);
  const int m = engine.add_model(store);
  ASSERT_TRUE(engine.resident(m));
  run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/true);
  engine.finish(m);
  const auto grads = expected_grads(*store, 1);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(store->steps_taken(s), 1);
    EXPECT_TRUE(at::allclose(store->master(s), before[s] - grads[s] * 0.25, 1e-6, 1e-6)) << "shard " << s;
    for (const ParamEntry& e : store->layout(s))
      EXPECT_TRUE(at::equal(e.param.detach().reshape({-1}), store->master(s).narrow(0, e.master_offset, e.numel)));
  }
}

// A scheduled step (lr_scale: the task's schedule at this step) moves by the scaled rate, spilled and resident,
// through backward_done and through clip_and_step.
TEST(DeviceEngine, StepsUseTheScheduledLearningRate) {
  ASSERT_TRUE(op_registered("hydra::sgd_step")) << "the engine tests link the op registrations";
  OptimizerSpec sgd;
  sgd.kind = OptimizerSpec::Kind::kSgd;
  sgd.lr = 0.5;
  for (const bool resident : {false, true}) {
    for (const bool clipped : {false, true}) {
      SCOPED_TRACE(testing::Message() << (resident ? "resident" : "spilled") << (clipped ? ", clipped" : ""));
      auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, false, sgd);
      std::vector<at::Tensor> before;
      for (int s = 0; s < 2; ++s) before.push_back(store->master(s).clone());
      DeviceEngine engine(kCpu, resident ? int64_t{1} << 24 : tight_budget(*store));
      const int m = engine.add_model(store);
      ASSERT_EQ(engine.resident(m), resident);
      run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/!clipped, /*lr_scale=*/0.25);
      if (clipped) engine.clip_and_step(m, /*max_norm=*/1e9, /*lr_scale=*/0.25);
      engine.finish(m);
      const auto grads = expected_grads(*store, 1);
      for (int s = 0; s < 2; ++s)
        EXPECT_TRUE(at::allclose(store->master(s), before[s] - grads[s] * (0.5 * 0.25), 1e-6, 1e-6)) << "shard " << s;
    }
  }
}

TEST(DeviceEngine, SpilledAdamFirstStepMovesByLearningRate) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  OptimizerSpec adam;
  adam.lr = 1e-2;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, false, adam);
  std::vector<at::Tensor> before;
  for (int s = 0; s < 2; ++s) before.push_back(store->master(s).clone());
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  run_step(engine, m, *store, 1, true, /*step=*/true);
  engine.synchronize(m);
  for (int s = 0; s < 2; ++s) {
    // Step 1 of bias-corrected Adam: m_hat = g, v_hat = g^2, so every trained element moves by lr * sign(g).
    const int64_t n = store->trainable_numel(s);
    const auto grads = expected_grads(*store, 1)[s].narrow(0, 0, n);
    const at::Tensor moved = before[s].narrow(0, 0, n) - grads.sign() * adam.lr;
    EXPECT_TRUE(at::allclose(store->master(s).narrow(0, 0, n), moved, 1e-5, 1e-6)) << "shard " << s;
    EXPECT_EQ(store->steps_taken(s), 1);
  }
}

// The same model and gradients trained once with every shard's step reading its one landed gradient, once
// through the fp32 accumulators (forced by accumulating a zero gradient first): the results must agree
// bit for bit, and only the owner of a borrowed parameter may have spent an accumulator.
TEST(DeviceEngine, SingleMicroBatchStepsReadTheLandedGradientWithoutAnAccumulator) {
  OptimizerSpec adam;
  adam.lr = 1e-2;
  TiedModel single, forced;
  auto direct = make_store(single.shards(), false, adam);
  auto accumulated = make_store(forced.shards(), false, adam);
  for (int s = 0; s < 3; ++s) accumulated->grad(s);  // allocated up front: the step takes the accumulator path
  const int64_t without = direct->host_bytes();
  for (auto* store : {&direct, &accumulated}) {
    DeviceEngine engine(kCpu, tight_budget(**store));
    const int m = engine.add_model(*store);
    for (int step = 0; step < 2; ++step) run_step(engine, m, **store, 1, /*check_values=*/false, /*step=*/true);
    engine.synchronize(m);
  }
  for (int s = 0; s < 3; ++s) {
    EXPECT_TRUE(at::equal(direct->master(s), accumulated->master(s))) << "shard " << s;
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(direct->state(s, k), accumulated->state(s, k))) << s;
    EXPECT_EQ(direct->steps_taken(s), 2);
  }
  EXPECT_TRUE(direct->has_grad(0)) << "shard 0 owns e, which shard 2 borrows: its gradient is a sum";
  EXPECT_FALSE(direct->has_grad(1));
  EXPECT_FALSE(direct->has_grad(2));
  EXPECT_EQ(direct->host_bytes(), without + direct->trainable_numel(0) * 4) << "only shard 0's accumulator was added";
  EXPECT_TRUE(at::equal(direct->grad(0), at::zeros_like(direct->grad(0)))) << "zeroed after its step";
}

// bf16 with clipping and one micro-batch a step: every gradient waits for the global norm. Kept as it landed
// (bf16, 2 bytes a parameter) instead of in an fp32 accumulator (4), the steps must agree bit for bit.
TEST(DeviceEngine, ClippedBf16StepsReadTheKeptGradientsAsTheAccumulatorsWould) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  OptimizerSpec adam;
  adam.lr = 1e-2;
  TiedModel kept_model, summed_model;
  auto kept = make_store(kept_model.shards(), /*bf16=*/true, adam);
  auto summed = make_store(summed_model.shards(), /*bf16=*/true, adam);
  const int64_t before = kept->host_bytes();
  std::vector<double> norms;
  for (auto* store : {&kept, &summed}) {
    DeviceEngine engine(kCpu, tight_budget(**store));
    const int m = engine.add_model(*store);
    for (int step = 0; step < 3; ++step) {
      run_step(engine, m, **store, 1, /*check_values=*/false, /*step=*/false, 1.0, /*keep=*/*store == kept);
      norms.push_back(engine.clip_and_step(m, /*max_norm=*/0.75)->value());
    }
    engine.synchronize(m);
  }
  EXPECT_EQ(std::vector<double>(norms.begin(), norms.begin() + 3), std::vector<double>(norms.begin() + 3, norms.end()));
  for (int s = 0; s < 3; ++s) {
    EXPECT_TRUE(at::equal(kept->master(s), summed->master(s))) << "shard " << s;
    EXPECT_TRUE(at::equal(kept->shadow(s), summed->shadow(s))) << "shard " << s;
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(kept->state(s, k), summed->state(s, k))) << s;
  }
  EXPECT_TRUE(kept->has_grad(0) && !kept->has_kept(0)) << "shard 0 owns e, which shard 2 borrows: a sum";
  for (int s : {1, 2}) EXPECT_TRUE(kept->has_kept(s) && !kept->has_grad(s)) << "shard " << s;
  for (int s = 0; s < 3; ++s) EXPECT_TRUE(summed->has_grad(s) && !summed->has_kept(s)) << "shard " << s;
  EXPECT_EQ(kept->host_bytes(),
            before + kept->trainable_numel(0) * 4 + (kept->trainable_numel(1) + kept->trainable_numel(2)) * 2);
}

// A backward's gradients (for run_step) whose pairwise sums round differently in bf16 than in fp32
// (write_grads' values sum exactly in either).
std::function<void(ShardStore&, int)> rough_grads(int step) {
  return [step](ShardStore& store, int s) {
    const auto& layout = store.layout(s);
    for (size_t i = 0; i < layout.size(); ++i) {
      if (!layout[i].trainable) continue;
      layout[i].param.mutable_grad().copy_(values(layout[i].param.sizes(), 0.37 * step + 1.3 * s + 0.11 * i) * 3);
    }
  };
}

// bf16, one micro-batch a step, no clipping: shard 2's gradient of the tied e is the first of the two shard 0
// steps e with. Kept as it landed, in shard 0's kept buffer (2 bytes a parameter) instead of an fp32
// accumulator (4), it must step e exactly as the accumulator would: summed with shard 0's own in fp32.
TEST(DeviceEngine, ATiedWeightsBorrowedBf16GradientWaitsAsItLandedAndStepsAsTheAccumulatorWould) {
  OptimizerSpec adam;
  adam.lr = 1e-2;
  TiedModel kept_model, summed_model;
  auto kept = make_store(kept_model.shards(), /*bf16=*/true, adam);
  auto summed = make_store(summed_model.shards(), /*bf16=*/true, adam);
  for (int s = 0; s < 3; ++s) summed->grad(s);  // allocated up front: every step takes the accumulator path
  const int64_t before = kept->host_bytes();
  for (auto* store : {&kept, &summed}) {
    DeviceEngine engine(kCpu, tight_budget(**store));
    const int m = engine.add_model(*store);
    for (int step = 0; step < 3; ++step)
      run_step(engine, m, **store, 1, /*check_values=*/false, /*step=*/true, 1.0, /*keep=*/false, rough_grads(step));
    engine.synchronize(m);
  }
  // The two gradients of e (shard 0's entry 0, shard 2's entry 1) sum differently in bf16: a bf16 sum would show.
  const at::Tensor own = (values({10, 4}, 1.3 * 0 + 0.11 * 0) * 3).to(at::kBFloat16);
  const at::Tensor borrowed = (values({10, 4}, 1.3 * 2 + 0.11 * 1) * 3).to(at::kBFloat16);
  ASSERT_FALSE(at::equal((own + borrowed).to(at::kFloat), own.to(at::kFloat) + borrowed.to(at::kFloat)));
  for (int s = 0; s < 3; ++s) {
    EXPECT_TRUE(at::equal(kept->master(s), summed->master(s))) << "shard " << s;
    EXPECT_TRUE(at::equal(kept->shadow(s), summed->shadow(s))) << "shard " << s;
    for (int k = 0; k < 2; ++k) EXPECT_TRUE(at::equal(kept->state(s, k), summed->state(s, k))) << s;
    EXPECT_EQ(kept->steps_taken(s), 3);
    EXPECT_FALSE(kept->has_grad(s)) << "shard " << s << ": no fp32 accumulator";
  }
  EXPECT_TRUE(kept->has_kept(0)) << "shard 2's gradient of e waited in shard 0's kept buffer";
  EXPECT_EQ(kept->host_bytes(), before + kept->trainable_numel(0) * 2);
}

// A borrower's gradient waits as it landed only where it is one of just two a step sums (a third would have to
// be summed in bf16), and in bf16 (an fp32 gradient as it landed takes an accumulator's 4 bytes anyway).
TEST(ShardStore, KeepsABorrowedGradientAsLandedOnlyInBf16WithOneBorrowerATrainableParameter) {
  TiedModel m;  // shard 2 borrows e and the frozen z
  EXPECT_TRUE(ShardStore(m.shards(), OptimizerSpec{}, /*bf16=*/true, false).keeps_borrowed_as_landed());
  EXPECT_FALSE(ShardStore(m.shards(), OptimizerSpec{}, /*bf16=*/false, false).keeps_borrowed_as_landed());
  auto shards = m.shards();
  shards[1].push_back(m.e);
  EXPECT_FALSE(ShardStore(shards, OptimizerSpec{}, true, false).keeps_borrowed_as_landed()) << "e borrowed twice";
  shards = m.shards();
  shards[0].push_back(m.z);
  EXPECT_TRUE(ShardStore(shards, OptimizerSpec{}, true, false).keeps_borrowed_as_landed())
      << "z, borrowed twice, is frozen: it has no gradient to sum";
}

}  // namespace
