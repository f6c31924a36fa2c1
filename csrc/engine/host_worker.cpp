#include "engine/host_worker.h"

#include <algorithm>
#include <stdexcept>

namespace hydra::engine {

HostWorker::HostWorker(int threads, std::function<void()> on_start, bool in_submission_order)
    : in_submission_order_(in_submission_order) {
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

Fence HostWorker::enqueue(Job job) {
  Fence fence(job.done.get_future().share());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (job.urgent) {
      queue_.push_front(std::move(job));
    } else {
      queue_.push_back(std::move(job));
    }
  }
  wake_.notify_one();
  return fence;
}

Fence HostWorker::submit(std::function<DeviceEvent()> job, bool urgent) {
  Job queued;
  queued.run = std::move(job);
  queued.urgent = urgent;
  return enqueue(std::move(queued));
}

Fence HostWorker::submit_chained(std::function<DeviceEvent()> job, int64_t chain, std::function<bool()> startable,
                                 bool only_once_startable, int64_t rank) {
  if (chain < 0) throw std::invalid_argument("HostWorker: a chain is >= 0, got " + std::to_string(chain));
  if (!startable) throw std::invalid_argument("HostWorker: a chained job needs its startable");
  Job queued;
  queued.run = std::move(job);
  queued.chain = chain;
  if (!in_submission_order_ || only_once_startable) {
    queued.startable = std::move(startable);
    queued.only_once_startable = only_once_startable;
    queued.rank = rank;
  }
  return enqueue(std::move(queued));
}

void HostWorker::poke() {
  { std::lock_guard<std::mutex> lock(mutex_); }  // a thread between its look at the queue and its wait gets this
  wake_.notify_all();
}

void HostWorker::want(int64_t chain) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::any_of(queue_.begin(), queue_.end(), [chain](const Job& job) { return job.chain == chain; }))
    wanted_.insert(chain);
}

namespace {

// The chained job this thread runs now, if any: what let_lower_ranks_run() yields from.
struct RunningJob {
  HostWorker* worker = nullptr;
  int64_t chain = -1;
  int64_t rank = 0;
};
thread_local RunningJob running_job;

}  // namespace

void HostWorker::let_lower_ranks_run(const std::function<bool(int64_t rank)>& go_on) {
  const RunningJob current = running_job;
  if (current.worker == nullptr || current.chain < 0 || current.worker->in_submission_order_) return;
  HostWorker& worker = *current.worker;
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(worker.mutex_);
      auto next = worker.lower_rank_job(current.chain, current.rank);
      if (next == worker.queue_.end()) return;
      if (go_on) {
        // Asked without the worker's lock (it may read what takes other locks); the chain is running, so no other
        // thread takes its jobs meanwhile, though one of still lower rank may become startable: that one goes.
        const int64_t rank = next->rank;
        lock.unlock();
        if (!go_on(rank)) return;
        lock.lock();
        next = worker.lower_rank_job(current.chain, current.rank);
        if (next == worker.queue_.end()) return;
      }
      job = std::move(*next);
      worker.queue_.erase(next);
      worker.taken(job);
    }
    // The chain stays running meanwhile (the job that yields is still in it): no other thread takes its jobs.
    worker.run_job(job);
  }
}

std::deque<HostWorker::Job>::iterator HostWorker::lower_rank_job(int64_t chain, int64_t rank) {
  auto best = queue_.end();
  for (auto it = queue_.begin(); it != queue_.end(); ++it)
    if (it->chain == chain && it->startable && it->rank < rank &&
        (best == queue_.end() || it->rank < best->rank) && it->startable())
      best = it;
  return best;
}

void HostWorker::taken(const Job& job) {
  if (job.chain >= 0 && wanted_.count(job.chain) &&
      std::none_of(queue_.begin(), queue_.end(), [&job](const Job& other) { return other.chain == job.chain; }))
    wanted_.erase(job.chain);
}

void HostWorker::run_job(Job& job) {
  const RunningJob outer = running_job;
  running_job = RunningJob{this, job.chain, job.rank};
  try {
    DeviceEvent event = job.run();
    job.run = nullptr;  // what the job captured goes now, before anyone learns it is done
    job.startable = nullptr;
    job.done.set_value(std::move(event));
  } catch (...) {
    job.run = nullptr;
    job.startable = nullptr;
    job.done.set_exception(std::current_exception());  // reported through the job's Fence
  }
  running_job = outer;
}

void HostWorker::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return queue_.empty() && busy_ == 0; });
}

bool HostWorker::can_take(const Job& job) const {
  return job.startable && !running_.count(job.chain) && job.startable();
}

std::deque<HostWorker::Job>::iterator HostWorker::next_job() {
  // A plain job at the front is taken in its turn (an urgent one was put there), as is every job where none is
  // chained (in submission order, once no job of its chain runs). Else the first chained job that can start, one of
  // a wanted chain first, and then its chain's job of lowest rank that can; where none can, the front, unless it may
  // only be taken once it can start or a job of its chain runs (it may not wait for that one: the running job's end
  // wakes the threads): then none.
  if (!queue_.front().startable) return running_.count(queue_.front().chain) ? queue_.end() : queue_.begin();
  auto first = queue_.end();
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (!can_take(*it)) continue;
    if (wanted_.count(it->chain)) {
      first = it;
      break;
    }
    if (first == queue_.end()) first = it;
  }
  if (first == queue_.end()) {
    const Job& front = queue_.front();
    return front.only_once_startable || running_.count(front.chain) ? queue_.end() : queue_.begin();
  }
  auto best = first;
  for (auto it = std::next(first); it != queue_.end(); ++it)
    if (it->chain == first->chain && it->rank < best->rank && can_take(*it)) best = it;
  return best;
}

void HostWorker::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    auto next = queue_.end();
    wake_.wait(lock, [this, &next] {
      if (queue_.empty()) return stopping_;
      next = next_job();
      return next != queue_.end();
    });
    if (queue_.empty()) return;  // stopping, with nothing left to do
    Job job = std::move(*next);
    queue_.erase(next);
    taken(job);
    ++busy_;
    if (job.chain >= 0) running_.insert(job.chain);
    lock.unlock();
    run_job(job);
    lock.lock();
    --busy_;
    if (job.chain >= 0) {
      running_.erase(job.chain);
      if (!queue_.empty()) wake_.notify_all();  // the chain's next job may be taken now, by any free thread
    }
    if (queue_.empty() && busy_ == 0) idle_.notify_all();
  }
}

}  // namespace hydra::engine
