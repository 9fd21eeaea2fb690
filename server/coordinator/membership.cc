#include "server/coordinator/membership.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/ucx_address.h"
#include "glog/logging.h"

namespace pith::coordinator {

Membership::Membership(absl::Duration lease, Clock clock)
    : lease_(lease), clock_(std::move(clock)) {}

Membership::~Membership() {
  stop_watch_.Notify();
  if (watch_.joinable()) watch_.join();
}

void Membership::WatchPauses(MonotonicClock monotonic) {
  {
    absl::MutexLock lock(&mu_);
    if (monotonic_) return;  // watching already
    monotonic_ = std::move(monotonic);
    last_ran_ = monotonic_();
  }
  watch_ = std::thread([this] {
    while (!stop_watch_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
      absl::MutexLock lock(&mu_);
      MovePastPauseLocked();
    }
  });
}

void Membership::MovePastPauseLocked() {
  if (!monotonic_) return;
  const absl::Duration now = monotonic_();
  const absl::Duration paused = now - last_ran_;
  last_ran_ = now;
  if (paused <= lease_ / 4) return;
  const int64_t ms = absl::ToInt64Milliseconds(paused);
  LOG(WARNING) << "this process did not run for " << absl::FormatDuration(paused)
               << ": every member's lease moves on by as much";
  // A dead member's too: its lease's end is when it died, and a job waiting for a dead
  // store (Scheduler::AwaitedStores) counts its wait from there.
  for (auto& [id, m] : members_) m.set_lease_expires_unix_ms(m.lease_expires_unix_ms() + ms);
}

absl::StatusOr<std::string> Membership::Register(v1::MemberInfo member,
                                                 std::optional<IdentityQuota> quota) {
  if (member.role() != v1::MEMBER_ROLE_STORE && member.role() != v1::MEMBER_ROLE_WORKER) {
    return absl::InvalidArgumentError("member.role must be store or worker");
  }
  if (member.grpc_address().empty()) {
    return absl::InvalidArgumentError("member.grpc_address is required");
  }
  // Peers connect to it: junk here would reach every one of them.
  if (!member.ucx_address().empty()) {
    RETURN_IF_ERROR(
        Annotate(UnwrapUcxAddress(member.ucx_address()).status(), "member.ucx_address"));
  }
  absl::MutexLock lock(&mu_);
  if (!member.identity().empty()) {
    ASSIGN_OR_RETURN(std::string id, IdForIdentityLocked(member, quota));
    // A new process of a store whose last one still holds a lease (it restarted within
    // the lease): it lost that process's uncommitted writes, so the scheduler must see
    // the old one gone first (ExpireLeases marks it dead), never a silent continuation.
    auto previous = members_.find(id);
    if (previous != members_.end() && previous->second.state() != v1::MEMBER_STATE_DEAD &&
        previous->second.ucx_address() != member.ucx_address()) {
      return absl::UnavailableError(absl::StrCat(
          id,
          " is still registered by its previous process; a restarted store waits until "
          "the coordinator has seen that one's lease run out"));
    }
    member.set_member_id(id);
  } else if (member.member_id().empty()) {
    member.set_member_id(NewIdLocked(member.role()));
  } else if (identity_of_id_.count(member.member_id())) {
    return absl::FailedPreconditionError(absl::StrCat(
        member.member_id(), " belongs to a member with an identity; this one has none"));
  }
  auto drain = drains_.find(member.member_id());
  member.set_state(drain != drains_.end() ? drain->second : v1::MEMBER_STATE_ALIVE);
  member.set_lease_expires_unix_ms(absl::ToUnixMillis(clock_() + lease_));
  const std::string id = member.member_id();
  LOG_IF(ERROR, !member.health().empty())
      << id << " registered unhealthy and counts as dead: " << member.health();
  NoteDiskLocked(member);
  members_[id] = std::move(member);
  return id;
}

std::string Membership::NewIdLocked(v1::MemberRole role) {
  const char* prefix = role == v1::MEMBER_ROLE_STORE ? "store-" : "worker-";
  std::string id;
  do {
    id = absl::StrCat(prefix, next_[role]++);
    // A drained store's id stays its own, and an identity's id stays its identity's.
  } while (members_.count(id) || drains_.count(id) || identity_of_id_.count(id));
  return id;
}

void Membership::RestoreIdentities(const std::map<std::string, std::string>& ids,
                                   PersistIdentity persist) {
  absl::MutexLock lock(&mu_);
  for (const auto& [id, identity] : ids) {
    identity_of_id_[id] = identity;
    id_of_identity_[identity] = id;
  }
  persist_ = std::move(persist);
}

absl::StatusOr<std::string> Membership::IdForIdentityLocked(
    const v1::MemberInfo& member, const std::optional<IdentityQuota>& quota) {
  const std::string& identity = member.identity();
  const std::string& claimed = member.member_id();
  auto known = id_of_identity_.find(identity);
  if (known != id_of_identity_.end()) {
    if (!claimed.empty() && claimed != known->second) {
      return absl::FailedPreconditionError(
          absl::StrCat("this data dir is ", known->second, "'s, not ", claimed));
    }
    return known->second;
  }
  auto owner = identity_of_id_.find(claimed);
  if (!claimed.empty() && owner != identity_of_id_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(claimed,
                                                      " belongs to another data dir (identity ",
                                                      owner->second, ", not ", identity, ")"));
  }
  if (quota) {
    const std::string prefix = quota->owner + "/";
    size_t held = 0;
    for (auto it = id_of_identity_.lower_bound(prefix);
         it != id_of_identity_.end() && absl::StartsWith(it->first, prefix); ++it) {
      ++held;
    }
    if (held >= quota->max) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the certificate ", quota->owner, " registered ", quota->max,
                       " members already; give each store and worker its own certificate"));
    }
  }
  const std::string id = claimed.empty() ? NewIdLocked(member.role()) : claimed;
  if (persist_) {
    RETURN_IF_ERROR(persist_(id, identity));
  }
  identity_of_id_[id] = identity;
  id_of_identity_[identity] = id;
  return id;
}

