// OpaqueBackend's device group (tests only): an in-process stand-in for NCCL among the
// OpaqueBackends of one process (a test's in-process workers). The ranks of a group meet
// in a registry by id; a sum copies each rank's floats to the host, adds them in rank
// order and copies the sum back to every rank; an exchange posts each send's bytes (a host
// copy) to its pair's queue and takes each receive's from its pair's, in order. As NCCL's,
// every wait has a deadline, and an error, a passed deadline or RequestAbort breaks the
// group for every rank.
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "worker/compute/opaque_backend.h"

namespace pith::compute {
namespace {

// Where the ranks of one group meet.
class Hub {
 public:
  explicit Hub(int world) : world_(world), parts_(world) {}
  int world() const { return world_; }

  // Waits until all `world` ranks have joined.
  absl::Status Join(absl::Time deadline, const std::atomic<bool>& abort) {
    absl::MutexLock lock(&mu_);
    ++joined_;
    return Wait([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return joined_ == world_; }, deadline,
                abort, "join");
  }

  // Rank `rank`'s part of one sum in, the rank-order sum of every rank's out.
  absl::Status Sum(int rank, std::vector<float>& data, absl::Time deadline,
                   const std::atomic<bool>& abort) {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(Wait([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !scattering_; },
                         deadline, abort, "sum (the last one's end)"));
    parts_[rank] = data;
    if (++arrived_ == world_) {
      sum_ = parts_[0];
      for (int r = 1; r < world_; ++r) {
        if (parts_[r].size() != sum_.size()) {
          broken_ = absl::InvalidArgumentError("opaque group: the ranks' sums differ in size");
          return broken_;
        }
        for (size_t i = 0; i < sum_.size(); ++i) sum_[i] += parts_[r][i];
      }
      scattering_ = true;
      collected_ = 0;
    }
    RETURN_IF_ERROR(Wait([this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return scattering_; },
                         deadline, abort, "sum"));
    data = sum_;
    if (++collected_ == world_) {
      scattering_ = false;
      arrived_ = 0;
    }
    return absl::OkStatus();
  }

  // A send from `from` to `to`, queued for the matching receive.
  absl::Status Post(int from, int to, std::string bytes) {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
    mail_[{from, to}].push_back(std::move(bytes));
    return absl::OkStatus();
  }

  // The next send from `from` to `to`.
  absl::StatusOr<std::string> Take(int from, int to, absl::Time deadline,
                                   const std::atomic<bool>& abort) {
    absl::MutexLock lock(&mu_);
    std::deque<std::string>& queue = mail_[{from, to}];
    RETURN_IF_ERROR(Wait([&queue]() { return !queue.empty(); }, deadline, abort, "exchange"));
    std::string bytes = std::move(queue.front());
    queue.pop_front();
    return bytes;
  }

  void Break(const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = why;
  }

 private:
  // Waits for `done` (polling `abort` every 10 ms) until `deadline`; a break of the group
  // by any rank ends every wait.
  template <typename Done>
  absl::Status Wait(Done done, absl::Time deadline, const std::atomic<bool>& abort,
                    const char* what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !broken_.ok() || done(); };
    while (!ready()) {
      if (abort.load())
        broken_ = absl::AbortedError(absl::StrCat("opaque group: ", what, ": aborted"));
      if (absl::Now() >= deadline) {
        broken_ = absl::DeadlineExceededError(absl::StrCat("opaque group: ", what, ": deadline"));
      }
      if (!broken_.ok()) break;
      mu_.AwaitWithDeadline(absl::Condition(&ready),
                            std::min(deadline, absl::Now() + absl::Milliseconds(10)));
    }
    return broken_;
  }

  const int world_;
  absl::Mutex mu_;
  int joined_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::vector<float>> parts_ ABSL_GUARDED_BY(mu_);
  std::vector<float> sum_ ABSL_GUARDED_BY(mu_);
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  int collected_ ABSL_GUARDED_BY(mu_) = 0;
  bool scattering_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::pair<int, int>, std::deque<std::string>> mail_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// The groups of this process, by id (a group lives while a rank holds it).
absl::Mutex registry_mu;
std::map<std::string, std::weak_ptr<Hub>>& Registry() ABSL_EXCLUSIVE_LOCKS_REQUIRED(registry_mu) {
  static auto* groups = new std::map<std::string, std::weak_ptr<Hub>>();
  return *groups;
}

class OpaqueDeviceGroup final : public DeviceGroup {
 public:
  OpaqueDeviceGroup(OpaqueBackend* backend, std::shared_ptr<Hub> hub, int rank)
      : backend_(backend), hub_(std::move(hub)), rank_(rank) {}

