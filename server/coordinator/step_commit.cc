// The step-commit protocol (DESIGN §5, §6): workers report a step written, the last
// report has the job's stores prepare it and decides the commit (durably), every live
// store commits it, and the job advances: its figures, its end, its placement for the
// next step. See scheduler.h.
#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_state.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {
namespace {

// `call` on each of `stores` at once (each syncs or writes to its disk); the answers in
// their order.
template <typename Answer>
std::vector<Answer> OnEachStore(const std::vector<v1::MemberInfo>& stores,
                                absl::FunctionRef<Answer(const v1::MemberInfo&)> call) {
  std::vector<Answer> answers(stores.size());
  std::vector<std::thread> callers;
  for (size_t i = 0; i < stores.size(); ++i) {
    callers.emplace_back([&answers, &stores, &call, i] { answers[i] = call(stores[i]); });
  }
  for (std::thread& t : callers) t.join();
  return answers;
}

// What the job's stores answered to a step's prepare.
struct PrepareAnswers {
  std::set<std::string> prepared_on;          // stores that prepared what was written to them
  std::string problems;                       // every other store, and why
  std::map<std::string, std::string> silent;  // stores that did not answer, and why
  bool answered_wrongly = false;              // a store answered, and had not prepared
};

PrepareAnswers TakePrepareAnswers(const std::vector<v1::MemberInfo>& stores,
                                  std::map<std::string, uint64_t> expected,
                                  const std::vector<absl::StatusOr<uint64_t>>& answers) {
  PrepareAnswers out;
  for (size_t i = 0; i < stores.size(); ++i) {
    const std::string& id = stores[i].member_id();
    std::string problem;
    if (!answers[i].ok()) {
      problem = std::string(answers[i].status().message());
      const absl::StatusCode code = answers[i].status().code();
      if (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded ||
          code == absl::StatusCode::kCancelled) {
        out.silent[id] = problem;
      } else {
        out.answered_wrongly = true;
      }
    } else if (*answers[i] < expected[id]) {
      problem =
          absl::StrCat("it holds ", *answers[i], " of the ", expected[id], " blobs written to it");
      out.answered_wrongly = true;
    } else {
      out.prepared_on.insert(id);
      continue;
    }
    absl::StrAppend(&out.problems, out.problems.empty() ? "" : "; ", "store ", id, ": ", problem);
  }
  return out;
}

}  // namespace

v1::StepStatus Scheduler::StatusLocked(const std::string& job_id, const Run& run,
                                       int64_t step) const {
  v1::StepStatus s;
  s.set_job_id(job_id);
  s.set_step(step);
  s.set_committed_step(run.committed);
  s.set_assignment_version(run.record.assignment_version());
  s.set_placement_epoch(run.record.placement().epoch());
  return s;
}

absl::Status Scheduler::PinDataLocked(Run& run, const v1::StepWrittenRequest& r) {
  if (!r.has_data()) return absl::OkStatus();  // a worker of an earlier build names none
  if (!run.data.has_value()) {
    ASSIGN_OR_RETURN(const v1::Job job, jobs_->Get(r.job_id()));
    if (job.has_data()) run.data = job.data();
  }
  if (!run.data.has_value()) {  // the first report pins it
    v1::DataFingerprint pin = r.data();
    pin.set_worker_id(r.worker_id());
    RETURN_IF_ERROR(jobs_
                        ->Update(r.job_id(),
                                 [&](v1::Job& j) {
                                   *j.mutable_data() = pin;
                                   return absl::OkStatus();
                                 })
                        .status());
    run.data = pin;
    return absl::OkStatus();
  }
  if (run.data->bytes() == r.data().bytes() && run.data->crc32c() == r.data().crc32c()) {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrFormat(
      "train.data_path: this worker read %d bytes (CRC32C %08x), but the job has trained on "
      "%d bytes (CRC32C %08x, as worker %s read it): the file changed since the job started, "
      "or the workers' hosts hold different copies",
      r.data().bytes(), r.data().crc32c(), run.data->bytes(), run.data->crc32c(),
      run.data->worker_id().empty() ? "?" : run.data->worker_id()));
}

