// The StoreControl the coordinator runs with: the stores' gRPC StoreService for commits,
// aborts, listings and pulls, and a UCX StoreClient for reads (checkpoint export).
//
// Thread safety: the returned object is thread-safe (channels and the UCX client are
// created once under its own lock and shared).
#ifndef PITH_SERVER_COORDINATOR_GRPC_STORE_CONTROL_H_
#define PITH_SERVER_COORDINATOR_GRPC_STORE_CONTROL_H_

#include <memory>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "server/coordinator/store_control.h"

namespace pith::coordinator {

// StoreControl over the stores' gRPC StoreService, each call bounded by `timeout`, on
// channels with `credentials` (the coordinator's mutual TLS, or plaintext).
std::unique_ptr<StoreControl> NewGrpcStoreControl(
    absl::Duration timeout, std::shared_ptr<grpc::ChannelCredentials> credentials);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_GRPC_STORE_CONTROL_H_
