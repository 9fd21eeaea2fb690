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
// The class is defined over several files, one part each: scheduler.cc (start, recovery,
// aborts, metrics), scheduling.cc (the tick's steps, assignments, repair of dead members),
// step_commit.cc (the step-commit protocol), scheduler_replication.cc (replication and
// drain, whose state is a Replication, replication.h) and checkpoint_export.cc. Placement
// math is in placement_table.h and placement.h, the stores' seam in store_control.h.
//
// Time comes from SchedulerOptions::clock (absl::Now, or the membership's fake clock in
// tests), so lease grace periods and step timing are tested without sleeping.
//
// Thread safety: all public methods are thread-safe; Start runs Tick and ReplicateOnce on
// threads of their own, and the coordinator's RPC threads call the rest. One mutex, mu_,
// guards the runs, the worker map and the replication state. Calls into stores are made
// without it held. Lock order: drain_mu_, then mu_, then JobRegistry/Membership/
// HeatRegistry (each of which locks only itself).
#ifndef PITH_SERVER_COORDINATOR_SCHEDULER_H_
#define PITH_SERVER_COORDINATOR_SCHEDULER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
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
#include "server/coordinator/placement_table.h"
#include "server/coordinator/replication.h"
#include "server/coordinator/store_control.h"

namespace pith::coordinator {

struct SchedulerOptions {
  // Store-to-store copies (re-replication, hot-expert replicas, rebalancing) are throttled
  // to this many bytes per second per pull, so that training fetches keep priority.
  uint64_t replication_bytes_per_second = 256ull << 20;
  // Groups copied concurrently at most (one pull each).
  int max_pulls = 4;
  // Failed attempts of one step (reported by a worker: a put refused, a data file that
  // cannot be read) after which the job fails with the last one's reason.
  int step_attempts = 8;
  // Garbage collection (CollectGarbageOnce): an ended job's committed weights stay on its
  // stores (for `pith checkpoint`) unless this is false; everything else of it goes.
  bool keep_ended_weights = true;
  // How often Start's collector runs a pass.
  absl::Duration gc_period = absl::Seconds(10);
  // The scheduler's time (the grace period after a restart, assignment versions, job
  // timestamps, step timing): the same seam as the membership's leases.
  Membership::Clock clock = [] { return absl::Now(); };
};

// After a coordinator restart, how long a running job waits at least for its stores to
// register again before it gives up the missing ones (Scheduler::Gone).
inline constexpr absl::Duration kStoreRestartGrace = absl::Seconds(30);

// How long a job keeps off a store it dropped for a full disk (Scheduler::DropFullStore).
inline constexpr absl::Duration kFullStoreCooldown = absl::Minutes(5);

// How long a job whose only copy of a group is on a full disk waits, at one step, for
// room there or for its copies to move to stores with room (Scheduler::WaitForRoom).
inline constexpr absl::Duration kRoomWait = absl::Minutes(10);

class Scheduler {
 public:
  // Whether a job of `spec` trains on CUDA workers only (bf16).
  static bool NeedsCuda(const v1::JobSpec& spec);
  // Workers alive (idle or not) that a job of `spec` could train on: CUDA ones for a bf16
  // job, else the most of any one backend (a job does not mix them); with `cuda_reserved`
  // (an earlier bf16 job waits for them) no CUDA worker.
  static int WorkersFor(const Alive& alive, const v1::JobSpec& spec, bool cuda_reserved);
  // None of the pointers is owned; all outlive the scheduler. `metrics` may be null.
  Scheduler(JobRegistry* jobs, Membership* members, HeatRegistry* heat, StoreControl* stores,
            MetricsRegistry* metrics = nullptr, SchedulerOptions options = {});
  ~Scheduler();  // stops the loop started by Start

