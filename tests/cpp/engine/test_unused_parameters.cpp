// DeviceEngine on the CPU device: parameters that receive no gradient are left alone by the step.
#include "device_engine_helpers.h"

namespace {

using namespace engine_test;

// ---------------------------------------------------------------------------------------------------------
// Parameters that receive no gradient: left alone by the step, as torch.optim leaves a parameter whose .grad
// is None (no update, no decay, no state change, no step counted for it)

// The layout entry of the shard that owns `p`.
const ParamEntry& home_entry(const ShardStore& store, const at::Tensor& p) {
  for (int s = 0; s < store.num_shards(); ++s)
    for (const ParamEntry& e : store.layout(s))
      if (e.owner == s && e.param.is_same(p)) return e;
  ADD_FAILURE() << "parameter not owned by any shard";
  static const ParamEntry none{};
  return none;
}

at::Tensor master_of(ShardStore& store, const at::Tensor& p) {
  const ParamEntry& e = home_entry(store, p);
  return store.master(e.owner).narrow(0, e.master_offset, e.numel).view(p.sizes());
}

at::Tensor state_of(ShardStore& store, const at::Tensor& p, int k) {
  const ParamEntry& e = home_entry(store, p);
  return store.state(e.owner, k).narrow(0, e.master_offset, e.numel).view(p.sizes());
}

int64_t steps_of(const ShardStore& store, const at::Tensor& p) {
  const ParamEntry& e = home_entry(store, p);
  return store.param_steps(e.owner, e.owner_index);
}

// Host state up to date: a spilled model's host jobs done, a resident model's device state brought home.
void settle(DeviceEngine& engine, int model) {
  if (engine.resident(model)) {
    engine.finish(model);
  } else {
    engine.synchronize(model);
  }
}

// One backward visit of `shard` in which exactly the listed parameters receive a gradient (`value` added to
// each, as autograd's accumulation does); the shard's other parameters receive none.
void backward_visit(DeviceEngine& engine, int model, int shard, const std::vector<at::Tensor>& receiving,
                    float value, bool step) {
  engine.acquire(model, shard, /*with_grads=*/true);
  for (const at::Tensor& p : receiving) p.mutable_grad().add_(value);
  engine.backward_done(model, shard, step);
  engine.release(model, shard);
}

std::unique_ptr<DeviceEngine> engine_for(const ShardStore& store, bool resident) {
  return std::make_unique<DeviceEngine>(kCpu, resident ? int64_t{1} << 24 : tight_budget(store));
}

class UnusedParameters : public testing::TestWithParam<bool> {
 protected:
  bool resident() const { return GetParam(); }
  DeviceEngine::Residency residency() const {
    return resident() ? DeviceEngine::Residency::kResident : DeviceEngine::Residency::kSpilled;
  }
  void SetUp() override {
    if (!op_registered("hydra::adam_step")) GTEST_SKIP() << "hydra::adam_step is not registered in this build";
  }
};

TEST_P(UnusedParameters, AutogradDecidesWhichParametersStep) {
  // u and v are reached by the first backward, u and s by the second: the middle parameter s takes its first
  // step in the shard's second, v only one.
  at::Tensor u = param({5}, 1.0), s = param({20}, 2.0), v = param({3}, 3.0);
  const at::Tensor s0 = s.detach().clone(), v0 = v.detach().clone();
  const OptimizerSpec adamw = adamw_spec();
  auto store = make_store({{u, s, v}}, false, adamw);
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, residency());
  ASSERT_EQ(engine->resident(m), resident());
  engine->acquire(m, 0, true);
  (u * u).sum().add((v * 3.0).sum()).backward();
  engine->backward_done(m, 0, /*step=*/true);
  engine->release(m, 0);
  engine->acquire(m, 0, true);
  (u * u).sum().add((s * -2.0).sum()).backward();
  engine->backward_done(m, 0, /*step=*/true);
  engine->release(m, 0);
  settle(*engine, m);

  EXPECT_EQ(store->steps_taken(0), 2);
  EXPECT_EQ(steps_of(*store, u), 2);
  EXPECT_EQ(steps_of(*store, s), 1);
  EXPECT_EQ(steps_of(*store, v), 1);
  // A first step is bias-corrected to move by lr against the gradient's sign, after the decay: s took its
  // first in the shard's second step, and v was neither decayed nor moved by the step that gave it nothing.
  const double decay = 1.0 - adamw.lr * adamw.weight_decay;
  EXPECT_TRUE(at::allclose(master_of(*store, s), s0 * decay + adamw.lr, 1e-6, 1e-7)) << master_of(*store, s);
  EXPECT_TRUE(at::allclose(master_of(*store, v), v0 * decay - adamw.lr, 1e-6, 1e-7)) << master_of(*store, v);
  EXPECT_TRUE(at::allclose(state_of(*store, v, 0), at::full({3}, (1.0 - adamw.beta1) * 3.0), 1e-6, 1e-7))
      << "v's moments are those of its one step";
  EXPECT_TRUE(at::allclose(state_of(*store, v, 1), at::full({3}, (1.0 - adamw.beta2) * 9.0), 1e-6, 1e-9));
}

