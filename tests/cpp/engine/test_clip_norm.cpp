// Global-norm clipping (DeviceEngine::clip_and_step): a spilled model's norm and steps are queued behind its
// gradient jobs, not waited for; a non-finite norm skips the step on every shard, spilled or resident, as if it
// had never been taken.
#include <chrono>
#include <future>
#include <limits>

#include "device_engine_helpers.h"
#include "engine/gradient_norm.h"
#include "manual_fence.h"

namespace engine_test {
namespace {

using hydra::engine::ClipNorm;
using hydra::engine::DeviceEvent;
using hydra::engine::HostWorker;
using hydra::engine::testing::ManualFence;
using namespace std::chrono_literals;

OptimizerSpec adam() {
  OptimizerSpec spec;
  spec.lr = 1e-2;
  return spec;
}

// Spilled: the tied model (a borrowed parameter, frozen ones); resident: three linear shards (run_step's
// gradients overwrite, so a tied weight's one resident gradient buffer would not hold its sum).
std::shared_ptr<ShardStore> model(bool resident, bool bf16 = false) {
  if (resident) return make_store({linear_shard(0, 30), linear_shard(1, 30), linear_shard(2, 30)}, bf16, adam());
  return make_store(TiedModel().shards(), bf16, adam());
}

// write_grads' gradients, with one element of shard 1's first trainable parameter set to `bad`.
std::function<void(ShardStore&, int)> grads_with(double bad) {
  return [bad](ShardStore& store, int s) {
    write_grads(store, s);
    if (s != 1) return;
    for (const ParamEntry& e : store.layout(s))
      if (e.trainable) {
        e.param.mutable_grad().view(-1)[0] = bad;
        return;
      }
  };
}

// One micro-batch a step, clipped at 0.75; each step's gradients as grads_with(bad) for its entry of `bad`
// (0: none). Returns the state reached and every step's norm.
std::pair<Trained, std::vector<double>> train_clipped(bool resident, bool bf16, const std::vector<double>& bad) {
  auto store = model(resident, bf16);
  DeviceEngine engine(kCpu, resident ? int64_t{1} << 24 : tight_budget(*store));
  const int m = engine.add_model(store);
  EXPECT_EQ(engine.resident(m), resident);
  std::vector<double> norms;
  for (const double b : bad) {
    run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/false, 1.0, /*keep=*/true,
             b == 0 ? std::function<void(ShardStore&, int)>(write_grads) : grads_with(b));
    norms.push_back(engine.clip_and_step(m, /*max_norm=*/0.75)->value());
  }
  return {finish_and_copy(engine, m, *store), norms};
}

TEST(ClipNorm, ASpilledModelsNormAndStepsAreQueuedBehindItsGradientsNotWaitedFor) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  auto host_steps = std::make_shared<HostWorker>(1);
  auto store = model(/*resident=*/false);
  DeviceEngine engine(kCpu, DeviceEngine::min_spilled_bytes(*store) * 4, host_steps);
  const int m = engine.add_model(store);
  ManualFence busy;  // the one host-step thread is busy until this finishes: no gradient job can run
  host_steps->submit([fence = busy.fence]() -> DeviceEvent {
    fence.wait();
    return nullptr;
  });
  run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/false, 1.0, /*keep=*/true);
  auto clipping = std::async(std::launch::async, [&] { return engine.clip_and_step(m, /*max_norm=*/0.75); });
  const bool returned = clipping.wait_for(10s) == std::future_status::ready;
  const std::shared_ptr<ClipNorm> norm = returned ? clipping.get() : nullptr;
  EXPECT_TRUE(norm && !norm->ready()) << "no gradient has been accumulated yet";
  busy.finish();
  ASSERT_TRUE(returned) << "clip_and_step waited for the gradient jobs";
  for (int s = 0; s < 3; ++s) EXPECT_EQ(store->steps_taken(s), 1) << "every shard's step is queued";
  double want = 0.0;
  for (const at::Tensor& g : expected_grads(*store, 1)) want += g.to(at::kDouble).square().sum().item<double>();
  EXPECT_NEAR(norm->value(), std::sqrt(want), 1e-12 * std::sqrt(want));
  // The same steps as when the norm was known before they were queued (the gradients are the same).
  const Trained queued = finish_and_copy(engine, m, *store);
  const auto [known, norms] = train_clipped(/*resident=*/false, /*bf16=*/false, {0.0});
  EXPECT_EQ(norms.front(), norm->value());
  expect_same(queued, known);
}

