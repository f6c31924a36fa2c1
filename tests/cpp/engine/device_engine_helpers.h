// Shared by the DeviceEngine tests (CPU device): small models with exactly representable values, the
// runner's visit sequence, and checks of what parameters are bound to.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "engine/device_engine.h"
#include "engine/shard_store.h"

namespace engine_test {

using hydra::engine::DeviceEngine;
using hydra::engine::OptimizerSpec;
using hydra::engine::ParamEntry;
using hydra::engine::ShardStore;

inline const c10::Device kCpu("cpu");

inline bool op_registered(const char* name) { return c10::Dispatcher::singleton().findSchema({name, ""}).has_value(); }

inline at::Tensor values(at::IntArrayRef sizes, double seed) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return at::arange(n, at::kDouble).mul(0.173).add(seed).sin().to(at::kFloat).reshape(sizes);
}

inline at::Tensor param(at::IntArrayRef sizes, double seed, bool trainable = true) {
  return values(sizes, seed).set_requires_grad(trainable);
}

// Shard s: a [rows, 8] weight and a [rows] bias.
inline std::vector<at::Tensor> linear_shard(int s, int64_t rows) {
  return {param({rows, 8}, 10.0 * s + 1.0), param({rows}, 10.0 * s + 2.0)};
}

inline std::shared_ptr<ShardStore> make_store(std::vector<std::vector<at::Tensor>> shards, bool bf16 = false,
                                       OptimizerSpec optimizer = OptimizerSpec{}) {
  return std::make_shared<ShardStore>(shards, optimizer, bf16, /*pin_memory=*/false);
}

inline std::shared_ptr<ShardStore> equal_shards(int n, int64_t rows = 30) {
  std::vector<std::vector<at::Tensor>> shards;
  for (int s = 0; s < n; ++s) shards.push_back(linear_shard(s, rows));
  return make_store(shards);
}

// What the engine's add_model accepts as the smallest budget for a spilled model.
inline int64_t tight_budget(const ShardStore& store) { return DeviceEngine::min_spilled_bytes(store) + 2 * 512; }

// Every parameter of `shard` is bound to device memory holding exactly its master value.
inline void expect_bound_to_master(ShardStore& store, int shard) {
  for (const ParamEntry& e : store.layout(shard)) {
    SCOPED_TRACE(testing::Message() << "shard " << shard << " entry at device offset " << e.device_offset);
    const at::Tensor expected =
        store.transfer_source(e.owner).narrow(0, e.master_offset, e.numel).view(e.param.sizes());
    ASSERT_EQ(e.param.scalar_type(), store.compute_dtype());
    ASSERT_EQ(e.param.sizes(), expected.sizes());
    EXPECT_TRUE(at::equal(e.param.detach(), expected));
    EXPECT_NE(e.param.data_ptr(), expected.data_ptr()) << "bound to device memory, not the host master";
  }
}

// Distinct, exactly representable gradient per (shard, parameter index).
inline float grad_value(int shard, size_t index) { return 0.5f * static_cast<float>(shard + 1) + 0.25f * index; }

// What autograd does to a parameter's gradient: a buffer that stays on the device (a resident or device-stepped
// shard's) accumulates over micro-batches.
inline void add_grads(ShardStore& store, int shard) {
  const auto& layout = store.layout(shard);
  for (size_t i = 0; i < layout.size(); ++i)
    if (layout[i].trainable) layout[i].param.mutable_grad().add_(grad_value(shard, i));
}

// AdamW with decoupled weight decay, as the tests of steps use it.
inline OptimizerSpec adamw_spec() {
  OptimizerSpec spec;
  spec.lr = 0.01;
  spec.weight_decay = 0.1;
  spec.decoupled_weight_decay = true;
  return spec;
}

inline void write_grads(ShardStore& store, int shard) {
  const auto& layout = store.layout(shard);
  for (size_t i = 0; i < layout.size(); ++i) {
    const ParamEntry& e = layout[i];
    if (!e.trainable) {
      EXPECT_FALSE(e.param.grad().defined());
      continue;
    }
    at::Tensor g = e.param.grad();
    ASSERT_TRUE(g.defined()) << "acquire(with_grads) must bind a gradient view";
    ASSERT_EQ(g.sizes(), e.param.sizes());
    EXPECT_TRUE(at::equal(g, at::zeros_like(g))) << "fresh gradient buffers start at zero";
    e.param.mutable_grad().fill_(grad_value(shard, i));
  }
}

