// TaskThreads: long-lived threads for a worker's background tasks (a step's expert
// updates, the fetcher of their moments, each update batch's writes). A task runs on an
// idle thread, or on a new one when none is idle, so a task may wait for one submitted
// after it; threads stay for the next task instead of being created and torn down each
// time (a dozen a step).
//
// Thread safety: Run and Async may be called from any thread, tasks included; not
// concurrently with the destructor except from tasks: it waits for every task submitted
// to end, those submitted by tasks while it waits too.

#ifndef PITH_WORKER_RUNTIME_TASK_THREADS_H_
#define PITH_WORKER_RUNTIME_TASK_THREADS_H_

#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pith::runtime {

class TaskThreads {
 public:
  TaskThreads() = default;
  ~TaskThreads();
  TaskThreads(const TaskThreads&) = delete;
  TaskThreads& operator=(const TaskThreads&) = delete;

  // Runs `task` on an idle thread, starting one if none is.
  void Run(std::function<void()> task);

  // Runs `f` as Run does; its result comes through the future.
  template <typename F>
  std::future<std::invoke_result_t<F>> Async(F f) {
    auto task = std::make_shared<std::packaged_task<std::invoke_result_t<F>()>>(std::move(f));
    std::future<std::invoke_result_t<F>> result = task->get_future();
    Run([task] { (*task)(); });
    return result;
  }

  // Threads started so far.
  int threads();

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_TASK_THREADS_H_
