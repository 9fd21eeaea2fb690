#include "worker/runtime/cluster_worker.h"

#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/grpc_status.h"
#include "common/metrics.h"
#include "common/safetensors_reader.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "server/coordinator/member_agent.h"
#include "server/store/store_client.h"
#include "worker/compute/cpu_backend.h"
#include "worker/data/token_dataset.h"
#include "worker/model/checkpoint.h"
#include "worker/model/moe_gpt.h"
#include "worker/model/optimizer.h"
#include "worker/model/param_init.h"
#include "worker/runtime/coordinator_link.h"
#include "worker/runtime/dense_mirror.h"
#include "worker/runtime/device_group.h"
#include "worker/runtime/dispatch.h"
#include "worker/runtime/expert_cache.h"
#include "worker/runtime/expert_gradients.h"
#include "worker/runtime/expert_updater.h"
#include "worker/runtime/grad_pool.h"
#include "worker/runtime/heat_report.h"
#include "worker/runtime/memory_plan.h"
#include "worker/runtime/peer_channels.h"
#include "worker/runtime/peer_group.h"
#include "worker/runtime/step_loop.h"
#include "worker/runtime/store_io.h"
#include "worker/runtime/worker_metrics.h"

namespace pith::runtime {
namespace {

using store::StoreClient;
using Expert = ExpertCache::Expert;
using Overlap = ExpertUpdater::Overlap;

// One assignment: the model, optimizer and peers of one job at one (rank, world). It
// drives the step loop (RunSteps) on the training thread; the parts it owns say which
// other threads touch them: the store I/O (the cache's prefetch thread, the updates), the
// expert updater (its own threads), the abort watch (its thread).
class JobRun : public StepDriver {
 public:
  JobRun(const v1::Assignment& a, PeerGroup* peers, StoreClient* client, CoordinatorLink* link,
         const ClusterWorkerOptions& options, WorkerMetrics* metrics)
      : a_(a),
        job_id_(a.job_id()),
        peers_(peers),
        client_(client),
        link_(link),
        options_(options),
        metrics_(metrics) {}

  ~JobRun() override {
    (void)writes_.Wait();
    watch_.reset();
    dispatch_.reset();  // its device copies of the cache's slots go before the slots do
  }

  // Trains until the job ends or the assignment changes (OK: fetch it again), or a
  // failure (reported to the coordinator, which aborts the step).
  absl::Status Run(const std::atomic<bool>& stop) {
    absl::Status s = Setup();
    if (!s.ok()) {
      // The step it could not set up for: the one after the committed one.
      link_->ReportFailure(job_id_, a_.assignment_version(), a_.committed_step() + 1, s,
                           /*fatal=*/!can_run_);
      return s;
    }
    watch_ = std::make_unique<AbortWatch>(link_, job_id_, /*step=*/0, a_.assignment_version(),
                                          [this](uint64_t version) {
                                            if (peers_->AbandonAttempt(version))
                                              device_group_.Abort();
                                          });
    return RunSteps(*this, a_.committed_step(), a_.spec().train().steps(), stop);
  }

