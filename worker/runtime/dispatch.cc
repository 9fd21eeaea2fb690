#include "worker/runtime/dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/runtime/peer_channels.h"

namespace pith::runtime {

absl::StatusOr<std::vector<std::vector<ExpertOwners>>> OwnersOf(const v1::PlacementTable& placement,
                                                                int layers, int experts,
                                                                int world) {
  std::vector<std::vector<ExpertOwners>> owners(layers, std::vector<ExpertOwners>(experts));
  for (const v1::ExpertPlacement& e : placement.experts()) {
    if (e.layer() < 0) continue;
    if (e.layer() >= layers || e.expert() < 0 || e.expert() >= experts || e.owners_size() == 0 ||
        !owners[e.layer()][e.expert()].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("placement entry of layer ", e.layer(),
                                                     " expert ", e.expert(), " does not fit"));
    }
    for (const v1::ComputeOwner& o : e.owners()) {
      if (o.rank() < 0 || o.rank() >= world) {
        return absl::InvalidArgumentError(
            absl::StrCat("owner rank ", o.rank(), " outside ", world));
      }
      owners[e.layer()][e.expert()].push_back({o.rank(), o.token_share()});
    }
  }
  for (const auto& layer : owners) {
    for (const ExpertOwners& o : layer) {
      if (o.empty()) return absl::InvalidArgumentError("placement leaves an expert without owner");
    }
  }
  return owners;
}
std::pair<int, int> ComputedAndUpdated(const v1::PlacementTable& placement, int rank) {
  int computed = 0, updated = 0;
  for (const v1::ExpertPlacement& e : placement.experts()) {
    if (e.layer() < 0) continue;
    for (const v1::ComputeOwner& o : e.owners()) computed += o.rank() == rank;
    updated += e.owners_size() > 0 && e.owners(0).rank() == rank;
  }
  return {computed, updated};
}

bool AnyShared(const std::vector<std::vector<ExpertOwners>>& owners) {
  for (const auto& layer : owners) {
    for (const ExpertOwners& o : layer) {
      if (o.size() > 1) return true;
    }
  }
  return false;
}

namespace {

enum Phase : int {
  kForwardRows = 1,  // sender's token rows for the owner's buckets (each token once)
  kForwardOut = 2,   // owner's expert outputs for them
  kBackwardDy = 3,   // sender's output gradients of those rows
  kBackwardDx = 4,   // owner's input gradients for them
};

}  // namespace

Dispatch::Dispatch(compute::Backend* backend, model::MoeGpt* model, PeerGroup* peers,
                   std::vector<std::vector<ExpertOwners>> owners)
    : backend_(backend),
      model_(model),
      peers_(peers),
      owners_(std::move(owners)),
      staged_(!backend->host_addressable()) {
  inbound_.resize(model_->shape().layers);
  for (auto& layer : inbound_) layer.resize(peers_->world());
}

Dispatch::~Dispatch() {
  // After an error mid-phase, host slots may still wait for their uploads: released here
  // (the cache outlives this object).
  (void)SettleCopies();
}

absl::Status Dispatch::Fit(compute::DeviceBuffer& buf, int64_t floats) {
  const size_t bytes = std::max<int64_t>(floats, 1) * sizeof(float);
  if (buf.bytes() >= bytes) return absl::OkStatus();
  buf = compute::DeviceBuffer();  // the old one goes first: device memory is the tight one
  ASSIGN_OR_RETURN(buf, backend_->Allocate(bytes));
  return absl::OkStatus();
}