absl::StatusOr<v1::StepStatus> Scheduler::ReportStepWritten(const v1::StepWrittenRequest& r) {
  if (!r.ok() && r.fatal()) return FailJob(r);
  if (!r.ok() && r.needs_more_workers()) return WaitForMoreWorkers(r);
  std::vector<StoreCall> aborts;
  std::optional<int64_t> prepare;  // the attempt whose step every worker wrote
  std::string give_up;             // the job fails with this reason
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(r.job_id());
    if (it == runs_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", r.job_id(), " is not running"));
    }
    Run& run = it->second;
    // The attempt was voided: no failure counts now.
    if (const std::string paused = PausedLocked(run); !paused.empty()) {
      return absl::UnavailableError(absl::StrCat("job ", r.job_id(), " ", paused, "; retry"));
    }
    const auto& workers = run.record.workers();
    const auto pos = std::find(workers.begin(), workers.end(), r.worker_id());
    if (pos == workers.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", r.worker_id(), " is not training job ", r.job_id()));
    }
    if (r.step() <= run.committed) return StatusLocked(r.job_id(), run, r.step());
    if (r.assignment_version() != run.record.assignment_version()) {
      return absl::AbortedError(absl::StrCat("step ", r.step(), " of job ", r.job_id(),
                                             " was aborted (", run.abort_reason,
                                             "); fetch the new assignment"));
    }
    if (r.step() != step_in_flight(run)) {
      return absl::FailedPreconditionError(absl::StrCat("job ", r.job_id(), " is at step ",
                                                        step_in_flight(run), ", not ", r.step()));
    }
    if (run.record.committing_step() >= 0) return StatusLocked(r.job_id(), run, r.step());
    if (!r.ok()) {
      give_up = FailedReportLocked(run, r, &aborts);
    } else if (absl::Status data = PinDataLocked(run, r); !data.ok()) {
      if (!absl::IsFailedPrecondition(data)) return data;  // not recorded: the report retries
      // Other bytes than the job trained on: no retry reads the right ones.
      give_up = absl::StrCat("worker ", r.worker_id(), ": ", data.message());
      AbortLocked(run, give_up, &aborts);
      absl::Status s = PersistLocked(run);
      if (!s.ok()) LOG(ERROR) << s;
    } else if (run.written.insert(r.worker_id()).second) {
      for (const v1::BlobInfo& b : r.written()) {
        if (b.version() != r.step()) continue;
        const v1::BlobKey& k = b.key();
        run.written_blobs[GroupOf(k.layer(), k.expert())].insert(
            absl::StrCat(k.kind(), "/", k.tensor()));
      }
      run.tokens += r.tokens();
      run.cache_hits += r.cache_hits();
      run.cache_misses += r.cache_misses();
      if (pos == workers.begin()) run.rank0 = r;
      if (run.written.size() == static_cast<size_t>(workers.size())) {
        prepare = run.record.assignment_version();
      }
    }
  }
  RunStoreAborts(aborts);
  if (prepare) {
    ASSIGN_OR_RETURN(const bool decided, PrepareAndDecide(r, *prepare));
    if (decided) Commit(r.job_id(), r.step());
  }
  if (!give_up.empty()) {
    RETURN_IF_ERROR(MarkFailed(r.job_id(), give_up));
  }
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(r.job_id());
  v1::StepStatus status;
  if (it != runs_.end()) {
    status = StatusLocked(r.job_id(), it->second, r.step());
  } else {
    status.set_job_id(r.job_id());
    status.set_step(r.step());
    status.set_committed_step(r.step());
    status.set_job_ended(true);
  }
  // Voided by this report, or by the prepare it started.
  const bool voided = it != runs_.end() && it->second.committed < r.step() &&
                      it->second.record.assignment_version() != r.assignment_version();
  if (!r.ok() || voided) {
    status.set_aborted(true);
    status.set_abort_reason(it != runs_.end() ? it->second.abort_reason : r.failure());
  }
  return status;
}