 private:
  absl::Status Setup() {
    const v1::JobSpec& spec = a_.spec();
    shape_ = model::ModelShape::FromSpec(spec.model());
    const int W = a_.world(), B = spec.train().batch();
    for (int i = a_.rank(); i < B; i += W) rows_.push_back(i);
    if (rows_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("global batch ", B, " has no rows for rank ", a_.rank(), " of ", W));
    }
    // The data file first, before the model and the cache: a job whose data this worker
    // cannot read fails at once, with the reason, instead of retrying step 0.
    absl::StatusOr<data::TokenDataset> dataset =
        data::TokenDataset::Open(spec.train().data_path(), shape_.vocab);
    if (!dataset.ok()) {
      // Missing, unreadable or malformed is for good; anything else (an I/O error, no
      // memory for it now, a file changing under the read) may pass: retried.
      const absl::StatusCode code = dataset.status().code();
      can_run_ = code != absl::StatusCode::kNotFound &&
                 code != absl::StatusCode::kPermissionDenied &&
                 code != absl::StatusCode::kInvalidArgument;
      return dataset.status();
    }
    dataset_ = *std::move(dataset);
    // The dense state alone must fit before anything is allocated (PlanMemory checks
    // the rest once the model's activations are known).
    if (const uint64_t dense = 4 * sizeof(float) * model::ParamLayout(shape_).dense_floats();
        options_.memory_bytes > 0 && dense > options_.memory_bytes) {
      can_run_ = false;
      return absl::FailedPreconditionError(absl::StrCat(
          "the job does not fit this worker's --memory_bytes=", options_.memory_bytes,
          ": its dense state alone (parameters, gradients and moments) is ", dense, " bytes"));
    }
    RETURN_IF_ERROR(MakeBackends());
    // The dense tensors only: the experts live in the cache, the gradient pool and the
    // stores (memory_plan.h).
    ASSIGN_OR_RETURN(model_,
                     model::MoeGpt::Create(backend_.get(), shape_, static_cast<int>(rows_.size()),
                                           model::Experts::kExternal));
    dense_ = std::make_unique<DenseMirror>(backend_.get(), model_->layout().dense_floats());
    ASSIGN_OR_RETURN(optimizer_,
                     model::AdamWOptimizer::Create(backend_.get(), model_->layout(),
                                                   model::OptimizerConfig::FromSpec(spec.train()),
                                                   /*dense_only=*/true));
    std::vector<std::string> addresses;
    for (const v1::MemberInfo& p : a_.peers()) addresses.push_back(p.ucx_address());
    RETURN_IF_ERROR(peers_->Join(a_.rank(), addresses, a_.assignment_version()));
    RETURN_IF_ERROR(device_group_.Rejoin(*backend_, *peers_, kDeviceGroupTimeout));
    DealDense();
    store_io_ = std::make_unique<StoreIo>(client_, metrics_, job_id_, shape_.experts);
    RETURN_IF_ERROR(ApplyPlacement());
    absl::StatusOr<MemoryPlan> plan =
        PlanMemory(MemoryNeeds(static_cast<int>(owned_.size()), static_cast<int>(updated_.size())));
    can_run_ = plan.ok();
    RETURN_IF_ERROR(plan.status());
    plan_ = *plan;
    ReportMemory();
    ASSIGN_OR_RETURN(
        grads_, GradPool::Create(shape_.expert_floats(), plan_.grad_buffers, options_.scratch_dir));
    dispatch_->SetGradPool(grads_.get());
    // The expert cache, in registered memory.
    const size_t slot_bytes = static_cast<size_t>(shape_.expert_blob_bytes());
    const int slots = plan_.cache_slots;
    ASSIGN_OR_RETURN(std::unique_ptr<ucx::MemoryRegion> slot_memory,
                     client_->AllocateBuffer(slot_bytes * slots));
    store_io_->SetRegion(Region::kSlots, slot_memory->data(), slot_bytes * slots,
                         slot_memory->handle());
    ASSIGN_OR_RETURN(cache_, ExpertCache::Create(
                                 std::move(slot_memory), slot_bytes, slots,
                                 [io = store_io_.get()](absl::Span<ExpertCache::FetchRequest> r,
                                                        size_t bytes, ucp_mem_h memh) {
                                   return io->FetchWeights(r, bytes, memh);
                                 },
                                 /*pinned_wait=*/kStoreTimeout));
    dispatch_->SetCache(cache_.get());
    updater_ = std::make_unique<ExpertUpdater>(
        ExpertUpdater::Deps{job_id_, store_io_.get(), cache_.get(), &model_->layout(),
                            &optimizer_->config(), grads_.get(), host_backend_, &update_backend_});
    RETURN_IF_ERROR(updater_->SetUp(updated_, plan_.moments));
    inputs_.resize(rows_.size() * shape_.seq);
    targets_.resize(rows_.size() * shape_.seq);
    zeros_.assign(
        std::max<int64_t>(shape_.expert_floats(), model_->layout().largest_dense_floats()), 0.0f);
    LOG(INFO) << "job " << a_.job_id() << ": rank " << a_.rank() << " of " << W << ", "
              << rows_.size() << " rows per step, " << owned_.size() << " experts computed ("
              << updated_.size() << " updated), " << slots << " cache slots, " << plan_.grad_buffers
              << " gradient buffers, " << plan_.total() << " bytes planned, placement epoch "
              << a_.placement().epoch();
    return absl::OkStatus();
  }

  // Takes this assignment's placement: compute owners, the dispatch over them, the experts
  // computed and updated here, every group's stores (connected).
  // The training backend (options' factory, else the CPU's) and the CPU backend for work
  // on host memory: the training one when it is a CpuBackend.
  absl::Status MakeBackends() {
    if (options_.make_backend) {
      ASSIGN_OR_RETURN(backend_, options_.make_backend());
    } else {
      backend_ = std::make_unique<compute::CpuBackend>(options_.threads);
    }
    host_backend_ = dynamic_cast<compute::CpuBackend*>(backend_.get());
    if (host_backend_ == nullptr) {
      own_host_ = std::make_unique<compute::CpuBackend>(options_.threads);
      host_backend_ = own_host_.get();
    }
    return absl::OkStatus();
  }