std::optional<std::string> Membership::IdentityOf(const std::string& member_id) const {
  absl::MutexLock lock(&mu_);
  auto it = identity_of_id_.find(member_id);
  if (it == identity_of_id_.end()) return std::nullopt;
  return it->second;
}

absl::StatusOr<v1::MemberState> Membership::Heartbeat(const std::string& member_id,
                                                      const v1::MemberInfo& status) {
  absl::MutexLock lock(&mu_);
  auto it = members_.find(member_id);
  if (it == members_.end() || it->second.state() == v1::MEMBER_STATE_DEAD) {
    return absl::NotFoundError(absl::StrCat("unknown member ", member_id, ": register again"));
  }
  v1::MemberInfo& m = it->second;
  m.set_lease_expires_unix_ms(absl::ToUnixMillis(clock_() + lease_));
  m.set_ram_bytes(status.ram_bytes());
  m.set_rocksdb_bytes(status.rocksdb_bytes());
  m.set_disk_free_bytes(status.disk_free_bytes());
  m.set_disk_reserve_bytes(status.disk_reserve_bytes());
  NoteDiskLocked(m);
  if (status.capacity_bytes() != 0) m.set_capacity_bytes(status.capacity_bytes());
  if (!status.job_id().empty()) m.set_job_id(status.job_id());
  if (status.health() != m.health()) {
    LOG_IF(ERROR, !status.health().empty())
        << m.member_id() << " is unhealthy and counts as dead: " << status.health();
    m.set_health(status.health());
  }
  return m.state();
}

absl::StatusOr<bool> Membership::Deregister(const std::string& member_id) {
  absl::MutexLock lock(&mu_);
  auto it = members_.find(member_id);
  if (it == members_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown member ", member_id));
  }
  const bool drained = it->second.state() == v1::MEMBER_STATE_DRAINED;
  members_.erase(it);
  return drained;  // a drain is forgotten by the scheduler once it is over
}

absl::Status Membership::Drain(const std::string& store_id) {
  absl::MutexLock lock(&mu_);
  auto it = members_.find(store_id);
  if (it == members_.end()) return absl::NotFoundError(absl::StrCat("unknown store ", store_id));
  v1::MemberInfo& m = it->second;
  if (m.role() != v1::MEMBER_ROLE_STORE) {
    return absl::FailedPreconditionError(absl::StrCat(store_id, " is not a store"));
  }
  if (m.state() == v1::MEMBER_STATE_DEAD) {
    return absl::FailedPreconditionError(
        absl::StrCat("store ", store_id, " is dead: its blobs are re-replicated already"));
  }
  if (m.state() == v1::MEMBER_STATE_ALIVE) {
    m.set_state(v1::MEMBER_STATE_DRAINING);
    drains_[store_id] = v1::MEMBER_STATE_DRAINING;
  }
  return absl::OkStatus();
}

