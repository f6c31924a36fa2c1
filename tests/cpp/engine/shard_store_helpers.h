// What the ShardStore tests share: parameters of distinct, deterministic values, a model with tied and frozen
// parameters across three shards, and lookups of a parameter's entry.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "engine/shard_store.h"

namespace shard_store_test {

using hydra::engine::OptimizerSpec;
using hydra::engine::ParamEntry;
using hydra::engine::ShardStore;

// Deterministic, distinct, non-zero values; `seed` tells parameters apart.
inline at::Tensor values(at::IntArrayRef sizes, double seed, at::ScalarType dtype = at::kFloat) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return at::arange(n, at::kDouble).mul(0.37).add(seed).sin().add(seed + 2.0).reshape(sizes).to(dtype);
}

inline at::Tensor param(at::IntArrayRef sizes, double seed, bool trainable = true,
                        at::ScalarType dtype = at::kFloat) {
  return values(sizes, seed, dtype).set_requires_grad(trainable);
}

inline const ParamEntry& entry_for(const ShardStore& store, int shard, const at::Tensor& p) {
  for (const ParamEntry& e : store.layout(shard))
    if (e.param.unsafeGetTensorImpl() == p.unsafeGetTensorImpl()) return e;
  ADD_FAILURE() << "parameter not in the layout of shard " << shard;
  static ParamEntry none{};
  return none;
}

inline at::Tensor flat(const at::Tensor& t) { return t.detach().reshape({-1}).to(at::kFloat); }

inline bool same_values(const at::Tensor& a, const at::Tensor& b) {
  return at::equal(a.to(at::kFloat), b.to(at::kFloat));
}

// shard 0: frozen f0 (5), e (10x4, tied with shard 2), a (5), e again
// shard 1: h (8), z (3, frozen, tied with shard 2)
// shard 2: e (borrowed), g (6), z (borrowed)
struct TiedModel {
  at::Tensor f0 = param({5}, 1.0, false);
  at::Tensor e = param({10, 4}, 2.0);
  at::Tensor a = param({5}, 3.0);
  at::Tensor h = param({8}, 4.0);
  at::Tensor z = param({3}, 5.0, false);
  at::Tensor g = param({6}, 6.0);
  std::vector<std::vector<at::Tensor>> shards() const { return {{f0, e, a, e}, {h, z}, {e, g, z}}; }
};

}  // namespace shard_store_test