TEST_P(UnusedParameters, ATiedWeightStepsThroughTheBorrowersUseAlone) {
  TiedModel t;  // shard 0 owns e (borrowed by shard 2) and a; shard 1 owns h; shard 2 owns g
  auto store = make_store(t.shards(), false, adamw_spec());
  const at::Tensor e0 = t.e.detach().clone(), a0 = t.a.detach().clone(), h0 = t.h.detach().clone(),
                   g0 = t.g.detach().clone();
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, residency());
  ASSERT_EQ(engine->resident(m), resident());
  engine->plan(m, {2, 1, 0});
  backward_visit(*engine, m, 2, {t.e}, 1.0f, /*step=*/true);  // only the borrower's use of e
  backward_visit(*engine, m, 1, {}, 1.0f, true);
  backward_visit(*engine, m, 0, {}, 1.0f, true);
  settle(*engine, m);
  EXPECT_FALSE(at::equal(master_of(*store, t.e), e0)) << "e received a gradient through shard 2";
  EXPECT_EQ(steps_of(*store, t.e), 1);
  for (const auto& [p, before] : {std::pair{t.a, a0}, std::pair{t.h, h0}, std::pair{t.g, g0}}) {
    EXPECT_TRUE(at::equal(master_of(*store, p), before));
    EXPECT_EQ(steps_of(*store, p), 0);
    EXPECT_TRUE(at::equal(state_of(*store, p, 0), at::zeros_like(p)));
  }
  for (int s = 0; s < 3; ++s) EXPECT_EQ(store->steps_taken(s), 1) << "shard " << s;
}

TEST_P(UnusedParameters, AGradientInAnyMicroBatchCountsAndDiscardedOnesDoNot) {
  at::Tensor a = param({7}, 1.0), b = param({9}, 2.0);
  auto store = make_store({{a, b}}, false, adamw_spec());
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, residency());
  backward_visit(*engine, m, 0, {a}, 1.0f, /*step=*/false);  // first micro-batch: a only
  backward_visit(*engine, m, 0, {b}, 1.0f, /*step=*/true);   // last micro-batch: b only
  // A micro-batch that failed: its gradient is discarded and must not make a step.
  backward_visit(*engine, m, 0, {a}, 1.0f, false);
  engine->discard_grads(m);
  // After the first step: a resident model's weights are the device values a is bound to, a spilled one's
  // the host master.
  const at::Tensor a1 = (resident() ? a.detach() : master_of(*store, a)).clone();
  backward_visit(*engine, m, 0, {}, 1.0f, true);
  settle(*engine, m);
  EXPECT_EQ(steps_of(*store, a), 1);
  EXPECT_EQ(steps_of(*store, b), 1);
  EXPECT_EQ(store->steps_taken(0), 2);
  EXPECT_TRUE(at::equal(master_of(*store, a), a1)) << "the second step left a alone";
}

TEST_P(UnusedParameters, ClippedStepsLeaveParametersWithoutAGradient) {
  at::Tensor x = param({5}, 1.0), a = param({6}, 2.0), y = param({4}, 3.0);
  auto store = make_store({{x}, {a, y}}, false, adamw_spec());
  const at::Tensor x0 = x.detach().clone(), a0 = a.detach().clone(), y0 = y.detach().clone();
  auto engine = engine_for(*store, resident());
  const int m = engine->add_model(store, residency());
  engine->plan(m, {1, 0});
  backward_visit(*engine, m, 1, {a}, 3.0f, /*step=*/false);
  backward_visit(*engine, m, 0, {}, 3.0f, false);
  EXPECT_NEAR(engine->clip_and_step(m, 1.0)->value(), std::sqrt(6.0 * 9.0), 1e-5);
  settle(*engine, m);
  EXPECT_FALSE(at::equal(master_of(*store, a), a0));
  EXPECT_TRUE(at::equal(master_of(*store, x), x0));
  EXPECT_TRUE(at::equal(master_of(*store, y), y0));
  EXPECT_EQ(steps_of(*store, a), 1);
  EXPECT_EQ(steps_of(*store, x), 0);
  EXPECT_EQ(steps_of(*store, y), 0);
}

INSTANTIATE_TEST_SUITE_P(Placement, UnusedParameters, testing::Bool(),
                         [](const testing::TestParamInfo<bool>& info) { return info.param ? "Resident" : "Spilled"; });

}  // namespace
