// Replication and drain (DESIGN §5). A group short of its desired stores (the spec's
// replica count over the live, not draining stores by rendezvous hashing, more for hot
// experts) gets one of them as a joining store at the next step boundary: from then on
// writers send it every new version, and the replicator pulls the group's committed copy
// to it store to store. A joining store whose pull is done becomes a reader at the
// following boundary; a group's surplus copies leave the placement once its desired stores
// all hold it. A draining store takes no new copies, so its groups move off it this way.
//
// State: each job's joins and copies (JobCopies) live with the scheduler's run of the job;
// the copies in flight, the bytes moved and the drains in progress live in Replication.
//
// Thread safety: JobCopies and Replication are not thread-safe. The scheduler owns both
// and guards them with its own mutex (Scheduler::mu_), held around every call here except
// Replication::Copy, which only calls the stores and touches no state, so that a copy runs
// with no lock held.
#ifndef PITH_SERVER_COORDINATOR_REPLICATION_H_
#define PITH_SERVER_COORDINATOR_REPLICATION_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/metrics.h"
#include "pith/v1/common.pb.h"
#include "pith/v1/coordinator.pb.h"
#include "pith/v1/job.pb.h"
#include "server/coordinator/heat_map.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/store_control.h"

namespace pith::coordinator {

// One job's replication state: stores to join groups at the next step boundary, joining
// stores, and copies (pulls to joining stores) in progress and done.
struct JobCopies {
  using Group = std::pair<int, int>;  // GroupOf(layer, expert)
  std::map<Group, std::string> join_requests;
  // Joining stores: the committed step when each joined its group (a copy pulled before
  // that does not count), and the stores that committed the step being finished.
  std::map<std::pair<Group, std::string>, int64_t> joined_at;
  std::set<std::string> committed_on;
  std::set<Group> copying;
  struct Copy {
    Group group;
    std::string target;
    int64_t start_step;  // committed step when the copy began
  };
  std::vector<Copy> copied;
};

// One group's committed copy to pull from `source` to its joining store `target`.
struct CopyTask {
  std::string job_id;
  int layer, expert;
  v1::MemberInfo source, target;
  int64_t start_step;
};

// What a copy moved, or why it failed.
struct CopyResult {
  absl::Status status;
  size_t blobs = 0;
  uint64_t bytes = 0;
};

class Replication {
 public:
  // `metrics` may be null.
  explicit Replication(MetricsRegistry* metrics);

  // At a step boundary of `job` (its step `committed` just committed on
  // `copies.committed_on`): joining stores that missed the commit leave, finished copies
  // join `placement` as readers, requested joins are added, surplus copies leave. `heat`
  // is the job's heat snapshot (for hot experts). Returns whether `placement` changed;
  // `why`, when given, gets what changed ("2 joins added, 1 copy done", for the log).
  static bool ApplyCopies(const v1::Job& job, int64_t committed, const Alive& alive,
                          const std::optional<HeatMap>& heat, JobCopies& copies,
                          v1::PlacementTable& placement, std::string* why = nullptr);
  // The same for a job that trains no step (it waits, at committed step `committed`, with
  // no attempt writing): no commit to miss, so no join leaves; a copy pulled since its
  // store joined holds the group's committed state whole, and joins as a reader.
  static bool ApplyCopiesWhilePaused(const v1::Job& job, int64_t committed, const Alive& alive,
                                     const std::optional<HeatMap>& heat, JobCopies& copies,
                                     v1::PlacementTable& placement, std::string* why);

  // For a running job at committed step `committed`: a group short of a desired store gets
  // a join request for it (one new copy of a group at a time), and a joining store with no
  // copy yet gets one queued in `tasks` (until `tasks` holds `max_pulls`), a move in
  // flight until Finish.
  void PlanCopies(const v1::Job& job, const v1::PlacementTable& placement, int64_t committed,
                  const Alive& alive, const std::optional<HeatMap>& heat, int max_pulls,
                  JobCopies& copies, std::vector<CopyTask>* tasks);

  // Lists the group on the source and has the target pull it, throttled to
  // `bytes_per_second`. Only calls `stores`: run it without the scheduler's lock.
  static CopyResult Copy(StoreControl& stores, const CopyTask& task, uint64_t bytes_per_second);

  // The copy of `task` is over: it is no longer in flight, and when it succeeded and its
  // job still runs (`copies` is the job's state, null once the job ended), it counts for
  // the next step boundary. Returns whether it counted.
  bool Finish(const CopyTask& task, const CopyResult& result, JobCopies* copies);

  // Copies in flight from or to `store`.
  uint64_t MovesOn(const std::string& store) const;

  // Draining stores (draining, drained, or gone but not forgotten) and how many groups
  // each held when its drain began; the scheduler keeps them durable.
  std::map<std::string, uint64_t>& drains() { return drains_; }

  // The moves in flight, the blobs and bytes moved so far and the replica `deficit`, into
  // `out` (the deficit also goes to its gauge).
  void Report(uint64_t deficit, v1::ClusterStatusResponse* out) const;

 private:
  static bool Apply(const v1::Job& job, int64_t committed, const Alive& alive,
                    const std::optional<HeatMap>& heat, JobCopies& copies,
                    v1::PlacementTable& placement, std::string* why, bool paused);
  void SetMovesGauge();

  std::vector<v1::BlobMove> moves_;         // copies in flight
  std::map<std::string, uint64_t> drains_;  // store -> groups at start
  uint64_t blobs_moved_ = 0, bytes_moved_ = 0;

  prometheus::Counter* blobs_moved_total_ = nullptr;
  prometheus::Counter* bytes_moved_total_ = nullptr;
  prometheus::Gauge* moves_in_flight_ = nullptr;
  prometheus::Gauge* replica_deficit_ = nullptr;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_REPLICATION_H_