void Membership::MarkDrained(const std::string& store_id) {
  absl::MutexLock lock(&mu_);
  auto it = members_.find(store_id);
  if (it == members_.end() || it->second.state() != v1::MEMBER_STATE_DRAINING) return;
  it->second.set_state(v1::MEMBER_STATE_DRAINED);
  drains_[store_id] = v1::MEMBER_STATE_DRAINED;
}

void Membership::ForgetDrain(const std::string& store_id) {
  absl::MutexLock lock(&mu_);
  drains_.erase(store_id);
}

void Membership::RestoreDrains(const std::vector<std::string>& store_ids) {
  absl::MutexLock lock(&mu_);
  for (const std::string& id : store_ids) drains_.emplace(id, v1::MEMBER_STATE_DRAINING);
}

std::vector<std::string> Membership::ExpireLeases() {
  const int64_t now = absl::ToUnixMillis(clock_());
  std::vector<std::string> dead;
  absl::MutexLock lock(&mu_);
  MovePastPauseLocked();  // first: a pause that the watch has not seen yet
  for (auto& [id, m] : members_) {
    if (m.state() != v1::MEMBER_STATE_DEAD && m.lease_expires_unix_ms() < now) {
      m.set_state(v1::MEMBER_STATE_DEAD);
      dead.push_back(id);
    }
  }
  return dead;
}

void Membership::NoteDiskLocked(const v1::MemberInfo& m) {
  const uint64_t free = m.disk_free_bytes(), reserve = m.disk_reserve_bytes();
  auto low = low_disk_.find(m.member_id());
  const absl::Time now = clock_();
  if (reserve > 0 && free / 2 < reserve) {
    if (low == low_disk_.end()) {
      LOG(WARNING) << "store " << m.member_id() << " is low on disk (" << free
                   << " bytes free, reserve " << reserve << "): it takes no new copies";
      low_disk_.emplace(m.member_id(), LowDisk{.since = now});
    } else {
      low->second.above_since = absl::InfiniteFuture();
    }
    return;
  }
  if (low == low_disk_.end()) return;
  LowDisk& l = low->second;
  if (l.above_since == absl::InfiniteFuture()) l.above_since = now;
  // No figures (a store without a disk tier), or room with a margin for long enough, or
  // over the low line for long enough.
  if (reserve == 0 || (free / 3 >= reserve && now - l.since >= kLowDiskCooldown) ||
      now - l.above_since >= kLowDiskCooldown) {
    LOG(INFO) << "store " << m.member_id() << " has disk room again (" << free
              << " bytes free): it takes new copies";
    low_disk_.erase(low);
  }
}

std::vector<v1::MemberInfo> Membership::Members(v1::MemberRole role) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::MemberInfo> out;
  for (const auto& [id, m] : members_) {
    if (m.role() != role) continue;
    out.push_back(m);
    out.back().set_disk_low(low_disk_.count(id) > 0);
  }
  return out;
}

Alive Snapshot(const Membership& members) {
  Alive a;
  for (v1::MemberRole role : {v1::MEMBER_ROLE_STORE, v1::MEMBER_ROLE_WORKER}) {
    for (v1::MemberInfo& m : members.Members(role)) {
      a.known.insert(m.member_id());
      const bool store = role == v1::MEMBER_ROLE_STORE;
      const bool draining =
          m.state() == v1::MEMBER_STATE_DRAINING || m.state() == v1::MEMBER_STATE_DRAINED;
      if (store && m.state() == v1::MEMBER_STATE_DEAD) {
        a.stores_down_since_ms[m.member_id()] = m.lease_expires_unix_ms();
      }
      if (m.state() != v1::MEMBER_STATE_ALIVE && !(store && draining)) continue;
      if (!m.health().empty()) continue;  // a stopped tier: as good as dead
      if (draining) a.draining.insert(m.member_id());
      if (store && m.disk_low()) a.full.insert(m.member_id());
      (store ? a.stores : a.workers)[m.member_id()] = std::move(m);
    }
  }
  return a;
}

}  // namespace pith::coordinator