absl::Status Dispatch::StageInbound(Inbound& in, int64_t rows, bool forward, bool upload) {
  if (!staged_) return absl::OkStatus();
  const int64_t C = model_->shape().channels, F = model_->shape().hidden;
  Inbound::Device& d = in.dev;
  if (forward) {
    for (auto [buf, width] :
         {std::pair{&d.x, C}, std::pair{&d.hpre, F}, std::pair{&d.h, F}, std::pair{&d.out, C}}) {
      RETURN_IF_ERROR(Fit(*buf, rows * width));
    }
    return upload ? backend_->CopyToDevice(d.x.data(), in.x.data(), rows * C * sizeof(float))
                  : absl::OkStatus();
  }
  for (auto [buf, width] : {std::pair{&d.dy, C}, std::pair{&d.dx, C}, std::pair{&d.dh, F}}) {
    RETURN_IF_ERROR(Fit(*buf, rows * width));
  }
  return upload ? backend_->CopyToDevice(d.dy.data(), in.dy.data(), rows * C * sizeof(float))
                : absl::OkStatus();
}

bool Dispatch::Computes(int layer, int expert) const {
  for (const auto& [rank, share] : owners_[layer][expert]) {
    if (rank == peers_->rank()) return true;
  }
  return false;
}

std::pair<int64_t, int64_t> Dispatch::Part(int layer, int expert, int64_t n, int rank) const {
  const ExpertOwners& owners = owners_[layer][expert];
  if (Computes(layer, expert)) {
    return rank == peers_->rank() ? std::pair<int64_t, int64_t>{0, n}
                                  : std::pair<int64_t, int64_t>{0, 0};
  }
  double cumulative = 0;
  int64_t begin = 0;
  for (size_t i = 0; i < owners.size(); ++i) {
    cumulative += owners[i].second;
    const int64_t end =
        i + 1 == owners.size() ? n : std::min<int64_t>(n, std::llround(cumulative * n));
    if (owners[i].first == rank) return {begin, std::max<int64_t>(0, end - begin)};
    begin = std::max(begin, end);
  }
  return {0, 0};
}

bool Dispatch::HasRows(int layer, int expert, const int64_t* offsets) const {
  if (offsets[expert + 1] > offsets[expert]) return true;
  for (int q = 0; q < peers_->world(); ++q) {
    if (q != peers_->rank() && inbound_[layer][q].counts[expert] > 0) return true;
  }
  return false;
}

uint64_t Dispatch::Tag(int layer, int phase) const {
  return channels::DispatchExchange(step_, layer, phase);
}

absl::Status Dispatch::PlanRows(int layer, int peer, const int64_t* offsets, const int32_t* tokens,
                                std::vector<int64_t>& counts, std::vector<int64_t>& source,
                                std::vector<int32_t>& index) {
  const int E = model_->shape().experts;
  counts.assign(E, 0);
  source.clear();
  index.clear();
  for (int e = 0; e < E; ++e) {
    int64_t begin;
    std::tie(begin, counts[e]) = Part(layer, e, offsets[e + 1] - offsets[e], peer);
    for (int64_t i = offsets[e] + begin; i < offsets[e] + begin + counts[e]; ++i) {
      if (tokens == nullptr) {
        source.push_back(i);
        continue;
      }
      // A token's row once however many of the peer's experts it goes to.
      const int32_t t = tokens[i];
      if (t < 0) {
        for (int64_t d : source) slot_of_token_[tokens[d]] = -1;
        return absl::InternalError("dispatch: a bucket row without a token");
      }
      if (static_cast<size_t>(t) >= slot_of_token_.size()) slot_of_token_.resize(t + 1, -1);
      if (slot_of_token_[t] < 0) {
        slot_of_token_[t] = static_cast<int32_t>(source.size());
        source.push_back(i);
      }
      index.push_back(slot_of_token_[t]);
    }
  }
  if (tokens != nullptr) {
    for (int64_t i : source) slot_of_token_[tokens[i]] = -1;
  }
  return absl::OkStatus();
}