TEST(ClipNorm, ANonFiniteNormSkipsEveryShardsStepAsIfItHadNeverBeenTaken) {
  ASSERT_TRUE(op_registered("hydra::adam_step")) << "the engine tests link the op registrations";
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  for (const bool resident : {false, true}) {
    for (const bool bf16 : {false, true}) {
      for (const double bad : {nan, inf}) {
        SCOPED_TRACE(testing::Message() << (resident ? "resident" : "spilled") << (bf16 ? ", bf16" : ", fp32")
                                        << ", a gradient " << bad);
        const auto [skipped, norms] = train_clipped(resident, bf16, {0.0, bad, 0.0});
        EXPECT_FALSE(std::isfinite(norms[1]));
        EXPECT_EQ(skipped.steps, std::vector<int64_t>(3, 2));
        const auto [two, two_norms] = train_clipped(resident, bf16, {0.0, 0.0});
        expect_same(skipped, two);
        EXPECT_EQ(norms[2], two_norms[1]) << "nothing of the skipped step's gradients was left behind";
      }
    }
  }
}

TEST(ClipNorm, AfterAFailedHostJobOfTheModelNoNormIsTakenAndNoShardSteps) {
  // Shard 1's host job fails (its step: the op rejects a negative learning rate), so its gradient may be
  // incomplete; the norm would be finite, and shard 0 would step, if the failure were not seen.
  OptimizerSpec bad;
  bad.lr = -1.0;
  auto store = make_store({linear_shard(0, 30), linear_shard(1, 30)}, /*bf16=*/false, bad);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  engine.plan(m, {1, 0});
  engine.acquire(m, 1, true);
  write_grads(*store, 1);
  engine.backward_done(m, 1, /*step=*/true);  // a job that throws
  engine.release(m, 1);
  engine.acquire(m, 0, true);
  write_grads(*store, 0);
  engine.backward_done(m, 0, /*step=*/false);
  engine.release(m, 0);
  const at::Tensor before = store->master(0).clone();
  const std::shared_ptr<ClipNorm> norm = engine.clip_and_step(m, /*max_norm=*/1.0);
  EXPECT_THROW(norm->value(), c10::Error);
  EXPECT_THROW(engine.synchronize(m), c10::Error);
  EXPECT_TRUE(at::equal(store->master(0), before)) << "shard 0 stepped after its model's failed job";
  EXPECT_EQ(store->steps_taken(0), 0);
}

TEST(ClipNorm, AMaxNormThatIsNotPositiveIsAnErrorThatChangesNothing) {
  auto store = model(/*resident=*/false);
  DeviceEngine engine(kCpu, tight_budget(*store));
  const int m = engine.add_model(store);
  run_step(engine, m, *store, 1, /*check_values=*/false, /*step=*/false, 1.0, /*keep=*/true);
  EXPECT_THROW(engine.clip_and_step(m, 0.0), c10::Error);
  EXPECT_THROW(engine.clip_and_step(m, -1.0), c10::Error);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(store->steps_taken(s), 0);
  EXPECT_TRUE(std::isfinite(engine.clip_and_step(m, 1.0)->value()));
  engine.finish(m);
}

TEST(GradientNorm, BuffersATenReducesAreSummedTogether) {
  // Half precision and a strided view go through ATen (on a GPU: every device buffer), read once.
  const std::vector<at::Tensor> grads{at::full({100}, 2.0, at::kHalf), at::full({1000, 2}, 0.5f).t(),
                                      at::full({10}, 3.0f)};
  EXPECT_NEAR(hydra::engine::squared_norm(grads), 400.0 + 500.0 + 90.0, 1e-3);
  EXPECT_EQ(hydra::engine::squared_norm(std::vector<at::Tensor>{}), 0.0);
}

}  // namespace
}  // namespace engine_test
