#include "server/coordinator/job_history.h"

#include "server/coordinator/job_registry.h"

namespace pith::coordinator {

void JobHistory::Observe(const v1::Job& job) {
  const int64_t step = job.committed_step();
  if (job.removed_unix_ms() != 0) {  // its curve goes with it
    absl::MutexLock lock(&mu_);
    if (curves_.erase(job.job_id()) > 0) std::erase(order_, job.job_id());
    return;
  }
  if (step < 1) return;
  absl::MutexLock lock(&mu_);
  auto [it, fresh] = curves_.try_emplace(job.job_id());
  it->second.ended = IsFinal(job.state());
  if (fresh) {
    order_.push_back(job.job_id());
    if (order_.size() > kMaxJobs) {
      // The first seen of the ended jobs goes (the oldest of all if none has ended); never
      // the one just added, which `it` refers to.
      auto victim = order_.begin();
      for (auto at = order_.begin(); at + 1 != order_.end(); ++at) {
        if (curves_[*at].ended) {
          victim = at;
          break;
        }
      }
      curves_.erase(*victim);
      order_.erase(victim);
    }
  }
  Series& c = it->second;
  if (!c.points.empty() && step <= c.points.back().step) return;  // not a new commit
  if (step % c.stride != 0) return;
  c.points.push_back({step, job.last_loss(), job.tokens_per_second()});
  if (c.points.size() < kMaxPoints) return;
  // Full: keep every other point from now on, and of what is there.
  c.stride *= 2;
  std::vector<Point> kept;
  kept.reserve(kMaxPoints / 2 + 1);
  for (const Point& p : c.points) {
    if (p.step % c.stride == 0) kept.push_back(p);
  }
  c.points = std::move(kept);
}

std::vector<JobHistory::Point> JobHistory::Curve(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = curves_.find(job_id);
  return it == curves_.end() ? std::vector<Point>() : it->second.points;
}

}  // namespace pith::coordinator
