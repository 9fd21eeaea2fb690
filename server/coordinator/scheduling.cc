// The scheduler's tick, step by step (DESIGN §5): ended jobs release their workers,
// jobs that lost members get new ones and a repaired placement, drains progress, pending
// jobs are scheduled; and the workers' view of it, their assignments. See scheduler.h.
#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/compute_dtype.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {

bool Scheduler::Gone(const Alive& alive, const std::string& id, bool store) const {
  if ((store ? alive.stores : alive.workers).count(id)) return false;
  if (alive.known.count(id) > 0) return true;
  const absl::Duration leases = 3 * members_->lease();
  return options_.clock() > started_ + (store ? std::max(leases, kStoreRestartGrace) : leases);
}

std::set<std::string> Scheduler::AwaitedStores(const Run& run, const Alive& alive) const {
  std::set<std::string> awaited;
  if (run.committed < 0) return awaited;  // nothing committed: nothing to lose
  const int64_t now = NowMs(), grace = absl::ToInt64Milliseconds(kStoreRestartGrace);
  // The wait has one bound per job, so a store that keeps coming back and dying again
  // cannot hold it for ever: from the first wait since the last commit.
  if (run.wait_started_ms >= 0 && now - run.wait_started_ms >= grace) return {};
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    const auto& ids = e.store_ids();
    if (std::any_of(ids.begin(), ids.end(),
                    [&](const std::string& id) { return alive.stores.count(id) > 0; })) {
      continue;
    }
    bool hope = false;
    for (const std::string& id : ids) {
      auto down = alive.stores_down_since_ms.find(id);
      if (down != alive.stores_down_since_ms.end() && !run.record.lost_stores().contains(id) &&
          now - down->second < grace) {
        awaited.insert(id);
        hope = true;
      }
    }
    if (!hope) return {};  // this group is lost whatever comes back: no use waiting
  }
  return awaited;
}

bool Scheduler::WaitForStoreLocked(const std::string& job_id, Run& run, const Alive& alive,
                                   bool stores_lost, std::vector<StoreCall>* aborts) {
  if (!run.awaited_store.empty() && alive.stores.count(run.awaited_store) > 0) {
    // Back: its step of the job is checked (a crash may have lost commits) and the job
    // goes on from a fresh attempt.
    LOG(INFO) << "job " << job_id << ": store " << run.awaited_store << " is back";
    run.awaited_store.clear();
    NoteWaitLocked(job_id, run, Wait::kStore, "");
    run.verify_stores = true;
    run.failed_attempts = 0;  // attempts that failed on the store while it was down
    AbortLocked(run, "a store it waited for came back", aborts);
    if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
    return true;
  }
  const std::set<std::string> stores =
      stores_lost ? AwaitedStores(run, alive) : std::set<std::string>{};
  const std::string awaited = stores.empty() ? "" : *stores.begin();
  if (awaited.empty()) {
    LOG_IF(WARNING, !run.awaited_store.empty())
        << "job " << job_id << ": store " << run.awaited_store << " did not come back within "
        << absl::FormatDuration(kStoreRestartGrace);
    NoteWaitLocked(job_id, run, Wait::kStore, "");
    run.awaited_store.clear();
    return false;
  }
  if (run.awaited_store != awaited) {
    LOG(WARNING) << "job " << job_id << " waits for store " << awaited
                 << ", which died holding data no live store has a copy of (for at most "
                 << absl::FormatDuration(kStoreRestartGrace) << ")";
    run.awaited_store = awaited;
    NoteWaitLocked(
        job_id, run, Wait::kStore,
        absl::StrCat("waiting up to ", absl::FormatDuration(kStoreRestartGrace), " for store ",
                     awaited, ", which died holding data no live store has a copy of"));
    if (run.wait_started_ms < 0) run.wait_started_ms = NowMs();
    run.failed_attempts = 0;  // those of the store's last seconds do not count
    AbortLocked(run, absl::StrCat("waiting for store ", awaited), aborts);
    if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
  }
  return true;
}

void Scheduler::Tick() {
  members_->ExpireLeases();
  const Alive alive = Snapshot(*members_);
  StoreWork work;
  {
    absl::MutexLock lock(&mu_);
    ReviewRunsLocked(alive, &work);
    ForgetLeftDrainsLocked(alive);
    MarkDrainedStoresLocked(alive);
    SchedulePendingLocked(alive);
  }
  RunStoreAborts(work.aborts);
  VerifyStores(work.verifies);
  for (const auto& [job_id, step] : work.commits) Commit(job_id, step);
}

