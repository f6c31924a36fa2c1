#include "engine/device_model.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <future>
#include <mutex>

namespace hydra::engine {

DeviceModel::DeviceModel(DeviceEngine& engine, int id, std::shared_ptr<ShardStore> store)
    : engine_(engine), id_(id), store_(std::move(store)), visits_(store_->num_shards()) {}

void DeviceModel::check_shard(int shard) const {
  TORCH_CHECK(shard >= 0 && shard < static_cast<int>(visits_.size()), "model ", id_, " has ", visits_.size(),
              " shards: no shard ", shard);
}

void DeviceModel::acquire(int shard, bool with_grads) {
  Visit& visit = visits_.at(shard);
  TORCH_CHECK(visit.pins == 0 || may_pin_again(shard), "shard ", shard, " of model ", id_, " acquired twice on ",
              engine_.device_);
  ++visit.pins;
  try {
    make_computable(shard, with_grads);
  } catch (...) {
    --visit.pins;
    throw;
  }
}

void DeviceModel::release(int shard) {
  Visit& visit = visits_.at(shard);
  TORCH_CHECK(visit.pins > 0, "release of shard ", shard, " of model ", id_, " that was not acquired");
  --visit.pins;
  visit.bound_grads.clear();  // a backward that never completed (an error) received nothing
  after_release(shard);
}

void DeviceModel::bind(int shard, bool with_grads, const std::function<Place(const ParamEntry&)>& place) {
  std::vector<at::Tensor> bound;
  for (const ParamEntry& e : store_->layout(shard)) {
    const Place p = place(e);
    e.param.set_data(p.weights.narrow(0, p.offset, e.numel).view(e.param.sizes()));
    // variable_data(): the same memory under a version counter of its own (see Visit::bound_grads).
    const at::Tensor grad = with_grads && e.trainable
                                ? p.grads.narrow(0, p.grad_offset >= 0 ? p.grad_offset : p.offset, e.numel)
                                      .view(e.param.sizes())
                                      .variable_data()
                                : at::Tensor();
    e.param.mutable_grad() = grad;
    bound.push_back(grad);
  }
  visits_[shard].bound_grads = std::move(bound);
}

void DeviceModel::bind_homes(const ShardHomes& homes, int shard, bool with_grads) {
  bind(shard, with_grads, [&](const ParamEntry& e) {
    return Place{homes.weights(*store_, e.owner), homes.grads(*store_, e.owner), e.master_offset};
  });
}

void DeviceModel::count_upload(int shard, int64_t bytes) {
  count_load(shard);
  ++engine_.stats_.host_to_device_copies;
  engine_.stats_.host_to_device_bytes += bytes;
}

void DeviceModel::note_gradients(int shard) {
  std::vector<at::Tensor>& bound = visits_.at(shard).bound_grads;
  const std::vector<ParamEntry>& layout = store_->layout(shard);
  for (size_t i = 0; i < bound.size(); ++i)
    if (bound[i].defined() && bound[i]._version() > 0) store_->note_gradient(layout[i].owner, layout[i].owner_index);
  bound.clear();  // noted once: a later backward of the shard binds afresh
}

std::vector<int64_t> DeviceModel::shard_loads() const {
  std::vector<int64_t> loads;
  for (const Visit& visit : visits_) loads.push_back(visit.loads);
  return loads;
}

Fence DeviceModel::submit(std::function<DeviceEvent()> job, std::function<bool()> startable,
                          const std::vector<int>& shards) {
  static std::mutex order;  // one global submission order across devices (see ShardStore::exchange_last_jobs)
  auto done = std::make_shared<std::promise<void>>();
  Fence fence;
  {
    std::lock_guard<std::mutex> lock(order);
    std::vector<std::shared_future<void>> previous = store_->exchange_last_jobs(shards, done->get_future().share());
    auto can_start = [previous, startable = std::move(startable)] {
      return std::all_of(previous.begin(), previous.end(), [](const std::shared_future<void>& job) {
               return job.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
             }) &&
             (!startable || startable());
    };
    fence = engine_.host_steps_->submit_chained([previous, done, store = store_, job = std::move(job)]() -> DeviceEvent {
      for (const std::shared_future<void>& before : previous) before.wait();
      struct Signal {  // completes the chain however the job ends; its error travels in its own Fence
        std::shared_ptr<std::promise<void>> promise;
        ~Signal() { promise->set_value(); }
      } signal{done};
      try {
        return job();
      } catch (...) {
        store->note_failed_job(std::current_exception());  // before the chain goes on (signal's destructor)
        throw;
      }
    }, store_->host_chain(), std::move(can_start), /*only_once_startable=*/false,
       shards.empty() ? 0 : *std::min_element(shards.begin(), shards.end()));
  }
  return track(fence);
}

Fence DeviceModel::track(Fence fence) {
  // Finished jobs are forgotten, failed ones kept until synchronize() reports them.
  jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(), [](const Fence& f) { return f.succeeded(); }), jobs_.end());
  jobs_.push_back(fence);
  return fence;
}

void DeviceModel::synchronize() {
  // An empty job at the end of the model's chain finishes after every earlier host job, whichever device
  // queued it.
  submit([]() -> DeviceEvent { return nullptr; });
  std::vector<Fence> jobs = std::move(jobs_);
  jobs_.clear();
  // Every job's device work is waited for, so nothing is in flight afterwards; then the first error is raised.
  std::exception_ptr first_error;
  for (const Fence& job : jobs) {
    try {
      job.wait();
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  // A step another device queued (a model spilled on several steps a shard on the device that ran its backward)
  // sends the shard home on that device's lane, outside this model's jobs: it is the shard's last step in the
  // store. Its error, if any, is that device's to report.
  for (int s = 0; s < store_->num_shards(); ++s) store_->last_step(s).wait_done();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace hydra::engine