  absl::Status ApplyPlacement() {
    ASSIGN_OR_RETURN(std::vector<std::vector<ExpertOwners>> owners,
                     OwnersOf(a_.placement(), shape_.layers, shape_.experts, a_.world()));
    primary_.assign(shape_.layers, std::vector<int>(shape_.experts, -1));
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) primary_[l][e] = owners[l][e][0].first;
    }
    owners_ = owners;
    observed_device_ = {};  // the new Dispatch counts from 0
    dispatch_ = std::make_unique<Dispatch>(backend_.get(), model_.get(), peers_, std::move(owners));
    model_->SetExpertParallel(dispatch_.get());
    dispatch_->SetDeviceGroup(&device_group_);
    if (cache_ != nullptr) dispatch_->SetCache(cache_.get());
    if (grads_ != nullptr) dispatch_->SetGradPool(grads_.get());
    dispatch_->SetRoutingKnown([this] { OnRoutingKnown(); });
    owned_.clear();
    updated_.clear();
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (dispatch_->Computes(l, e)) owned_.push_back({l, e});
        if (primary_[l][e] == a_.rank()) updated_.push_back({l, e});
      }
    }
    return store_io_->ApplyPlacement(a_);
  }

  // After a commit under a new assignment: takes it in place when it is the same job, the
  // same workers and ranks and the same spec (only the placement changed), keeping the
  // model, optimizer, dataset and cache; false when it is not (the caller starts over).
  absl::StatusOr<bool> Adopt() override {
    updater_->DropEarlyMoments();  // it reads the stores of the placement this replaces
    ASSIGN_OR_RETURN(v1::Assignment next, link_->GetAssignment(kAdoptAssignmentDeadline));
    bool same = next.job_id() == a_.job_id() && next.world() == a_.world() &&
                next.rank() == a_.rank() && next.peers_size() == a_.peers_size() &&
                next.spec().SerializeAsString() == a_.spec().SerializeAsString();
    for (int i = 0; same && i < next.peers_size(); ++i) {
      same = next.peers(i).member_id() == a_.peers(i).member_id() &&
             next.peers(i).ucx_address() == a_.peers(i).ucx_address();
    }
    if (!same) return false;
    // The cache and the gradient pool keep their buffers: a worker that would want more
    // (it computes more experts now, and its budget allows) starts over instead.
    absl::StatusOr<MemoryPlan> plan = PlanFor(next);
    if (!plan.ok() || plan->cache_slots > cache_->slots() ||
        plan->grad_buffers > grads_->buffers()) {
      return false;
    }
    // Kept pools and the new moment buffers must fit the budget too.
    const uint64_t expert_bytes = shape_.expert_floats() * sizeof(float);
    const uint64_t kept = plan->dense_bytes + plan->activation_bytes + plan->moment_bytes +
                          cache_->slot_bytes() * cache_->slots() + expert_bytes * grads_->buffers();
    if (options_.memory_bytes > 0 && kept > options_.memory_bytes) return false;
    // A cached expert is current only if this worker made its last update (it was its
    // primary); the others may have moved on (pinned ones too, once their uploads land).
    RETURN_IF_ERROR(dispatch_->SettleCopies());
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (primary_[l][e] != a_.rank()) cache_->Invalidate({l, e});
      }
    }
    a_ = std::move(next);
    peers_->SetAttempt(a_.assignment_version());
    watch_->SetVersion(a_.assignment_version());
    RETURN_IF_ERROR(device_group_.Rejoin(*backend_, *peers_, kDeviceGroupTimeout));
    RETURN_IF_ERROR(ApplyPlacement());
    // The experts updated here changed: their moments come from the stores.
    plan_.moments = plan->moments;
    plan_.moment_bytes = plan->moment_bytes;
    ReportMemory();
    RETURN_IF_ERROR(updater_->SetUp(updated_, plan_.moments));
    LOG(INFO) << "job " << a_.job_id() << ": placement epoch " << a_.placement().epoch()
              << " adopted in place (" << owned_.size() << " experts computed, " << updated_.size()
              << " updated)";
    return true;
  }

  // What this job needs here with `owned` experts computed and `updated` updated.
  MemoryInput MemoryNeeds(int owned, int updated) const {
    const int64_t job_cache = a_.spec().cluster().cache_bytes();
    return MemoryNeedsOf(shape_, options_.memory_bytes,
                         job_cache > 0 ? static_cast<uint64_t>(job_cache) : options_.cache_bytes,
                         model_->layout().dense_floats(), model_->activation_bytes(), owned,
                         updated);
  }
  // The plan for `next`'s placement.
  absl::StatusOr<MemoryPlan> PlanFor(const v1::Assignment& next) const {
    const auto [owned, updated] = ComputedAndUpdated(next.placement(), next.rank());
    return PlanMemory(MemoryNeeds(owned, updated));
  }
  void ReportMemory() const { ReportMemoryPlan(*metrics_, plan_); }

  // Whether this worker is the expert's primary owner: it applies its update.
  bool Owns(int layer, int expert) const { return primary_[layer][expert] == a_.rank(); }

  v1::BlobKey Key(int layer, int expert, const std::string& tensor, v1::BlobKind kind) const {
    return BlobKeyOf(job_id_, layer, expert, tensor, kind);
  }

  // Whether an expert has several owners (computed by a worker that reads its primary's
  // update from the stores).
  bool SharedExperts() const { return AnyShared(owners_); }
  Overlap OverlapWrites() const { return updater_->OverlapWrites(SharedExperts()); }

  // Waits for the writes and the report of the step written last, if they went on in the
  // background; a failure is reported to the coordinator (which aborts the step).
  absl::Status JoinWrites(int64_t s) {
    if (!writes_.pending()) return absl::OkStatus();
    absl::Status st = writes_.Wait();
    if (!st.ok()) ReportFailure(s, st);
    return st;
  }

  // Step s is written and reported; the next step's reads ask for its versions.
  void SetPending(int64_t s) override {
    std::vector<bool> written(shape_.layers * shape_.experts, s == 0);
    if (s != 0) {  // step 0 wrote every expert
      for (int l = 0; l < shape_.layers; ++l) {
        for (int e = 0; e < shape_.experts; ++e) {
          written[l * shape_.experts + e] = model_->ExpertUsed(l, e);
        }
      }
    }
    store_io_->SetPending(s, std::move(written));
  }
  void ClearPending() override { store_io_->ClearPending(); }

  // Step 0: every worker builds the same initial weights (ParamInit's stream, or the
  // init file) and writes its share of the dense tensors and the experts it owns, with
  // zero moments and counts.
  absl::Status WriteInitial() override {
    const std::string& init = a_.spec().train().init_path();
    std::optional<SafetensorsReader> file;  // read an expert at a time, never whole
    if (!init.empty()) {
      ASSIGN_OR_RETURN(file, SafetensorsReader::Open(init));
      RETURN_IF_ERROR(
          model::LoadDenseWeights(*backend_, model_->layout(), *file, model_->params()));
    } else {
      RETURN_IF_ERROR(model_->InitWeights(a_.spec().train().seed()));
    }
    store_io_->ClearWritten();
    RETURN_IF_ERROR(WriteDense(0));
    RETURN_IF_ERROR(WriteInitialExperts(file ? &*file : nullptr));
    return Report(0, model::StepLoss(), 0);
  }

  // Step 0's experts owned here, made and written a few at a time (with the dense writes
  // queued before them): a worker never holds more than kInitialBatch of them.
  absl::Status WriteInitialExperts(const SafetensorsReader* file) {
    constexpr int kInitialBatch = 8;
    const model::ParamLayout& layout = model_->layout();
    model::ParamInit init(layout, a_.spec().train().seed());
    const int64_t floats = shape_.expert_floats();
    std::vector<float> weights(kInitialBatch * floats);
    // A bf16 job's weights blobs (common/bf16.h) beside the fp32 masters.
    const bool bf16 = shape_.compute_dtype == ComputeDtype::kBf16;
    const size_t blob_bytes = static_cast<size_t>(shape_.expert_blob_bytes());
    std::vector<uint8_t> blobs(bf16 ? kInitialBatch * blob_bytes : 0);
    static constexpr int64_t kZeroCount = 0;
    int queued = 0;
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (!Owns(l, e)) continue;
        float* w = weights.data() + queued * floats;
        if (file != nullptr) {
          RETURN_IF_ERROR(model::ReadExpertWeights(layout, *file, l, e, w));
        } else {
          init.FillExpert(l, e, w);
        }
        const std::vector<std::string> stores = store_io_->WriteStores({l, e});
        uint8_t* blob = bf16 ? blobs.data() + queued * blob_bytes : nullptr;
        if (bf16) PackExpertBf16(w, shape_.channels, shape_.hidden, blob);
        RETURN_IF_ERROR(store_io_->PutParams(stores, l, e, "", 0, w, zeros_.data(), zeros_.data(),
                                             floats * sizeof(float), puts_, blob, blob_bytes));
        RETURN_IF_ERROR(store_io_->Put(stores, Key(l, e, "", v1::BLOB_KIND_STATE), 0, &kZeroCount,
                                       sizeof(int64_t), puts_));
        if (++queued == kInitialBatch) {
          RETURN_IF_ERROR(store_io_->Flush(puts_));
          queued = 0;
        }
      }
    }
    return store_io_->Flush(puts_);
  }

  // Queues version `version` of this worker's share of the dense tensors (their moments
  // zero at step 0); they go with the next flush (the experts' first).
  absl::Status WriteDense(int64_t version) {
    ASSIGN_OR_RETURN(const float* p, dense_->Host(DenseMirror::kParams, model_->params()));
    const float *m = zeros_.data(), *v = zeros_.data();
    if (version != 0) {
      ASSIGN_OR_RETURN(m, dense_->Host(DenseMirror::kMomentM, optimizer_->m()));
      ASSIGN_OR_RETURN(v, dense_->Host(DenseMirror::kMomentV, optimizer_->v()));
    }
    const std::vector<std::string> dense_stores = store_io_->WriteStores(kDenseGroup);
    for (const model::ParamTensor& t : model_->layout().tensors()) {
      if (!DenseHere(t)) continue;
      const int64_t o = version == 0 ? 0 : t.offset;
      RETURN_IF_ERROR(store_io_->PutParams(dense_stores, -1, 0, t.name, version, p + t.offset,
                                           m + o, v + o, t.numel * sizeof(float), puts_));
    }
    return absl::OkStatus();
  }

  // Rebuilds this worker's state from the committed step in the stores: the dense
  // tensors and their moments; experts come through the cache when needed.
  absl::Status LoadCommitted() override {
    const model::ParamLayout& layout = model_->layout();
    RETURN_IF_ERROR(FetchDense());
    std::vector<int64_t>& counts = optimizer_->update_counts();
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      if (layout.tensors()[i].layer < 0) counts[i] = a_.committed_step();
    }
    return absl::OkStatus();
  }

  // Reads every dense tensor and its moments, committed.
  absl::Status FetchDense() {
    std::vector<StoreClient::FetchItem> items;
    for (const model::ParamTensor& t : model_->layout().tensors()) {
      if (t.layer >= 0) continue;
      const size_t bytes = t.numel * sizeof(float);
      for (const auto& [kind, mirror, dev] :
           {std::tuple{v1::BLOB_KIND_WEIGHTS, DenseMirror::kParams, model_->params()},
            std::tuple{v1::BLOB_KIND_ADAM_M, DenseMirror::kMomentM, optimizer_->m()},
            std::tuple{v1::BLOB_KIND_ADAM_V, DenseMirror::kMomentV, optimizer_->v()}}) {
        items.push_back(
            FetchItemOf(Key(-1, 0, t.name, kind), dense_->Landing(mirror, dev) + t.offset, bytes));
      }
    }
    RETURN_IF_ERROR(store_io_->Fetch(store_io_->ReadStores(kDenseGroup), items));
    RETURN_IF_ERROR(dense_->Upload(DenseMirror::kParams, model_->params()));
    RETURN_IF_ERROR(dense_->Upload(DenseMirror::kMomentM, optimizer_->m()));
    return dense_->Upload(DenseMirror::kMomentV, optimizer_->v());
  }

  // Whether this worker writes dense tensor `t` (and counts its gradient in the norm):
  // every worker applies AdamW to every dense tensor (the same all-reduced gradients, the
  // same bits), and each tensor is written by one of them; they are dealt out in layout
  // order to the worker with the fewest bytes so far, so the writes take about as long on
  // every worker.
  bool DenseHere(const model::ParamTensor& t) const {
    if (t.layer >= 0) return false;
    auto it = dense_rank_.find(t.offset);
    return it != dense_rank_.end() && it->second == a_.rank();
  }
  void DealDense() {
    dense_rank_.clear();
    std::vector<int64_t> load(a_.world(), 0);
    for (const model::ParamTensor& t : model_->layout().tensors()) {
      if (t.layer >= 0) continue;
      const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      dense_rank_[t.offset] = r;
      load[r] += t.numel;
    }
  }

  // The first half of training step s >= 1 (data step s - 1): forward/backward with the
  // experts dispatched, replica gradients reduced, dense gradients summed, the global grad
  // norm. It reads only what this worker holds (the dense tensors are updated alike on
  // every worker) and, with replica experts, what their primaries wrote for step s - 1
  // (the barrier below), committed or not, so it runs while step s - 1 commits.
  absl::Status Compute(int64_t s) override {
    watch_->SetStep(s);
    step_start_ = std::chrono::steady_clock::now();
    if (store_io_->Pending() && SharedExperts()) {
      // Every worker's writes of the step before are in the stores: this worker reads its
      // replica experts' updates from there (their primaries wrote them).
      double one = 1;
      RETURN_IF_ERROR(peers_->AllReduceSum(&one, 1, channels::ReplicaBarrier(s)));
    }
    dispatch_->SetStep(s);
    // The owner's compute order, for the prefetcher: the forward through the layers, of
    // the experts expected to get tokens (those that got some last step; every one before
    // the first), then the backward, then the updates (OnRoutingKnown: only those that did).
    // Experts this worker computes but does not update were updated by their primary.
    for (const Expert& x : owned_) {
      if (!Owns(x.first, x.second)) cache_->Invalidate(x);
    }
    std::vector<Expert> order;
    for (const Expert& x : owned_) {
      if (last_used_.empty() || last_used_[x.first * shape_.experts + x.second]) order.push_back(x);
    }
    const std::vector<Expert> forward = order;
    order.insert(order.end(), forward.rbegin(), forward.rend());
    cache_->SetSchedule(std::move(order));
    const int T = shape_.seq;
    const int64_t B = a_.spec().train().batch();
    for (size_t j = 0; j < rows_.size(); ++j) {
      dataset_->Row((s - 1) * B + rows_[j], T, inputs_.data() + j * T, targets_.data() + j * T);
    }
    ASSIGN_OR_RETURN(computed_loss_, model_->ForwardBackward(inputs_.data(), targets_.data(), B));
    auto used = [this](int l, int e) { return model_->ExpertUsed(l, e); };
    const ExpertGradients gradients{grads_.get(), &model_->layout(), &owners_,
                                    &primary_,    a_.rank(),         used};
    RETURN_IF_ERROR(dispatch_->ReplicasOnDevice() ? dispatch_->ReduceReplicasOnDevice()
                                                  : gradients.ReduceReplicas(*peers_, s, owned_));
    RETURN_IF_ERROR(device_group_.SumDense(model_->grads(), model_->layout().dense_floats(),
                                           *dense_, *peers_, channels::DenseGradients(s),
                                           metrics_->dense_sums));
    // The dense tensors dealt here, then the experts updated here that got tokens, in
    // layout order.
    const double dense_sq = optimizer_->LocalSumOfSquares(
        model_->grads(), [&](const model::ParamTensor& t) { return DenseHere(t); });
    ASSIGN_OR_RETURN(double sum_sq, gradients.AddSumOfSquares(*host_backend_, dense_sq, updated_));
    RETURN_IF_ERROR(peers_->AllReduceSum(&sum_sq, 1, channels::GradNorm(s)));
    grad_norm_ = std::sqrt(sum_sq);
    ReportDevice(*metrics_, backend_->device_bytes(),
                 {dispatch_->slot_uploads(), dispatch_->device_exchanges()}, &observed_device_);
    return absl::OkStatus();
  }

  // The second half of step s, once step s - 1 is committed: the updates applied and
  // written (every dense tensor applied here, this worker's share of them written; experts
  // by their primary, with moments from the stores), heat and the step reported. The
  // experts' part goes on while the next step computes (the updater's handle, writes_),
  // unless OverlapWrites is kNone.
  absl::Status Write(int64_t s) override {
    ReportHeat(s);
    const int T = shape_.seq;
    // Every dense tensor through the optimizer (the same bits on every worker: the same
    // all-reduced gradients and norm); experts by the updater, with their moments fetched
    // from the stores.
    const model::HasGrad dense = [](const model::ParamTensor& t) { return t.layer < 0; };
    lr_ = optimizer_->Apply(model_->params(), model_->grads(), s - 1, dense, grad_norm_).lr;
    RETURN_IF_ERROR(backend_->Synchronize());  // the dense puts read what it wrote
    store_io_->ClearWritten();                 // the step's writes have all ended (Finish)
    const Overlap overlap = OverlapWrites();
    RETURN_IF_ERROR(WriteDense(s));
    metrics_->tokens->Increment(static_cast<double>(rows_.size() * T));
    metrics_->rows_sent->Increment(static_cast<double>(dispatch_->rows_sent()));
    // The experts this step updates: its routing, read before the next step's forward.
    std::vector<Expert> used = UsedExperts();
    const StepTail tail{s, computed_loss_, rows_.size() * T, step_start_};
    PutQueue queued = std::move(puts_);  // the dense writes go with the experts' first
    puts_.clear();
    if (overlap == Overlap::kNone) {
      RETURN_IF_ERROR(updater_->UpdateNow(s, grad_norm_, used, std::move(queued)));
      ObserveStep(tail);
      return Report(s, computed_loss_, tail.tokens);
    }
    // NOTE: the next step's compute goes on meanwhile (ExpertUpdater::Launch). What the
    // report reads there (observed_, step_hits_, step_misses_, lr_) the compute does not
    // touch; Report sets last_loss_. A fetch of an updated expert asks for this step's
    // version (pending from here; a slot is pinned until its writes land).
    cache_->BeginUpdates(used);
    SetPending(s);
    writes_ =
        updater_->Launch(s, grad_norm_, overlap, std::move(used), std::move(queued), [this, tail] {
          ObserveStep(tail);
          return Report(tail.step, tail.loss, tail.tokens);
        });
    return absl::OkStatus();
  }

  // The experts this step updates: those updated here that got tokens (its routing).
  std::vector<Expert> UsedExperts() const {
    std::vector<Expert> used;
    for (const Expert& x : updated_) {
      if (model_->ExpertUsed(x.first, x.second)) used.push_back(x);
    }
    return used;
  }

  // Once step s's routing is known, before its backward (the training thread): the rest
  // of the cache's schedule, the backward of the experts computed here that got tokens,
  // then the updates (and the next step's forward guess, last_used_); the early fetch of
  // the updates' first moments.
  void OnRoutingKnown() {
    last_used_.assign(shape_.layers * shape_.experts, 0);
    std::vector<Expert> order;
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) {
      if (!model_->ExpertUsed(it->first, it->second)) continue;
      last_used_[it->first * shape_.experts + it->second] = 1;
      order.push_back(*it);
    }
    std::vector<Expert> updates = UsedExperts();
    order.insert(order.end(), updates.begin(), updates.end());
    cache_->SetSchedule(std::move(order));
    updater_->StartEarlyMoments(std::move(updates), OverlapWrites());
  }

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
  void ObserveStep(const StepTail& tail) {
    const ExpertCache::Stats before = observed_;
    const ExpertCache::Stats after = observed_ = cache_->stats();
    step_hits_ = after.hits - before.hits;
    step_misses_ = after.misses - before.misses;
    metrics_->hits->Increment(static_cast<double>(step_hits_));
    metrics_->misses->Increment(static_cast<double>(step_misses_));
    metrics_->prefetch_hits->Increment(
        static_cast<double>(after.prefetch_hits - before.prefetch_hits));
    const uint64_t spills = grads_->stats().spills;
    metrics_->gradient_spills->Increment(static_cast<double>(spills - observed_spills_));
    observed_spills_ = spills;
    metrics_->resident->Set(static_cast<double>(after.resident_bytes));
    metrics_->step_seconds->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - tail.start).count());
  }

  absl::Status Report(int64_t s, const model::StepLoss& loss, uint64_t tokens) {
    v1::StepWrittenRequest r;
    r.set_job_id(a_.job_id());
    r.set_step(s);
    r.set_placement_epoch(a_.placement().epoch());
    r.set_assignment_version(a_.assignment_version());
    r.set_ok(true);
    *r.mutable_written() = store_io_->Written();
    r.set_loss(loss.loss);
    r.set_ce(loss.ce);
    r.set_lr(lr_);
    r.set_tokens(tokens);
    r.set_cache_hits(step_hits_);
    r.set_cache_misses(step_misses_);
    last_loss_ = loss;
    return link_->ReportStepWritten(std::move(r));
  }

  void ReportFailure(int64_t s, const absl::Status& why) override {
    link_->ReportFailure(a_.job_id(), a_.assignment_version(), s, why);
  }

  void ReportHeat(int64_t s) {
    HeatInput in;
    in.job_id = a_.job_id();
    in.worker_id = link_->worker_id();
    in.step = s;
    in.tokens = static_cast<int64_t>(rows_.size()) * shape_.seq;
    in.experts = shape_.experts;
    in.top_k = shape_.top_k;
    for (int l = 0; l < shape_.layers; ++l) in.routed.push_back(model_->routed(l));
    in.fetched = cache_->TakeFetchCounts();
    in.chosen = [this](int layer, int32_t* chosen) {
      return model_->CopyChosenExperts(layer, chosen).ok();
    };
    link_->ReportHeat(MakeHeatReport(in));
  }

  // Waits for step s to settle: committed (under this assignment, or with a new one from
  // the next step: kReassigned), or aborted / the job ended (kStop: start over).
  absl::StatusOr<Settled> Finish(int64_t s) override {
    RETURN_IF_ERROR(JoinWrites(s));
    while (true) {
      v1::WaitStepRequest req;
      req.set_job_id(a_.job_id());
      req.set_step(s);
      req.set_assignment_version(a_.assignment_version());
      absl::StatusOr<v1::StepStatus> st = link_->WaitStep(req, kSettleWaitDeadline);
      if (absl::IsDeadlineExceeded(st.status())) continue;
      RETURN_IF_ERROR(st.status());
      if (st->committed_step() >= s) {
        OnCommitted(s);
        if (st->job_ended()) return Settled::kStop;
        // A new placement epoch (or worker set) from the next step: re-fetch.
        return st->assignment_version() == a_.assignment_version() ? Settled::kCommitted
                                                                   : Settled::kReassigned;
      }
      if (st->aborted() || st->job_ended()) {
        LOG(INFO) << "step " << s << " of job " << a_.job_id()
                  << " aborted: " << st->abort_reason();
        return Settled::kStop;
      }
    }
  }

  void OnCommitted(int64_t s) {
    metrics_->step->Set(static_cast<double>(s));
    if (s == 0) return;
    metrics_->loss->Set(last_loss_.loss);
    if (a_.rank() == 0 && (s == 1 || s % 10 == 0 || s == a_.spec().train().steps())) {
      LOG(INFO) << absl::StrFormat("job %s step %d/%d loss %.4f ce %.4f lr %.3g", a_.job_id(), s,
                                   a_.spec().train().steps(), last_loss_.loss, last_loss_.ce, lr_);
    }
    if (a_.rank() == 0 && !options_.loss_log.empty()) {
      (void)AppendToFile(options_.loss_log,
                         absl::StrFormat("%d %.9g %.9g\n", s, last_loss_.loss, last_loss_.ce));
    }
  }

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
  // False: the job cannot run here whatever is retried (its data file is missing or bad,
  // it does not fit the memory budget): a fatal failure.
  bool can_run_ = true;
  // Thread-safe parts, in the order they must be destroyed in reverse: the cache's
  // prefetch thread and the updater's threads use the store I/O, the updater the cache
  // and the gradient pool.
  std::unique_ptr<GradPool> grads_;
  std::unique_ptr<StoreIo> store_io_;
  std::unique_ptr<ExpertCache> cache_;
  std::unique_ptr<ExpertUpdater> updater_;
  std::unique_ptr<AbortWatch> watch_;
  // The updates, writes and report of the step written last, going on while the next one
  // computes (Write), waited for by Finish and the destructor.
  UpdateHandle writes_;
};

}  // namespace