void Scheduler::ReviewRunsLocked(const Alive& alive, StoreWork* work) {
  for (auto it = runs_.begin(); it != runs_.end();) {
    const std::string job_id = it->first;
    Run& run = it->second;
    absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
    if (!job.ok() || IsFinal(job->state())) {
      ReleaseRunLocked(job_id, run, &work->aborts);
      it = runs_.erase(it);
      continue;
    }
    ++it;
    if (run.record.committing_step() >= 0) {
      // The decision is made: finish it before anything else changes.
      if (!run.committing) work->commits.emplace_back(job_id, run.record.committing_step());
      continue;
    }
    // Before a repair: a drop re-places, a dead peer is replaced. A job either failed is
    // left as it is: the next tick releases its run.
    if (ReviewRoomWaitLocked(job_id, run, *job, alive) ||
        ReviewPeerWaitLocked(job_id, run, *job, alive)) {
      continue;
    }
    RepairRunLocked(job_id, run, *job, alive, &work->aborts);
    NoteSilentWorkerLocked(job_id, run, alive);
    if (ForgetFullStoresLocked(run)) {
      if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
    }
    if (std::exchange(run.verify_stores, false)) {
      for (const std::string& id : JobStores(run)) {
        auto store = alive.stores.find(id);
        if (store != alive.stores.end())
          work->verifies.push_back({store->second, job_id, run.committed});
      }
    }
  }
}

void Scheduler::VerifyStores(const std::vector<StoreCall>& calls) {
  std::vector<std::pair<const StoreCall*, int64_t>> behind;  // and the store's step
  for (const StoreCall& c : calls) {
    absl::StatusOr<std::vector<v1::StoreJob>> jobs = stores_->ListJobs(c.store);
    if (!jobs.ok()) {
      LOG(WARNING) << "job " << c.job_id << ": cannot check store " << c.store.member_id()
                   << "'s step: " << jobs.status();
      continue;
    }
    for (const v1::StoreJob& j : *jobs) {
      if (j.job_id() == c.job_id && j.committed_step() >= 0 && j.committed_step() < c.step) {
        behind.emplace_back(&c, j.committed_step());
      }
    }
  }
  if (behind.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const auto& [c, step] : behind) {
    auto it = runs_.find(c->job_id);
    if (it == runs_.end()) continue;
    const std::string why =
        absl::StrCat("holds step ", step, " of the job, behind its committed step ", c->step,
                     " (it lost commits: a power loss with --sync_interval_ms?)");
    LOG(ERROR) << "job " << c->job_id << " no longer uses store " << c->store.member_id() << ": it "
               << why;
    (*it->second.record.mutable_lost_stores())[c->store.member_id()] = why;
    if (absl::Status s = PersistLocked(it->second); !s.ok()) LOG(ERROR) << s;
  }
}

void Scheduler::ReleaseRunLocked(const std::string& job_id, Run& run,
                                 std::vector<StoreCall>* aborts) {
  // Cancelled or failed: drop the attempt in flight and free the workers.
  if (run.record.committing_step() < 0) AbortLocked(run, "job ended", aborts);
  RemoveMetricsLocked(job_id, run);
  for (const std::string& w : run.record.workers()) worker_job_.erase(w);
  (void)jobs_->DeleteRecord(absl::StrCat(kRunPrefix, job_id));
  KeepHeatLocked(job_id);
  NoteJobEndedLocked(run);
}

void Scheduler::KeepHeatLocked(const std::string& job_id) {
  if (jobs_->Removed(job_id)) {
    heat_->Drop(job_id);
    if (absl::Status s = jobs_->DeleteRecord(absl::StrCat(kHeatPrefix, job_id)); !s.ok()) {
      LOG(WARNING) << "removed job " << job_id << ": " << s;
    }
    return;
  }
  if (const std::string heat = heat_->Save(job_id); !heat.empty()) {
    (void)jobs_->PutRecord(absl::StrCat(kHeatPrefix, job_id), heat);
  }
}

