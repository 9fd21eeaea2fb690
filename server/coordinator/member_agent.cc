#include "server/coordinator/member_agent.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "common/grpc_status.h"
#include "common/process.h"
#include "common/status.h"
#include "common/ucx_auth.h"
#include "glog/logging.h"

namespace pith {

absl::StatusOr<std::unique_ptr<MemberAgent>> MemberAgent::Start(
    const std::string& address, const security::TransportSecurity& security, v1::MemberInfo self,
    StatusFn status, ClusterFn cluster, absl::Duration timeout) {
  // A member of a TLS cluster takes in no UCX message without the cluster's tag; the key
  // comes with the registration (DESIGN §8).
  if (security.tls()) ucx::RequireDataPlaneAuth();
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = Dial(address, security, timeout);
  if (!channel.ok()) return Annotate(channel.status(), "coordinator");
  std::unique_ptr<MemberAgent> agent(new MemberAgent());
  agent->channel_ = *channel;
  agent->stub_ = v1::CoordinatorService::NewStub(agent->channel_);
  agent->status_ = std::move(status);
  agent->cluster_ = std::move(cluster);
  {
    absl::MutexLock lock(&agent->mu_);
    agent->self_ = std::move(self);
  }
  // UNAVAILABLE: this process's predecessor (a restarted store) still holds a lease; it
  // runs out within one lease, and the coordinator then takes this one.
  const absl::Time give_up = absl::Now() + std::max(timeout, absl::Minutes(2));
  absl::Status registered;
  while (!(registered = agent->Register()).ok() && absl::IsUnavailable(registered) &&
         absl::Now() < give_up) {
    LOG_FIRST_N(INFO, 1) << registered.message();
    if (ShutdownRequested()) {
      return absl::CancelledError(absl::StrCat("stopped by a signal while waiting to register (",
                                               registered.message(), ")"));
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  RETURN_IF_ERROR(registered);
  agent->thread_ = std::thread([a = agent.get()] { a->Loop(); });
  return agent;
}

MemberAgent::~MemberAgent() { Leave(); }

bool MemberAgent::Leave() {
  if (stop_.HasBeenNotified()) return false;  // left before
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  v1::DeregisterRequest req;
  req.set_member_id(member_id());
  v1::DeregisterResponse resp;
  // Best effort: the lease expires otherwise.
  if (stub_->Deregister(&ctx, req, &resp).ok()) return resp.drained();
  absl::MutexLock lock(&mu_);
  LOG_IF(INFO, drained_) << "the coordinator did not answer the leave; its last heartbeat said "
                         << self_.member_id() << " is drained";
  return drained_;
}

std::string MemberAgent::member_id() const {
  absl::MutexLock lock(&mu_);
  return self_.member_id();
}

absl::Status MemberAgent::Register() {
  v1::RegisterRequest req;
  {
    absl::MutexLock lock(&mu_);
    *req.mutable_member() = self_;
  }
  // What a heartbeat would say (its health above all: an unhealthy member is not taken
  // for a healthy one until its first heartbeat). Start's registration ends before the
  // loop's thread begins, so status_ is never called from two threads at once.
  if (status_) status_(req.mutable_member());
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::RegisterResponse resp;
  RETURN_IF_ERROR(Annotate(FromGrpcStatus(stub_->Register(&ctx, req, &resp)), "register"));
  if (cluster_) {
    if (absl::Status mine = cluster_(resp.cluster_id()); !mine.ok()) {
      // Registered, but refused here: leave at once, so that nothing is placed on it.
      v1::DeregisterRequest leave;
      leave.set_member_id(resp.member_id());
      grpc::ClientContext left_ctx;
      left_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
      v1::DeregisterResponse left;
      (void)stub_->Deregister(&left_ctx, leave, &left);
      absl::MutexLock lock(&mu_);
      foreign_ = mine;
      return mine;
    }
  }
  // With mutual TLS the cluster's data-plane key comes with the answer (DESIGN §8).
  ucx::SetDataPlaneKey(resp.data_plane_key());
  absl::MutexLock lock(&mu_);
  self_.set_member_id(resp.member_id());
  lease_ = absl::Milliseconds(resp.lease_ms());
  return absl::OkStatus();
}

void MemberAgent::Loop() {
  auto lease = [this] {
    absl::MutexLock lock(&mu_);
    return lease_;
  };
  while (!stop_.WaitForNotificationWithTimeout(lease() / 3)) {
    v1::HeartbeatRequest req;
    req.set_member_id(member_id());
    if (status_) status_(req.mutable_status());
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + lease() / 3));
    // Waits while the channel reconnects (a coordinator restart) rather than failing at
    // once: a waiting call polls the channel's sockets, which in a process without a gRPC
    // server of its own (a worker) nothing else may do, and a reconnection's TLS handshake
    // would otherwise move only at gRPC's 5-s backup poll, and time out. The member's other
    // calls share this channel (channel()) and fail at once while it is down.
    ctx.set_wait_for_ready(true);
    v1::HeartbeatResponse resp;
    absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
    if (!s.ok()) {
      LOG(WARNING) << "heartbeat to the coordinator failed: " << s.message();
      continue;
    }
    if (resp.reregister()) {
      absl::MutexLock lock(&mu_);
      // A coordinator of another cluster: not joined again (its own coming back knows this
      // member's id, and the heartbeats go on).
      if (!foreign_.ok()) {
        LOG_EVERY_N(WARNING, 30) << "not joining the coordinator's cluster: " << foreign_.message();
        continue;
      }
    }
    {
      absl::MutexLock lock(&mu_);
      if (!resp.reregister()) foreign_ = absl::OkStatus();
      LOG_IF(INFO, resp.drained() && !drained_)
          << "the coordinator says " << self_.member_id() << " is drained: it can be stopped";
      drained_ = resp.drained();
    }
    if (resp.reregister()) {
      LOG(INFO) << "the coordinator does not know " << member_id() << "; registering again";
      if (absl::Status r = Register(); !r.ok()) LOG(WARNING) << r.message();
    }
  }
}

}  // namespace pith