  absl::Status AllReduceSum(float* data, size_t n, absl::Duration timeout) override {
    RETURN_IF_ERROR(Usable());
    std::vector<float> host(n);
    absl::Status st = backend_->CopyToHost(host.data(), data, n * sizeof(float));
    if (st.ok()) st = hub_->Sum(rank_, host, absl::Now() + timeout, abort_);
    if (st.ok()) st = backend_->CopyToDevice(data, host.data(), n * sizeof(float));
    if (!st.ok()) {
      failed_ = st;
      hub_->Break(st);
    }
    return st;
  }
  absl::Status Exchange(absl::Span<const DeviceTransfer> sends,
                        absl::Span<const DeviceTransfer> recvs, absl::Duration timeout) override {
    RETURN_IF_ERROR(Usable());
    for (const auto* list : {&sends, &recvs}) {
      for (const DeviceTransfer& t : *list) {
        if (t.peer < 0 || t.peer >= hub_->world()) {
          return absl::InvalidArgumentError(
              absl::StrCat("opaque group: exchange with rank ", t.peer, " of ", hub_->world()));
        }
      }
    }
    const absl::Time deadline = absl::Now() + timeout;
    absl::Status st;
    for (const DeviceTransfer& t : sends) {
      if (t.bytes == 0 || !st.ok()) continue;
      std::string bytes(t.bytes, '\0');
      st = backend_->CopyToHost(bytes.data(), t.data, t.bytes);
      if (st.ok()) st = hub_->Post(rank_, t.peer, std::move(bytes));
    }
    for (const DeviceTransfer& t : recvs) {
      if (t.bytes == 0 || !st.ok()) continue;
      absl::StatusOr<std::string> bytes = hub_->Take(t.peer, rank_, deadline, abort_);
      if (bytes.ok() && bytes->size() != t.bytes) {
        bytes = absl::InvalidArgumentError(absl::StrCat("opaque group: rank ", t.peer, " sent ",
                                                        bytes->size(), " bytes for a receive of ",
                                                        t.bytes));
      }
      st = bytes.ok() ? backend_->CopyToDevice(t.data, bytes->data(), t.bytes) : bytes.status();
    }
    if (!st.ok()) {
      failed_ = st;
      hub_->Break(st);
    }
    return st;
  }
  void RequestAbort() override { abort_ = true; }

 private:
  // As NCCL's: a group that failed, or whose abort was asked for before the call, refuses it.
  absl::Status Usable() {
    if (abort_.load() && failed_.ok()) failed_ = absl::AbortedError("abort requested");
    if (!failed_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("opaque group: aborted: ", failed_.message()));
    }
    return absl::OkStatus();
  }

  OpaqueBackend* backend_;
  std::shared_ptr<Hub> hub_;
  const int rank_;
  std::atomic<bool> abort_{false};
  absl::Status failed_;
};

}  // namespace

absl::StatusOr<std::string> OpaqueBackend::NewGroupId() {
  static std::atomic<uint64_t> next{0};
  return absl::StrCat("opaque-group-", ++next);
}

absl::StatusOr<std::unique_ptr<DeviceGroup>> OpaqueBackend::JoinGroup(
    const std::string& id, int rank, int world, absl::Duration timeout,
    const std::atomic<bool>& abandon) {
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("opaque group: rank ", rank, " of ", world));
  }
  std::shared_ptr<Hub> hub;
  {
    absl::MutexLock lock(&registry_mu);
    std::weak_ptr<Hub>& entry = Registry()[id];
    hub = entry.lock();
    if (hub == nullptr) {
      hub = std::make_shared<Hub>(world);
      entry = hub;
    }
  }
  RETURN_IF_ERROR(hub->Join(absl::Now() + timeout, abandon));
  return std::unique_ptr<DeviceGroup>(new OpaqueDeviceGroup(this, std::move(hub), rank));
}

}  // namespace pith::compute