absl::StatusOr<v1::Job> Scheduler::Remove(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  {
    ASSIGN_OR_RETURN(const v1::Job job, jobs_->Get(job_id));
    if (!IsFinal(job.state())) return jobs_->Remove(job_id);  // refused, saying why
  }
  // An ended job's run goes at the next tick (a cancelled job's last commit may still be
  // landing): its workers then learn it ended, not that it is unknown.
  auto released = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !runs_.count(job_id); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&released), kRemoveWait)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job_id, " has ended but its workers are still being released; try again"));
  }
  if (auto e = exporting_.find(job_id); e != exporting_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is being exported (", e->second,
                     " checkpoint(s) in flight); remove it once they end"));
  }
  ASSIGN_OR_RETURN(v1::Job last, jobs_->Remove(job_id));
  KeepHeatLocked(job_id);  // removed: its heat goes
  return last;
}

void Scheduler::RepairRunLocked(const std::string& job_id, Run& run, const v1::Job& job,
                                const Alive& all, std::vector<StoreCall>* aborts) {
  const Alive alive = ForJob(all, run);  // a store the job lost is as good as dead to it
  // The worker count its plan was made for (0 when it gave its workers back to wait).
  const int planned_for = run.record.workers_size();
  std::vector<std::string> kept, lost;
  bool back = true;  // every member of the job is alive
  for (const std::string& w : run.record.workers()) {
    (Gone(alive, w, /*store=*/false) ? lost : kept).push_back(w);
    back &= alive.workers.count(w) > 0;
  }
  bool stores_lost = false, stores_awaited = false;
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    for (const auto* ids : {&e.store_ids(), &e.joining_store_ids()}) {
      for (const std::string& s : *ids) {
        const bool gone = Gone(alive, s, /*store=*/true);  // a lost store is not in `alive`
        stores_lost |= gone;
        stores_awaited |= !gone && alive.stores.count(s) == 0;
        back &= alive.stores.count(s) > 0;
      }
    }
  }
  if (run.recovering) {
    // Still in the grace period: members may come back. While a store is awaited nothing
    // ends it (a worker or another store gone meanwhile): the repair would take the
    // awaited store for lost, and with it maybe a group's last copy.
    if (!back && (stores_awaited || (lost.empty() && !stores_lost))) return;
    run.recovering = false;
    if (back) {
      run.verify_stores = true;
      AbortLocked(run, "the coordinator restarted", aborts);
      absl::Status s = PersistLocked(run);
      if (!s.ok()) LOG(ERROR) << s;
      return;
    }
  }
  if (WaitForStoreLocked(job_id, run, alive, stores_lost, aborts)) return;
  const int want = std::max(1, job.spec().cluster().workers());
  const std::vector<std::string> idle =
      IdleWorkersLocked(alive, job, kept, false, run.record.backend());
  // Fewer than min_workers did not fit a worker's memory: it waits until that many are free.
  const bool grow = static_cast<int>(kept.size()) < want && !idle.empty() &&
                    static_cast<int>(kept.size() + idle.size()) >= run.record.min_workers();
  // A job no worker trains says so (pith status); `why`: how it came to have none.
  const auto note_workers = [&](const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (kept.empty() == run.no_workers) return;
    run.no_workers = kept.empty();
    NoteWaitLocked(job_id, run, Wait::kWorkers,
                   kept.empty() ? absl::StrCat("waiting for a worker: ", why,
                                               ", and the job goes on from its last step when "
                                               "one joins")
                                : "");
  };
  if (lost.empty() && !stores_lost && !grow) {
    note_workers("none is free");  // a job a restarted coordinator reloaded with none
    return;
  }
  std::string reason =
      lost.empty() ? (stores_lost ? "a store died or was lost to the job" : "a worker joined")
                   : absl::StrCat("worker ", lost.front(), " died");
  AbortLocked(run, reason, aborts);
  run.failed_attempts = 0;  // failures while a member was dying do not count against the job
  for (const std::string& w : lost) worker_job_.erase(w);
  // A spare takes a lost worker's rank (the others keep theirs: their experts, their rows);
  // further spares join after them.
  std::vector<std::string> ranks;
  size_t spare = 0;
  const auto take_spare = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    worker_job_[idle[spare]] = job_id;
    ranks.push_back(idle[spare++]);
  };
  for (const std::string& w : run.record.workers()) {
    if (std::find(lost.begin(), lost.end(), w) == lost.end()) {
      ranks.push_back(w);
    } else if (spare < idle.size() && static_cast<int>(kept.size() + spare) < want) {
      take_spare();
    }
  }
  while (static_cast<int>(ranks.size()) < want && spare < idle.size()) take_spare();
  kept = std::move(ranks);
  note_workers(absl::StrCat(reason, ", no other is free"));
  run.record.clear_workers();
  for (const std::string& w : kept) {
    run.record.add_workers(w);
    auto it = alive.workers.find(w);
    if (it != alive.workers.end()) run.record.set_backend(it->second.backend());
  }
  ReplaceLocked(run, job, alive.store_ids(), alive.placeable_ids(), planned_for);
  absl::Status s = PersistLocked(run);
  if (!s.ok()) LOG(ERROR) << s;
}

