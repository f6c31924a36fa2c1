// Where each model of a run trains, decided once before training starts from the engines' budget rules.
//
// A model is resident on the device with the most room left if, after that, the device still holds the
// working set of every other model that may spill there (any later model, and the earlier ones already
// spilled), so an early resident model never leaves a later one without room. Otherwise it is spilled. Models
// are placed in order; the same arithmetic as DeviceEngine::add_model, which registers each one where it was
// placed. A resident model keeps its micro-batch's whole autograd graph, which a spilled one does not:
// `graph_bytes[i]` (empty: none) is what model i needs for it beyond what the budget keeps for a spilled
// micro-batch already. It must fit beside the model's state, and is kept outside the arena of the device the
// model is resident on (DeviceEngine::keep_outside_arena).
//
// Where `resident_ends[i]` (placement "auto") on one device, model i, if spilled, keeps its first and last
// shards resident where their homes fit beside every other model's working set (else its first alone, else its
// last alone; each with the shards that share a tied weight with it): the first shard's step then runs on the
// device right after its backward and its weights never leave, so the next step's forward starts without the
// round trip through the host, and the last shard, whose backward follows its forward at once, is never copied.
// The homes take arena room that would cache weights, so beside other models that may spill (whose units run
// while a model's step goes round) they are taken only where every spilled shard's weights still fit cached.
// With several devices a spilled model runs on any of them, which resident shards would give up: there it keeps
// none.
//
// Where `wishes[i]` asks (placement "device": every shard stepped on the device; "auto": what the lane model takes
// off the host, hydra_torch/run/lane_choice.py), model i, if spilled, on one device also keeps resident each shard
// of `wishes[i].resident` (with the shards tied to it, in the order asked) whose home and its working set still fit
// beside every other model's working set, and steps on the device each shard of `wishes[i].device` that is not
// resident and has something of its own to train (a tie's owner and borrowers each where wished: the tied weight
// steps with its owner; a borrower with nothing of its own with its owner, SpilledModel's device-stepped shards),
// first shards first (each with the shards it shares a tied weight with) while their gradient buffers and its working
// set fit, passing over one that does not. Unlike the
// resident ends, the wishes are not held to every spilled shard's weights staying cached: the lane model that makes
// them has weighed what its homes and steps' regions cost the weights the arena keeps. On several devices it keeps
// no resident shard and steps on the device (whichever ran the shard's backward) the untied shards of
// `wishes[i].device` that every device has room for, and only where each of its backwards is followed by its step
// (ShardStore::steps_after_each_backward): a step summing backwards, or a tied weight's gradient, would sum in one
// device's buffer, and the model's units may run on several.
//
// `bases[i]` (empty: none) is the frozen base model i uses (DeviceEngine::add_base, the same id on every engine),
// or -1: its units hold their base shards beside their own, which its working set counts, and it is resident
// (or keeps resident ends) only where the whole base still fits cached beside it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "engine/device_engine.h"
#include "engine/shard_store.h"

namespace hydra::engine {

struct ShardWishes {
  std::vector<int> resident;  // more resident shards than the resident ends
  std::vector<int> device;    // shards stepped on the device
};

struct Placement {
  int resident_device = -1;    // -1: spilled on every device, or with resident shards on `home_device`
  int home_device = -1;        // the one device a model trains on: where it is resident or has resident shards
  std::vector<int> resident_shards;  // of a spilled model: the shards whose state lives on home_device
  std::vector<int> device_shards;    // of a spilled model: the shards stepped on home_device
  std::vector<int> model_ids;  // per device: the model's id in its engine, -1 where it is not registered
};

// Registers every store with the engines, store i as the scheduler's task i (DeviceEngine::model_of).
// Throws, naming the task (`names`, one per store), when a model cannot train on them at all (its largest
// shard does not fit what a budget has left); models placed before it stay registered, and the run is not
// started.
std::vector<Placement> place_models(const std::vector<DeviceEngine*>& engines,
                                    const std::vector<std::shared_ptr<ShardStore>>& stores,
                                    const std::vector<std::string>& names,
                                    const std::vector<int64_t>& graph_bytes = {},
                                    const std::vector<bool>& resident_ends = {},
                                    const std::vector<int>& bases = {},
                                    const std::vector<ShardWishes>& wishes = {});

// What place_models would decide, registering nothing: each model's placement (model_ids all -1) and, in
// `free_left`, what each device's budget would have left beyond the resident models, resident shards and
// device-stepped shards' gradient buffers (the spilled models' working sets not taken from it). The lane model
// plans device steps around the resident ends this decides (hydra_torch/run/lane_choice.py).
std::vector<Placement> decide_placement(const std::vector<DeviceEngine*>& engines,
                                        const std::vector<std::shared_ptr<ShardStore>>& stores,
                                        const std::vector<std::string>& names,
                                        const std::vector<int64_t>& graph_bytes,
                                        const std::vector<bool>& resident_ends, const std::vector<int>& bases,
                                        const std::vector<ShardWishes>& wishes, std::vector<int64_t>& free_left);

// The shards `shards` names and every shard that shares a tied weight with one of them, sorted.
std::vector<int> closed_under_ties(const ShardStore& store, std::vector<int> shards);

}  // namespace hydra::engine
