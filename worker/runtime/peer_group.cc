#include "worker/runtime/peer_group.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/pause_watch.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pith::runtime {
namespace {

constexpr uint16_t kPeerMessage = 100;

struct Header {
  uint64_t attempt;
  uint64_t tag;
  int32_t source;
};

std::string Pack(const Header& h) {
  std::string out(sizeof(Header), '\0');
  std::memcpy(out.data(), &h, sizeof(Header));
  return out;
}

}  // namespace

absl::Status WithUnreachablePeer(absl::Status status, int rank) {
  if (!status.ok() && !status.GetPayload(kUnreachablePeerPayload).has_value()) {
    status.SetPayload(kUnreachablePeerPayload, absl::Cord(absl::StrCat(rank)));
  }
  return status;
}

int UnreachablePeer(const absl::Status& status) {
  const auto rank = status.GetPayload(kUnreachablePeerPayload);  // an absl::optional<absl::Cord>
  int out = -1;
  if (!rank || !absl::SimpleAtoi(std::string(*rank), &out) || out < 0) return -1;
  return out;
}

absl::StatusOr<std::unique_ptr<PeerGroup>> PeerGroup::Create() {
  std::unique_ptr<PeerGroup> g(new PeerGroup());
  ASSIGN_OR_RETURN(g->worker_, ucx::Worker::Create());
  PeerGroup* self = g.get();
  g->worker_->SetHandler(kPeerMessage, [self](ucx::AmMessage& m) { self->OnMessage(m); });
  RETURN_IF_ERROR(g->worker_->Start());
  return g;
}

PeerGroup::~PeerGroup() {
  if (worker_) worker_->Stop();
}

absl::Status PeerGroup::Join(int rank, const std::vector<std::string>& addresses,
                             uint64_t attempt) {
  if (rank < 0 || rank >= static_cast<int>(addresses.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " outside a group of ", addresses.size()));
  }
  absl::Status status;
  worker_->RunSync([&] {
    group_ = addresses;
    {
      // Reset before connecting: a peer that fails while we connect must stay failed.
      absl::MutexLock lock(&mu_);
      failed_.assign(addresses.size(), false);
    }
    endpoints_.assign(addresses.size(), nullptr);
    for (size_t r = 0; r < addresses.size() && status.ok(); ++r) {
      if (static_cast<int>(r) == rank) continue;
      absl::StatusOr<ucp_ep_h> ep = ConnectionTo(addresses[r]);
      if (!ep.ok()) {
        status = WithUnreachablePeer(ep.status(), static_cast<int>(r));
      } else {
        endpoints_[r] = *ep;
      }
    }
  });
  RETURN_IF_ERROR(status);
  {
    absl::MutexLock lock(&mu_);
    rank_ = rank;
    world_ = static_cast<int>(addresses.size());
  }
  SetAttempt(attempt);
  return absl::OkStatus();
}

absl::StatusOr<ucp_ep_h> PeerGroup::ConnectionTo(const std::string& address) {
  auto it = connections_.find(address);
  if (it != connections_.end()) return it->second;
  ASSIGN_OR_RETURN(ucp_ep_h ep, worker_->Connect(address, [this, address](absl::Status s) {
    OnPeerFailed(address, s);
  }));
  connections_[address] = ep;
  return ep;
}

void PeerGroup::OnPeerFailed(const std::string& address, const absl::Status& status) {
  auto it = connections_.find(address);
  if (it == connections_.end()) return;
  const ucp_ep_h ep = it->second;
  connections_.erase(it);
  std::vector<int> ranks;
  for (size_t r = 0; r < group_.size(); ++r) {
    if (group_[r] != address || endpoints_[r] != ep) continue;
    ranks.push_back(static_cast<int>(r));
    endpoints_[r] = nullptr;
  }
  worker_->Close(ep);
  if (ranks.empty()) return;  // a peer of an earlier group
  LOG(WARNING) << "peer " << ranks.front() << " failed: " << status;
  absl::MutexLock lock(&mu_);
  for (int r : ranks) {
    if (r < static_cast<int>(failed_.size())) failed_[r] = true;
  }
}

void PeerGroup::SetAttempt(uint64_t attempt) {
  absl::MutexLock lock(&mu_);
  attempt_ = attempt;
  abandoned_ = abandoned_ahead_ != 0 && attempt == abandoned_ahead_;
  if (attempt >= abandoned_ahead_) abandoned_ahead_ = 0;  // used, or passed
  mailbox_.erase(mailbox_.begin(), mailbox_.lower_bound({attempt, INT32_MIN, 0}));
}

void PeerGroup::Abandon() {
  absl::MutexLock lock(&mu_);
  abandoned_ = true;
}

bool PeerGroup::AbandonAttempt(uint64_t attempt) {
  absl::MutexLock lock(&mu_);
  if (attempt >= attempt_) abandoned_ahead_ = std::max(abandoned_ahead_, attempt);
  if (attempt_ == attempt) abandoned_ = true;
  return attempt_ == attempt;
}