bool Scheduler::ForgetFullStoresLocked(Run& run) {
  const absl::Time now = options_.clock();
  std::set<std::string> placed;
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    placed.insert(e.store_ids().begin(), e.store_ids().end());
    placed.insert(e.joining_store_ids().begin(), e.joining_store_ids().end());
  }
  bool forgot = false;
  auto* lost = run.record.mutable_lost_stores();
  for (auto it = run.full_since.begin(); it != run.full_since.end();) {
    it = lost->contains(it->first) ? std::next(it) : run.full_since.erase(it);
  }
  for (auto it = lost->begin(); it != lost->end();) {
    if (!absl::StartsWith(it->second, kFullDiskLoss)) {
      ++it;
      continue;
    }
    const absl::Time since = run.full_since.emplace(it->first, now).first->second;
    if (now - since < kFullStoreCooldown || placed.count(it->first)) {
      ++it;
      continue;
    }
    LOG(INFO) << "job " << run.record.job_id() << " may use store " << it->first
              << " again once it has disk room";
    run.full_since.erase(it->first);
    it = lost->erase(it);
    forgot = true;
  }
  return forgot;
}

void Scheduler::ReplaceLocked(Run& run, const v1::Job& job,
                              const std::vector<std::string>& live_stores,
                              const std::vector<std::string>& stores, int planned_for) {
  v1::PlacementTable previous = run.record.placement();
  const std::set<std::string> live(live_stores.begin(), live_stores.end());
  if (run.committed >= 0) {
    if (const std::string lost = UnheldGroup(run, live); !lost.empty()) {
      // The store's disk may well hold the data still: say how to get it back.
      const std::string reason = absl::StrCat(
          "every store copy of ", lost,
          " was lost to the job (a store that died keeps its data on disk: start it again "
          "on its --data_dir, then pith checkpoint this job and resubmit from the file with "
          "train.init_path)");
      (void)MarkFailed(job.job_id(), reason);
      return;  // the next Tick releases the run
    }
  }
  for (v1::ExpertPlacement& e : *previous.mutable_experts()) {
    auto* ids = e.mutable_store_ids();
    ids->erase(std::remove_if(ids->begin(), ids->end(),
                              [&](const std::string& id) { return !live.count(id); }),
               ids->end());
    auto* joining = e.mutable_joining_store_ids();
    joining->erase(std::remove_if(joining->begin(), joining->end(),
                                  [&](const std::string& id) { return !live.count(id); }),
                   joining->end());
  }
  std::vector<std::string> workers(run.record.workers().begin(), run.record.workers().end());
  // As many workers as before keep the plan by rank (only stores changed, or a spare took
  // a dead worker's rank): no expert moves between ranks, and the job's math stays that
  // of an undisturbed run. Otherwise the compute is re-planned.
  const int n = static_cast<int>(workers.size());
  std::optional<ComputePlan> kept = KeptPlan(previous, n, planned_for, job.spec().model());
  if (run.wider && run.wider->committed != run.committed) run.wider.reset();  // trained since
  if (!kept && run.wider && run.wider->workers == n) {
    kept = KeptPlan(run.wider->placement, n, n, job.spec().model());
  }
  if (n < planned_for && !run.wider) {
    run.wider = Run::WiderPlan{planned_for, run.committed, run.record.placement()};
  } else if (run.wider && n >= run.wider->workers) {
    run.wider.reset();
  }
  const ComputePlan plan =
      kept ? *std::move(kept) : PlanJobCompute(job, n, heat_->Snapshot(job.job_id()));
  const v1::PlacementTable before = run.record.placement();
  *run.record.mutable_placement() = BuildPlacement(job, workers, stores, plan, &previous,
                                                   previous.epoch() + 1, step_in_flight(run));
  NoteLeftLocked(run, before);
  const int64_t epoch = run.record.placement().epoch();
  (void)jobs_->Update(job.job_id(), [&](v1::Job& j) {
    j.set_placement_epoch(epoch);
    j.set_workers(static_cast<int>(workers.size()));
    return absl::OkStatus();
  });
  UpdateMetricsLocked(job, run);
}

