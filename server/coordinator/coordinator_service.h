// CoordinatorServiceImpl: the member-facing gRPC adapter — registration, heartbeats and
// leases, clean departure, heat reports, assignments, placement and the step-commit
// protocol and store draining (the Scheduler).
//
// Thread safety: handlers run concurrently; Membership, JobRegistry, HeatRegistry and
// Scheduler are thread-safe.
#ifndef PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
#define PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_

#include <optional>
#include <string>

#include "pith/v1/coordinator.grpc.pb.h"
#include "security/authorize.h"
#include "server/coordinator/heat_registry.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {

// Members (data dirs, worker processes) one certificate may register, at most.
inline constexpr size_t kMaxIdentitiesPerCertificate = 16;

class CoordinatorServiceImpl final : public v1::CoordinatorService::Service {
 public:
  // `enforce`: the server runs mutual TLS, and CoordinatorPolicy decides who may call.
  // `tokens`: bearer tokens (an admin's may drain; security/tokens.h).
  CoordinatorServiceImpl(Membership* members, JobRegistry* jobs, HeatRegistry* heat,
                         Scheduler* scheduler, bool enforce = false,
                         security::Policy::TokenLookup tokens = nullptr)
      : members_(members),
        jobs_(jobs),
        heat_(heat),
        scheduler_(scheduler),
        policy_(CoordinatorPolicy(enforce, std::move(tokens))) {}

  // Members (stores, workers) call everything but DrainStore, which is an admin's.
  static security::Policy CoordinatorPolicy(bool enforce,
                                            security::Policy::TokenLookup tokens = nullptr);

  // The data-plane key Register hands each member (with TLS: §8). Call before serving.
  void set_data_plane_key(std::string key) { data_plane_key_ = std::move(key); }
  void set_cluster_id(std::string id) { cluster_id_ = std::move(id); }

  grpc::Status Register(grpc::ServerContext* context, const v1::RegisterRequest* request,
                        v1::RegisterResponse* reply) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* reply) override;
  grpc::Status Deregister(grpc::ServerContext* context, const v1::DeregisterRequest* request,
                          v1::DeregisterResponse* reply) override;
  grpc::Status ReportHeat(grpc::ServerContext* context, const v1::HeatReport* request,
                          v1::HeatReportResponse* reply) override;
  grpc::Status GetAssignment(grpc::ServerContext* context, const v1::GetAssignmentRequest* request,
                             v1::Assignment* reply) override;
  grpc::Status GetPlacement(grpc::ServerContext* context, const v1::GetPlacementRequest* request,
                            v1::PlacementTable* reply) override;
  grpc::Status ReportStepWritten(grpc::ServerContext* context,
                                 const v1::StepWrittenRequest* request,
                                 v1::StepWrittenResponse* reply) override;
  // Waits at most until the call's deadline, and never longer than 30 s.
  grpc::Status WaitStep(grpc::ServerContext* context, const v1::WaitStepRequest* request,
                        v1::StepStatus* reply) override;
  grpc::Status DrainStore(grpc::ServerContext* context, const v1::DrainStoreRequest* request,
                          v1::DrainStoreResponse* reply) override;

 private:
  Membership* members_;
  JobRegistry* jobs_;
  HeatRegistry* heat_;
  Scheduler* scheduler_;
  const security::Policy policy_;
  std::string data_plane_key_;
  std::string cluster_id_;  // RegisterResponse.cluster_id

  // With TLS, a member id named in a call must be the one the caller's certificate
  // registered (Register prefixes the member's identity with its certificate's name).
  grpc::Status CheckOwnId(const std::optional<security::Identity>& caller,
                          const std::string& member_id) const;
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_COORDINATOR_SERVICE_H_