  // Loads the durable schedule after a (re)start: every running job's assignment
  // version is bumped and its heat restored. Call once, before Start.
  absl::Status Recover() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs Tick every `period` on its own thread, the replicator on another and the garbage
  // collector (every gc_period) on a third, until Stop or destruction.
  void Start(absl::Duration period);
  // Ends those threads (after the pass in progress); idempotent. A coordinator that is
  // shutting down stops them first: once it serves no heartbeat, every member's lease
  // would lapse and be judged a death, and that judgment would outlive the restart.
  // Not from one of those threads.
  void Stop();
  // One pass: expires leases, reacts to dead members and ended jobs, finishes pending
  // commits, schedules pending jobs.
  void Tick() ABSL_LOCKS_EXCLUDED(mu_);

  // A worker's assignment (an idle worker gets an empty job_id). NOT_FOUND for an
  // unknown or dead worker. UNAVAILABLE (retry) while the job commits a step: its workers
  // already compute the next one, which a run starting from the committed step would
  // not; while one of the job's workers is dead; and while the job waits (PausedLocked:
  // after a coordinator restart, for a store, for disk room, for a peer's fate). A new
  // process of a worker (its
  // restart came before the scheduler saw the death) voids the attempt in flight, which
  // its predecessor was part of: every worker of the job starts the next one together.
  absl::StatusOr<v1::Assignment> GetAssignment(const std::string& worker_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The assignment version of the worker's job (0 when idle), for heartbeats.
  int64_t AssignmentVersion(const std::string& worker_id) ABSL_LOCKS_EXCLUDED(mu_);
  // A running job's placement. NOT_FOUND for a job that is not running.
  absl::StatusOr<v1::PlacementTable> GetPlacement(const std::string& job_id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A worker's report that it wrote (or failed to write) a step's versions; a fatal
  // failure fails the job (FailJob). FAILED_PRECONDITION for a job that is not running, a
  // worker not in it, or a step that is not the one in flight; ABORTED for an attempt
  // that was aborted meanwhile.
  absl::StatusOr<v1::StepStatus> ReportStepWritten(const v1::StepWrittenRequest& report)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until the step commits, its attempt is aborted, or `timeout` passes.
  absl::StatusOr<v1::StepStatus> WaitStep(const v1::WaitStepRequest& request,
                                          absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_);

  // Exports a job's last committed step as a safetensors weights file (DESIGN §3 names)
  // in request.output_dir, reading every blob from a store that holds it. A running
  // job's commits are held meanwhile, so the file is one step. FAILED_PRECONDITION
  // before the initial weights are committed or when a blob is on no live store.
  absl::StatusOr<v1::CheckpointJobResponse> Checkpoint(const v1::CheckpointJobRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Replication (replication.h): groups short of their desired stores get joining stores
  // at the next step boundary, and the committed copies of joining stores are pulled
  // store to store (up to max_pulls at once; this call waits for them). Returns the
  // copies made.
  int ReplicateOnce() ABSL_LOCKS_EXCLUDED(mu_);
  // Garbage collection, one pass: each live store loses the groups it left (once the job
  // committed a step under the placement without it) and the blobs of ended jobs (all,
  // or all but their committed weights: keep_ended_weights; removed jobs' all). Jobs the
  // registry does not know are left alone. A group's copy to a store waits while the group is being
  // deleted there (a copy pulled before the delete lands would be deleted with the old blobs).
  // Then, for each draining store not yet found so, the ended jobs' kept weights it alone
  // holds are copied to stores that stay (HomeEndedWeights; ended_homed_). Returns the
  // deletions made.
  int CollectGarbageOnce() ABSL_LOCKS_EXCLUDED(mu_);
  // garbage.cc: the kept weights (and masters) of ended job `job_id` on draining store
  // `source` that no store that stays holds (at that version or newer) are pulled to one
  // (rendezvous over the stores new copies may go to), so that `pith checkpoint` of the
  // job still works once the drained store is stopped. Returns how many are still
  // without such a copy (-1: the source could not be listed).
  int HomeEndedWeights(const v1::MemberInfo& source, const std::string& job_id, const Alive& alive)
      ABSL_LOCKS_EXCLUDED(mu_);
  // FAILED_PRECONDITION when `store_id` (not draining yet) holds ended jobs' kept weights
  // and no other store takes copies: its drain would never end.
  absl::Status EndedWeightsHaveAHome(const std::string& store_id, const Alive& alive)
      ABSL_LOCKS_EXCLUDED(mu_);
  // What garbage collection does with a job's blobs on the stores: nothing (a job the
  // registry does not know, or one still going), all but its committed weights (an ended
  // job, keep_ended_weights), or all (ended without keep_ended_weights, or removed).
  enum class BlobFate { kKeep, kAllButWeights, kAll };
  BlobFate FateOf(const std::string& job_id) const;
  // A deletion of a garbage collection pass; those of groups stores left (run.left), once
  // the job committed a step without them (their keys go into collecting_).
  struct Deletion;
  void CollectLeftLocked(const Alive& alive, std::vector<Deletion>* deletions)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes an ended job (JobRegistry::Remove; its errors): its heat map goes now, its
  // blobs at the next garbage collection (every blob: removed jobs keep no weights).
  // FAILED_PRECONDITION while a checkpoint of it is being exported (its blobs would go
  // from under the reads). Returns the job's last record.
  // Waits up to kRemoveWait for an ended job's run to be released.
  absl::StatusOr<v1::Job> Remove(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  static constexpr absl::Duration kRemoveWait = absl::Seconds(10);

  // Moves in flight, blobs and bytes moved so far, the replica deficit (copies missing
  // to reach every group's replica count) and the drains' progress, into `out`.
  void ReplicationStatus(v1::ClusterStatusResponse* out) ABSL_LOCKS_EXCLUDED(mu_);

  // Starts draining a store (durably): it takes no new copies, every group placed on it
  // is copied to the store rendezvous hashing now picks and then leaves it (at a step
  // boundary, as any surplus copy), so no group ever has fewer copies than before. Once
  // nothing is placed on it, Tick marks it DRAINED: its process can be stopped. Returns
  // what will move. NOT_FOUND for an unknown store; FAILED_PRECONDITION for a dead one,
  // or when the other stores could not hold a running job's replica count.
  absl::StatusOr<v1::DrainStoreResponse> Drain(const std::string& store_id)
      ABSL_LOCKS_EXCLUDED(drain_mu_, mu_);

 private:
  // Keys of the scheduler's durable records in the job registry.
  static constexpr char kRunPrefix[] = "run/";      // + job id: the job's JobRun
  static constexpr char kHeatPrefix[] = "heat/";    // + job id: its heat, at re-plan boundaries
  static constexpr char kDrainPrefix[] = "drain/";  // + store id: groups on it at drain start

  // What a running job that trains no step waits for; Job.pending_reason names them in
  // this order, joined by kAlsoWaiting.
  enum class Wait { kWorkers, kStore, kRoom, kPeer, kSilent };
  static constexpr char kAlsoWaiting[] = "; and also ";

  struct Run {
    v1::JobRun record;              // durable
    int64_t committed = -1;         // the job's committed step
    std::set<std::string> written;  // workers that reported the step in flight
    v1::StepWrittenRequest rank0;   // rank 0's figures for the step in flight
    uint64_t tokens = 0, cache_hits = 0, cache_misses = 0;
    std::optional<v1::DataFingerprint> data;  // Job.data once known (PinDataLocked)
    // Why the job, running, trains no step now, by wait: Job.pending_reason joins them
    // (NoteWaitLocked), so a wait that ends takes only its own words with it.
    std::map<Wait, std::string> waits;
    bool committing = false;                        // a thread is running the store commits
    absl::Time last_commit = absl::InfinitePast();  // of this process; step timing
    // Loaded after a restart and waiting for its members to register again (or for the
    // grace period to end); assignments and reports wait too.
    bool recovering = false;
    // Back after a restart: its stores' steps of the job are checked (VerifyStores).
    bool verify_stores = false;
    // A store that died holding the only copies of a group of the job, within the last
    // kStoreRestartGrace: the job waits for it (see AwaitedStores) as for a restart.
    std::string awaited_store;
    // When the first such wait since the job's last commit began (Unix ms; -1: none).
    int64_t wait_started_ms = -1;
    // Every worker of the job died and none was free to take over: it waits for one
    // (Job.pending_reason says so).
    bool no_workers = false;
    // The placement of a job before it lost workers none could replace, with its worker
    // count and committed step then: as many workers back before a step commits on
    // fewer take that compute plan again, and the bits stay an undisturbed run's.
    struct WiderPlan {
      int workers = 0;
      int64_t committed = -1;
      v1::PlacementTable placement;
    };
    std::optional<WiderPlan> wider;
    JobCopies copies;  // replication: joins and copies of the job's groups
    int holds = 0;     // checkpoints reading the job: commits wait
    std::string abort_reason;
    int64_t failed_step = -1;  // the step of the latest failed attempts, and how many
    int failed_attempts = 0;
    // The step in flight's blobs the workers wrote (their primary stores recorded them),
    // by group ((-1, 0): dense): a store's commit must make at least these current.
    std::map<std::pair<int, int>, std::set<std::string>> written_blobs;
    // Stores whose commits (or prepares) of this job fail, since when: after several
    // leases of it, the job loses them (record.lost_stores).
    std::map<std::string, absl::Time> commit_trouble;
    // A store of the job that refused the step's puts for want of disk while it held a
    // group's only copy (WaitForRoomLocked): until it has room, or its copies moved to
    // stores with room, the job trains no step; assignments and reports wait too.
    std::string room_store;
    std::string room_why;                          // the refusal
    int64_t room_step = -1;                        // the step whose attempts it refused,
    absl::Time room_since = absl::InfinitePast();  // since when
    // A worker of the job that another could not reach in step `peer_step` (its endpoint
    // failed, or it fell silent) while it held its lease (WaitForPeerLocked): the attempt
    // was voided without counting, and the job waits, as for room, until the worker
    // heartbeats after the report (alive: the attempt counts then) or its lease lapses
    // (dead: the repair gives its rank to a spare, or shrinks the job).
    std::string peer_worker;
    std::string peer_address;                      // its UCX address at the report
    std::string peer_why;                          // the report
    int64_t peer_step = -1;                        // the step it failed
    absl::Time peer_since = absl::InfinitePast();  // the report's time
    // Stores the job dropped for a full disk (DropFullStoreLocked), since when (after a
    // coordinator restart: since the restart).
    std::map<std::string, absl::Time> full_since;
    // Groups stores left ((store, layer, expert); layer -1: dense), with the first step of
    // the placement without them: their blobs there are deleted once it committed.
    std::map<std::tuple<std::string, int, int>, int64_t> left;
    // The workers of assignment version `issued_version` with the UCX address of the
    // process that took it, or that another worker was told to connect to: another process
    // of the same worker (a restart the scheduler did not see as a death) cannot join an
    // attempt its predecessor was part of (GetAssignment).
    int64_t issued_version = 0;
    std::map<std::string, std::string> issued;
  };
  struct StoreCall {
    v1::MemberInfo store;
    std::string job_id;
    int64_t step;
    int64_t successor = 0;  // an abort's: the attempt replacing the aborted one
  };
  // Store calls a pass decided under mu_, made once it is released.
  struct StoreWork {
    std::vector<StoreCall> aborts;
    std::vector<std::pair<std::string, int64_t>> commits;  // (job, step) to finish
    std::vector<StoreCall> verifies;  // (store, job, its committed step) for VerifyStores
  };
  // After a restart, asks each store of a job that came back for its step of the job: a
  // store behind the job's committed step (one that lost commits, as a power loss under
  // --sync_interval_ms can) would serve stale versions as current, so the job loses it
  // (record.lost_stores) and its groups are copied back from the other copies.
  void VerifyStores(const std::vector<StoreCall>& calls) ABSL_LOCKS_EXCLUDED(mu_);

  // A worker's fatal failure: the job fails with it (the next Tick releases its
  // run). In step_commit.cc.
  absl::StatusOr<v1::StepStatus> FailJob(const v1::StepWrittenRequest& report)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A worker's share did not fit its memory at the attempt's worker count
  // (needs_more_workers): with fewer workers than the job asked for, the job frees them
  // and waits for one more than it had (its record.min_workers); with all of them, FailJob.
  absl::StatusOr<v1::StepStatus> WaitForMoreWorkers(const v1::StepWrittenRequest& report)
      ABSL_LOCKS_EXCLUDED(mu_);
  // OK when the report's worker trains the job under its current assignment;
  // FAILED_PRECONDITION (not its worker) or ABORTED (an older assignment) otherwise.
  absl::Status CheckReporterLocked(const v1::StepWrittenRequest& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pins the job's data to the first report's (Job.data, naming its worker);
  // FAILED_PRECONDITION naming both when a report of the run's current attempt read other
  // bytes. In step_commit.cc.
  absl::Status PinDataLocked(Run& run, const v1::StepWrittenRequest& report)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the job as failed with `reason` and logs it (a finished job stays as it is); the
  // next Tick releases its run. Locks only the job registry: callable with mu_ held or not.
  absl::Status MarkFailed(const std::string& job_id, const std::string& reason);
  // scheduler.cc: time, persistence, aborts, metrics.
  int64_t NowMs() const;
  // Assignment versions only ever grow, across jobs and coordinator restarts alike, so a
  // worker can tell any change by inequality.
  int64_t NextVersion(int64_t previous) const;
  int64_t step_in_flight(const Run& run) const { return run.committed + 1; }
  absl::Status PersistLocked(const Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Voids the attempt in flight: queues store aborts, bumps the assignment version.
  void AbortLocked(Run& run, const std::string& reason, std::vector<StoreCall>* aborts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunStoreAborts(const std::vector<StoreCall>& aborts) ABSL_LOCKS_EXCLUDED(mu_);
  // The stores of the job's placement (complete or joining copies) it has not lost.
  static std::set<std::string> JobStores(const Run& run);
  // `alive` without the stores the job lost: what its placement may use.
  static Alive ForJob(const Alive& alive, const Run& run);
  // The job's heat and replica gauges, set at every commit and removed when its run ends.
  void UpdateMetricsLocked(const v1::Job& job, const Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveMetricsLocked(const std::string& job_id, const Run& run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // scheduling.cc: the tick's steps and the repair of a job's assignment.
  // Whether a member that is not alive is gone for good: known dead, or still unknown
  // once members had time to register again after a restart: 3 leases for a worker, and
  // for a store at least kStoreRestartGrace (a store may hold a group's only copy: taking
  // it for gone fails the job, and a whole cluster restarted at once, on a busy machine,
  // can take longer than 3 leases to bring its stores back).
  bool Gone(const Alive& alive, const std::string& id, bool store) const;
  // The stores the job waits for rather than take for lost: those that died (their lease
  // ran out) less than kStoreRestartGrace ago, not lost by the job otherwise, among the
  // stores of a group none of whose copies is alive. Empty when there is none (a group
  // with a live copy goes on without the dead store at once), when some such group has no
  // store worth waiting for, and once the job has waited kStoreRestartGrace since its last
  // commit. A store restarted in place (a crash, a host reboot) keeps its data on disk,
  // so its job goes on once it is back.
  std::set<std::string> AwaitedStores(const Run& run, const Alive& alive) const;
  // Starts, keeps or ends the job's wait for AwaitedStores (voiding the attempt in flight
  // when it starts and when the store is back); true while the repair must wait.
  bool WaitForStoreLocked(const std::string& job_id, Run& run, const Alive& alive, bool stores_lost,
                          std::vector<StoreCall>* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every running job: ended ones are released, decided commits queued, and the
  // assignments of jobs that lost (or can gain) members repaired.
  void ReviewRunsLocked(const Alive& alive, StoreWork* work) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A job that ended (cancelled, failed): drops its attempt in flight, frees its workers.
  void ReleaseRunLocked(const std::string& job_id, Run& run, std::vector<StoreCall>* aborts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A run ended, or its job was removed: its heat is kept past a restart (for `pith
  // experts`), or goes with the job once it was removed.
  void KeepHeatLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Replaces the job's dead workers and stores (and adds idle workers it lacks); a job
  // back from a restart with all its members only has its attempt in flight voided.
  void RepairRunLocked(const std::string& job_id, Run& run, const v1::Job& job, const Alive& alive,
                       std::vector<StoreCall>* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new placement epoch for the run's workers: store copies not on `live_stores` are
  // gone; a group left with none is placed on `stores` (those taking new copies). The
  // compute plan is kept by rank when the job had `planned_for` workers, as many as now
  // (0: not known; see KeptPlan), else made afresh.
  void ReplaceLocked(Run& run, const v1::Job& job, const std::vector<std::string>& live_stores,
                     const std::vector<std::string>& stores, int planned_for)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The first group of the job's placement none of whose complete copies is in `holding`,
  // named with why the job lost its store (if it did); empty when every group has one.
  static std::string UnheldGroup(const Run& run, const std::set<std::string>& holding);
  // Pending jobs, oldest first, get idle workers while there are enough and a store that
  // takes data. First come, first served, except that a job wanting more workers than are
  // alive holds back no later job. Each job left waiting records why (pending_reason).
  void SchedulePendingLocked(const Alive& alive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records why `job` (pending) waits, when that changed.
  void SetPendingReasonLocked(const v1::Job& job, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts (`reason`) or ends (empty) a running job's wait of one kind, and records the
  // waits it has in Job.pending_reason, for `pith status`.
  void NoteWaitLocked(const std::string& job_id, Run& run, Wait wait, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static std::string WaitReasons(const Run& run);
  // garbage.cc: `run`'s job ended; its weights may be on a draining store it used (placed,
  // joining, lost or left) that no pass has looked at for it.
  void NoteJobEndedLocked(const Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Idle workers of one compute backend (a job never mixes backends): that of `job_workers`
  // when it has any (`job_backend`, the run's recorded one, when none of them is alive
  // yet), else CUDA's for a bf16 `job` (it trains on nothing else), else the backend with
  // the most idle workers (CUDA on a tie). With `cuda_reserved` (an earlier bf16 job waits
  // for them) no CUDA worker.
  std::vector<std::string> IdleWorkersLocked(const Alive& alive, const v1::Job& job,
                                             const std::vector<std::string>& job_workers,
                                             bool cuda_reserved = false,
                                             v1::Backend job_backend = v1::BACKEND_AUTO) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GetAssignment's work under the lock (an abort it causes goes to `aborts`).
  absl::StatusOr<v1::Assignment> AssignmentLocked(const std::string& worker_id,
                                                  const v1::MemberInfo& worker, const Alive& alive,
                                                  std::vector<StoreCall>* aborts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // GetAssignment's checks of the asking worker's process against the attempt in flight
  // (an abort it causes goes to `aborts`).
  absl::Status AdmitToAttemptLocked(const std::string& worker_id, const v1::MemberInfo& worker,
                                    Run& run, std::vector<StoreCall>* aborts)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // step_commit.cc: the step-commit protocol.
  v1::StepStatus StatusLocked(const std::string& job_id, const Run& run, int64_t step) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's report that the step in flight failed: a full store is dropped or, where
  // the membership judges it low on disk, waited for (a put refused for want of disk);
  // any other failure counts (FailAttemptLocked), as does a refusal by a store not (yet)
  // judged low (a put bigger than its reserve, or before its heartbeat told its disk).
  // The reason the job fails with, else empty.
  std::string FailedReportLocked(Run& run, const v1::StepWrittenRequest& report,
                                 std::vector<StoreCall>* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Voids the attempt after a failure and counts it: the reason the job fails with when
  // the step has failed step_attempts attempts in a row, else empty.
  std::string FailAttemptLocked(Run& run, int64_t step, const std::string& reason,
                                std::vector<StoreCall>* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Counts a failed attempt of `step` (voided already): as FailAttemptLocked.
  std::string CountAttemptLocked(Run& run, int64_t step, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why assignments and reports of the job wait ("is waiting for ..."), empty when they
  // do not: after a coordinator restart, for a store, for disk room, for a peer's fate.
  static std::string PausedLocked(const Run& run);
  // peer_wait.cc. A worker's report that it could not reach `peer`, a worker of the job,
  // in the step in flight (`why`). When the peer still holds its lease, the attempt is
  // voided without counting and the job waits (Run.peer_worker; its pending reason says
  // so); when it holds none, only voided (the next tick's repair replaces it). True in
  // both cases; false when `peer` is not another worker of the job (the caller counts).
  bool WaitForPeerLocked(const std::string& job_id, Run& run, const std::string& reporter,
                         const std::string& peer, const std::string& why,
                         std::vector<StoreCall>* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each tick, for a job waiting for a peer's fate: a peer that died (or left the job)
  // ends the wait uncounted, the repair following; one that heartbeated since the report
  // is alive, and the attempt counts (the job fails once step_attempts did); so it does
  // after two leases without either, which membership does not allow.
  // True when the job failed (as ReviewRoomWaitLocked).
  bool ReviewPeerWaitLocked(const std::string& job_id, Run& run, const v1::Job& job,
                            const Alive& alive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each tick: a worker of the job silent for two thirds of a lease (a killed one: the others wait
  // on its part of the step, and nothing tells the coordinator before its lease lapses)
  // is named in the job's pending reason, with when its lease lapses, until it heartbeats
  // or leaves the job.
  void NoteSilentWorkerLocked(const std::string& job_id, Run& run, const Alive& alive)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker's put to `store` was refused for want of disk (`why`): the job stops using
  // the store (record.lost_stores; the next tick's repair copies its groups to stores
  // with room) where the job's other live stores with room hold every group; true if it
  // did (or had). `alive`: the members, as ForJob gives them for the run.
  bool DropFullStoreLocked(Run& run, const std::string& store, const std::string& why,
                           const Alive& alive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // room_wait.cc. A put refused for want of disk by `store`, which holds the only copy of
  // a group with room (DropFullStoreLocked said no): the attempt is voided without
  // counting, and the job waits (Run.room_store, its pending reason says so). Returns the
  // reason the job fails with once this step has waited kRoomWait, else "".
  std::string WaitForRoomLocked(const std::string& job_id, Run& run, const std::string& store,
                                const std::string& why, const Alive& alive,
                                std::vector<StoreCall>* aborts) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Each tick, for a job waiting for room: the wait ends when the store has room (it is
  // no longer low on disk; where no store could take its copies, twice its reserve
  // free will do), is gone (a lost store's repair takes over), or no longer holds the
  // job's only copies (copies pulled meanwhile join as readers, ApplyCopiesWhilePaused,
  // and the full store leaves); after kRoomWait the job fails with the refusal.
  // True when the job failed (its run keeps waiting until the next tick releases it).
  bool ReviewRoomWaitLocked(const std::string& job_id, Run& run, const v1::Job& job,
                            const Alive& alive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The groups (named as in a failure) whose complete copies on live stores with room are
  // all on `store`: none but its own (`alive`: ForJob's).
  static std::vector<std::string> OnlyCopiesOn(const Run& run, const std::string& store,
                                               const Alive& alive);
  // The pending reason of a job waiting for room on `store`.
  std::string RoomWaitReason(const Run& run, const Alive& alive) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The placement changed (`why`): a new epoch from step `from`, a new assignment version.
  void NewEpochLocked(const std::string& job_id, Run& run, const v1::PlacementTable& before,
                      int64_t from, const std::string& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Why a store dropped that way is lost to the job (record.lost_stores), for
  // kFullStoreCooldown and until the job's placement no longer names it: then it is
  // forgotten (its blobs of the job go as any store's that left a group), and it may take
  // copies of the job again once it has room. The wait keeps a store that fills
  // again with the job's copies from cycling in and out of it at every step.
  static constexpr char kFullDiskLoss[] = "its disk is full";
  // True when it forgot one (the record is to be persisted).
  bool ForgetFullStoresLocked(Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Blobs of the step in flight written to each store's complete copies: what its
  // prepare and its commit must count at least.
  static std::map<std::string, uint64_t> ExpectedBlobsLocked(const Run& run);
  // Once every worker wrote `report`'s step under `attempt`: every live store of the job
  // prepares it (its pending versions survive the store's crash), and when each group has
  // a complete copy that did, the commit is decided, durably (true: the caller commits).
  // Otherwise the attempt is voided (counted as failed when a store answered wrongly).
  absl::StatusOr<bool> PrepareAndDecide(const v1::StepWrittenRequest& report, int64_t attempt)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Commits `step` of `job_id` on every live store of the job, checks each answer, then
  // advances the job.
  void Commit(const std::string& job_id, int64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes one store's answer to the commit of `step`: true when it committed what was
  // written to it; otherwise its trouble is noted, and the job loses the store when the
  // answer is a refusal or a wrong count, or its commits have failed for several leases.
  bool CheckCommitLocked(Run& run, const std::string& store, int64_t step,
                         const absl::StatusOr<v1::CommitStepResponse>& answer, uint64_t expected)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A store of the job whose calls (`calls`: "commits", "prepares") fail: noted since
  // when; the job loses it at once when it `refused` (answered wrongly), else once it has
  // failed for three leases (record.lost_stores, with why).
  void StoreTroubleLocked(Run& run, const std::string& store, const std::string& calls,
                          const std::string& problem, bool refused)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishCommitLocked(const std::string& job_id, Run& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After a commit of `step` (not the last): copies join or leave the placement, and at
  // a re-plan boundary the compute plan may change; a new placement applies from the
  // next step under a new epoch.
  void AdvancePlacementLocked(const std::string& job_id, Run& run, const v1::Job& job, int64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A checkpoint holds the job's commits (after any in progress); false when the job is
  // not running.
  bool HoldCommits(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseCommits(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

  // garbage.cc: the stores that left a group between placements `before` and the run's.
  static void NoteLeftLocked(Run& run, const v1::PlacementTable& before);

  // scheduler_replication.cc: the drains' part of the tick.
  // Groups of running jobs placed on `store` (reading or joining), and with `with_moves`
  // the copies in flight from or to it.
  uint64_t GroupsOnLocked(const std::string& store, bool with_moves) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A drained store that left cleanly (deregistered, and not back after a restart's grace
  // period): its drain is over, and its id may be given out again.
  void ForgetLeftDrainsLocked(const Alive& alive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Draining stores that hold nothing any more can be stopped.
  void MarkDrainedStoresLocked(const Alive& alive) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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
  std::map<std::string, int> exporting_ ABSL_GUARDED_BY(mu_);  // job -> checkpoints in flight
  std::map<std::string, std::string> pending_reasons_ ABSL_GUARDED_BY(mu_);  // last recorded
  Replication replication_ ABSL_GUARDED_BY(mu_);  // copies in flight, drains, bytes moved
  // Groups being deleted from a store, (job, store, layer, expert): no copy of them there
  // starts until the delete returned.
  std::set<std::tuple<std::string, std::string, int, int>> collecting_ ABSL_GUARDED_BY(mu_);
  absl::Mutex drain_mu_ ABSL_ACQUIRED_BEFORE(mu_);  // serializes Drain
  // Draining stores on which the last garbage collection found no ended job's kept
  // weights without a copy on a store that stays (HomeEndedWeights): only these may be
  // drained. A job that ends takes the stores it used out (NoteJobEndedLocked).
  std::set<std::string> ended_homed_ ABSL_GUARDED_BY(mu_);
  // Jobs that ended, by store they used (NoteJobEndedLocked): a pass that began before one
  // did leaves the store for the next pass (the job may have written there after the pass
  // listed it, or been taken for a running one).
  std::map<std::string, uint64_t> ended_on_ ABSL_GUARDED_BY(mu_);

  prometheus::Counter* steps_committed_ = nullptr;
  prometheus::Counter* steps_aborted_ = nullptr;

  absl::Notification stop_;
  std::thread loop_, replicator_, collector_;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_SCHEDULER_H_
