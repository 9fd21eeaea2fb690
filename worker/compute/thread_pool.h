// ThreadPool: a fixed set of threads for data-parallel loops in the CPU backend. The
// caller's thread takes part, so a pool of size 1 runs everything inline.
//
// Thread safety: ParallelFor is called from one thread at a time (the training loop);
// the function it runs must be safe to call concurrently on disjoint ranges.
#ifndef PITH_WORKER_COMPUTE_THREAD_POOL_H_
#define PITH_WORKER_COMPUTE_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"

namespace pith::compute {

class ThreadPool {
 public:
  // `threads` workers in all, the caller included; 0 means one per core.
  explicit ThreadPool(int threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(begin, end) on disjoint ranges covering [0, n), each at least `grain` long
  // (but the last), and returns when all are done. Allocates nothing.
  void ParallelFor(int64_t n, int64_t grain, absl::FunctionRef<void(int64_t, int64_t)> fn);

 private:
  void WorkerLoop(int index);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  // Guarded by mu_.
  const absl::FunctionRef<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t job_n_ = 0;
  int64_t job_chunk_ = 0;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_THREAD_POOL_H_
