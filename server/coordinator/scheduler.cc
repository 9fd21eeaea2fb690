// The scheduler's start, recovery after a restart, and what its parts share: time,
// persisting a run, aborting a step attempt, placement metrics. See scheduler.h.
#include "server/coordinator/scheduler.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pith::coordinator {

Scheduler::Scheduler(JobRegistry* jobs, Membership* members, HeatRegistry* heat,
                     StoreControl* stores, MetricsRegistry* metrics, SchedulerOptions options)
    : jobs_(jobs),
      members_(members),
      heat_(heat),
      stores_(stores),
      metrics_(metrics),
      options_(std::move(options)),
      started_(options_.clock()),
      replication_(metrics) {
  if (metrics_ != nullptr) {
    steps_committed_ = *metrics_->Counter("pith_coordinator_steps_committed_total",
                                          "Job steps committed on every store");
    steps_aborted_ = *metrics_->Counter("pith_coordinator_steps_aborted_total",
                                        "Step attempts aborted (worker failure, dead member)");
  }
}

Scheduler::~Scheduler() { Stop(); }

void Scheduler::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (loop_.joinable()) loop_.join();
  if (replicator_.joinable()) replicator_.join();
  if (collector_.joinable()) collector_.join();
}

void Scheduler::Start(absl::Duration period) {
  loop_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) Tick();
  });
  replicator_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) ReplicateOnce();
  });
  collector_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(options_.gc_period)) CollectGarbageOnce();
  });
}

int64_t Scheduler::NowMs() const { return absl::ToUnixMillis(options_.clock()); }

int64_t Scheduler::NextVersion(int64_t previous) const { return std::max(previous + 1, NowMs()); }

absl::Status Scheduler::Recover() {
  ASSIGN_OR_RETURN(auto records, jobs_->Records(kRunPrefix));
  ASSIGN_OR_RETURN(auto heats, jobs_->Records(kHeatPrefix));
  ASSIGN_OR_RETURN(auto drains, jobs_->Records(kDrainPrefix));
  absl::MutexLock lock(&mu_);
  std::vector<std::string> draining;
  for (const auto& [key, value] : drains) {
    const std::string id = key.substr(std::strlen(kDrainPrefix));
    uint64_t groups = 0;
    if (!absl::SimpleAtoi(value, &groups)) groups = 0;
    replication_.drains()[id] = groups;
    draining.push_back(id);
  }
  members_->RestoreDrains(draining);
  for (const auto& [key, bytes] : records) {
    Run run;
    if (!run.record.ParseFromString(bytes)) {
      return absl::DataLossError(absl::StrCat("unreadable schedule record ", key));
    }
    absl::StatusOr<v1::Job> job = jobs_->Get(run.record.job_id());
    if (!job.ok() || IsFinal(job->state())) {
      RETURN_IF_ERROR(jobs_->DeleteRecord(key));
      continue;
    }
    for (const v1::LeftGroup& g : run.record.left()) {
      run.left[{g.store_id(), g.layer(), g.expert()}] = g.from_step();
    }
    run.record.clear_left();
    // Joining stores count from here: a copy pulled from now on completes them.
    run.committed = job->committed_step();
    for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
      for (const std::string& id : e.joining_store_ids()) {
        run.copies.joined_at[{GroupOf(e.layer(), e.expert()), id}] = run.committed;
      }
    }
    if (auto h = heats.find(absl::StrCat(kHeatPrefix, job->job_id())); h != heats.end()) {
      absl::Status s = heat_->Restore(*job, h->second);
      if (!s.ok()) LOG(WARNING) << s;  // heat is advisory: start afresh
    }
    run.committed = job->committed_step();
    // A job that gave its workers back to wait for more still waits, and says so.
    const bool waits_for_workers =
        run.record.workers().empty() && run.record.min_workers() > 0 &&
        absl::StartsWith(job->pending_reason(),
                         absl::StrCat("waiting for ", run.record.min_workers(), " workers"));
    run.no_workers = waits_for_workers;
    if (waits_for_workers) {
      const std::string& reason = job->pending_reason();
      run.waits[Wait::kWorkers] = reason.substr(0, reason.find(kAlsoWaiting));
    }
    if (job->pending_reason() != WaitReasons(run)) {
      // Other waits (for a store, for room, for a peer): the new process's to judge.
      (void)jobs_->Update(job->job_id(), [&](v1::Job& j) {
        j.set_pending_reason(WaitReasons(run));
        return absl::OkStatus();
      });
    }
    // Whatever attempt was in flight is void (its reports died with the old process); it
    // is aborted once the job's members are back (Tick).
    run.recovering = true;
    for (const std::string& w : run.record.workers()) worker_job_[w] = job->job_id();
    runs_[job->job_id()] = std::move(run);
  }
  // Ended jobs' heat too: `pith experts` shows it after a restart as before.
  for (const auto& [key, saved] : heats) {
    const std::string id = key.substr(std::strlen(kHeatPrefix));
    if (runs_.count(id)) continue;
    if (jobs_->Removed(id)) {  // removed while its heat was being written
      RETURN_IF_ERROR(jobs_->DeleteRecord(key));
      continue;
    }
    absl::StatusOr<v1::Job> job = jobs_->Get(id);
    if (!job.ok() || !IsFinal(job->state())) continue;
    if (absl::Status s = heat_->Restore(*job, saved); !s.ok()) LOG(WARNING) << s;
  }
  return absl::OkStatus();
}

