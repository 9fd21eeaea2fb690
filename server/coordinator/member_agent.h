// MemberAgent: keeps one process (a store or a worker) a member of the cluster — it
// registers with the coordinator (taking the data-plane key it hands out, ucx_auth.h), heartbeats
// at a third of the lease from a background thread with fresh figures, and registers again (keeping
// its id) when the coordinator has forgotten it, e.g. after a restart.
//
// It lives beside the coordinator's CoordinatorService, the one service it talks to (DESIGN
// §5, membership and leases).
//
// Thread safety: the status callback runs on the agent's thread; the accessors are
// thread-safe.
#ifndef PITH_SERVER_COORDINATOR_MEMBER_AGENT_H_
#define PITH_SERVER_COORDINATOR_MEMBER_AGENT_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "security/tls.h"

namespace pith {

class MemberAgent {
 public:
  using StatusFn = std::function<void(v1::MemberInfo*)>;
  // Judges the cluster id of each registration's answer (RegisterResponse.cluster_id): an
  // error refuses to join that coordinator's cluster (a store whose data is another's).
  using ClusterFn = std::function<absl::Status(const std::string& cluster_id)>;

  // Registers `self` with the coordinator at `address`, over `security` (the member's
  // certificate, or plaintext on loopback). UNAVAILABLE, naming the address, when it
  // cannot be reached within `timeout`; the coordinator's error otherwise. While a
  // predecessor's lease holds this member's id (UNAVAILABLE), it tries again for up to two
  // minutes, or until SIGTERM or SIGINT arrives (ShutdownRequested: CANCELLED).
  static absl::StatusOr<std::unique_ptr<MemberAgent>> Start(
      const std::string& address, const security::TransportSecurity& security, v1::MemberInfo self,
      StatusFn status, ClusterFn cluster = nullptr, absl::Duration timeout = absl::Seconds(10));
  // Stops heartbeating and deregisters (best effort), once: true when the coordinator
  // answered that this member is a drained store, or (the coordinator did not answer)
  // when its last heartbeat said so.
  bool Leave();
  // Leave().
  ~MemberAgent();
  MemberAgent(const MemberAgent&) = delete;
  MemberAgent& operator=(const MemberAgent&) = delete;

  std::string member_id() const;
  // The channel it heartbeats on. A member's other calls to the coordinator go over it too:
  // the heartbeat, always in flight or about to be, then keeps it connected (see Loop).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  MemberAgent() = default;
  absl::Status Register();
  void Loop();

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::CoordinatorService::Stub> stub_;
  StatusFn status_;
  ClusterFn cluster_;
  std::thread thread_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  v1::MemberInfo self_ ABSL_GUARDED_BY(mu_);
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(3);
  bool drained_ ABSL_GUARDED_BY(mu_) = false;  // the last heartbeat's answer
  // Why the coordinator's cluster was refused (ClusterFn), until a heartbeat is answered
  // as this member's again: no registration meanwhile.
  absl::Status foreign_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith

#endif  // PITH_SERVER_COORDINATOR_MEMBER_AGENT_H_
