// Scheduler: the coordinator's running half (DESIGN §5, §6). It gives pending jobs their
// workers, builds and versions each job's placement (stores by rendezvous hashing,
// compute owners from the heat map), runs the step-commit protocol with the stores, and
// reacts to members that die: the step in flight is aborted everywhere and the job goes
// on from its last committed step once its assignment is repaired.
//
// Step protocol. Step 0 writes the initial weights, step s >= 1 is training step s. A
// step attempt is identified by (step, assignment_version): every worker reports its new
// versions written (ReportStepWritten); when all have, the coordinator records that the
// step is committing (durably), tells every live store to commit it, then advances the
// job's committed step. Any failure before that (a worker reporting failure, a member
// dying) aborts the attempt: the stores drop the step's pending versions and the
// assignment version is bumped, so every worker refetches its assignment and redoes the
// step. After a coordinator restart, every running job's assignment version is bumped
// (in-flight attempts are void) and an interrupted commit is finished first.
//
// Thread safety: all methods are thread-safe. Calls into stores are made without the
// scheduler's lock held. Lock order: Scheduler::mu_, then JobRegistry/Membership/HeatRegistry.
#ifndef PITH_SERVER_COORDINATOR_SCHEDULER_H_
#define PITH_SERVER_COORDINATOR_SCHEDULER_H_

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "pith/v1/coordinator.pb.h"
#include "pith/v1/job.pb.h"
#include "server/coordinator/heat_registry.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/placement.h"

namespace pith::coordinator {

// The coordinator's calls into stores; a seam so the scheduler's logic can be tested
// without store processes. Implementations are thread-safe.
class StoreControl {
 public:
  virtual ~StoreControl() = default;
  // Makes the job's pending versions of `step` current on `store` (idempotent).
  virtual absl::Status CommitStep(const v1::MemberInfo& store, const std::string& job_id,
                                  int64_t step) = 0;
  // Drops the job's pending versions of `step` on `store`.
  virtual absl::Status AbortStep(const v1::MemberInfo& store, const std::string& job_id,
                                 int64_t step) = 0;
  // The committed blobs of one group on `store` (layer -1: every dense tensor).
  virtual absl::StatusOr<std::vector<v1::BlobInfo>> ListGroup(const v1::MemberInfo& store,
                                                              const std::string& job_id, int layer,
                                                              int expert) = 0;
  // Has `target` copy `keys` (their committed versions) from `source`, store to store
  // over UCX, at most `max_bytes_per_second`. Returns what `target` installed.
  virtual absl::StatusOr<std::vector<v1::BlobInfo>> Pull(const v1::MemberInfo& target,
                                                         const v1::MemberInfo& source,
                                                         const std::vector<v1::BlobKey>& keys,
                                                         uint64_t max_bytes_per_second) = 0;
  // One blob to read into `buffer`; `info` is filled in.
  struct Read {
    v1::BlobKey key;
    int64_t version = -1;  // -1: the committed one
    void* buffer = nullptr;
    size_t capacity = 0;
    v1::BlobInfo info;
  };
  // Reads the committed versions of `reads` from `store` (one batched UCX fetch).
  virtual absl::Status Fetch(const v1::MemberInfo& store, std::vector<Read>& reads) = 0;
};

// StoreControl over the stores' gRPC StoreService, each call bounded by `timeout`.
std::unique_ptr<StoreControl> NewGrpcStoreControl(absl::Duration timeout);

// The placement of a job over `workers` (member ids by rank) and `stores`: every expert
// group keeps the store copies `previous` lists, new groups get RendezvousStores over
// `stores` with the spec's replica count; compute owners come from `plan`. The dense
// tensors are one group (layer -1, empty tensor name): every dense blob of the job lives
// on its stores.
v1::PlacementTable BuildPlacement(const v1::Job& job, const std::vector<std::string>& workers,
                                  const std::vector<std::string>& stores, const ComputePlan& plan,
                                  const v1::PlacementTable* previous, int64_t epoch,
                                  int64_t effective_step);

struct SchedulerOptions {
  // Store-to-store copies (re-replication, hot-expert replicas, rebalancing) are throttled
  // to this many bytes per second per pull, so that training fetches keep priority.
  uint64_t replication_bytes_per_second = 256ull << 20;
  // Groups copied concurrently at most (one pull each).
  int max_pulls = 4;
};

class Scheduler {
 public:
  // None of the pointers is owned; all outlive the scheduler. `metrics` may be null.
  Scheduler(JobRegistry* jobs, Membership* members, HeatRegistry* heat, StoreControl* stores,
            MetricsRegistry* metrics = nullptr, SchedulerOptions options = {});
  ~Scheduler();  // stops the loop started by Start

