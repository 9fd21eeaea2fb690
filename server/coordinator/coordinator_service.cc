#include "server/coordinator/coordinator_service.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/step_protocol.h"

namespace pith::coordinator {

using security::Role;

security::Policy CoordinatorServiceImpl::CoordinatorPolicy(bool enforce,
                                                           security::Policy::TokenLookup tokens) {
  const std::set<Role> member = {Role::kMember};
  return security::Policy(enforce,
                          {{"Register", member},
                           {"Heartbeat", member},
                           {"Deregister", member},
                           {"ReportHeat", member},
                           {"GetAssignment", member},
                           {"GetPlacement", member},
                           {"ReportStepWritten", member},
                           {"WaitStep", member},
                           {"DrainStore", {Role::kAdmin}}},
                          std::move(tokens));
}

grpc::Status CoordinatorServiceImpl::CheckOwnId(const std::optional<security::Identity>& caller,
                                                const std::string& member_id) const {
  if (!caller) return grpc::Status::OK;
  std::optional<std::string> identity = members_->IdentityOf(member_id);
  // An id nobody holds: the call itself answers (NOT_FOUND, register again).
  if (!identity || absl::StartsWith(*identity, caller->name + "/")) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat(member_id, " is another member's id; the caller is ",
                                   security::DebugString(*caller)));
}

grpc::Status CoordinatorServiceImpl::Register(grpc::ServerContext* context,
                                              const v1::RegisterRequest* request,
                                              v1::RegisterResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "Register", &caller); !denied.ok()) {
    return denied;
  }
  if (grpc::Status s = CheckOwnId(caller, request->member().member_id()); !s.ok()) return s;
  v1::MemberInfo member = request->member();
  // A member's identity is its certificate's name first: the ids it is given, and the
  // ids it may name later, are bound to the certificate, never chosen by the caller.
  // Each new identity under a certificate is a new id kept forever: a certificate gets a
  // few (a store whose data dir was replaced), not an unbounded number.
  std::optional<Membership::IdentityQuota> quota;
  if (caller) {
    member.set_identity(absl::StrCat(caller->name, "/", member.identity()));
    quota = Membership::IdentityQuota{caller->name, kMaxIdentitiesPerCertificate};
  }
  absl::StatusOr<std::string> id = members_->Register(std::move(member), std::move(quota));
  if (!id.ok()) return ToGrpcStatus(id.status());
  reply->set_member_id(*id);
  if (caller) reply->set_data_plane_key(data_plane_key_);  // only over mutual TLS
  reply->set_cluster_id(cluster_id_);
  reply->set_lease_ms(absl::ToInt64Milliseconds(members_->lease()));
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::Heartbeat(grpc::ServerContext* context,
                                               const v1::HeartbeatRequest* request,
                                               v1::HeartbeatResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "Heartbeat", &caller); !denied.ok()) {
    return denied;
  }
  if (grpc::Status s = CheckOwnId(caller, request->member_id()); !s.ok()) return s;
  absl::StatusOr<v1::MemberState> state =
      members_->Heartbeat(request->member_id(), request->status());
  // An unknown member is told to register again rather than failed: after a coordinator
  // restart every member is unknown.
  reply->set_reregister(absl::IsNotFound(state.status()));
  if (!state.ok() && !absl::IsNotFound(state.status())) return ToGrpcStatus(state.status());
  reply->set_lease_ms(absl::ToInt64Milliseconds(members_->lease()));
  if (state.ok()) {
    reply->set_assignment_version(scheduler_->AssignmentVersion(request->member_id()));
    reply->set_drained(*state == v1::MEMBER_STATE_DRAINED);
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::Deregister(grpc::ServerContext* context,
                                                const v1::DeregisterRequest* request,
                                                v1::DeregisterResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "Deregister", &caller); !denied.ok()) {
    return denied;
  }
  if (grpc::Status s = CheckOwnId(caller, request->member_id()); !s.ok()) return s;
  absl::StatusOr<bool> drained = members_->Deregister(request->member_id());
  if (!drained.ok()) return ToGrpcStatus(drained.status());
  reply->set_drained(*drained);
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::ReportHeat(grpc::ServerContext* context,
                                                const v1::HeatReport* request,
                                                v1::HeatReportResponse*) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "ReportHeat", &caller); !denied.ok()) {
    return denied;
  }
  if (grpc::Status s = CheckOwnId(caller, request->worker_id()); !s.ok()) return s;
  absl::StatusOr<v1::Job> job = jobs_->Get(request->job_id());
  if (!job.ok()) return ToGrpcStatus(job.status());
  absl::Status reported = heat_->Report(*job, *request);
  // Removed meanwhile (after the Get, before or after its heat was dropped): it goes.
  if (jobs_->Removed(request->job_id())) heat_->Drop(request->job_id());
  return ToGrpcStatus(reported);
}

