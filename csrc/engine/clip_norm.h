// Global-norm clipping's norm, on its way to whoever needs it: every shard's step of the clipped step, and the
// caller, who learns from it whether the step was applied.
//
// A spilled model's norm is summed by a host job queued after the model's gradient jobs, so the thread that
// issues the device's compute queues the norm and every shard's step at once and goes on with other work: it
// never waits for the last gradients to land. Each step job reads the norm first; a non-finite norm skips the
// step on every shard, so the weights stay those of the last completed step, as a closed loss gate does.
// A resident model's norm is computed on the issuing thread (its gradients are on the device) and is known
// when clip_and_step returns.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <future>

namespace hydra::engine {

class ClipNorm {
 public:
  explicit ClipNorm(double max_norm) : max_norm_(max_norm), value_(promise_.get_future().share()) {}

  // Blocks until the norm is computed; rethrows the error of the job that failed to compute it.
  double value() const { return value_.get(); }
  bool ready() const { return value_.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
  bool finite() const { return std::isfinite(value()); }
  // What every gradient is multiplied by, as torch.nn.utils.clip_grad_norm_: at most 1.
  double scale() const { return std::min(1.0, max_norm_ / (value() + 1e-6)); }

  // Once, by whoever computes it.
  void set(double norm) { promise_.set_value(norm); }
  void fail(std::exception_ptr error) { promise_.set_exception(std::move(error)); }

 private:
  double max_norm_;
  std::promise<double> promise_;
  std::shared_future<double> value_;
};

}  // namespace hydra::engine