absl::Status PeerGroup::Send(int peer, uint64_t tag, std::string bytes) {
  uint64_t attempt;
  {
    absl::MutexLock lock(&mu_);
    if (peer < 0 || peer >= world_ || peer == rank_) {
      return absl::InvalidArgumentError(absl::StrCat("no peer ", peer));
    }
    if (failed_[peer]) {
      return WithUnreachablePeer(absl::UnavailableError(absl::StrCat("peer ", peer, " failed")),
                                 peer);
    }
    if (abandoned_) return absl::UnavailableError("the step attempt was abandoned");
    attempt = attempt_;
  }
  auto payload = std::make_shared<std::string>(std::move(bytes));
  const Header h{attempt, tag, rank_};
  worker_->Post([this, peer, payload, h] {
    if (peer >= static_cast<int>(endpoints_.size()) || endpoints_[peer] == nullptr) return;
    worker_->Send(endpoints_[peer], kPeerMessage, Pack(h), payload->data(), payload->size(),
                  nullptr, false, [payload, peer](absl::Status s) {
                    if (!s.ok()) LOG(WARNING) << "message to peer " << peer << ": " << s;
                  });
  });
  return absl::OkStatus();
}

void PeerGroup::OnMessage(ucx::AmMessage& m) {
  if (m.header.size() != sizeof(Header)) {
    worker_->Release(m);
    return;
  }
  Header h;
  std::memcpy(&h, m.header.data(), sizeof(Header));
  auto buffer = std::make_shared<std::string>(m.length, '\0');
  worker_->ReceiveData(m, buffer->data(), nullptr, [this, h, buffer](absl::Status s) {
    if (!s.ok()) {
      LOG(WARNING) << "message from peer " << h.source << " lost: " << s;
      return;
    }
    Deliver(h.attempt, h.source, h.tag, std::move(*buffer));
  });
}

void PeerGroup::Deliver(uint64_t attempt, int source, uint64_t tag, std::string bytes) {
  absl::MutexLock lock(&mu_);
  if (attempt < attempt_) return;                       // from an aborted attempt
  mailbox_[{attempt, source, tag}] = std::move(bytes);  // this one, or one about to start
}

absl::StatusOr<std::string> PeerGroup::Receive(int peer, uint64_t tag, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const uint64_t attempt = attempt_;
  const std::tuple<uint64_t, int, uint64_t> key{attempt, peer, tag};
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return mailbox_.count(key) > 0 || attempt_ != attempt || abandoned_ ||
           (peer >= 0 && peer < static_cast<int>(failed_.size()) && failed_[peer]);
  };
  const absl::Duration start = SteadyNow();
  bool arrived = mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
  // Counted in the time this process ran: stopped, it would blame the peer for its stop.
  for (absl::Duration left;
       !arrived && (left = RunningLeft(start, timeout)) > absl::ZeroDuration();) {
    arrived = mu_.AwaitWithTimeout(absl::Condition(&ready), left);
  }
  if (!arrived) {  // a silent peer
    return WithUnreachablePeer(
        absl::DeadlineExceededError(absl::StrCat("no message ", tag, " from peer ", peer,
                                                 " within ", absl::FormatDuration(timeout))),
        peer);
  }
  auto it = mailbox_.find(key);
  if (it == mailbox_.end() || abandoned_) {
    if (attempt_ != attempt || abandoned_) {
      return absl::UnavailableError("the step attempt was abandoned");
    }
    return WithUnreachablePeer(absl::UnavailableError(absl::StrCat("peer ", peer, " failed")),
                               peer);
  }
  std::string out = std::move(it->second);
  mailbox_.erase(it);
  return out;
}

template <typename T>
absl::Status PeerGroup::AllReduce(T* values, size_t n, uint64_t tag) {
  if (world_ == 1) return absl::OkStatus();
  const std::string mine(reinterpret_cast<const char*>(values), n * sizeof(T));
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) RETURN_IF_ERROR(Send(p, tag, mine));
  }
  // Every rank adds the same contributions in the same (rank) order.
  std::vector<T> sum(n, T{0});
  for (int p = 0; p < world_; ++p) {
    const T* part = values;
    std::string got;
    if (p != rank_) {
      ASSIGN_OR_RETURN(got, Receive(p, tag));
      if (got.size() != n * sizeof(T)) {
        return absl::DataLossError(absl::StrCat("all-reduce ", tag, ": peer ", p, " sent ",
                                                got.size(), " bytes, want ", n * sizeof(T)));
      }
      part = reinterpret_cast<const T*>(got.data());
    } else {
      part = reinterpret_cast<const T*>(mine.data());
    }
    for (size_t i = 0; i < n; ++i) sum[i] += part[i];
  }
  std::memcpy(values, sum.data(), n * sizeof(T));
  return absl::OkStatus();
}

absl::StatusOr<std::string> PeerGroup::Broadcast(int root, uint64_t tag, std::string bytes,
                                                 absl::Duration timeout) {
  if (root < 0 || root >= world_) {
    return absl::InvalidArgumentError(
        absl::StrCat("broadcast from rank ", root, " in a group of ", world_));
  }
  if (rank_ != root) return Receive(root, tag, timeout);
  for (int p = 0; p < world_; ++p) {
    if (p != rank_) RETURN_IF_ERROR(Send(p, tag, bytes));
  }
  return bytes;
}

absl::Status PeerGroup::AllReduceSum(double* values, size_t n, uint64_t tag) {
  return AllReduce(values, n, tag);
}

absl::Status PeerGroup::AllReduceSum(float* values, size_t n, uint64_t tag) {
  return AllReduce(values, n, tag);
}

}  // namespace pith::runtime
