// JobRun: setup, placement, memory, the initial and committed state (job_run.h).
#include "worker/runtime/job_run.h"

#include <algorithm>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/export_path.h"
#include "common/file.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/model/checkpoint.h"
#include "worker/model/param_init.h"

namespace pith::runtime {

JobRun::~JobRun() {
  (void)writes_.Wait();
  watch_.reset();
  dispatch_.reset();  // its device copies of the cache's slots go before the slots do
}

absl::Status JobRun::Run(const std::atomic<bool>& stop, bool report_passing) {
  stop_ = &stop;
  // Watching from before the setup, the step it sets up for: its waits on peers (the
  // device group's id, which rank 0 may be slow to send) end at a stop or an abort instead
  // of their timeouts (an attempt abandoned before the setup's join starts abandoned).
  watch_ = std::make_unique<AbortWatch>(
      link_, job_id_, /*step=*/a_.committed_step() + 1, a_.assignment_version(),
      [this](uint64_t version) {
        if (peers_->AbandonAttempt(version)) device_group_.Abort();
      },
      &stop);
  absl::Status s = Setup();
  if (!s.ok() && stop) return s;  // what the stop interrupted is no failure of the job
  if (!s.ok()) {
    // The step it could not set up for: the one after the committed one (a peer it could
    // not join is named, as in a step).
    ReportFailure(a_.committed_step() + 1, s);
    return s;
  }
  return RunSteps(*this, a_.committed_step(), a_.spec().train().steps(), stop, report_passing);
}

namespace {

// Past the machine's memory the kernel would kill the worker mid-step (and the next one
// the job lands on): a job that cannot fit fails at its setup, with what to do.
absl::Status FitsTheMachine(const MemoryPlan& plan, uint64_t memory_bytes) {
  const uint64_t machine = PhysicalMemoryBytes();
  if (machine == 0 || plan.total() <= machine) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "the job needs ", plan.total(), " bytes on this worker (dense state, activations",
      memory_bytes == 0 ? " and every expert it computes: no --memory_bytes"
                        : " and the expert pools",
      "), more than the machine's ", machine,
      " bytes of memory; give the workers --memory_bytes (the experts then stream through a "
      "cache within it), or shrink model.seq_len or train.batch"));
}

}  // namespace

void JobRun::JudgeFit(const absl::Status& fits) {
  short_of_workers_ = !fits.ok() && a_.world() < std::max(1, a_.spec().cluster().workers());
  can_run_ = fits.ok() || short_of_workers_;
}

CoordinatorLink::Failure JobRun::FailureKind() const {
  if (short_of_workers_) return CoordinatorLink::Failure::kNeedsMoreWorkers;
  return can_run_ ? CoordinatorLink::Failure::kRetry : CoordinatorLink::Failure::kFatal;
}

