// JobRun: one assignment of a cluster worker (RunClusterWorker, cluster_worker.h): the
// model, optimizer, peers and store I/O of one job at one (rank, world), driving the step
// loop. Its setup and state (job_run.cc) and its steps (job_step.cc).
//
// Thread safety: one training thread calls Run (and through it every StepDriver method);
// the members say which other threads touch them.
#ifndef PITH_WORKER_RUNTIME_JOB_RUN_H_
#define PITH_WORKER_RUNTIME_JOB_RUN_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/safetensors_reader.h"
#include "pith/v1/coordinator.pb.h"
#include "server/store/store_client.h"
#include "worker/compute/cpu_backend.h"
#include "worker/data/token_dataset.h"
#include "worker/model/moe_gpt.h"
#include "worker/model/optimizer.h"
#include "worker/runtime/cluster_worker.h"
#include "worker/runtime/coordinator_link.h"
#include "worker/runtime/dense_mirror.h"
#include "worker/runtime/device_group.h"
#include "worker/runtime/dispatch.h"
#include "worker/runtime/expert_cache.h"
#include "worker/runtime/expert_updater.h"
#include "worker/runtime/grad_pool.h"
#include "worker/runtime/memory_plan.h"
#include "worker/runtime/peer_group.h"
#include "worker/runtime/step_loop.h"
#include "worker/runtime/store_io.h"
#include "worker/runtime/worker_metrics.h"

namespace pith::runtime {

// One assignment: the model, optimizer and peers of one job at one (rank, world). It
// drives the step loop (RunSteps) on the training thread; the parts it owns say which
// other threads touch them: the store I/O (the cache's prefetch thread, the updates), the
// expert updater (its own threads), the abort watch (its thread).
class JobRun : public StepDriver {
 public:
  using StoreClient = store::StoreClient;
  using Expert = ExpertCache::Expert;
  using Overlap = ExpertUpdater::Overlap;

  JobRun(const v1::Assignment& a, PeerGroup* peers, StoreClient* client, CoordinatorLink* link,
         const ClusterWorkerOptions& options, WorkerMetrics* metrics)
      : a_(a),
        job_id_(a.job_id()),
        peers_(peers),
        client_(client),
        link_(link),
        options_(options),
        metrics_(metrics) {}

  ~JobRun() override;

  // Trains until the job ends or the assignment changes (OK: fetch it again), or a
  // failure (reported to the coordinator, which aborts the step). `report_passing`: see
  // RunSteps.
  absl::Status Run(const std::atomic<bool>& stop, bool report_passing = false);

 private:
  absl::Status Setup();

  // The training backend (options' factory, else the CPU's) and the CPU backend for work
  // on host memory: the training one when it is a CpuBackend.
  absl::Status MakeBackends();
  // Takes this assignment's placement: compute owners, the dispatch over them, the experts
  // computed and updated here, every group's stores (connected).
  absl::Status ApplyPlacement();

  // After a commit under a new assignment: takes it in place when it is the same job, the
  // same workers and ranks and the same spec (only the placement changed), keeping the
  // model, optimizer, dataset and cache; false when it is not (the caller starts over).
  absl::StatusOr<bool> Adopt() override;

  // What this job needs here with `owned` experts computed and `updated` updated.
  MemoryInput MemoryNeeds(int owned, int updated) const;
  // The plan for `next`'s placement.
  absl::StatusOr<MemoryPlan> PlanFor(const v1::Assignment& next) const;
  void ReportMemory() const { ReportMemoryPlan(*metrics_, plan_); }

  // Whether this worker is the expert's primary owner: it applies its update.
  bool Owns(int layer, int expert) const { return primary_[layer][expert] == a_.rank(); }

  v1::BlobKey Key(int layer, int expert, const std::string& tensor, v1::BlobKind kind) const;

  // Whether an expert has several owners (computed by a worker that reads its primary's
  // update from the stores).
  bool SharedExperts() const { return AnyShared(owners_); }
  Overlap OverlapWrites() const { return updater_->OverlapWrites(SharedExperts()); }

