// CoordinatorServiceImpl: the member-facing gRPC adapter — registration, heartbeats and
// leases, clean departure, heat reports. Assignments, placement and step commits answer
// UNIMPLEMENTED until the scheduler lands.
//
// Thread safety: handlers run concurrently; Membership is thread-safe.
#ifndef PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
#define PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_

#include "pith/v1/coordinator.grpc.pb.h"
#include "server/coordinator/heat_registry.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/membership.h"

namespace pith::coordinator {

class CoordinatorServiceImpl final : public v1::CoordinatorService::Service {
 public:
  CoordinatorServiceImpl(Membership* members, JobRegistry* jobs, HeatRegistry* heat)
      : members_(members), jobs_(jobs), heat_(heat) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* request,
                        v1::RegisterResponse* reply) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* reply) override;
  grpc::Status Deregister(grpc::ServerContext*, const v1::DeregisterRequest* request,
                          v1::DeregisterResponse* reply) override;
  grpc::Status ReportHeat(grpc::ServerContext*, const v1::HeatReport* request,
                          v1::HeatReportResponse* reply) override;

 private:
  Membership* members_;
  JobRegistry* jobs_;
  HeatRegistry* heat_;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
