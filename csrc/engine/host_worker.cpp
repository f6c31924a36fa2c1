#include "engine/host_worker.h"

#include <stdexcept>

namespace hydra::engine {

HostWorker::HostWorker(int threads, std::function<void()> on_start) {
  if (threads < 1) throw std::invalid_argument("HostWorker: threads must be >= 1, got " + std::to_string(threads));
  for (int i = 0; i < threads; ++i)
    threads_.emplace_back([this, on_start] {
      if (on_start) on_start();
      run();
    });
}

HostWorker::~HostWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  for (std::thread& thread : threads_) thread.join();
}

Fence HostWorker::submit(std::function<DeviceEvent()> job, bool urgent) {
  Job queued{std::move(job), {}};
  Fence fence(queued.done.get_future().share());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (urgent) {
      queue_.push_front(std::move(queued));
    } else {
      queue_.push_back(std::move(queued));
    }
  }
  wake_.notify_one();
  return fence;
}

void HostWorker::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
}

void HostWorker::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, with nothing left to do
    Job job = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    try {
      DeviceEvent event = job.run();
      job.run = nullptr;  // what the job captured goes now, before anyone learns it is done
      job.done.set_value(std::move(event));
    } catch (...) {
      job.run = nullptr;
      job.done.set_exception(std::current_exception());  // reported through the job's Fence
    }
    lock.lock();
    --busy_;
    if (queue_.empty() && busy_ == 0) idle_.notify_all();
  }
}

}  // namespace hydra::engine
