// CoordinatorServiceImpl: the member-facing gRPC adapter — registration, heartbeats and
// leases, clean departure. Assignments, placement, heat reports and step commits answer
// UNIMPLEMENTED until the scheduler lands.
//
// Thread safety: handlers run concurrently; Membership is thread-safe.
#ifndef PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
#define PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_

#include "pith/v1/coordinator.grpc.pb.h"
#include "server/coordinator/membership.h"

namespace pith::coordinator {

class CoordinatorServiceImpl final : public v1::CoordinatorService::Service {
 public:
  explicit CoordinatorServiceImpl(Membership* members) : members_(members) {}

  grpc::Status Register(grpc::ServerContext*, const v1::RegisterRequest* request,
                        v1::RegisterResponse* reply) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* reply) override;
  grpc::Status Deregister(grpc::ServerContext*, const v1::DeregisterRequest* request,
                          v1::DeregisterResponse* reply) override;

 private:
  Membership* members_;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