std::string Scheduler::FailedReportLocked(Run& run, const v1::StepWrittenRequest& r,
                                          std::vector<StoreCall>* aborts) {
  const std::string reason = absl::StrCat("worker ", r.worker_id(), ": ",
                                          r.failure().empty() ? "step failed" : r.failure());
  std::string give_up;
  const std::string& full = r.full_store_id();
  const Alive alive = full.empty() ? Alive() : ForJob(Snapshot(*members_), run);
  if (!full.empty() && DropFullStoreLocked(run, full, reason, alive)) {
    AbortLocked(run, reason, aborts);  // no attempt counts: the next tick re-places
  } else if (!full.empty() && JobStores(run).count(full) && alive.full.count(full)) {
    give_up = WaitForRoomLocked(r.job_id(), run, full, reason, alive, aborts);  // an only copy
  } else if (!r.unreachable_worker_id().empty() &&
             WaitForPeerLocked(r.job_id(), run, r.worker_id(), r.unreachable_worker_id(), reason,
                               aborts)) {
    // not counted: the peer's fate decides (ReviewPeerWaitLocked)
  } else {
    give_up = FailAttemptLocked(run, r.step(), reason, aborts);
  }
  if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
  return give_up;
}

std::string Scheduler::FailAttemptLocked(Run& run, int64_t step, const std::string& reason,
                                         std::vector<StoreCall>* aborts) {
  AbortLocked(run, reason, aborts);
  return CountAttemptLocked(run, step, reason);
}

std::string Scheduler::CountAttemptLocked(Run& run, int64_t step, const std::string& reason) {
  run.failed_attempts = run.failed_step == step ? run.failed_attempts + 1 : 1;
  run.failed_step = step;
  if (run.failed_attempts < options_.step_attempts) return "";
  return absl::StrCat("step ", step, " failed ", run.failed_attempts,
                      " attempts in a row; the last: ", reason);
}

bool Scheduler::DropFullStoreLocked(Run& run, const std::string& store, const std::string& why,
                                    const Alive& alive) {
  // Dropped already (a report of an attempt before the next tick's repair re-placed it).
  if (run.record.lost_stores().contains(store)) return true;
  if (!JobStores(run).count(store)) return false;  // not the job's
  if (run.committed >= 0) {
    // Holders that count: live, with room (a job that drops one full store for another
    // keeps its last copies on a disk that refuses them).
    if (!OnlyCopiesOn(run, store, alive).empty()) return false;  // it holds one's only copy
  } else {  // nothing committed to keep: its groups start again where there is room
    const std::vector<std::string> room = alive.placeable_ids();
    if (room.empty() || (room.size() == 1 && room[0] == store)) return false;
  }
  StoreTroubleLocked(run, store, "puts", absl::StrCat(kFullDiskLoss, " (", why, ")"),
                     /*refused=*/true);
  run.full_since[store] = options_.clock();
  return true;
}

std::map<std::string, uint64_t> Scheduler::ExpectedBlobsLocked(const Run& run) {
  std::map<std::string, uint64_t> expected;
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    auto written = run.written_blobs.find(GroupOf(e.layer(), e.expert()));
    if (written == run.written_blobs.end()) continue;
    for (const std::string& id : e.store_ids()) expected[id] += written->second.size();
  }
  return expected;
}

