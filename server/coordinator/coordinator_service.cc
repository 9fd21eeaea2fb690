#include "server/coordinator/coordinator_service.h"

#include "common/grpc_util.h"

namespace pith::coordinator {

grpc::Status CoordinatorServiceImpl::Register(grpc::ServerContext*,
                                              const v1::RegisterRequest* request,
                                              v1::RegisterResponse* reply) {
  absl::StatusOr<std::string> id = members_->Register(request->member());
  if (!id.ok()) return ToGrpcStatus(id.status());
  reply->set_member_id(*id);
  reply->set_lease_ms(absl::ToInt64Milliseconds(members_->lease()));
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::Heartbeat(grpc::ServerContext*,
                                               const v1::HeartbeatRequest* request,
                                               v1::HeartbeatResponse* reply) {
  absl::Status s = members_->Heartbeat(request->member_id(), request->status());
  // An unknown member is told to register again rather than failed: after a coordinator
  // restart every member is unknown.
  reply->set_reregister(absl::IsNotFound(s));
  if (!s.ok() && !absl::IsNotFound(s)) return ToGrpcStatus(s);
  reply->set_lease_ms(absl::ToInt64Milliseconds(members_->lease()));
  return grpc::Status::OK;
}

grpc::Status CoordinatorServiceImpl::Deregister(grpc::ServerContext*,
                                                const v1::DeregisterRequest* request,
                                                v1::DeregisterResponse*) {
  return ToGrpcStatus(members_->Deregister(request->member_id()));
}

grpc::Status CoordinatorServiceImpl::ReportHeat(grpc::ServerContext*, const v1::HeatReport* request,
                                                v1::HeatReportResponse*) {
  absl::StatusOr<v1::Job> job = jobs_->Get(request->job_id());
  if (!job.ok()) return ToGrpcStatus(job.status());
  return ToGrpcStatus(heat_->Report(*job, *request));
}

}  // namespace pith::coordinator