std::string Scheduler::UnheldGroup(const Run& run, const std::set<std::string>& holding) {
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    if (e.store_ids().empty()) continue;
    if (std::any_of(e.store_ids().begin(), e.store_ids().end(),
                    [&](const std::string& id) { return holding.count(id) > 0; })) {
      continue;
    }
    std::string group = e.layer() < 0 ? "the dense tensors"
                                      : absl::StrCat("layer ", e.layer(), " expert ", e.expert());
    bool named = false;
    for (const std::string& id : e.store_ids()) {
      auto why = run.record.lost_stores().find(id);
      if (why != run.record.lost_stores().end()) {
        absl::StrAppend(&group, " (store ", id, " ", why->second, ")");
        named = true;
        break;
      }
    }
    if (!named) {  // its stores died (their leases ran out)
      absl::StrAppend(&group, " (held by ", absl::StrJoin(e.store_ids(), ", "),
                      e.store_ids().size() == 1 ? ", which is gone)" : ", which are gone)");
    }
    return group;
  }
  return "";
}

void Scheduler::SchedulePendingLocked(const Alive& alive) {
  std::vector<v1::Job> waiting = jobs_->List({v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING}, 0);
  std::reverse(waiting.begin(), waiting.end());
  bool cuda_reserved = false;  // a bf16 job waits for CUDA workers: later jobs take others
  std::string ahead;           // the first job that waits for busy workers: later ones queue
  // A running job that gave its workers back to wait for more (its min_workers) comes
  // first, where the cluster has that many of its kind: pending jobs would otherwise take
  // each worker as it frees up, and it would never resume.
  for (const auto& [id, run] : runs_) {
    if (!run.no_workers || run.record.min_workers() < 2 || !ahead.empty()) continue;
    absl::StatusOr<v1::Job> job = jobs_->Get(id);
    if (job.ok() && WorkersFor(alive, job->spec(), false) >= run.record.min_workers()) ahead = id;
  }
  const size_t placeable = alive.placeable_ids().size();
  for (auto it = pending_reasons_.begin(); it != pending_reasons_.end();) {
    const bool waits = std::any_of(waiting.begin(), waiting.end(),
                                   [&](const v1::Job& j) { return j.job_id() == it->first; });
    it = waits ? std::next(it) : pending_reasons_.erase(it);
  }
  for (const v1::Job& job : waiting) {
    if (runs_.count(job.job_id())) continue;
    const int want = std::max(1, job.spec().cluster().workers());
    if (placeable == 0) {
      SetPendingReasonLocked(job, alive.stores.empty() ? "waiting for a store (none is alive)"
                                  : alive.full.empty()
                                      ? "waiting for a store that is not draining"
                                      : "waiting for a store that is not draining and has disk "
                                        "room (pith cluster: disk low or DISK FULL)");
      continue;
    }
    std::vector<std::string> idle = IdleWorkersLocked(alive, job, {}, cuda_reserved);
    // Workers of the job's kind alive at all, idle or not: a job that wants more cannot
    // run until more join, so it does not hold back the jobs behind it.
    const int could = WorkersFor(alive, job.spec(), cuda_reserved);
    if (could < want) {
      SetPendingReasonLocked(
          job, absl::StrCat("waiting for ", want, want == 1 ? " worker (" : " workers (", could,
                            " alive); jobs that fit start before it"));
      continue;
    }
    if (!ahead.empty() || static_cast<int>(idle.size()) < want) {
      SetPendingReasonLocked(
          job, !ahead.empty() ? absl::StrCat("queued behind ", ahead)
                              : absl::StrCat("waiting for ", want,
                                             want == 1 ? " idle worker (" : " idle workers (",
                                             idle.size(), " idle; the others train jobs)"));
      if (NeedsCuda(job.spec())) {
        cuda_reserved = true;
      } else if (ahead.empty()) {
        ahead = job.job_id();  // first come, first served
      }
      continue;
    }
    idle.resize(want);
    Run run;
    run.committed = job.committed_step();
    run.record.set_job_id(job.job_id());
    for (const std::string& w : idle) run.record.add_workers(w);
    run.record.set_backend(alive.workers.at(idle.front()).backend());
    run.record.set_assignment_version(NextVersion(0));
    run.record.set_committing_step(-1);
    *run.record.mutable_placement() = BuildPlacement(
        job, idle, alive.placeable_ids(), PlanJobCompute(job, want, heat_->Snapshot(job.job_id())),
        nullptr, job.placement_epoch() + 1, run.committed + 1);
    absl::Status s = PersistLocked(run);
    if (!s.ok()) {
      LOG(ERROR) << s;
      continue;
    }
    const int64_t epoch = run.record.placement().epoch();
    pending_reasons_.erase(job.job_id());
    (void)jobs_->Update(job.job_id(), [&](v1::Job& j) {
      j.set_state(v1::JOB_STATE_RUNNING);
      j.clear_pending_reason();
      if (j.started_unix_ms() == 0) j.set_started_unix_ms(NowMs());
      j.set_placement_epoch(epoch);
      j.set_workers(want);
      return absl::OkStatus();
    });
    for (const std::string& w : idle) worker_job_[w] = job.job_id();
    LOG(INFO) << "job " << job.job_id() << " scheduled on " << want << " worker(s)";
    UpdateMetricsLocked(job, run);
    runs_[job.job_id()] = std::move(run);
  }
}

