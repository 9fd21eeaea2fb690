// The scheduler's replication and drain entry points (DESIGN §5): the replicator's pass,
// drains and their part of the tick, and the replication status. The state and the
// placement logic are Replication's (replication.h); what is here reads the runs.
#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {

int Scheduler::ReplicateOnce() {
  const Alive alive = Snapshot(*members_);
  std::vector<CopyTask> tasks;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.recovering || !run.awaited_store.empty() || run.committed < 0) continue;
      absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
      if (!job.ok()) continue;
      replication_.PlanCopies(*job, run.record.placement(), run.committed, ForJob(alive, run),
                              heat_->Snapshot(job_id), options_.max_pulls, run.copies, &tasks);
    }
    // A store that is having a group deleted neither joins it (the workers' writes to it
    // would go with the delete) nor gets a copy of it, until the delete returned.
    for (auto& [job_id, run] : runs_) {
      for (auto it = run.copies.join_requests.begin(); it != run.copies.join_requests.end();) {
        const bool deleting =
            collecting_.count({job_id, it->second, it->first.first, it->first.second}) > 0;
        it = deleting ? run.copies.join_requests.erase(it) : std::next(it);
      }
    }
    std::vector<CopyTask> ready;
    for (CopyTask& t : tasks) {
      if (!collecting_.count({t.job_id, t.target.member_id(), t.layer, t.expert})) {
        ready.push_back(std::move(t));
        continue;
      }
      auto it = runs_.find(t.job_id);
      replication_.Finish(t, {absl::UnavailableError("the group is being deleted there")},
                          it == runs_.end() ? nullptr : &it->second.copies);
    }
    tasks = std::move(ready);
  }
  if (tasks.empty()) return 0;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (const CopyTask& t : tasks) {
    threads.emplace_back([this, &t, &done] {
      const CopyResult result =
          Replication::Copy(*stores_, t, options_.replication_bytes_per_second);
      absl::MutexLock lock(&mu_);
      auto it = runs_.find(t.job_id);
      if (replication_.Finish(t, result, it == runs_.end() ? nullptr : &it->second.copies)) {
        ++done;
      }
    });
  }
  for (std::thread& th : threads) th.join();
  return done.load();
}

uint64_t Scheduler::GroupsOnLocked(const std::string& store, bool with_moves) const {
  uint64_t groups = 0;
  for (const auto& [job_id, run] : runs_) {
    for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
      groups += std::count(e.store_ids().begin(), e.store_ids().end(), store) +
                std::count(e.joining_store_ids().begin(), e.joining_store_ids().end(), store);
    }
  }
  if (!with_moves) return groups;
  return groups + replication_.MovesOn(store);
}

void Scheduler::ForgetLeftDrainsLocked(const Alive& alive) {
  std::map<std::string, uint64_t>& drains = replication_.drains();
  for (auto it = drains.begin(); it != drains.end();) {
    if (alive.known.count(it->first) || !Gone(alive, it->first, /*store=*/true) ||
        GroupsOnLocked(it->first, /*with_moves=*/true) > 0) {
      ++it;
      continue;
    }
    (void)jobs_->DeleteRecord(absl::StrCat(kDrainPrefix, it->first));
    members_->ForgetDrain(it->first);
    it = drains.erase(it);
  }
}

void Scheduler::MarkDrainedStoresLocked(const Alive& alive) {
  for (const std::string& id : alive.draining) {
    // Ended jobs' kept weights too: a garbage collection pass copies them to stores that
    // stay (HomeEndedWeights).
    if (alive.stores.at(id).state() == v1::MEMBER_STATE_DRAINING &&
        GroupsOnLocked(id, /*with_moves=*/true) == 0 && ended_homed_.count(id)) {
      members_->MarkDrained(id);
      ended_homed_.erase(id);  // drained: should it drain again, it is looked at afresh
      LOG(INFO) << "store " << id
                << " is drained: nothing is placed on it, and every ended "
                   "job's weights it holds have a copy on another store; it can be stopped";
    }
  }
}

