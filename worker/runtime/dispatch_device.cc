// Dispatch over the workers' device group (dispatch.h): the token rows, their headers
// over the peer group and the rows from device to device in one grouped exchange per
// phase; and the replica reduce of shared experts' gradients, one more exchange a step.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/runtime/dispatch.h"

namespace pith::runtime {
namespace {

// Device memory of `n` int32 row indices from `index`, in `buf` (grown to fit).
absl::StatusOr<const int32_t*> UploadIndex(compute::Backend& backend, compute::DeviceBuffer& buf,
                                           const std::vector<int32_t>& index) {
  const size_t bytes = std::max<size_t>(index.size(), 1) * sizeof(int32_t);
  if (buf.bytes() < bytes) {
    buf = compute::DeviceBuffer();
    ASSIGN_OR_RETURN(buf, backend.Allocate(bytes));
  }
  RETURN_IF_ERROR(backend.CopyToDevice(buf.data(), index.data(), index.size() * sizeof(int32_t)));
  return static_cast<const int32_t*>(buf.data());
}

std::vector<int32_t> Narrow(const std::vector<int64_t>& rows) {
  return std::vector<int32_t>(rows.begin(), rows.end());
}

}  // namespace

compute::DeviceGroup* Dispatch::RowsGroup() const {
  if (!staged_ || device_group_ == nullptr || peers_->world() == 1) return nullptr;
  return device_group_->group();
}

absl::StatusOr<std::pair<int64_t, int64_t>> Dispatch::TakeRowHeader(int layer, int phase, int peer,
                                                                    bool indexed, bool same_counts,
                                                                    std::vector<int32_t>& index) {
  const int E = model_->shape().experts;
  Inbound& in = inbound_[layer][peer];
  ASSIGN_OR_RETURN(const std::string header, peers_->Receive(peer, Tag(layer, phase)));
  const size_t head = (E + 1) * sizeof(int64_t);
  if (header.size() < head || (header.size() - head) % sizeof(int32_t) != 0) {
    return absl::DataLossError(
        absl::StrCat("dispatch: a row header of ", header.size(), " bytes from peer ", peer));
  }
  std::vector<int64_t> counts(E);
  std::memcpy(counts.data(), header.data(), E * sizeof(int64_t));
  int64_t n = 0;
  std::memcpy(&n, header.data() + E * sizeof(int64_t), sizeof(int64_t));
  const int64_t indices = static_cast<int64_t>((header.size() - head) / sizeof(int32_t));
  ASSIGN_OR_RETURN(const int64_t total, CheckCounts(layer, peer, counts, indexed ? indices : n));
  if (same_counts && counts != in.counts) {
    return absl::DataLossError(
        absl::StrCat("dispatch: peer ", peer, " sent gradients for other rows than in forward"));
  }
  const bool sizes =
      indexed ? indices == total && n >= 0 && n <= total : indices == 0 && n == total;
  if (!sizes) {
    return absl::DataLossError(absl::StrCat("dispatch: peer ", peer, " sent a header for ", n,
                                            " rows, ", indices, " indices and ", total,
                                            " bucket rows"));
  }
  index.resize(indexed ? total : 0);
  if (!index.empty()) std::memcpy(index.data(), header.data() + head, total * sizeof(int32_t));
  for (int32_t r : index) {
    if (r < 0 || r >= n) {
      return absl::DataLossError(
          absl::StrCat("dispatch: peer ", peer, " sent a row index out of range"));
    }
  }
  in.counts = std::move(counts);
  return std::make_pair(n, total);
}

absl::Status Dispatch::ExchangeRows(compute::DeviceGroup& group, int layer, int phase,
                                    const float* rows, int64_t width, const int64_t* offsets,
                                    const int32_t* tokens,
                                    compute::DeviceBuffer Inbound::Device::*dst, bool same_counts) {
  const int E = model_->shape().experts, me = peers_->rank(), world = peers_->world();
  const size_t row_bytes = width * sizeof(float);
  if (tokens == nullptr && !same_counts) {
    return absl::InternalError("dispatch: device rows need tokens or the forward's counts");
  }
  if (offsets[E] > INT32_MAX) return absl::InvalidArgumentError("dispatch: too many bucket rows");
  peer_rows_.resize(world);
  if (tokens != nullptr) {  // only the tokens come to the host, to index the rows
    ASSIGN_OR_RETURN(tokens, compute::ReadableOnHost(*backend_, tokens, offsets[E], host_tokens_));
  }
  // Each peer's header ([E counts][int64 rows sent][with tokens: an int32 per bucket row,
  // its row among those sent]) and its rows, gathered into one device buffer.
  std::vector<compute::DeviceTransfer> sends, recvs;
  std::vector<int64_t> counts, source;
  std::vector<int32_t> index;
  for (int p = 0; p < world; ++p) {
    if (p == me) continue;
    RETURN_IF_ERROR(PlanRows(layer, p, offsets, tokens, counts, source, index));
    const int64_t n = static_cast<int64_t>(source.size());
    std::string header(E * sizeof(int64_t) + sizeof(int64_t) + index.size() * sizeof(int32_t),
                       '\0');
    std::memcpy(header.data(), counts.data(), E * sizeof(int64_t));
    std::memcpy(header.data() + E * sizeof(int64_t), &n, sizeof(int64_t));
    if (!index.empty()) {
      std::memcpy(header.data() + (E + 1) * sizeof(int64_t), index.data(),
                  index.size() * sizeof(int32_t));
    }
    if (tokens != nullptr) {
      rows_sent_ += n;
      assignments_sent_ += static_cast<int64_t>(index.size());
    }
    RETURN_IF_ERROR(peers_->Send(p, Tag(layer, phase), std::move(header)));
    if (n == 0) continue;
    PeerRows& out = peer_rows_[p];
    RETURN_IF_ERROR(Fit(out.send, n * width));
    ASSIGN_OR_RETURN(const int32_t* gather, UploadIndex(*backend_, out.send_index, Narrow(source)));
    backend_->Permute(out.send.f32(), rows, gather, n, static_cast<int>(width));
    sends.push_back({p, out.send.data(), n * row_bytes});
  }
  // Each peer's rows land in `dst`, or, indexed, in a buffer of their own to be spread
  // from.
  std::vector<std::vector<int32_t>> spread(world);
  for (int q = 0; q < world; ++q) {
    if (q == me) continue;
    ASSIGN_OR_RETURN(const auto sizes,
                     TakeRowHeader(layer, phase, q, tokens != nullptr, same_counts, spread[q]));
    const auto [n, total] = sizes;
    compute::DeviceBuffer* landing = &(inbound_[layer][q].dev.*dst);
    RETURN_IF_ERROR(Fit(*landing, total * width));
    if (tokens != nullptr) {
      landing = &peer_rows_[q].landed;
      RETURN_IF_ERROR(Fit(*landing, n * width));
    }
    if (n > 0) recvs.push_back({q, landing->data(), n * row_bytes});
  }
  RETURN_IF_ERROR(group.Exchange(sends, recvs, kPeerReceiveTimeout));
  ++device_exchanges_;
  for (int q = 0; q < world && tokens != nullptr; ++q) {
    if (q == me || spread[q].empty()) continue;
    PeerRows& got = peer_rows_[q];
    ASSIGN_OR_RETURN(const int32_t* from, UploadIndex(*backend_, got.landed_index, spread[q]));
    backend_->Permute((inbound_[layer][q].dev.*dst).f32(), got.landed.f32(), from,
                      static_cast<int64_t>(spread[q].size()), static_cast<int>(width));
  }
  return absl::OkStatus();
}

absl::Status Dispatch::ExchangeResults(compute::DeviceGroup& group, int layer,
                                       compute::DeviceBuffer Inbound::Device::*results,
                                       int64_t width, const int64_t* offsets, float* out) {
  const int E = model_->shape().experts, me = peers_->rank(), world = peers_->world();
  const size_t row_bytes = width * sizeof(float);
  peer_rows_.resize(world);
  // What this worker computed for each peer goes back whole; what each peer computed for
  // this worker's buckets lands in one buffer, then goes to its rows.
  std::vector<compute::DeviceTransfer> sends, recvs;
  std::vector<std::vector<int32_t>> place(world);
  for (int q = 0; q < world; ++q) {
    if (q == me) continue;
    Inbound& in = inbound_[layer][q];
    if (in.offsets[E] > 0)
      sends.push_back({q, (in.dev.*results).data(), in.offsets[E] * row_bytes});
    for (int e = 0; e < E; ++e) {
      const auto [begin, count] = Part(layer, e, offsets[e + 1] - offsets[e], q);
      for (int64_t i = 0; i < count; ++i) {
        place[q].push_back(static_cast<int32_t>(offsets[e] + begin + i));
      }
    }
    const int64_t n = static_cast<int64_t>(place[q].size());
    if (n == 0) continue;
    RETURN_IF_ERROR(Fit(peer_rows_[q].landed, n * width));
    recvs.push_back({q, peer_rows_[q].landed.data(), n * row_bytes});
  }
  RETURN_IF_ERROR(group.Exchange(sends, recvs, kPeerReceiveTimeout));
  ++device_exchanges_;
  for (int q = 0; q < world; ++q) {
    if (q == me || place[q].empty()) continue;
    PeerRows& got = peer_rows_[q];
    ASSIGN_OR_RETURN(const int32_t* to, UploadIndex(*backend_, got.landed_index, place[q]));
    backend_->ScatterRows(out, got.landed.f32(), to, static_cast<int64_t>(place[q].size()),
                          static_cast<int>(width));
  }
  return absl::OkStatus();
}

bool Dispatch::ReplicasOnDevice() const {
  return replicas_on_device_ == 1 && grad_pool_ != nullptr && RowsGroup() != nullptr;
}

absl::Status Dispatch::VoteReplicasOnDevice() {
  replicas_on_device_ = 0;
  // The same on every rank: the placement is, and so are the device group and the pools.
  if (grad_pool_ == nullptr || RowsGroup() == nullptr || !AnyShared(owners_)) {
    return absl::OkStatus();
  }
  // Every step attempt votes again, at the same point on every rank: a rank whose last
  // vote was cut short by an abort never waits alone for the others'.
  if (replicas_fit_ < 0) replicas_fit_ = ReplicasFit() ? 1 : 0;
  double votes = replicas_fit_;
  RETURN_IF_ERROR(AllReduce(&votes, 1));
  replicas_on_device_ = votes == peers_->world() ? 1 : 0;
  if (replicas_on_device_ == 0) FreeReplicaBuffers();  // and so for the placement's life
  return absl::OkStatus();
}

void Dispatch::FreeReplicaBuffers() {
  replica_grads_.clear();
  replica_landed_.clear();
  replica_sum_ = compute::DeviceBuffer();
}

bool Dispatch::ReplicasFit() {
  // The device buffers this rank would keep: its copy of each shared expert it computes,
  // at the primary the other owners' copies too, and the sum. They follow the budget of
  // the gradient pool (the host's plan) and must be on the device: allocated now, for
  // the Dispatch's life, or none is.
  const model::ModelShape& s = model_->shape();
  const int64_t floats = s.expert_floats();
  std::vector<GradPool::Expert> kept;
  size_t landed = 0;
  for (int l = 0; l < s.layers; ++l) {
    for (int e = 0; e < s.experts; ++e) {
      const ExpertOwners& who = owners_[l][e];
      if (who.size() < 2 || !Computes(l, e)) continue;
      kept.push_back({l, e});
      if (who[0].first == peers_->rank()) landed += who.size() - 1;
    }
  }
  const size_t buffers = kept.size() + landed + (landed > 0 ? 1 : 0);
  bool fits = buffers * floats * sizeof(float) <= grad_pool_->bytes();
  for (size_t i = 0; fits && i < kept.size(); ++i) fits = Fit(replica_grads_[kept[i]], floats).ok();
  replica_landed_.resize(fits ? landed : 0);
  for (size_t i = 0; fits && i < landed; ++i) fits = Fit(replica_landed_[i], floats).ok();
  fits = fits && (landed == 0 || Fit(replica_sum_, floats).ok());  // a primary's only
  if (!fits) FreeReplicaBuffers();                                 // the device memory goes back
  return fits;
}

absl::Status Dispatch::ReduceReplicasOnDevice() {
  compute::DeviceGroup* const group = RowsGroup();
  if (group == nullptr || grad_pool_ == nullptr) {
    return absl::FailedPreconditionError("dispatch: no device group for the replica reduce");
  }
  const model::ModelShape& s = model_->shape();
  const int64_t floats = s.expert_floats();
  const size_t bytes = floats * sizeof(float);
  const int me = peers_->rank();
  // At this primary: each replicated expert's parts, in rank order.
  std::vector<std::pair<GradPool::Expert, std::vector<const float*>>> sums;
  std::vector<compute::DeviceTransfer> sends, recvs;
  size_t landed = 0;
  for (int l = 0; l < s.layers; ++l) {
    for (int e = 0; e < s.experts; ++e) {
      const ExpertOwners& who = owners_[l][e];
      if (who.size() < 2 || !Computes(l, e) || !model_->ExpertUsed(l, e)) continue;
      const GradPool::Expert x{l, e};
      compute::DeviceBuffer& mine = replica_grads_[x];
      if (replica_written_.count(x) == 0) {  // no rows of it here: zeros
        RETURN_IF_ERROR(Fit(mine, floats));
        backend_->Zero(mine.data(), bytes);
      }
      if (who[0].first != me) {
        sends.push_back({who[0].first, mine.data(), bytes});
        continue;
      }
      std::vector<int> ranks;
      for (const auto& [r, share] : who) ranks.push_back(r);
      std::sort(ranks.begin(), ranks.end());
      std::vector<const float*> parts;
      for (int r : ranks) {
        if (r == me) {
          parts.push_back(mine.f32());
          continue;
        }
        if (replica_landed_.size() <= landed) replica_landed_.resize(landed + 1);
        compute::DeviceBuffer& in = replica_landed_[landed++];
        RETURN_IF_ERROR(Fit(in, floats));
        recvs.push_back({r, in.data(), bytes});
        parts.push_back(in.f32());
      }
      sums.push_back({x, std::move(parts)});
    }
  }
  if (sends.empty() && recvs.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(group->Exchange(sends, recvs, kPeerReceiveTimeout));
  ++device_exchanges_;
  if (!sums.empty()) RETURN_IF_ERROR(Fit(replica_sum_, floats));
  for (const auto& [x, parts] : sums) {
    backend_->Zero(replica_sum_.data(), bytes);
    for (const float* part : parts)
      backend_->Add(replica_sum_.f32(), replica_sum_.f32(), part, floats);
    ASSIGN_OR_RETURN(float* g, grad_pool_->Open(x));
    const absl::Status st = backend_->CopyToHost(g, replica_sum_.data(), bytes);
    grad_pool_->Close(x);
    RETURN_IF_ERROR(st);
  }
  return absl::OkStatus();
}

}  // namespace pith::runtime