void Scheduler::NoteWaitLocked(const std::string& job_id, Run& run, Wait wait,
                               const std::string& reason) {
  if (reason.empty() ? run.waits.erase(wait) == 0 : run.waits[wait] == reason) return;
  if (!reason.empty()) run.waits[wait] = reason;
  (void)jobs_->Update(job_id, [&](v1::Job& j) {
    if (j.state() == v1::JOB_STATE_RUNNING) j.set_pending_reason(WaitReasons(run));
    return absl::OkStatus();
  });
}

std::string Scheduler::WaitReasons(const Run& run) {
  std::string joined;
  for (const auto& [wait, reason] : run.waits) {
    absl::StrAppend(&joined, joined.empty() ? "" : kAlsoWaiting, reason);
  }
  return joined;
}

void Scheduler::SetPendingReasonLocked(const v1::Job& job, const std::string& reason) {
  if (job.state() != v1::JOB_STATE_PENDING) return;  // a running job waiting to resume
  std::string& recorded = pending_reasons_[job.job_id()];
  if (recorded == reason && job.pending_reason() == reason) return;
  recorded = reason;
  (void)jobs_->Update(job.job_id(), [&](v1::Job& j) {
    j.set_pending_reason(reason);
    return absl::OkStatus();
  });
}

int Scheduler::WorkersFor(const Alive& alive, const v1::JobSpec& spec, bool cuda_reserved) {
  std::map<v1::Backend, int> count;
  for (const auto& [id, m] : alive.workers) ++count[m.backend()];
  if (NeedsCuda(spec)) return cuda_reserved ? 0 : count[v1::BACKEND_CUDA];
  if (cuda_reserved) count.erase(v1::BACKEND_CUDA);
  int most = 0;
  for (const auto& [backend, n] : count) most = std::max(most, n);
  return most;
}

bool Scheduler::NeedsCuda(const v1::JobSpec& spec) {
  return ParseComputeDtype(spec.model().compute_dtype()).value_or(ComputeDtype::kFp32) ==
         ComputeDtype::kBf16;
}

std::vector<std::string> Scheduler::IdleWorkersLocked(const Alive& alive, const v1::Job& job,
                                                      const std::vector<std::string>& job_workers,
                                                      bool cuda_reserved,
                                                      v1::Backend job_backend) const {
  std::map<v1::Backend, std::vector<std::string>> idle;
  for (const auto& [id, m] : alive.workers) {
    if (!worker_job_.count(id)) idle[m.backend()].push_back(id);
  }
  for (const std::string& w : job_workers) {
    auto it = alive.workers.find(w);
    if (it != alive.workers.end()) return idle[it->second.backend()];
  }
  if (!job_workers.empty() && job_backend != v1::BACKEND_AUTO) return idle[job_backend];
  if (NeedsCuda(job.spec()))
    return cuda_reserved ? std::vector<std::string>{} : idle[v1::BACKEND_CUDA];
  if (cuda_reserved) idle.erase(v1::BACKEND_CUDA);
  const std::vector<std::string>* best = nullptr;
  for (const auto& [backend, ids] : idle) {  // ascending: CUDA last, so it wins ties
    if (best == nullptr || ids.size() >= best->size()) best = &ids;
  }
  return best != nullptr ? *best : std::vector<std::string>{};
}