absl::StatusOr<bool> Scheduler::PrepareAndDecide(const v1::StepWrittenRequest& r, int64_t attempt) {
  const Alive alive = Snapshot(*members_);
  std::vector<v1::MemberInfo> targets;
  std::map<std::string, uint64_t> expected;
  bool stores_down = false;  // a store of the job is not alive: it cannot prepare
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(r.job_id());
    if (it == runs_.end() || it->second.record.assignment_version() != attempt) return false;
    for (const std::string& id : JobStores(it->second)) {
      auto store = alive.stores.find(id);
      if (store != alive.stores.end()) {
        targets.push_back(store->second);
      } else {
        stores_down = true;
      }
    }
    expected = ExpectedBlobsLocked(it->second);
  }
  const PrepareAnswers answers = TakePrepareAnswers(
      targets, expected,
      OnEachStore<absl::StatusOr<uint64_t>>(targets, [&](const v1::MemberInfo& store) {
        return stores_->PrepareStep(store, r.job_id(), r.step(), attempt);
      }));
  std::vector<StoreCall> aborts;
  std::string give_up;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(r.job_id());
    if (it == runs_.end() || it->second.record.assignment_version() != attempt ||
        it->second.record.committing_step() >= 0) {
      return false;  // voided (or decided) meanwhile
    }
    Run& run = it->second;
    for (const std::string& id : answers.prepared_on) run.commit_trouble.erase(id);
    for (const auto& [id, why] : answers.silent)
      StoreTroubleLocked(run, id, "prepares", why, false);
    const std::string unheld = UnheldGroup(run, answers.prepared_on);
    if (unheld.empty()) {
      LOG_IF(WARNING, !answers.problems.empty())
          << "job " << r.job_id() << ": step " << r.step() << " goes on without a prepare on "
          << answers.problems;
      run.record.set_committing_step(r.step());
      // The decision is durable before any store hears of it; if it cannot be made
      // durable, it is not made.
      if (absl::Status persisted = PersistLocked(run); !persisted.ok()) {
        run.record.set_committing_step(-1);
        run.written.erase(r.worker_id());
        return persisted;
      }
      return true;
    }
    // A group no store made crash-proof: the step is redone. Stores that answered wrongly,
    // all of the job's alive and answering, count as a failed attempt; a store that is
    // down or silent is the membership's (or the patience's) to judge.
    const std::string reason =
        absl::StrCat("step ", r.step(), " was prepared on no copy of ", unheld,
                     answers.problems.empty() ? " (its stores are down)" : ": ", answers.problems);
    if (answers.answered_wrongly && answers.silent.empty() && !stores_down) {
      give_up = FailAttemptLocked(run, r.step(), reason, &aborts);
    } else {
      AbortLocked(run, reason, &aborts);
    }
    if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
  }
  RunStoreAborts(aborts);
  if (!give_up.empty()) RETURN_IF_ERROR(MarkFailed(r.job_id(), give_up));
  return false;
}

absl::Status Scheduler::CheckReporterLocked(const v1::StepWrittenRequest& r) {
  auto it = runs_.find(r.job_id());
  const auto& workers = it != runs_.end() ? it->second.record.workers()
                                          : google::protobuf::RepeatedPtrField<std::string>();
  if (std::find(workers.begin(), workers.end(), r.worker_id()) == workers.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", r.worker_id(), " is not training job ", r.job_id()));
  }
  // A report about an older assignment (a placement since replaced) changes nothing.
  if (r.assignment_version() != it->second.record.assignment_version()) {
    return absl::AbortedError(
        absl::StrCat("job ", r.job_id(), " has a newer assignment; fetch it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::StepStatus> Scheduler::WaitForMoreWorkers(const v1::StepWrittenRequest& r) {
  ASSIGN_OR_RETURN(const v1::Job job, jobs_->Get(r.job_id()));
  const int want = std::max(1, job.spec().cluster().workers());
  std::vector<StoreCall> aborts;
  std::optional<v1::StepStatus> status;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckReporterLocked(r));
    Run& run = runs_.at(r.job_id());
    // As for any report: nothing counts while the job waits for its members or a store,
    // and a commit under way is not aborted.
    if (run.recovering || !run.awaited_store.empty()) {
      return absl::UnavailableError(
          absl::StrCat("job ", r.job_id(), " is waiting for its members; retry"));
    }
    if (run.record.committing_step() >= 0) return StatusLocked(r.job_id(), run, r.step());
    const int have = run.record.workers_size();
    if (have < want) {
      // Its workers go back to the pool (other jobs may take them) until enough are idle.
      const std::string why = absl::StrCat("with ", have, " of its ", want, " workers, worker ",
                                           r.worker_id(), ": ", r.failure());
      run.record.set_min_workers(std::max(run.record.min_workers(), have + 1));
      AbortLocked(run, why, &aborts);
      for (const std::string& w : run.record.workers()) worker_job_.erase(w);
      run.record.clear_workers();
      run.no_workers = true;
      (void)jobs_->Update(r.job_id(), [](v1::Job& j) {
        j.set_workers(0);
        return absl::OkStatus();
      });
      NoteWaitLocked(r.job_id(), run, Wait::kWorkers,
                     absl::StrCat("waiting for ", run.record.min_workers(), " workers (", why,
                                  "); the job goes on from its last step when they are free"));
      if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
      status = StatusLocked(r.job_id(), run, r.step());
      status->set_aborted(true);
      status->set_abort_reason(why);
    }
  }
  if (!status.has_value()) return FailJob(r);  // every worker it asked for: it cannot fit
  RunStoreAborts(aborts);
  return *status;
}

absl::StatusOr<v1::StepStatus> Scheduler::FailJob(const v1::StepWrittenRequest& r) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckReporterLocked(r));
  }
  const std::string reason = absl::StrCat("worker ", r.worker_id(), ": ", r.failure());
  RETURN_IF_ERROR(MarkFailed(r.job_id(), reason));
  v1::StepStatus status;  // the next Tick releases the run
  status.set_job_id(r.job_id());
  status.set_step(r.step());
  status.set_aborted(true);
  status.set_abort_reason(reason);
  status.set_job_ended(true);
  return status;
}