  // Loads the durable schedule after a (re)start: every running job's assignment
  // version is bumped and its heat restored. Call once, before Start.
  absl::Status Recover();
  // Runs Tick every `period` on its own thread, and the replicator on another, until
  // destruction.
  void Start(absl::Duration period);
  // One pass: expires leases, reacts to dead members and ended jobs, finishes pending
  // commits, schedules pending jobs.
  void Tick();

  // A worker's assignment (an idle worker gets an empty job_id). NOT_FOUND for an
  // unknown or dead worker.
  absl::StatusOr<v1::Assignment> GetAssignment(const std::string& worker_id);
  // The assignment version of the worker's job (0 when idle), for heartbeats.
  int64_t AssignmentVersion(const std::string& worker_id);
  // A running job's placement. NOT_FOUND for a job that is not running.
  absl::StatusOr<v1::PlacementTable> GetPlacement(const std::string& job_id);
  // A worker's report that it wrote (or failed to write) a step's versions.
  // FAILED_PRECONDITION for a job that is not running, a worker not in it, or a step
  // that is not the one in flight; ABORTED for an attempt that was aborted meanwhile.
  absl::StatusOr<v1::StepStatus> ReportStepWritten(const v1::StepWrittenRequest& report);
  // Waits until the step commits, its attempt is aborted, or `timeout` passes.
  absl::StatusOr<v1::StepStatus> WaitStep(const v1::WaitStepRequest& request,
                                          absl::Duration timeout);

  // Exports a job's last committed step as a safetensors weights file (DESIGN §3 names)
  // in request.output_dir, reading every blob from a store that holds it. A running
  // job's commits are held meanwhile, so the file is one step. FAILED_PRECONDITION
  // before the initial weights are committed or when a blob is on no live store.
  absl::StatusOr<v1::CheckpointJobResponse> Checkpoint(const v1::CheckpointJobRequest& request);

  // Replication: a group short of its desired stores (the spec's replica count over the
  // live, not draining stores by rendezvous hashing, more for hot experts) gets one of
  // them as a joining store at the next step boundary: from then on writers send it every
  // new version, and the replicator pulls the group's committed copy to it store to store
  // (up to max_pulls at once; this call waits for them). A joining store whose pull is
  // done becomes a reader at the following boundary; a group's surplus copies leave the
  // placement once its desired stores all hold it. Returns the copies made.
  int ReplicateOnce();
  // Moves in flight, blobs and bytes moved so far, the replica deficit (copies missing
  // to reach every group's replica count) and the drains' progress, into `out`.
  void ReplicationStatus(v1::ClusterStatusResponse* out);

  // Starts draining a store (durably): it takes no new copies, every group placed on it
  // is copied to the store rendezvous hashing now picks and then leaves it (at a step
  // boundary, as any surplus copy), so no group ever has fewer copies than before. Once
  // nothing is placed on it, Tick marks it DRAINED: its process can be stopped. Returns
  // what will move. NOT_FOUND for an unknown store; FAILED_PRECONDITION for a dead one,
  // or when the other stores could not hold a running job's replica count.
  absl::StatusOr<v1::DrainStoreResponse> Drain(const std::string& store_id);