grpc::Status CoordinatorServiceImpl::GetAssignment(grpc::ServerContext* context,
                                                   const v1::GetAssignmentRequest* request,
                                                   v1::Assignment* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "GetAssignment", &caller); !denied.ok()) {
    return denied;
  }
  if (grpc::Status s = CheckOwnId(caller, request->worker_id()); !s.ok()) return s;
  return ToGrpcReply(scheduler_->GetAssignment(request->worker_id()), reply);
}

grpc::Status CoordinatorServiceImpl::GetPlacement(grpc::ServerContext* context,
                                                  const v1::GetPlacementRequest* request,
                                                  v1::PlacementTable* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "GetPlacement"); !denied.ok()) return denied;
  absl::StatusOr<v1::PlacementTable> t = scheduler_->GetPlacement(request->job_id());
  if (!t.ok()) return ToGrpcStatus(t.status());
  if (t->epoch() < request->min_epoch()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat("job ", request->job_id(), " is at placement epoch ", t->epoch(), ", not ",
                     request->min_epoch(), " yet")));
  }
  *reply = *std::move(t);
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::ReportStepWritten(grpc::ServerContext* context,
                                                       const v1::StepWrittenRequest* request,
                                                       v1::StepWrittenResponse* reply) {
  std::optional<security::Identity> caller;
  if (grpc::Status denied = policy_.Admit(*context, "ReportStepWritten", &caller); !denied.ok()) {
    return denied;
  }
  if (grpc::Status s = CheckOwnId(caller, request->worker_id()); !s.ok()) return s;
  if (request->job_id().empty() || request->worker_id().empty() || request->step() < 0) {
    return ToGrpcStatus(absl::InvalidArgumentError("job_id, worker_id and step >= 0 are required"));
  }
  absl::StatusOr<v1::StepStatus> s = scheduler_->ReportStepWritten(*request);
  if (!s.ok()) return ToGrpcStatus(s.status());
  *reply->mutable_status() = *std::move(s);
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::WaitStep(grpc::ServerContext* context,
                                              const v1::WaitStepRequest* request,
                                              v1::StepStatus* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "WaitStep"); !denied.ok()) return denied;
  if (request->job_id().empty() || request->step() < 0) {
    return ToGrpcStatus(absl::InvalidArgumentError("job_id and step >= 0 are required"));
  }
  absl::Duration timeout = kWaitStepServerCap;
  const absl::Time deadline = absl::FromChrono(context->deadline());
  if (deadline < absl::Now() + timeout)
    timeout = std::max(deadline - absl::Now(), absl::ZeroDuration());
  return ToGrpcReply(scheduler_->WaitStep(*request, timeout), reply);
}

grpc::Status CoordinatorServiceImpl::DrainStore(grpc::ServerContext* context,
                                                const v1::DrainStoreRequest* request,
                                                v1::DrainStoreResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "DrainStore"); !denied.ok()) return denied;
  return ToGrpcReply(scheduler_->Drain(request->store_id()), reply);
}

}  // namespace pith::coordinator