absl::Status Dispatch::SendBuckets(int layer, int phase, const float* rows, int64_t width,
                                   const int64_t* offsets, const int32_t* tokens) {
  const int E = model_->shape().experts;
  if (peers_->world() == 1) return absl::OkStatus();  // nobody to send to (nor read back for)
  ASSIGN_OR_RETURN(rows, compute::ReadableOnHost(*backend_, rows, offsets[E] * width, host_rows_));
  if (tokens != nullptr) {
    ASSIGN_OR_RETURN(tokens, compute::ReadableOnHost(*backend_, tokens, offsets[E], host_tokens_));
  }
  std::vector<int64_t> counts, source;
  std::vector<int32_t> index;
  for (int p = 0; p < peers_->world(); ++p) {
    if (p == peers_->rank()) continue;
    RETURN_IF_ERROR(PlanRows(layer, p, offsets, tokens, counts, source, index));
    // [E counts][with tokens: an int32 per bucket row, its row among those sent][rows]
    std::string bytes(E * sizeof(int64_t) + index.size() * sizeof(int32_t) +
                          source.size() * width * sizeof(float),
                      '\0');
    char* out = bytes.data();
    std::memcpy(out, counts.data(), E * sizeof(int64_t));
    out += E * sizeof(int64_t);
    if (!index.empty()) std::memcpy(out, index.data(), index.size() * sizeof(int32_t));
    out += index.size() * sizeof(int32_t);
    for (int64_t i : source) {
      std::memcpy(out, rows + i * width, width * sizeof(float));
      out += width * sizeof(float);
    }
    if (tokens != nullptr) {
      rows_sent_ += static_cast<int64_t>(source.size());
      assignments_sent_ += static_cast<int64_t>(index.size());
    }
    RETURN_IF_ERROR(peers_->Send(p, Tag(layer, phase), std::move(bytes)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Dispatch::CheckCounts(int layer, int peer,
                                              const std::vector<int64_t>& counts,
                                              int64_t most) const {
  int64_t total = 0;
  for (int e = 0; e < model_->shape().experts; ++e) {
    if (counts[e] < 0 || (counts[e] > 0 && !Computes(layer, e))) {
      return absl::DataLossError(absl::StrCat("dispatch: peer ", peer, " sent rows of expert ", e,
                                              " of layer ", layer, " that rank ", peers_->rank(),
                                              " does not own"));
    }
    if (counts[e] > most - total) {
      return absl::DataLossError(
          absl::StrCat("dispatch: message from peer ", peer, " is short for its row counts"));
    }
    total += counts[e];
  }
  return total;
}

absl::Status Dispatch::ReceiveBuckets(int layer, int phase, int peer, int64_t width, Inbound& in,
                                      std::vector<float>& rows, bool deduplicated) {
  const int E = model_->shape().experts;
  ASSIGN_OR_RETURN(std::string bytes, peers_->Receive(peer, Tag(layer, phase)));
  if (bytes.size() < E * sizeof(int64_t)) {
    return absl::DataLossError(absl::StrCat("dispatch: short message from peer ", peer));
  }
  in.counts.assign(E, 0);
  std::memcpy(in.counts.data(), bytes.data(), E * sizeof(int64_t));
  // No more rows than the message can describe (an index, or a row, each): no overflow,
  // no allocation beyond what the bytes justify.
  const int64_t most =
      static_cast<int64_t>((bytes.size() - E * sizeof(int64_t)) /
                           (deduplicated ? sizeof(int32_t) : width * sizeof(float)));
  absl::StatusOr<int64_t> counted = CheckCounts(layer, peer, in.counts, most);
  if (!counted.ok()) {
    in.counts.assign(E, 0);
    return counted.status();
  }
  const int64_t total = *counted;
  if (deduplicated) {
    const size_t head = E * sizeof(int64_t) + total * sizeof(int32_t);
    const size_t row_bytes = width * sizeof(float);
    if (bytes.size() < head || (bytes.size() - head) % row_bytes != 0) {
      return absl::DataLossError(absl::StrCat("dispatch: message from peer ", peer, " has ",
                                              bytes.size(), " bytes for ", total, " rows"));
    }
    const int64_t n_distinct = static_cast<int64_t>((bytes.size() - head) / row_bytes);
    if (n_distinct > total) {
      return absl::DataLossError(
          absl::StrCat("dispatch: peer ", peer, " sent more token rows than it indexes"));
    }
    std::vector<int32_t> index(total);
    if (total > 0) {
      std::memcpy(index.data(), bytes.data() + E * sizeof(int64_t), total * sizeof(int32_t));
    }
    const float* distinct = reinterpret_cast<const float*>(bytes.data() + head);
    rows.resize(total * width);
    for (int64_t r = 0; r < total; ++r) {
      if (index[r] < 0 || index[r] >= n_distinct) {
        return absl::DataLossError(
            absl::StrCat("dispatch: peer ", peer, " sent a row index out of range"));
      }
      std::memcpy(rows.data() + r * width, distinct + int64_t{index[r]} * width, row_bytes);
    }
    return absl::OkStatus();
  }
  if (bytes.size() != E * sizeof(int64_t) + total * width * sizeof(float)) {
    return absl::DataLossError(absl::StrCat("dispatch: message from peer ", peer, " has ",
                                            bytes.size(), " bytes for ", total, " rows"));
  }
  rows.resize(total * width);
  if (total > 0) {
    std::memcpy(rows.data(), bytes.data() + E * sizeof(int64_t), total * width * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status Dispatch::ScatterReturned(int layer, int phase, int peer, int64_t width,
                                       const int64_t* offsets, float* out) {
  const int E = model_->shape().experts;
  ASSIGN_OR_RETURN(std::string bytes, peers_->Receive(peer, Tag(layer, phase)));
  int64_t total = 0;
  for (int e = 0; e < E; ++e) total += Part(layer, e, offsets[e + 1] - offsets[e], peer).second;
  if (bytes.size() != total * width * sizeof(float)) {
    return absl::DataLossError(absl::StrCat("dispatch: peer ", peer, " returned ", bytes.size(),
                                            " bytes for ", total, " rows"));
  }
  const char* in = bytes.data();
  for (int e = 0; e < E; ++e) {
    const auto [begin, count] = Part(layer, e, offsets[e + 1] - offsets[e], peer);
    const size_t n = count * width * sizeof(float);
    float* to = out + (offsets[e] + begin) * width;
    if (staged_) {
      RETURN_IF_ERROR(backend_->CopyToDevice(to, in, n));
    } else {
      std::memcpy(to, in, n);
    }
    in += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<int, compute::ExpertWeights>> Dispatch::NextWeights(
    std::vector<ExpertCache::Expert>& experts) {
  if (cache_ == nullptr) {
    const auto [layer, e] = experts.front();
    if (model_->expert_weights(layer).empty()) {
      return absl::FailedPreconditionError("dispatch: no expert cache and no local experts");
    }
    experts.erase(experts.begin());
    return std::make_pair(e, model_->expert_weights(layer)[e]);
  }
  // The last expert's host slot is free once its upload is (its compute may go on).
  RETURN_IF_ERROR(SettleUploads());
  ASSIGN_OR_RETURN(const auto taken, cache_->AcquireAny(experts));
  auto [pick, w] = taken;
  const int layer = experts[pick].first, e = experts[pick].second;
  experts.erase(experts.begin() + static_cast<std::ptrdiff_t>(pick));
  const model::ModelShape& s = model_->shape();
  // The slot holds the expert's weights blob: fp32, or a bf16 job's bf16 form.
  const void* blob = w;
  if (staged_) {
    absl::StatusOr<const void*> on_device = DeviceCopy(layer, e, w);
    if (!on_device.ok()) {
      (void)Done(layer, e);
      return on_device.status();
    }
    blob = *on_device;
  }
  return std::make_pair(e, compute::ExpertWeightsAt(blob, s.compute_dtype == ComputeDtype::kBf16,
                                                    s.channels, s.hidden));
}

absl::StatusOr<const void*> Dispatch::DeviceCopy(int layer, int expert, const void* host) {
  const size_t bytes = cache_->slot_bytes();
  if (mirror_ == nullptr) {
    const int wanted =
        mirror_slots_ > 0 ? std::min(mirror_slots_, cache_->slots()) : cache_->slots();
    ASSIGN_OR_RETURN(mirror_, backend_->MakeSlotMirror(bytes, wanted, cache_->memory(),
                                                       bytes * cache_->slots()));
    mirrored_.assign(mirror_->slots(), 0);
    mirror_used_.assign(mirror_->slots(), 0);
  }
  // The device slot holding these bytes (a generation names one fill of one host slot),
  // else the least recently used one, uploaded into.
  const uint64_t generation = cache_->Generation({layer, expert});
  int slot = 0;
  for (int d = 0; d < mirror_->slots(); ++d) {
    if (generation != 0 && mirrored_[d] == generation) {
      slot = d;
      break;
    }
    if (mirror_used_[d] < mirror_used_[slot]) slot = d;
  }
  current_slot_ = slot;
  mirror_used_[slot] = ++mirror_clock_;
  current_uploaded_ = generation == 0 || mirrored_[slot] != generation;
  if (current_uploaded_) {
    mirrored_[slot] = 0;  // until the upload is issued
    RETURN_IF_ERROR(mirror_->Upload(slot, host, bytes));
    mirrored_[slot] = generation;
  }
  return mirror_->Use(slot);
}

absl::Status Dispatch::Done(int layer, int expert) {
  if (cache_ == nullptr) return absl::OkStatus();
  absl::Status st;
  if (current_slot_ >= 0) {
    st = mirror_->Release(current_slot_);
    current_slot_ = -1;
    if (current_uploaded_) {  // released once the upload is done (SettleUploads)
      unpin_after_upload_.push_back({layer, expert});
      return st;
    }
  }
  cache_->Release({layer, expert});
  return st;
}

absl::Status Dispatch::SettleUploads() {
  if (unpin_after_upload_.empty()) return absl::OkStatus();
  const absl::Status st = mirror_->WaitCopies();
  for (const ExpertCache::Expert& x : unpin_after_upload_) cache_->Release(x);
  unpin_after_upload_.clear();
  return st;
}

absl::Status Dispatch::SettleGradient(int slot) {
  const GradPool::Expert x = grad_pending_[slot];
  if (x.first < 0) return absl::OkStatus();
  grad_pending_[slot] = {-1, -1};
  absl::Status st = grad_mirror_->WaitSlot(slot);
  // The buffer may be reused or spilled once closed: nothing may land in it after.
  if (!st.ok()) st.Update(grad_mirror_->WaitCopies());
  grad_pool_->Close(x);
  return st;
}

absl::Status Dispatch::SettleCopies() {
  absl::Status st = SettleUploads();
  for (int slot = 0; slot < static_cast<int>(grad_pending_.size()); ++slot) {
    st.Update(SettleGradient(slot));
  }
  return st;
}

absl::Status Dispatch::BeforeBackward() {
  if (cache_ != nullptr) RETURN_IF_ERROR(cache_->AwaitUpdates());
  RETURN_IF_ERROR(SettleCopies());
  if (grad_pool_ != nullptr) grad_pool_->Reset();
  replica_written_.clear();
  return VoteReplicasOnDevice();
}

absl::StatusOr<compute::ExpertGrads> Dispatch::GradsOf(int layer, int expert) {
  if (grad_pool_ == nullptr) {
    const auto grads = model_->expert_grads(layer);
    if (grads.empty()) {
      return absl::FailedPreconditionError("dispatch: no gradient pool and no local experts");
    }
    return grads[expert];
  }
  const size_t bytes = model_->shape().expert_floats() * sizeof(float);
  const int64_t C = model_->shape().channels, F = model_->shape().hidden;
  grad_replica_ = ReplicasOnDevice() && owners_[layer][expert].size() > 1;
  if (grad_replica_) {  // kept on the device for ReduceReplicasOnDevice
    compute::DeviceBuffer& kept = replica_grads_[{layer, expert}];
    RETURN_IF_ERROR(Fit(kept, model_->shape().expert_floats()));
    backend_->Zero(kept.data(), bytes);
    replica_written_.insert({layer, expert});
    float* g = kept.f32();
    return compute::ExpertGrads{g, g + C * F, g + C * F + F, g + 2 * C * F + F};
  }
  if (staged_ && grad_mirror_ == nullptr) {
    // A device slot per pool buffer, at most 4: a slot's last download lands (its buffer
    // closes) before the next expert's buffer opens.
    const int wanted = std::min(grad_pool_->buffers(), 4);
    ASSIGN_OR_RETURN(grad_mirror_, backend_->MakeSlotMirror(bytes, wanted, grad_pool_->memory(),
                                                            grad_pool_->bytes()));
    grad_pending_.assign(std::min(wanted, grad_mirror_->slots()), {-1, -1});
    grad_next_ = 0;
  }
  // A device slot's last download landed (its pool buffer closed) before it is reused.
  if (staged_) RETURN_IF_ERROR(SettleGradient(grad_next_));
  ASSIGN_OR_RETURN(float* g, grad_pool_->Open({layer, expert}));
  if (staged_) {  // accumulated on the device from zero, as the pool buffer opens
    absl::StatusOr<void*> slot = grad_mirror_->Use(grad_next_);
    if (!slot.ok()) {
      grad_pool_->Close({layer, expert});
      return slot.status();
    }
    backend_->Zero(*slot, bytes);
    grad_host_ = g;
    grad_current_ = grad_next_;
    grad_next_ = (grad_next_ + 1) % static_cast<int>(grad_pending_.size());
    g = static_cast<float*>(*slot);
  }
  return compute::ExpertGrads{g, g + C * F, g + C * F + F, g + 2 * C * F + F};
}

absl::Status Dispatch::GradsDone(int layer, int expert) {
  if (grad_pool_ == nullptr || grad_replica_) return absl::OkStatus();
  if (!staged_) {
    grad_pool_->Close({layer, expert});
    return absl::OkStatus();
  }
  // Down to the pool buffer behind the next experts' compute; the buffer stays open
  // until the copy has landed (SettleGradient).
  const int slot = grad_current_;
  grad_current_ = -1;
  absl::Status st = grad_mirror_->Release(slot);
  if (st.ok()) {
    st = grad_mirror_->Download(slot, grad_host_, model_->shape().expert_floats() * sizeof(float));
  }
  if (!st.ok()) {  // as SettleGradient: nothing may land in the buffer once closed
    st.Update(grad_mirror_->WaitCopies());
    grad_pool_->Close({layer, expert});
    return st;
  }
  grad_pending_[slot] = {layer, expert};
  return absl::OkStatus();
}

absl::Status Dispatch::Forward(int layer, float* y, float* hpre, float* h, const float* xperm,
                               const int64_t* offsets, const int32_t* bucket_token) {
  const model::ModelShape& s = model_->shape();
  const int E = s.experts, C = s.channels, F = s.hidden;
  const int me = peers_->rank();
  if (layer == 0) rows_sent_ = assignments_sent_ = rows_received_ = 0;
  compute::DeviceGroup* const group = RowsGroup();
  if (group != nullptr) {
    RETURN_IF_ERROR(ExchangeRows(*group, layer, kForwardRows, xperm, C, offsets, bucket_token,
                                 &Inbound::Device::x, /*same_counts=*/false));
  } else {
    RETURN_IF_ERROR(SendBuckets(layer, kForwardRows, xperm, C, offsets, bucket_token));
  }
  // The rows peers sent, in rank order.
  for (int q = 0; q < peers_->world(); ++q) {
    if (q == me) continue;
    Inbound& in = inbound_[layer][q];
    if (group == nullptr) {
      RETURN_IF_ERROR(ReceiveBuckets(layer, kForwardRows, q, C, in, in.x, /*deduplicated=*/true));
    }
    in.offsets.assign(E + 1, 0);
    for (int e = 0; e < E; ++e) in.offsets[e + 1] = in.offsets[e] + in.counts[e];
    const int64_t rows = in.offsets[E];
    rows_received_ += rows;
    in.hpre.resize(staged_ ? 0 : rows * F);
    in.h.resize(staged_ ? 0 : rows * F);
    in.out.resize(group != nullptr ? 0 : rows * C);
    RETURN_IF_ERROR(StageInbound(in, rows, /*forward=*/true, /*upload=*/group == nullptr));
  }
  // Each owned expert once, over this worker's rows and then each peer's; the cache is
  // told which first (its prefetcher fetches those the last step's routing did not
  // predict).
  std::vector<ExpertCache::Expert> computed;
  for (int e = 0; e < E; ++e) {
    if (Computes(layer, e) && HasRows(layer, e, offsets)) computed.push_back({layer, e});
  }
  if (cache_ != nullptr) cache_->Expect(layer, computed);
  while (!computed.empty()) {
    ASSIGN_OR_RETURN(const auto next, NextWeights(computed));
    const auto [e, w] = next;
    const absl::Span<const compute::ExpertWeights> one_expert(&w, 1);
    if (const int64_t o = offsets[e], n = offsets[e + 1] - offsets[e]; n > 0) {
      const int64_t bucket[2] = {0, n};
      backend_->ExpertForward(y + o * C, hpre + o * F, h + o * F, xperm + o * C, bucket, one_expert,
                              C, F);
    }
    for (int q = 0; q < peers_->world(); ++q) {
      if (q == me) continue;
      Inbound& in = inbound_[layer][q];
      const int64_t o = in.offsets[e], n = in.counts[e];
      if (n == 0) continue;
      const int64_t bucket[2] = {0, n};
      backend_->ExpertForward(At(in, &Inbound::out, &Inbound::Device::out) + o * C,
                              At(in, &Inbound::hpre, &Inbound::Device::hpre) + o * F,
                              At(in, &Inbound::h, &Inbound::Device::h) + o * F,
                              At(in, &Inbound::x, &Inbound::Device::x) + o * C, bucket, one_expert,
                              C, F);
    }
    // The weights stay valid while the backend reads them: the host slot (a host backend
    // reads it in place) until it is done; a device copy until the next upload into it,
    // which waits for these ops on the device.
    absl::Status synced = mirror_ == nullptr ? backend_->Synchronize() : absl::OkStatus();
    synced.Update(Done(layer, e));
    RETURN_IF_ERROR(synced);
  }
  RETURN_IF_ERROR(SettleUploads());
  if (group != nullptr) return ExchangeResults(*group, layer, &Inbound::Device::out, C, offsets, y);
  return ReturnResults(layer, kForwardOut, &Inbound::out, &Inbound::Device::out, C, offsets, y);
}

absl::Status Dispatch::ReturnResults(int layer, int phase, std::vector<float> Inbound::*results,
                                     compute::DeviceBuffer Inbound::Device::*dev_results,
                                     int64_t width, const int64_t* offsets, float* out) {
  const int me = peers_->rank();
  for (int q = 0; q < peers_->world(); ++q) {
    if (q == me) continue;
    Inbound& in = inbound_[layer][q];
    std::vector<float>& rows = in.*results;
    if (staged_ && !rows.empty()) {
      RETURN_IF_ERROR(backend_->CopyToHost(rows.data(), (in.dev.*dev_results).data(),
                                           rows.size() * sizeof(float)));
    }
    RETURN_IF_ERROR(peers_->Send(
        q, Tag(layer, phase),
        std::string(reinterpret_cast<const char*>(rows.data()), rows.size() * sizeof(float))));
  }
  for (int p = 0; p < peers_->world(); ++p) {
    if (p != me) RETURN_IF_ERROR(ScatterReturned(layer, phase, p, width, offsets, out));
  }
  return absl::OkStatus();
}

absl::Status Dispatch::Backward(int layer, float* dxperm, float* dh, const float* dy,
                                const float* xperm, const float* hpre, const float* h,
                                const int64_t* offsets) {
  const model::ModelShape& s = model_->shape();
  const int E = s.experts, C = s.channels, F = s.hidden;
  const int me = peers_->rank();
  compute::DeviceGroup* const group = RowsGroup();
  if (group != nullptr) {
    RETURN_IF_ERROR(ExchangeRows(*group, layer, kBackwardDy, dy, C, offsets, nullptr,
                                 &Inbound::Device::dy, /*same_counts=*/true));
  } else {
    RETURN_IF_ERROR(SendBuckets(layer, kBackwardDy, dy, C, offsets));
  }
  for (int q = 0; q < peers_->world(); ++q) {
    if (q == me) continue;
    Inbound& in = inbound_[layer][q];
    if (group == nullptr) {
      const std::vector<int64_t> counts = in.counts;
      RETURN_IF_ERROR(ReceiveBuckets(layer, kBackwardDy, q, C, in, in.dy));
      if (in.counts != counts) {
        return absl::DataLossError(
            absl::StrCat("dispatch: peer ", q, " sent gradients for other rows than in forward"));
      }
    }
    in.dh.resize(staged_ ? 0 : in.offsets[E] * F);
    in.dx.resize(group != nullptr ? 0 : in.offsets[E] * C);
    RETURN_IF_ERROR(
        StageInbound(in, in.offsets[E], /*forward=*/false, /*upload=*/group == nullptr));
  }
  std::vector<ExpertCache::Expert> computed;
  for (int e = E - 1; e >= 0; --e) {  // the backward's order, as the cache's schedule
    if (Computes(layer, e) && HasRows(layer, e, offsets)) computed.push_back({layer, e});
  }
  while (!computed.empty()) {
    ASSIGN_OR_RETURN(const auto next, NextWeights(computed));
    const auto [e, w] = next;
    const absl::Span<const compute::ExpertWeights> one_expert(&w, 1);
    absl::StatusOr<compute::ExpertGrads> opened = GradsOf(layer, e);
    if (!opened.ok()) {
      (void)Done(layer, e);
      return opened.status();
    }
    const absl::Span<const compute::ExpertGrads> grads(&*opened, 1);
    // The expert's gradient accumulates over this worker's rows, then each peer's in rank
    // order: the same order on every run.
    if (const int64_t o = offsets[e], n = offsets[e + 1] - offsets[e]; n > 0) {
      const int64_t bucket[2] = {0, n};
      backend_->ExpertBackward(dxperm + o * C, dh + o * F, grads, dy + o * C, xperm + o * C,
                               hpre + o * F, h + o * F, bucket, one_expert, C, F);
    }
    for (int q = 0; q < peers_->world(); ++q) {
      if (q == me) continue;
      Inbound& in = inbound_[layer][q];
      const int64_t o = in.offsets[e], n = in.counts[e];
      if (n == 0) continue;
      const int64_t bucket[2] = {0, n};
      backend_->ExpertBackward(At(in, &Inbound::dx, &Inbound::Device::dx) + o * C,
                               At(in, &Inbound::dh, &Inbound::Device::dh) + o * F, grads,
                               At(in, &Inbound::dy, &Inbound::Device::dy) + o * C,
                               At(in, &Inbound::x, &Inbound::Device::x) + o * C,
                               At(in, &Inbound::hpre, &Inbound::Device::hpre) + o * F,
                               At(in, &Inbound::h, &Inbound::Device::h) + o * F, bucket, one_expert,
                               C, F);
    }
    // No wait on a device: the gradient goes down and the weights' device copy is freed
    // for the next upload in stream order (a host backend computes synchronously).
    absl::Status synced = staged_ ? absl::OkStatus() : backend_->Synchronize();
    synced.Update(GradsDone(layer, e));
    synced.Update(Done(layer, e));
    RETURN_IF_ERROR(synced);
  }
  // The pool holds every gradient once the last layer's backward is done.
  RETURN_IF_ERROR(layer == 0 ? SettleCopies() : SettleUploads());
  if (group != nullptr) {
    return ExchangeResults(*group, layer, &Inbound::Device::dx, C, offsets, dxperm);
  }
  return ReturnResults(layer, kBackwardDx, &Inbound::dx, &Inbound::Device::dx, C, offsets, dxperm);
}

absl::Status Dispatch::AllReduce(double* values, size_t n) {
  return peers_->AllReduceSum(values, n, channels::DispatchReduce(step_, reduce_seq_++));
}

}  // namespace pith::runtime