absl::Status Scheduler::AdmitToAttemptLocked(const std::string& worker_id,
                                             const v1::MemberInfo& worker, Run& run,
                                             std::vector<StoreCall>* aborts) {
  if (run.record.committing_step() >= 0) {
    return absl::UnavailableError(absl::StrCat("job ", run.record.job_id(), " is committing step ",
                                               run.record.committing_step(), "; retry"));
  }
  if (run.issued_version != run.record.assignment_version()) {
    run.issued.clear();
    run.issued_version = run.record.assignment_version();
  }
  auto [issued, first] = run.issued.emplace(worker_id, worker.ucx_address());
  if (first || issued->second == worker.ucx_address()) return absl::OkStatus();
  // The attempt's other workers wait on messages the dead process was to send, or sent
  // theirs to it: all of them start the next attempt together.
  AbortLocked(run, absl::StrCat("worker ", worker_id, " restarted"), aborts);
  if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
  run.issued.clear();
  run.issued_version = run.record.assignment_version();
  run.issued[worker_id] = worker.ucx_address();
  return absl::OkStatus();
}

absl::StatusOr<v1::Assignment> Scheduler::GetAssignment(const std::string& worker_id) {
  const Alive alive = Snapshot(*members_);
  auto self = alive.workers.find(worker_id);
  if (self == alive.workers.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id, ": register again"));
  }
  std::vector<StoreCall> aborts;
  absl::StatusOr<v1::Assignment> a;
  {
    absl::MutexLock lock(&mu_);
    a = AssignmentLocked(worker_id, self->second, alive, &aborts);
  }
  RunStoreAborts(aborts);
  return a;
}

absl::StatusOr<v1::Assignment> Scheduler::AssignmentLocked(const std::string& worker_id,
                                                           const v1::MemberInfo& worker,
                                                           const Alive& alive,
                                                           std::vector<StoreCall>* aborts) {
  v1::Assignment a;
  auto w = worker_job_.find(worker_id);
  if (w == worker_job_.end()) return a;  // idle
  Run& run = runs_.at(w->second);
  if (const std::string paused = PausedLocked(run); !paused.empty()) {
    return absl::UnavailableError(absl::StrCat("job ", w->second, " ", paused, "; retry"));
  }
  RETURN_IF_ERROR(AdmitToAttemptLocked(worker_id, worker, run, aborts));
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(w->second));
  a.set_assignment_version(run.record.assignment_version());
  a.set_job_id(job.job_id());
  *a.mutable_spec() = job.spec();
  a.set_world(run.record.workers_size());
  for (int rank = 0; rank < run.record.workers_size(); ++rank) {
    const std::string& id = run.record.workers(rank);
    if (id == worker_id) a.set_rank(rank);
    auto peer = alive.workers.find(id);
    if (peer == alive.workers.end()) {
      // Dead: the next pass replaces it (or shrinks the job) under a new attempt; a run
      // joining this one would fail on the missing address.
      return absl::UnavailableError(
          absl::StrCat("job ", job.job_id(), " is replacing worker ", id, "; retry"));
    }
    *a.add_peers() = peer->second;
  }
  // The processes this attempt's workers were told of, as well as those that asked: a
  // process that took none of them yet but whose address a peer holds (it died, and a new
  // one registered before its death was seen) is the attempt's too.
  for (const v1::MemberInfo& p : a.peers()) run.issued.emplace(p.member_id(), p.ucx_address());
  for (const auto& [id, store] : alive.stores) *a.add_stores() = store;
  *a.mutable_placement() = run.record.placement();
  a.set_committed_step(run.committed);
  return a;
}

int64_t Scheduler::AssignmentVersion(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto w = worker_job_.find(worker_id);
  if (w == worker_job_.end()) return 0;
  return runs_.at(w->second).record.assignment_version();
}

absl::StatusOr<v1::PlacementTable> Scheduler::GetPlacement(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it == runs_.end())
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not running"));
  return it->second.record.placement();
}

}  // namespace pith::coordinator
