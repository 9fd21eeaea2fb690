// A worker reports that it could not reach another worker of its job in a step (DESIGN
// §6.4): a peer killed breaks its endpoints at once, while its lease runs for seconds
// more. Retried at once, every attempt fails on the same dead peer and counts
// against --step_attempts, and a lease longer than the retries take would fail the job on
// an ordinary worker loss. So the attempt is voided without counting and the job waits
// for the peer's fate: dead, the repair gives its rank to a spare; alive, the attempt
// counts.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/job_state.h"
#include "glog/logging.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {

std::string Scheduler::PausedLocked(const Run& run) {
  if (run.recovering) return "is waiting for its members after a coordinator restart";
  if (!run.awaited_store.empty()) {
    return absl::StrCat("is waiting for store ", run.awaited_store, " to come back");
  }
  if (!run.room_store.empty()) {
    return absl::StrCat("is waiting for disk room on store ", run.room_store);
  }
  if (!run.peer_worker.empty()) {
    return absl::StrCat("is waiting to learn whether worker ", run.peer_worker, " is alive");
  }
  return "";
}

bool Scheduler::WaitForPeerLocked(const std::string& job_id, Run& run, const std::string& reporter,
                                  const std::string& peer, const std::string& why,
                                  std::vector<StoreCall>* aborts) {
  const auto& workers = run.record.workers();
  const auto pos = std::find(workers.begin(), workers.end(), peer);
  if (peer == reporter || pos == workers.end()) return false;
  AbortLocked(run, why, aborts);  // not counted: the peer's fate decides
  const Alive alive = Snapshot(*members_);
  if (!alive.workers.count(peer)) return true;  // dead already: the next tick replaces it
  run.peer_worker = peer;
  run.peer_address = alive.workers.at(peer).ucx_address();
  run.peer_why = why;
  run.peer_step = step_in_flight(run);
  run.peer_since = options_.clock();
  LOG(WARNING) << "job " << job_id << " waits to learn whether worker " << peer << " is alive ("
               << why << ")";
  NoteWaitLocked(job_id, run, Wait::kPeer,
                 absl::StrCat("waiting up to ", absl::FormatDuration(members_->lease()),
                              " to learn whether worker ", peer, " (rank ", pos - workers.begin(),
                              ") is alive: ", why,
                              ". Dead, a free worker takes its rank (with none free, the job "
                              "goes on with fewer); alive, the attempt counts against the job"));
  return true;
}

bool Scheduler::ReviewPeerWaitLocked(const std::string& job_id, Run& run, const v1::Job& job,
                                     const Alive& alive) {
  if (run.peer_worker.empty() || IsFinal(job.state())) return false;
  const auto& workers = run.record.workers();
  const auto peer = alive.workers.find(run.peer_worker);
  const absl::Duration lease = members_->lease();
  std::string ended;
  bool counts = false;
  if (peer == alive.workers.end() ||
      std::find(workers.begin(), workers.end(), run.peer_worker) == workers.end()) {
    ended = "is dead or left the job; the attempt does not count";
  } else if (peer->second.ucx_address() != run.peer_address) {
    // Its id taken by a new process once the old one's lease ran out (a restart).
    ended = "was restarted; the attempt does not count";
  } else if (peer->second.lease_expires_unix_ms() - absl::ToInt64Milliseconds(lease) >
             absl::ToUnixMillis(run.peer_since)) {
    ended = "heartbeated after the report: it is alive, and the attempt counts";
    counts = true;
  } else if (options_.clock() - run.peer_since >= 2 * lease) {
    ended = "neither heartbeated nor lost its lease in two leases; the attempt counts";
    counts = true;
  } else {
    return false;  // waits on
  }
  LOG(INFO) << "job " << job_id << ": worker " << run.peer_worker << " " << ended;
  const std::string give_up = counts ? CountAttemptLocked(run, run.peer_step, run.peer_why) : "";
  if (counts) {
    if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
  }
  if (!give_up.empty()) {
    // The run stays paused (no assignment for a failed job) until the next tick releases it.
    (void)MarkFailed(job_id, give_up);
    return true;
  }
  run.peer_worker.clear();
  NoteWaitLocked(job_id, run, Wait::kPeer, "");
  return false;
}

void Scheduler::NoteSilentWorkerLocked(const std::string& job_id, Run& run, const Alive& alive) {
  const int64_t lease_ms = absl::ToInt64Milliseconds(members_->lease());
  const int64_t now = absl::ToUnixMillis(options_.clock());
  const auto when = [](int64_t unix_ms) {
    return absl::FormatTime("%H:%M:%S UTC", absl::FromUnixMillis(unix_ms), absl::UTCTimeZone());
  };
  if (run.recovering) {  // after a coordinator restart the workers wait's words say it
    NoteWaitLocked(job_id, run, Wait::kSilent, "");
    return;
  }
  std::string note;
  const auto& workers = run.record.workers();
  for (int rank = 0; rank < workers.size() && note.empty(); ++rank) {
    const auto w = alive.workers.find(workers[rank]);
    if (w == alive.workers.end() || w->first == run.peer_worker) continue;
    const int64_t expires = w->second.lease_expires_unix_ms();
    const int64_t last = expires - lease_ms;  // its last heartbeat
    // It heartbeats every third of a lease: silent this long, it missed one, and the next
    // is due.
    if (now - last <= 2 * lease_ms / 3) continue;
    note = absl::StrCat("waiting for worker ", w->first, " (rank ", rank, "), silent since ",
                        when(last), ": if it stays silent, its lease lapses at ", when(expires),
                        " and a free worker takes its rank (with none free, the job goes on "
                        "with fewer)");
  }
  NoteWaitLocked(job_id, run, Wait::kSilent, note);
}

}  // namespace pith::coordinator