  // Waits for the writes and the report of the step written last, if they went on in the
  // background; a failure is reported to the coordinator (which aborts the step).
  absl::Status JoinWrites(int64_t s);

  // Step s is written and reported; the next step's reads ask for its versions.
  void SetPending(int64_t s) override;
  void ClearPending() override { store_io_->ClearPending(); }

  // Step 0: every worker builds the same initial weights (ParamInit's stream, or the
  // init file) and writes its share of the dense tensors and the experts it owns, with
  // zero moments and counts.
  absl::Status WriteInitial() override;

  // Step 0's experts owned here, made and written a few at a time (with the dense writes
  // queued before them): a worker never holds more than kInitialBatch of them.
  absl::Status WriteInitialExperts(const SafetensorsReader* file);
  // `why` a read of train.init_path failed, named so; the job cannot run (can_run_) when
  // no retry can read the file better.
  absl::Status InitFileFailed(const absl::Status& why);
  // Sets can_run_ and short_of_workers_ from whether the memory plan fits; FailureKind:
  // what a failure of this run tells the coordinator.
  void JudgeFit(const absl::Status& fits);
  CoordinatorLink::Failure FailureKind() const;

  // Queues version `version` of this worker's share of the dense tensors (their moments
  // zero at step 0); they go with the next flush (the experts' first).
  absl::Status WriteDense(int64_t version);

  // Rebuilds this worker's state from the committed step in the stores: the dense
  // tensors and their moments; experts come through the cache when needed.
  absl::Status LoadCommitted() override;

  // Reads every dense tensor and its moments, committed.
  absl::Status FetchDense();

  // Whether this worker writes dense tensor `t` (and counts its gradient in the norm):
  // every worker applies AdamW to every dense tensor (the same all-reduced gradients, the
  // same bits), and each tensor is written by one of them; they are dealt out in layout
  // order to the worker with the fewest bytes so far, so the writes take about as long on
  // every worker.
  bool DenseHere(const model::ParamTensor& t) const;
  void DealDense();

  // The first half of training step s >= 1 (data step s - 1): forward/backward with the
  // experts dispatched, replica gradients reduced, dense gradients summed, the global grad
  // norm. It reads only what this worker holds (the dense tensors are updated alike on
  // every worker) and, with replica experts, what their primaries wrote for step s - 1
  // (a barrier across the workers first), committed or not, so it runs while step s - 1
  // commits.
  absl::Status Compute(int64_t s) override;

  // The second half of step s, once step s - 1 is committed: the updates applied and
  // written (every dense tensor applied here, this worker's share of them written; experts
  // by their primary, with moments from the stores), heat and the step reported. The
  // experts' part goes on while the next step computes (the updater's handle, writes_),
  // unless OverlapWrites is kNone.
  absl::Status Write(int64_t s) override;

  // The experts this step updates: those updated here that got tokens (its routing).
  std::vector<Expert> UsedExperts() const;

  // Once step s's routing is known, before its backward (the training thread): the rest
  // of the cache's schedule, the backward of the experts computed here that got tokens,
  // then the updates (and the next step's forward guess, last_used_); the early fetch of
  // the updates' first moments.
  void OnRoutingKnown();

  // What a step's report and metrics need once its updates end (captured as Write
  // starts them: the next step's compute replaces the members).
  struct StepTail {
    int64_t step = 0;
    model::StepLoss loss;
    uint64_t tokens = 0;
    std::chrono::steady_clock::time_point start;
  };
  // The cache's figures since the last step's (its hits and misses go in its report too;
  // with pipelined updates a step's span overlaps the next one's, so each is counted
  // once, from the end of one step's updates to the end of the next's) and its time.
  void ObserveStep(const StepTail& tail);

  absl::Status Report(int64_t s, const model::StepLoss& loss, uint64_t tokens);

  void ReportFailure(int64_t s, const absl::Status& why) override;

  void ReportHeat(int64_t s);