absl::StatusOr<v1::DrainStoreResponse> Scheduler::Drain(const std::string& store_id) {
  if (store_id.empty()) return absl::InvalidArgumentError("store_id is required");
  absl::MutexLock drain_lock(&drain_mu_);  // one drain's capacity check at a time
  const Alive alive = Snapshot(*members_);
  if (!alive.known.count(store_id)) {
    return absl::NotFoundError(absl::StrCat("unknown store ", store_id));
  }
  struct Group {
    std::string job_id;
    int layer, expert;
  };
  std::vector<Group> groups;
  {
    absl::MutexLock lock(&mu_);
    // The others must be able to hold every running job's copies.
    std::vector<std::string> others = alive.placeable_ids();
    others.erase(std::remove(others.begin(), others.end(), store_id), others.end());
    size_t low = 0;  // live stores that take no copies for want of disk
    for (const std::string& id : alive.full) low += id != store_id && !alive.draining.count(id);
    for (const auto& [job_id, run] : runs_) {
      absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
      if (!job.ok()) continue;
      const int want = std::max(1, job->spec().cluster().store_replicas());
      if (!alive.draining.count(store_id) && static_cast<int>(others.size()) < want) {
        return absl::FailedPreconditionError(absl::StrCat(
            "draining ", store_id, " would leave ", others.size(), " store(s) for job ", job_id,
            ", which keeps ", want, " copies of every blob",
            low == 0 ? ""
                     : absl::StrCat(" (", low,
                                    " other store(s) are low on disk and take no "
                                    "copies: pith cluster)"),
            "; add a store first"));
      }
      for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
        if (std::count(e.store_ids().begin(), e.store_ids().end(), store_id)) {
          groups.push_back({job_id, e.layer(), e.expert()});
        }
      }
    }
  }
  RETURN_IF_ERROR(EndedWeightsHaveAHome(store_id, alive));
  // Durable first, then in force; undone if the store cannot be drained after all.
  bool recorded = false;
  {
    absl::MutexLock lock(&mu_);
    if (!replication_.drains().count(store_id)) {
      RETURN_IF_ERROR(
          jobs_->PutRecord(absl::StrCat(kDrainPrefix, store_id), absl::StrCat(groups.size())));
      replication_.drains()[store_id] = groups.size();
      recorded = true;
    }
  }
  if (absl::Status s = members_->Drain(store_id); !s.ok()) {
    if (recorded) {
      absl::MutexLock lock(&mu_);
      (void)jobs_->DeleteRecord(absl::StrCat(kDrainPrefix, store_id));
      replication_.drains().erase(store_id);
    }
    return s;
  }
  LOG(INFO) << "draining store " << store_id << ": " << groups.size() << " groups to move";
  v1::DrainStoreResponse out;
  out.set_groups_to_move(groups.size());
  auto store = alive.stores.find(store_id);
  if (store == alive.stores.end()) return out;
  for (const Group& g : groups) {
    absl::StatusOr<std::vector<v1::BlobInfo>> blobs =
        stores_->ListGroup(store->second, g.job_id, g.layer, g.expert);
    if (!blobs.ok()) continue;  // the figures are an estimate; the drain goes on
    for (const v1::BlobInfo& b : *blobs) {
      out.set_blobs_to_move(out.blobs_to_move() + 1);
      out.set_bytes_to_move(out.bytes_to_move() + b.size_bytes());
    }
  }
  return out;
}

void Scheduler::ReplicationStatus(v1::ClusterStatusResponse* out) {
  const Alive alive = Snapshot(*members_);
  absl::MutexLock lock(&mu_);
  uint64_t deficit = 0;
  for (const auto& [job_id, run] : runs_) {
    absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
    if (!job.ok()) continue;
    // Not capped at the stores alive: with fewer stores than copies wanted, the copies
    // missing are what one more store loss can take (the alert says to add stores).
    const int want = std::max(1, job->spec().cluster().store_replicas());
    for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
      int held = 0;
      for (const std::string& id : e.store_ids()) held += alive.stores.count(id) > 0;
      deficit += static_cast<uint64_t>(std::max(0, want - held));
    }
  }
  replication_.Report(deficit, out);
  for (const auto& [id, total] : replication_.drains()) {
    if (!alive.known.count(id)) continue;  // stopped and gone
    v1::StoreDrain* d = out->add_drains();
    d->set_store_id(id);
    d->set_groups_total(total);
    d->set_groups_left(GroupsOnLocked(id, /*with_moves=*/false));
    d->set_can_stop(alive.stores.count(id) && alive.draining.count(id) &&
                    alive.stores.at(id).state() == v1::MEMBER_STATE_DRAINED);
  }
}

}  // namespace pith::coordinator