absl::Status RunClusterWorker(const ClusterWorkerOptions& options, MetricsRegistry& registry,
                              const std::atomic<bool>& stop) {
  if (options.coordinator.empty()) return absl::InvalidArgumentError("--coordinator is required");
  ASSIGN_OR_RETURN(WorkerMetrics metrics, MakeWorkerMetrics(registry));
  v1::MemberInfo self;
  self.set_metrics_address(options.metrics_address);
  ASSIGN_OR_RETURN(std::unique_ptr<PeerGroup> peers, PeerGroup::Create());
  ASSIGN_OR_RETURN(std::unique_ptr<StoreClient> client, StoreClient::Create());
  self.set_role(v1::MEMBER_ROLE_WORKER);
  self.set_grpc_address(options.listen);
  self.set_ucx_address(peers->address());
  self.set_capacity_bytes(options.memory_bytes > 0 ? options.memory_bytes : options.cache_bytes);
  self.set_backend(options.backend_kind);
  ASSIGN_OR_RETURN(
      std::unique_ptr<MemberAgent> agent,
      MemberAgent::Start(options.coordinator, options.security, self, [](v1::MemberInfo*) {}));
  LOG(INFO) << "worker " << agent->member_id() << " joined " << options.coordinator;
  auto coordinator = v1::CoordinatorService::NewStub(
      NewChannel(options.coordinator, options.security.ChannelCredentials()));
  CoordinatorLink link(coordinator.get(), agent->member_id());
  const auto pause = [] {
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(kAssignmentRetry));
  };
  int failures = 0;  // failed runs in a row (30 s of training restarts it): doubling waits
  while (!stop) {
    absl::StatusOr<v1::Assignment> a = link.GetAssignment(kIdleAssignmentDeadline);
    if (!a.ok() || a->job_id().empty()) {
      if (!a.ok()) VLOG(1) << "assignment: " << a.status();
      pause();
      continue;
    }
    JobRun run(*a, peers.get(), client.get(), &link, options, &metrics);
    const absl::Time started = absl::Now();
    absl::Status s = run.Run(stop);
    failures = s.ok() ? 0 : (absl::Now() - started > absl::Seconds(30) ? 1 : failures + 1);
    if (!s.ok()) {
      LOG(WARNING) << "job " << a->job_id() << ": " << s;
      for (int i = 0; i < (1 << std::min(failures - 1, 5)) && !stop; ++i) pause();
    }
  }
  return absl::OkStatus();
}

}  // namespace pith::runtime