absl::Status Scheduler::MarkFailed(const std::string& job_id, const std::string& reason) {
  bool failed = false;
  absl::Status s = jobs_
                       ->Update(job_id,
                                [&](v1::Job& j) -> absl::Status {
                                  if (IsFinal(j.state())) return absl::OkStatus();
                                  j.set_state(v1::JOB_STATE_FAILED);
                                  j.set_failure_reason(reason);
                                  j.clear_pending_reason();
                                  j.set_finished_unix_ms(NowMs());
                                  failed = true;
                                  return absl::OkStatus();
                                })
                       .status();
  LOG_IF(ERROR, failed) << "job " << job_id << " failed: " << reason;
  return s;
}

void Scheduler::Commit(const std::string& job_id, int64_t step) {
  const Alive alive = Snapshot(*members_);
  std::vector<v1::MemberInfo> targets;
  std::map<std::string, uint64_t> expected;  // blobs written to each store's complete copies
  int64_t attempt = 0;
  bool all = true;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it == runs_.end() || it->second.committing || it->second.holds > 0 ||
        it->second.record.committing_step() != step) {
      return;  // a held commit is finished by Tick once the checkpoint is done
    }
    Run& run = it->second;
    run.committing = true;
    // The decided attempt: nothing moves the assignment version on before the commit ends.
    attempt = run.record.assignment_version();
    // The job's stores commit, no other: one not alive yet (after a restart), or one that
    // died holding a group's only copy (AwaitedStores), holds the commit back until it
    // registers again or is declared gone.
    const std::set<std::string> awaited = AwaitedStores(run, alive);
    for (const std::string& id : JobStores(run)) {
      auto store = alive.stores.find(id);
      if (store != alive.stores.end()) {
        targets.push_back(store->second);
      } else if (!Gone(alive, id, /*store=*/true) || awaited.contains(id)) {
        all = false;
        run.commit_trouble.erase(id);  // its patience starts again once it is back
      }
    }
    expected = ExpectedBlobsLocked(run);
  }
  // The stores commit side by side: each syncs the step's bytes to its disk.
  const std::vector<absl::StatusOr<v1::CommitStepResponse>> results =
      OnEachStore<absl::StatusOr<v1::CommitStepResponse>>(
          targets, [&](const v1::MemberInfo& store) {
            return stores_->CommitStep(store, job_id, step, attempt);
          });
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it == runs_.end()) return;
  Run& run = it->second;
  run.committing = false;
  std::set<std::string> committed_on;
  for (size_t i = 0; i < targets.size(); ++i) {
    const std::string& id = targets[i].member_id();
    if (CheckCommitLocked(run, id, step, results[i], expected[id])) {
      committed_on.insert(id);
    } else if (!run.record.lost_stores().contains(id)) {
      all = false;  // retried by Tick until the store answers or the job loses it
    }
  }
  if (all) {
    // Every store answered or is gone: each group needs one complete copy that committed.
    if (const std::string lost = UnheldGroup(run, committed_on); !lost.empty()) {
      const std::string reason = absl::StrCat("step ", step, " committed on no copy of ", lost);
      (void)MarkFailed(job_id, reason);
      return;  // the next Tick releases the run
    }
  }
  run.copies.committed_on = std::move(committed_on);
  if (all) FinishCommitLocked(job_id, run);
}