// The master gradients `micro_batches` passes of write_grads should leave: each trainable parameter gets
// the sum of the values written in every shard that lists it, in its owner's buffer.
inline std::vector<at::Tensor> expected_grads(ShardStore& store, int micro_batches) {
  std::vector<at::Tensor> expected;
  for (int s = 0; s < store.num_shards(); ++s) expected.push_back(at::zeros({store.trainable_numel(s)}));
  for (int s = 0; s < store.num_shards(); ++s) {
    const auto& layout = store.layout(s);
    for (size_t i = 0; i < layout.size(); ++i) {
      const ParamEntry& e = layout[i];
      if (!e.trainable) continue;
      expected[e.owner].narrow(0, e.master_offset, e.numel).add_(grad_value(s, i) * micro_batches);
    }
  }
  return expected;
}

// The runner's visit sequence for one optimizer step: forward 0..n-2 without gradients, the last shard with
// gradients, backward n-2..0, prefetching the next shard at every visit.
// `keep`: the last micro-batch's gradients wait for clip_and_step as they landed (backward_done's keep).
// `write`: what a shard's backward writes into its parameters' gradients.
inline void run_step(DeviceEngine& engine, int model, ShardStore& store, int micro_batches, bool check_values = true,
              bool step = false, double lr_scale = 1.0, bool keep = false,
              const std::function<void(ShardStore&, int)>& write = write_grads) {
  const int n = store.num_shards();
  std::vector<int> visits;
  for (int mb = 0; mb < micro_batches; ++mb) {
    for (int s = 0; s < n; ++s) visits.push_back(s);
    for (int s = n - 2; s >= 0; --s) visits.push_back(s);
  }
  engine.plan(model, visits);
  for (int mb = 0; mb < micro_batches; ++mb) {
    const bool last = step && mb == micro_batches - 1;
    for (int s = 0; s < n - 1; ++s) {
      engine.acquire(model, s, /*with_grads=*/false);
      engine.prefetch(model, s + 1);
      if (check_values) expect_bound_to_master(store, s);
      for (const ParamEntry& e : store.layout(s)) EXPECT_FALSE(e.param.grad().defined());
      engine.release(model, s);
    }
    for (int s = n - 1; s >= 0; --s) {
      engine.acquire(model, s, /*with_grads=*/true);
      if (s > 0) engine.prefetch(model, s - 1);
      if (check_values) expect_bound_to_master(store, s);
      write(store, s);
      engine.backward_done(model, s, last, lr_scale, keep && mb == micro_batches - 1);
      engine.release(model, s);
    }
  }
}

// shard 0 owns e (tied with shard 2) and a frozen f; shard 1 owns h and a frozen z (tied with shard 2).
struct TiedModel {
  at::Tensor e = param({10, 4}, 1.0);
  at::Tensor f = param({5}, 2.0, false);
  at::Tensor a = param({7}, 3.0);
  at::Tensor h = param({8}, 4.0);
  at::Tensor z = param({3}, 5.0, false);
  at::Tensor g = param({6}, 6.0);
  std::vector<std::vector<at::Tensor>> shards() const { return {{e, f, a}, {h, z}, {g, e, z}}; }
};

// A model's host training state after some steps, to compare two ways of reaching it.
struct Trained {
  std::vector<at::Tensor> master, states;
  std::vector<int64_t> steps, param_steps;
};

// Brings the model's state up to date in its store (snapshot), copies it, and finishes the model.
inline Trained finish_and_copy(DeviceEngine& engine, int model, ShardStore& store) {
  engine.snapshot(model);
  Trained out;
  for (int s = 0; s < store.num_shards(); ++s) {
    out.master.push_back(store.master(s).clone());
    for (int k = 0; k < store.optimizer().num_states(); ++k) out.states.push_back(store.state(s, k).clone());
    out.steps.push_back(store.steps_taken(s));
  }
  for (const auto& p : store.param_states()) out.param_steps.push_back(p.steps);
  engine.finish(model);
  return out;
}

inline void expect_same(const Trained& a, const Trained& b) {
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t s = 0; s < a.master.size(); ++s) EXPECT_TRUE(at::equal(a.master[s], b.master[s])) << "shard " << s;
  for (size_t k = 0; k < a.states.size(); ++k) EXPECT_TRUE(at::equal(a.states[k], b.states[k])) << "state " << k;
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.param_steps, b.param_steps);
}

}  // namespace engine_test
