// The commit gate of an optimizer step: the loss of the step's last micro-batch, as the host can see it
// without stalling the thread that issues the compute.
//
// On a device with streams the loss is copied to host memory on the compute stream right after it is
// computed, and an event marks the copy landed; the issuing thread goes on to the backward at once. Every
// shard's step reads the gate before it applies (a spilled shard's on a host-step thread, after its gradient
// has landed, which is later on the same stream, so it never waits; a resident shard's on the issuing thread
// before it queues the device step): a non-finite loss skips the step on every shard, so the weights stay
// those of the last completed step. The issuing thread reads the value itself once the micro-batch's
// backward is issued. On a CPU device the loss is computed synchronously and the gate holds it as it is.
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>

#include "engine/fence.h"

namespace hydra::engine {

class LossGate {
 public:
  // `value`: a one-element host tensor that holds the loss once `landed` is done.
  LossGate(at::Tensor value, Fence landed) : value_(std::move(value)), landed_(std::move(landed)) {}

  // Blocks until the copy has landed (never for the device's later work).
  double value() const {
    landed_.wait();
    return value_.item<double>();
  }
  bool open() const { return std::isfinite(value()); }

 private:
  at::Tensor value_;
  Fence landed_;
};

}  // namespace hydra::engine