absl::Status JobRun::Setup() {
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
  absl::StatusOr<data::TokenDataset> dataset = [&]() -> absl::StatusOr<data::TokenDataset> {
    ASSIGN_OR_RETURN(ReadPath data, ReadPath::Open(spec.train().data_path(), options_.data_rules,
                                                   "train.data_path"));
    absl::StatusOr<data::TokenDataset> opened = data::TokenDataset::Open(data.path(), shape_.vocab);
    if (!opened.ok()) return data.Named(opened.status());
    return opened;
  }();
  if (!dataset.ok()) {
    // Missing, unreadable or malformed is for good; anything else (an I/O error, no
    // memory for it now, a file changing under the read) may pass: retried.
    const absl::StatusCode code = dataset.status().code();
    can_run_ = code != absl::StatusCode::kNotFound && code != absl::StatusCode::kPermissionDenied &&
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
  JudgeFit(plan.status());
  RETURN_IF_ERROR(plan.status());
  const absl::Status fits = FitsTheMachine(*plan, options_.memory_bytes);
  JudgeFit(fits);
  RETURN_IF_ERROR(fits);
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
  zeros_.assign(std::max<int64_t>(shape_.expert_floats(), model_->layout().largest_dense_floats()),
                0.0f);
  LOG(INFO) << "job " << a_.job_id() << ": rank " << a_.rank() << " of " << W << ", "
            << rows_.size() << " rows per step, " << owned_.size() << " experts computed ("
            << updated_.size() << " updated), " << slots << " cache slots, " << plan_.grad_buffers
            << " gradient buffers, " << plan_.total() << " bytes planned, placement epoch "
            << a_.placement().epoch();
  return absl::OkStatus();
}

absl::Status JobRun::MakeBackends() {
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

absl::Status JobRun::ApplyPlacement() {
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

absl::StatusOr<bool> JobRun::Adopt() {
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
  if (!plan.ok() || plan->cache_slots > cache_->slots() || plan->grad_buffers > grads_->buffers()) {
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

MemoryInput JobRun::MemoryNeeds(int owned, int updated) const {
  const int64_t job_cache = a_.spec().cluster().cache_bytes();
  return MemoryNeedsOf(shape_, options_.memory_bytes,
                       job_cache > 0 ? static_cast<uint64_t>(job_cache) : options_.cache_bytes,
                       model_->layout().dense_floats(), model_->activation_bytes(), owned, updated);
}

absl::StatusOr<MemoryPlan> JobRun::PlanFor(const v1::Assignment& next) const {
  const auto [owned, updated] = ComputedAndUpdated(next.placement(), next.rank());
  ASSIGN_OR_RETURN(MemoryPlan plan, PlanMemory(MemoryNeeds(owned, updated)));
  RETURN_IF_ERROR(FitsTheMachine(plan, options_.memory_bytes));
  return plan;
}

v1::BlobKey JobRun::Key(int layer, int expert, const std::string& tensor, v1::BlobKind kind) const {
  return BlobKeyOf(job_id_, layer, expert, tensor, kind);
}

absl::Status JobRun::WriteInitial() {
  const std::string& init = a_.spec().train().init_path();
  std::optional<ReadPath> path;           // open while `file` is read
  std::optional<SafetensorsReader> file;  // read an expert at a time, never whole
  if (!init.empty()) {
    absl::Status loaded = [&]() -> absl::Status {
      ASSIGN_OR_RETURN(path, ReadPath::Open(init, options_.data_rules, "train.init_path"));
      ASSIGN_OR_RETURN(file, SafetensorsReader::Open(path->path()));
      RETURN_IF_ERROR(model::CheckInitModel(file->metadata(), a_.spec().model()));
      return model::LoadDenseWeights(*backend_, model_->layout(), *file, model_->params());
    }();
    if (!loaded.ok()) return InitFileFailed(path ? path->Named(loaded) : loaded);
  } else {
    RETURN_IF_ERROR(model_->InitWeights(a_.spec().train().seed()));
  }
  store_io_->ClearWritten();
  RETURN_IF_ERROR(WriteDense(0));
  if (absl::Status experts = WriteInitialExperts(file ? &*file : nullptr); !experts.ok()) {
    return path ? path->Named(experts) : experts;  // the file as the spec names it
  }
  return Report(0, model::StepLoss(), 0);
}

absl::Status JobRun::InitFileFailed(const absl::Status& why) {
  // Missing, unreadable, malformed or another model's is for good: no retry reads it
  // better (an I/O error may pass).
  const absl::StatusCode code = why.code();
  can_run_ = code != absl::StatusCode::kNotFound && code != absl::StatusCode::kPermissionDenied &&
             code != absl::StatusCode::kInvalidArgument &&
             code != absl::StatusCode::kFailedPrecondition && code != absl::StatusCode::kDataLoss &&
             code != absl::StatusCode::kOutOfRange;
  // ReadPath's errors name the field already.
  return absl::StartsWith(why.message(), "train.init_path") ? why
                                                            : Annotate(why, "train.init_path");
}

absl::Status JobRun::WriteInitialExperts(const SafetensorsReader* file) {
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
        if (absl::Status read = model::ReadExpertWeights(layout, *file, l, e, w); !read.ok()) {
          return InitFileFailed(read);
        }
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

absl::Status JobRun::WriteDense(int64_t version) {
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
    RETURN_IF_ERROR(store_io_->PutParams(dense_stores, -1, 0, t.name, version, p + t.offset, m + o,
                                         v + o, t.numel * sizeof(float), puts_));
  }
  return absl::OkStatus();
}

absl::Status JobRun::LoadCommitted() {
  const model::ParamLayout& layout = model_->layout();
  RETURN_IF_ERROR(FetchDense());
  std::vector<int64_t>& counts = optimizer_->update_counts();
  for (size_t i = 0; i < layout.tensors().size(); ++i) {
    if (layout.tensors()[i].layer < 0) counts[i] = a_.committed_step();
  }
  return absl::OkStatus();
}

absl::Status JobRun::FetchDense() {
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

bool JobRun::DenseHere(const model::ParamTensor& t) const {
  if (t.layer >= 0) return false;
  auto it = dense_rank_.find(t.offset);
  return it != dense_rank_.end() && it->second == a_.rank();
}

void JobRun::DealDense() {
  dense_rank_.clear();
  std::vector<int64_t> load(a_.world(), 0);
  for (const model::ParamTensor& t : model_->layout().tensors()) {
    if (t.layer >= 0) continue;
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    dense_rank_[t.offset] = r;
    load[r] += t.numel;
  }
}

}  // namespace pith::runtime
