// Membership: the stores and workers the coordinator knows, with leases. A member
// registers, heartbeats at least every lease/3, and is marked dead when its lease runs
// out. After a coordinator restart members are unknown until they register again (their
// heartbeat is answered with `reregister`). Time comes from a Clock, the seam the
// scheduler shares, so lease expiry and grace periods are tested by advancing a fake one.
//
// Thread safety: all methods are thread-safe.
#ifndef PITH_SERVER_COORDINATOR_MEMBERSHIP_H_
#define PITH_SERVER_COORDINATOR_MEMBERSHIP_H_

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/pause_watch.h"
#include "pith/v1/common.pb.h"

namespace pith::coordinator {

class Membership {
 public:
  using Clock = std::function<absl::Time()>;
  explicit Membership(
      absl::Duration lease, Clock clock = [] { return absl::Now(); });

  absl::Duration lease() const { return lease_; }

  // Where member identities are kept durably: called with (id, identity) when an
  // identity is first seen, before Register answers; an error fails the registration.
  using PersistIdentity = std::function<absl::Status(const std::string&, const std::string&)>;
  // The identities recorded before a restart (id -> identity) and where to record new ones.
  void RestoreIdentities(const std::map<std::string, std::string>& ids, PersistIdentity persist);

  // Registers `member` (role and grpc_address required; INVALID_ARGUMENT otherwise). A
  // member with an identity gets the id mapped to it (FAILED_PRECONDITION when it claims
  // another, or an id that belongs to another identity); otherwise an empty member_id gets
  // a new one (never one an identity holds) and a known or previous id is kept.
  // With `quota`, a new identity under `quota->owner + "/"` is refused (RESOURCE_EXHAUSTED)
  // once that owner has `quota->max` of them: each is an id kept forever.
  struct IdentityQuota {
    std::string owner;  // a certificate's name
    size_t max;
  };
  absl::StatusOr<std::string> Register(v1::MemberInfo member,
                                       std::optional<IdentityQuota> quota = std::nullopt);
  // Renews the lease and takes fresh figures and health from `status` (a member that says
  // it is unhealthy is left out of every Snapshot, as if dead). NOT_FOUND for an unknown or
  // dead member: it must register again. Returns the member's state.
  absl::StatusOr<v1::MemberState> Heartbeat(const std::string& member_id,
                                            const v1::MemberInfo& status);
  // Removes a member that leaves cleanly (its drain, if any, lasts until ForgetDrain);
  // true when it was a drained store.
  absl::StatusOr<bool> Deregister(const std::string& member_id);
  // Marks a live store as draining: it takes no new placement, and keeps the state across
  // re-registration. NOT_FOUND for an unknown member, FAILED_PRECONDITION for a worker or a
  // dead store. Draining a draining or drained store changes nothing.
  absl::Status Drain(const std::string& store_id);
  // A draining store that holds nothing any more: its process can be stopped.
  void MarkDrained(const std::string& store_id);
  // Stores to treat as draining when they register (drains recorded before a restart).
  void RestoreDrains(const std::vector<std::string>& store_ids);
  // Forgets a drain (its store left for good); its id may be given out again, unless an
  // identity holds it.
  void ForgetDrain(const std::string& store_id);
  // Marks members whose lease ran out as dead; returns their ids.
  std::vector<std::string> ExpireLeases() ABSL_LOCKS_EXCLUDED(mu_);

  // Leases do not run while this process does not (SIGSTOP, a paused VM, a machine too
  // loaded to run it): heartbeats could not be taken meanwhile, and a coordinator that
  // woke up would otherwise find every lease lapsed and every job's members gone. From
  // this call on, a thread (stopped by the destructor) looks at `monotonic` (by default the
  // boot-time clock, which runs through a suspend: common/pause_watch.h) every 100 ms;
  // when more than a quarter lease passed since it or ExpireLeases last looked, every
  // member's lease moves on by that long (a dead one's: when it died, which a job waiting
  // for a dead store counts from). The thread is not blocked by anything else, so
  // a scheduler pass that is merely slow (a long commit) is not taken for a pause.
  using MonotonicClock = std::function<absl::Duration()>;
  void WatchPauses(MonotonicClock monotonic = pith::SteadyNow) ABSL_LOCKS_EXCLUDED(mu_);
  ~Membership();