bool Scheduler::CheckCommitLocked(Run& run, const std::string& store, int64_t step,
                                  const absl::StatusOr<v1::CommitStepResponse>& answer,
                                  uint64_t expected) {
  std::string problem;
  bool refused = true;  // the store answered, wrongly: no retry can mend its copy
  if (!answer.ok()) {
    problem = std::string(answer.status().message());
    refused = answer.status().code() == absl::StatusCode::kFailedPrecondition ||
              answer.status().code() == absl::StatusCode::kInvalidArgument;
  } else if (answer->committed_step() != step) {
    problem =
        absl::StrCat("answered the commit of step ", step, " with step ", answer->committed_step());
  } else if (!answer->already_committed() && answer->blobs_committed() < expected) {
    problem = absl::StrCat("committed ", answer->blobs_committed(), " blobs of step ", step,
                           " where ", expected, " were written to it");
  } else {
    run.commit_trouble.erase(store);
    return true;
  }
  LOG(WARNING) << "job " << run.record.job_id() << ": commit of step " << step << " on store "
               << store << ": " << problem;
  StoreTroubleLocked(run, store, "commits", problem, refused);
  return false;
}

void Scheduler::StoreTroubleLocked(Run& run, const std::string& store, const std::string& calls,
                                   const std::string& problem, bool refused) {
  const absl::Time now = options_.clock();
  const absl::Time since = run.commit_trouble.emplace(store, now).first->second;
  const absl::Duration patience = 3 * members_->lease();
  if (!refused && now - since < patience) return;
  const std::string why = refused ? problem
                                  : absl::StrCat("failed the job's ", calls, " for ",
                                                 absl::FormatDuration(now - since), ": ", problem);
  LOG(ERROR) << "job " << run.record.job_id() << " no longer uses store " << store << ": " << why;
  (*run.record.mutable_lost_stores())[store] = why;
  run.commit_trouble.erase(store);
  absl::Status s = PersistLocked(run);
  if (!s.ok()) LOG(ERROR) << s;
}

void Scheduler::FinishCommitLocked(const std::string& job_id, Run& run) {
  const int64_t step = run.record.committing_step();
  const absl::Time now_time = options_.clock();
  const int64_t now = absl::ToUnixMillis(now_time);
  double seconds = 0;
  if (run.last_commit != absl::InfinitePast()) {
    seconds = absl::ToDoubleSeconds(now_time - run.last_commit);
  } else if (run.record.last_commit_unix_ms() > 0) {  // the previous commit was before a restart
    seconds = (now - run.record.last_commit_unix_ms()) / 1e3;
  }
  bool ended = false;
  absl::StatusOr<v1::Job> job = jobs_->Update(job_id, [&](v1::Job& j) {
    j.set_committed_step(step);
    j.set_pending_reason(WaitReasons(run));  // those of before a restart are over
    // The step's figures, where rank 0's report reached this process: a commit a restart
    // finished may have none (the reports went to the process before), and its job keeps
    // the figures it had, not zeros (a watch would show loss 0.0000, 0 tokens/s).
    if (step >= 1 && !run.rank0.worker_id().empty()) {
      j.set_last_loss(run.rank0.loss());
      j.set_last_ce(run.rank0.ce());
      j.set_last_lr(run.rank0.lr());
      j.set_step_seconds(seconds);
      j.set_tokens_per_second(seconds > 0 ? run.tokens / seconds : 0.0);
      const uint64_t lookups = run.cache_hits + run.cache_misses;
      j.set_cache_hit_rate(lookups > 0 ? static_cast<double>(run.cache_hits) / lookups : 0.0);
    }
    if (!IsFinal(j.state()) && step >= j.spec().train().steps()) {
      j.set_state(v1::JOB_STATE_SUCCEEDED);
      j.set_finished_unix_ms(now);
      j.clear_pending_reason();  // whatever it waited for last is over
    }
    ended = IsFinal(j.state());
    return absl::OkStatus();
  });
  if (!job.ok()) {
    LOG(ERROR) << "job " << job_id << ": " << job.status();
    return;
  }
  run.committed = step;
  run.record.set_committing_step(-1);
  run.record.set_last_commit_unix_ms(now);
  run.last_commit = now_time;
  run.written.clear();
  run.written_blobs.clear();
  run.commit_trouble.clear();
  run.wait_started_ms = -1;
  run.tokens = run.cache_hits = run.cache_misses = 0;
  run.rank0.Clear();
  run.abort_reason.clear();
  if (steps_committed_ != nullptr) steps_committed_->Increment();
  if (ended) {
    RemoveMetricsLocked(job_id, run);
    for (const std::string& w : run.record.workers()) worker_job_.erase(w);
    (void)jobs_->DeleteRecord(absl::StrCat(kRunPrefix, job_id));
    KeepHeatLocked(job_id);
    NoteJobEndedLocked(run);
    runs_.erase(job_id);
    return;
  }
  AdvancePlacementLocked(job_id, run, *job, step);
}

