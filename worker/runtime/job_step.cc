// JobRun: one training step, its compute, writes, reports and commit (job_run.h).
#include <chrono>
#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/runtime/expert_gradients.h"
#include "worker/runtime/heat_report.h"
#include "worker/runtime/job_run.h"
#include "worker/runtime/peer_channels.h"

namespace pith::runtime {

absl::Status JobRun::JoinWrites(int64_t s) {
  if (!writes_.pending()) return absl::OkStatus();
  absl::Status st = writes_.Wait();
  if (!st.ok()) ReportFailure(s, st);
  return st;
}

void JobRun::SetPending(int64_t s) {
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

absl::Status JobRun::Compute(int64_t s) {
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
  RETURN_IF_ERROR(device_group_.SumDense(model_->grads(), model_->layout().dense_floats(), *dense_,
                                         *peers_, channels::DenseGradients(s),
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

absl::Status JobRun::Write(int64_t s) {
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

std::vector<JobRun::Expert> JobRun::UsedExperts() const {
  std::vector<Expert> used;
  for (const Expert& x : updated_) {
    if (model_->ExpertUsed(x.first, x.second)) used.push_back(x);
  }
  return used;
}

void JobRun::OnRoutingKnown() {
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

void JobRun::ObserveStep(const StepTail& tail) {
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

absl::Status JobRun::Report(int64_t s, const model::StepLoss& loss, uint64_t tokens) {
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
  if (dataset_.has_value()) {
    r.mutable_data()->set_bytes(dataset_->file_bytes());
    r.mutable_data()->set_crc32c(dataset_->file_crc32c());
  }
  last_loss_ = loss;
  return link_->ReportStepWritten(std::move(r));
}

void JobRun::ReportFailure(int64_t s, const absl::Status& why) {
  const int peer = UnreachablePeer(why);
  const std::string unreachable =
      peer >= 0 && peer < a_.peers_size() && peer != a_.rank() ? a_.peers(peer).member_id() : "";
  link_->ReportFailure(a_.job_id(), a_.assignment_version(), s, why, FailureKind(), unreachable);
}

void JobRun::ReportHeat(int64_t s) {
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

absl::StatusOr<Settled> JobRun::Finish(int64_t s) {
  RETURN_IF_ERROR(JoinWrites(s));
  v1::WaitStepRequest req;
  req.set_job_id(a_.job_id());
  req.set_step(s);
  req.set_assignment_version(a_.assignment_version());
  auto round = [&]() -> absl::StatusOr<std::optional<Settled>> {
    absl::StatusOr<v1::StepStatus> st = link_->WaitStep(req, kSettleRound);
    if (absl::IsDeadlineExceeded(st.status())) return std::nullopt;  // not settled yet
    RETURN_IF_ERROR(st.status());
    if (st->committed_step() >= s) {
      OnCommitted(s);
      if (st->job_ended()) return Settled::kStop;
      // A new placement epoch (or worker set) from the next step: re-fetch.
      return st->assignment_version() == a_.assignment_version() ? Settled::kCommitted
                                                                 : Settled::kReassigned;
    }
    if (st->aborted() || st->job_ended()) {
      LOG(INFO) << "step " << s << " of job " << a_.job_id() << " aborted: " << st->abort_reason();
      return Settled::kStop;
    }
    return std::nullopt;  // the coordinator's answer at the round's end: not settled yet
  };
  return WaitSettled(round, stop_);
}

void JobRun::OnCommitted(int64_t s) {
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

}  // namespace pith::runtime
