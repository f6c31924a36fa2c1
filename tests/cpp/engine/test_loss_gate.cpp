// The commit gate (LossGate): a step whose loss is not finite is skipped on every shard, spilled or resident,
// with its step counts taken back, so that training could go on exactly as if it had never been submitted.
#include <limits>

#include "device_engine_helpers.h"

namespace engine_test {
namespace {

// Spilled: the tied model (a borrowed parameter, frozen ones); resident: three linear shards (run_step's
// gradients overwrite, so a tied weight's one resident gradient buffer would not hold its sum).
std::shared_ptr<ShardStore> model(bool resident) {
  OptimizerSpec adam;
  adam.lr = 1e-2;
  if (resident) return make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30)}, false, adam);
  return make_store(TiedModel().shards(), false, adam);
}

// Adam, each step gated by the loss given for it; a skipped step is followed by discard_grads, as the runner
// does after it.
Trained train(bool resident, const std::vector<double>& losses, int micro_batches) {
  auto store = model(resident);
  DeviceEngine engine(kCpu, resident ? int64_t{1} << 24 : tight_budget(*store));
  const int m = engine.add_model(store);
  EXPECT_EQ(engine.resident(m), resident);
  for (double loss : losses) {
    engine.watch_loss(m, at::scalar_tensor(loss));
    run_step(engine, m, *store, micro_batches, /*check_values=*/false, /*step=*/true);
    if (!std::isfinite(loss)) engine.discard_grads(m);
  }
  return finish_and_copy(engine, m, *store);
}

TEST(LossGate, AClosedGateSkipsTheStepOnEveryShardAndTakesItsCountsBack) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (const bool resident : {false, true}) {
    // run_step's gradients overwrite: a resident shard's one gradient buffer cannot hold two micro-batches.
    for (const int micro_batches : resident ? std::vector<int>{1} : std::vector<int>{1, 2}) {
      for (const double bad : {nan, inf, -inf}) {
        SCOPED_TRACE(testing::Message() << (resident ? "resident" : "spilled") << ", " << micro_batches
                                        << " micro-batches, loss " << bad);
        const Trained stopped = train(resident, {0.5, bad}, micro_batches);
        const Trained one_step = train(resident, {0.5}, micro_batches);
        expect_same(stopped, one_step);
        EXPECT_EQ(stopped.steps, std::vector<int64_t>(3, 1));
        // And the next step is the second, as if the skipped one had never been submitted.
        expect_same(train(resident, {0.5, bad, 0.25}, micro_batches), train(resident, {0.5, 0.25}, micro_batches));
      }
    }
  }
}

TEST(LossGate, AnOpenGateStepsAsWithoutOne) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  for (const bool resident : {false, true}) {
    SCOPED_TRACE(resident ? "resident" : "spilled");
    const Trained gated = train(resident, {0.5, 1e30, -3.0}, 1);
    EXPECT_EQ(gated.steps, std::vector<int64_t>(3, 3));
    auto store = model(resident);
    DeviceEngine engine(kCpu, resident ? int64_t{1} << 24 : tight_budget(*store));
    const int m = engine.add_model(store);
    for (int step = 0; step < 3; ++step) run_step(engine, m, *store, 1, false, true);
    engine.snapshot(m);
    for (int s = 0; s < 3; ++s) EXPECT_TRUE(at::equal(store->master(s), gated.master[s])) << "shard " << s;
    engine.finish(m);
  }
}

TEST(LossGate, TheLossIsReadAsComputedAndMustBeOneElement) {
  auto store = equal_shards(2);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  at::Tensor loss = at::scalar_tensor(2.5, at::kFloat);
  const auto reading = engine.watch_loss(m, loss);
  loss.fill_(7.0);  // the caller's tensor may change afterwards: the gate holds the value it was given
  EXPECT_EQ(reading->value(), 2.5);
  EXPECT_TRUE(reading->open());
  EXPECT_THROW(engine.watch_loss(m, at::ones({2})), c10::Error);
  EXPECT_EQ(store->loss_gate(), reading);
}

}  // namespace
}  // namespace engine_test