 private:
  struct Run {
    v1::JobRun record;              // durable
    int64_t committed = -1;         // the job's committed step
    std::set<std::string> written;  // workers that reported the step in flight
    v1::StepWrittenRequest rank0;   // rank 0's figures for the step in flight
    uint64_t tokens = 0, cache_hits = 0, cache_misses = 0;
    bool committing = false;                        // a thread is running the store commits
    absl::Time last_commit = absl::InfinitePast();  // of this process; step timing
    // Loaded after a restart and waiting for its members to register again (or for the
    // grace period to end); assignments and reports wait too.
    bool recovering = false;
    // Replication: stores to join groups at the next step boundary, copies (pulls to
    // joining stores) in progress and done.
    std::map<std::pair<int, int>, std::string> join_requests;
    // Joining stores: the committed step when each joined its group (a copy pulled before
    // that does not count), and the stores that committed the step being finished.
    std::map<std::pair<std::pair<int, int>, std::string>, int64_t> joined_at;
    std::set<std::string> committed_on;
    std::set<std::pair<int, int>> copying;
    struct Copy {
      std::pair<int, int> group;
      std::string target;
      int64_t start_step;  // committed step when the copy began
    };
    std::vector<Copy> copied;
    int holds = 0;  // checkpoints reading the job: commits wait
    std::string abort_reason;
  };
  struct StoreCall {
    v1::MemberInfo store;
    std::string job_id;
    int64_t step;
  };

  int64_t step_in_flight(const Run& run) const { return run.committed + 1; }
  // Whether a member that is not alive is gone for good: known dead, or still unknown
  // once members had time to register again after a restart (3 leases).
  bool Gone(const std::set<std::string>& alive, const std::set<std::string>& known,
            const std::string& id) const;
  v1::StepStatus StatusLocked(const std::string& job_id, const Run& run, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status PersistLocked(const Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Voids the attempt in flight: queues store aborts, bumps the assignment version.
  void AbortLocked(Run& run, const std::string& reason, std::vector<StoreCall>* aborts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Re-plans compute owners under a new epoch: store copies not on `live_stores` are
  // gone; a group left with none is placed on `stores` (those taking new copies).
  void ReplaceLocked(Run& run, const v1::Job& job, const std::vector<std::string>& live_stores,
                     const std::vector<std::string>& stores) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Compute ownership for `workers` from `heat` (the job's heat snapshot; none yet: every
  // expert average).
  ComputePlan PlanLocked(const v1::Job& job, int workers, std::optional<HeatMap> heat)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Commits `step` of `job_id` on every live store, then advances the job.
  void Commit(const std::string& job_id, int64_t step);
  void FinishCommitLocked(const std::string& job_id, Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunStoreAborts(const std::vector<StoreCall>& aborts);
  void UpdateMetricsLocked(const v1::Job& job, const Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Groups of running jobs placed on `store` (reading or joining), and with `with_moves`
  // the copies in flight from or to it.
  uint64_t GroupsOnLocked(const std::string& store, bool with_moves) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // At a step boundary: finished copies join the placement, surplus copies leave it.
  // Returns whether the placement changed.
  bool ApplyCopiesLocked(Run& run, const v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  JobRegistry* const jobs_;
  Membership* const members_;
  HeatRegistry* const heat_;
  StoreControl* const stores_;
  MetricsRegistry* const metrics_;
  const SchedulerOptions options_;
  const absl::Time started_;

  absl::Mutex mu_;
  std::map<std::string, Run> runs_ ABSL_GUARDED_BY(mu_);                // by job id: running jobs
  std::map<std::string, std::string> worker_job_ ABSL_GUARDED_BY(mu_);  // worker -> job

  std::vector<v1::BlobMove> moves_ ABSL_GUARDED_BY(mu_);               // copies in flight
  std::map<std::string, uint64_t> drain_groups_ ABSL_GUARDED_BY(mu_);  // store -> groups at start
  absl::Mutex drain_mu_ ABSL_ACQUIRED_BEFORE(mu_);                     // serializes Drain
  uint64_t blobs_moved_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t bytes_moved_ ABSL_GUARDED_BY(mu_) = 0;

  prometheus::Counter* steps_committed_ = nullptr;
  prometheus::Counter* steps_aborted_ = nullptr;
  prometheus::Counter* blobs_moved_total_ = nullptr;
  prometheus::Counter* bytes_moved_total_ = nullptr;
  prometheus::Gauge* moves_in_flight_ = nullptr;
  prometheus::Gauge* replica_deficit_ = nullptr;

  absl::Notification stop_;
  std::thread loop_, replicator_;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_SCHEDULER_H_