  // Waits for step s to settle: committed (under this assignment, or with a new one from
  // the next step: kReassigned), or aborted / the job ended (kStop: start over).
  absl::StatusOr<Settled> Finish(int64_t s) override;

  void OnCommitted(int64_t s);

  // The training thread's, unless said otherwise.
  v1::Assignment a_;          // Adopt replaces it
  const std::string job_id_;  // a_.job_id()
  PeerGroup* peers_;
  StoreClient* client_;
  CoordinatorLink* link_;
  const ClusterWorkerOptions& options_;
  WorkerMetrics* metrics_;
  // The expert updates' element-wise loops (on the update thread, while backend_ computes
  // the next step); constructed first: a CpuBackend sets OpenBLAS's thread count, which
  // must be the training one's.
  compute::CpuBackend update_backend_{1};
  std::unique_ptr<compute::Backend> backend_;      // training (MakeBackends)
  std::unique_ptr<compute::CpuBackend> own_host_;  // when backend_ is not a CpuBackend
  compute::CpuBackend* host_backend_ = nullptr;    // host-memory work: backend_ or own_host_
  std::unique_ptr<DenseMirror> dense_;
  DeviceGroupSlot device_group_;  // the run's NCCL group (dense sums, token rows), if any
  model::ModelShape shape_;
  std::vector<int> rows_;
  std::unique_ptr<model::MoeGpt> model_;
  std::unique_ptr<model::AdamWOptimizer> optimizer_;
  std::unique_ptr<Dispatch> dispatch_;
  std::optional<data::TokenDataset> dataset_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<float> zeros_;
  // Report and ObserveStep run on the updater's thread while the next step computes (it
  // does not touch these); Finish waits for them before anything else does.
  model::StepLoss last_loss_;
  double lr_ = 0;
  ExpertCache::Stats observed_;   // the cache's stats at the last ObserveStep
  uint64_t observed_spills_ = 0;  // the gradient pool's, likewise
  DeviceCounts observed_device_;  // dispatch_'s counts at the last ReportDevice
  uint64_t step_hits_ = 0, step_misses_ = 0;
  std::map<int64_t, int> dense_rank_;  // dense tensor (by offset) -> the rank writing it
  // Between Compute and Write of a step.
  std::chrono::steady_clock::time_point step_start_;
  model::StepLoss computed_loss_;
  double grad_norm_ = 0;
  std::vector<Expert> owned_;              // computed here, in (layer, expert) order
  std::vector<Expert> updated_;            // primary here: updated here
  std::vector<std::vector<int>> primary_;  // [layer][expert] -> primary owner's rank
  std::vector<std::vector<ExpertOwners>> owners_;
  PutQueue puts_;  // this step's writes queued here, handed to the updater (Write)
  // [layer * E + expert]: the expert got tokens in the last step computed (OnRoutingKnown);
  // empty before the first.
  std::vector<uint8_t> last_used_;
  MemoryPlan plan_;  // Setup's (Adopt changes its moments)
  // False: the job cannot run here whatever is retried (its data file or train.init_path
  // is missing or bad, it does not fit the memory budget): a fatal failure.
  bool can_run_ = true;
  // This worker's share does not fit its budget at this attempt's worker count, fewer than
  // the job asked for: with more workers (smaller shares) it may (JudgeFit).
  bool short_of_workers_ = false;
  // Thread-safe parts, in the order they must be destroyed in reverse: the cache's
  // prefetch thread and the updater's threads use the store I/O, the updater the cache
  // and the gradient pool.
  std::unique_ptr<GradPool> grads_;
  std::unique_ptr<StoreIo> store_io_;
  std::unique_ptr<ExpertCache> cache_;
  std::unique_ptr<ExpertUpdater> updater_;
  std::unique_ptr<AbortWatch> watch_;
  // Run's stop flag: Finish, waiting for a step to settle, ends the run when it is set.
  const std::atomic<bool>* stop_ = nullptr;
  // The updates, writes and report of the step written last, going on while the next one
  // computes (Write), waited for by Finish and the destructor.
  UpdateHandle writes_;
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_JOB_RUN_H_