void Scheduler::AdvancePlacementLocked(const std::string& job_id, Run& run, const v1::Job& job,
                                       int64_t step) {
  const v1::PlacementTable before = run.record.placement();
  std::string why;
  bool changed = Replication::ApplyCopies(job, run.committed, ForJob(Snapshot(*members_), run),
                                          heat_->Snapshot(job_id), run.copies,
                                          *run.record.mutable_placement(), &why);
  const int every = std::max(1, job.spec().cluster().replication().replan_every());
  if (step >= 1 && step % every == 0) {
    // Heat is durable at each re-plan boundary; a new placement applies from the next step.
    absl::Status s = jobs_->PutRecord(absl::StrCat(kHeatPrefix, job_id), heat_->Save(job_id));
    if (!s.ok()) LOG(WARNING) << s;
    std::vector<std::string> workers(run.record.workers().begin(), run.record.workers().end());
    std::vector<std::string> stores;  // unchanged: every group keeps its copies
    const std::optional<HeatMap> heat = heat_->Snapshot(job_id);
    v1::PlacementTable next = BuildPlacement(
        job, workers, stores, PlanJobCompute(job, static_cast<int>(workers.size()), heat),
        &run.record.placement(), before.epoch(), step + 1);
    if (ReplanPays(run.record.placement(), next, heat)) {
      *run.record.mutable_placement() = std::move(next);
      changed = true;
      absl::StrAppend(&why, why.empty() ? "" : ", ", "compute re-planned from the heat");
    }
  }
  if (changed) NewEpochLocked(job_id, run, before, step + 1, why);
  UpdateMetricsLocked(job, run);  // the heat moves every step, as ExpertHeat shows it
  absl::Status s = PersistLocked(run);
  if (!s.ok()) LOG(ERROR) << s;
}

absl::StatusOr<v1::StepStatus> Scheduler::WaitStep(const v1::WaitStepRequest& request,
                                                   absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = runs_.find(request.job_id());
    if (it == runs_.end()) return true;
    return it->second.committed >= request.step() ||
           it->second.record.assignment_version() != request.assignment_version();
  };
  mu_.AwaitWithTimeout(absl::Condition(&settled), timeout);
  auto it = runs_.find(request.job_id());
  if (it == runs_.end()) {
    if (jobs_->Removed(request.job_id())) {
      v1::StepStatus s;
      s.set_job_id(request.job_id());
      s.set_step(request.step());
      s.set_job_ended(true);
      s.set_abort_reason("the job ended and was removed");
      return s;
    }
    ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(request.job_id()));
    v1::StepStatus s;
    s.set_job_id(job.job_id());
    s.set_step(request.step());
    s.set_committed_step(job.committed_step());
    s.set_job_ended(IsFinal(job.state()));
    if (!s.job_ended() && job.committed_step() < request.step()) {
      s.set_aborted(true);
      s.set_abort_reason("the job is waiting for workers");
    } else if (s.job_ended()) {  // what its workers log on the way out
      s.set_abort_reason(absl::StrCat("the job ended (", StateName(job.state()), ")",
                                      job.failure_reason().empty() ? "" : ": ",
                                      job.failure_reason()));
    }
    return s;
  }
  v1::StepStatus s = StatusLocked(request.job_id(), it->second, request.step());
  if (it->second.committed < request.step() &&
      it->second.record.assignment_version() != request.assignment_version()) {
    s.set_aborted(true);
    s.set_abort_reason(it->second.abort_reason.empty() ? "the assignment changed"
                                                       : it->second.abort_reason);
  }
  return s;
}

bool Scheduler::HoldCommits(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it == runs_.end()) return false;
  auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto r = runs_.find(job_id);
    return r == runs_.end() || !r->second.committing;
  };
  mu_.Await(absl::Condition(&idle));
  it = runs_.find(job_id);
  if (it == runs_.end()) return false;
  ++it->second.holds;
  return true;
}

void Scheduler::ReleaseCommits(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it != runs_.end()) --it->second.holds;
}

}  // namespace pith::coordinator
