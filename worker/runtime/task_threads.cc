#include "worker/runtime/task_threads.h"

namespace pith::runtime {

TaskThreads::~TaskThreads() {
  while (true) {  // a last task may still start a thread for one it submits
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;  // the threads end once the queue is empty
      threads.swap(threads_);
    }
    if (threads.empty()) return;
    for (std::thread& t : threads) t.join();
  }
}

void TaskThreads::Run(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
  // Each idle thread takes one queued task; a task beyond them gets a thread of its own.
  if (idle_ >= static_cast<int>(queue_.size())) return;
  threads_.emplace_back([this] { Loop(); });
}

int TaskThreads::threads() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(threads_.size());
}

void TaskThreads::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    ++idle_;
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
    mu_.Await(absl::Condition(&ready));
    --idle_;
    if (queue_.empty()) return;  // stopping, nothing left
    std::function<void()> task = std::move(queue_.front());
    queue_.pop_front();
    mu_.Unlock();
    task();
    task = nullptr;  // what it captured goes before the next wait
    mu_.Lock();
  }
}

}  // namespace pith::runtime