  // The identity an id is bound to (nullopt for an id without one, or unknown).
  std::optional<std::string> IdentityOf(const std::string& member_id) const;

  // Every member of a role (dead ones included), by id; stores with disk_low set.
  std::vector<v1::MemberInfo> Members(v1::MemberRole role) const;

 private:
  const absl::Duration lease_;
  const Clock clock_;
  mutable absl::Mutex mu_;
  std::map<std::string, v1::MemberInfo> members_ ABSL_GUARDED_BY(mu_);
  std::map<v1::MemberRole, int> next_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, v1::MemberState> drains_ ABSL_GUARDED_BY(mu_);  // DRAINING or DRAINED
  struct LowDisk {
    absl::Time since;                                 // low since
    absl::Time above_since = absl::InfiniteFuture();  // back over the low line since
  };
  std::map<std::string, LowDisk> low_disk_ ABSL_GUARDED_BY(mu_);
  // Judges a store's disk from its figures (MemberInfo.disk_low: it takes no new copies,
  // Alive::full). A store becomes low under twice its --disk_reserve_bytes free, and is
  // low until it has three times its reserve free and kLowDiskCooldown has passed since
  // it became low, or until it has stayed over twice its reserve for kLowDiskCooldown (a
  // small disk may never free three times its reserve): without the margin and the
  // wait, a store that sheds its copies to other stores and so frees its disk would take
  // them back at once, and the copies would go back and forth.
  void NoteDiskLocked(const v1::MemberInfo& m) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::map<std::string, std::string> id_of_identity_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> identity_of_id_ ABSL_GUARDED_BY(mu_);
  PersistIdentity persist_ ABSL_GUARDED_BY(mu_);
  // WatchPauses: the clock, when it was last looked at, and the thread.
  MonotonicClock monotonic_ ABSL_GUARDED_BY(mu_);
  absl::Duration last_ran_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_watch_;
  std::thread watch_;
  // Moves every member's lease past a pause of this process (see WatchPauses).
  void MovePastPauseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The id for `member`'s identity (recording a new one); see Register.
  absl::StatusOr<std::string> IdForIdentityLocked(const v1::MemberInfo& member,
                                                  const std::optional<IdentityQuota>& quota)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string NewIdLocked(v1::MemberRole role) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
};

// How long a store low on disk stays so at least (MemberInfo.disk_low).
inline constexpr absl::Duration kLowDiskCooldown = absl::Minutes(5);

// The members alive at one moment: every decision of a scheduler pass is made on one
// snapshot, so that a member dying meanwhile is seen by the next pass, not half of this one.
struct Alive {
  // Live members by id; the stores include draining and drained ones, which still serve
  // what they hold.
  std::map<std::string, v1::MemberInfo> stores, workers;
  std::set<std::string> known;  // every id, dead ones included
  // Dead stores: when their lease ran out (Unix ms, coordinator clock).
  std::map<std::string, int64_t> stores_down_since_ms;
  std::set<std::string> draining;  // live stores draining or drained: no new placement
  // Live stores low on disk (MemberInfo.disk_low; under their --disk_reserve_bytes they
  // refuse puts, and just above it every put bigger than what is left): no new copies go
  // to them until they have room again, nor do their copies count as room for a job's
  // groups when another store of the job refuses puts for want of disk.
  std::set<std::string> full;
  std::vector<std::string> store_ids() const {
    std::vector<std::string> ids;
    for (const auto& [id, m] : stores) ids.push_back(id);
    return ids;
  }
  // Whether new copies may go to store `id`.
  bool placeable(const std::string& id) const {
    return stores.count(id) > 0 && !draining.count(id) && !full.count(id);
  }
  // The stores new copies may go to.
  std::vector<std::string> placeable_ids() const {
    std::vector<std::string> ids;
    for (const auto& [id, m] : stores) {
      if (placeable(id)) ids.push_back(id);
    }
    return ids;
  }
};

// The live members of `members` now.
Alive Snapshot(const Membership& members);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_MEMBERSHIP_H_