absl::Status Scheduler::PersistLocked(const Run& run) {
  // The groups left travel as the record's `left` field, appended (concatenated protobuf
  // messages parse as one, merged): the record in memory never holds them.
  v1::JobRun left;
  for (const auto& [group, from_step] : run.left) {
    v1::LeftGroup* g = left.add_left();
    g->set_store_id(std::get<0>(group));
    g->set_layer(std::get<1>(group));
    g->set_expert(std::get<2>(group));
    g->set_from_step(from_step);
  }
  return jobs_->PutRecord(absl::StrCat(kRunPrefix, run.record.job_id()),
                          run.record.SerializeAsString() + left.SerializeAsString());
}

std::set<std::string> Scheduler::JobStores(const Run& run) {
  std::set<std::string> ids;
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    for (const auto* group : {&e.store_ids(), &e.joining_store_ids()}) {
      for (const std::string& id : *group) {
        if (!run.record.lost_stores().contains(id)) ids.insert(id);
      }
    }
  }
  return ids;
}

Alive Scheduler::ForJob(const Alive& alive, const Run& run) {
  Alive out = alive;
  for (const auto& [id, why] : run.record.lost_stores()) {
    out.stores.erase(id);
    out.draining.erase(id);
    out.full.erase(id);
  }
  return out;
}

void Scheduler::AbortLocked(Run& run, const std::string& reason, std::vector<StoreCall>* aborts) {
  const Alive alive = Snapshot(*members_);
  const int64_t successor = NextVersion(run.record.assignment_version());
  // Only the job's stores hold its pending versions: a store the job does not use (or one
  // that does not answer) delays no other job's abort. The successor's writes that land
  // before a late abort are kept.
  for (const std::string& id : JobStores(run)) {
    auto store = alive.stores.find(id);
    if (store != alive.stores.end()) {
      aborts->push_back({store->second, run.record.job_id(), step_in_flight(run), successor});
    }
  }
  run.written.clear();
  run.written_blobs.clear();
  run.tokens = run.cache_hits = run.cache_misses = 0;
  run.rank0.Clear();
  run.abort_reason = reason;
  // The redone step reports its heat again.
  heat_->DropStep(run.record.job_id(), step_in_flight(run));
  run.record.set_assignment_version(successor);
  if (steps_aborted_ != nullptr) steps_aborted_->Increment();
  LOG(INFO) << "job " << run.record.job_id() << ": step " << step_in_flight(run)
            << " aborted: " << reason;
}

void Scheduler::RunStoreAborts(const std::vector<StoreCall>& aborts) {
  for (const StoreCall& call : aborts) {
    absl::Status s = stores_->AbortStep(call.store, call.job_id, call.step, call.successor);
    // Best effort: a store that missed it replaces the pending versions on the retry's
    // writes, and a dead one is dropped from the placement.
    if (!s.ok()) LOG(WARNING) << "abort of step " << call.step << ": " << s;
  }
}

void Scheduler::RemoveMetricsLocked(const std::string& job_id, const Run& run) {
  if (metrics_ == nullptr) return;
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    if (e.layer() < 0) continue;
    MetricLabels labels = {
        {"job", job_id}, {"layer", absl::StrCat(e.layer())}, {"expert", absl::StrCat(e.expert())}};
    metrics_->RemoveGauge("pith_coordinator_expert_heat", labels);
    for (const char* kind : {"store", "compute"}) {
      labels["kind"] = kind;
      metrics_->RemoveGauge("pith_coordinator_replicas", labels);
    }
  }
}

void Scheduler::UpdateMetricsLocked(const v1::Job& job, const Run& run) {
  if (metrics_ == nullptr) return;
  std::optional<HeatMap> heat = heat_->Snapshot(job.job_id());
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    if (e.layer() < 0) continue;
    MetricLabels labels = {{"job", job.job_id()},
                           {"layer", absl::StrCat(e.layer())},
                           {"expert", absl::StrCat(e.expert())}};
    if (heat) {
      absl::StatusOr<prometheus::Gauge*> g = metrics_->Gauge(
          "pith_coordinator_expert_heat", "Decayed tokens routed to an expert per step", labels);
      if (g.ok()) (*g)->Set(heat->heat(e.layer(), e.expert()));
    }
    for (const auto& [kind, count] :
         {std::pair<const char*, int>{"store", e.store_ids_size()}, {"compute", e.owners_size()}}) {
      labels["kind"] = kind;
      absl::StatusOr<prometheus::Gauge*> g = metrics_->Gauge(
          "pith_coordinator_replicas",
          "Copies of an expert: kind=store (stores holding it), kind=compute (owning workers)",
          labels);
      if (g.ok()) (*g)->Set(count);
    }
  }
}

}  // namespace pith::coordinator
