// The RPC boundary's status conversion and message size, apart from the server glue in
// grpc_util.h, so that the job-API SDK (client/) needs only gRPC and Abseil.
//
// Thread safety: free functions and constants.
#ifndef PITH_COMMON_GRPC_STATUS_H_
#define PITH_COMMON_GRPC_STATUS_H_

#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace pith {

// absl::Status <-> grpc::Status, keeping code and message. Only RPC adapters call these.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// A handler's answer: `result` moved into `*reply`, or its error.
template <typename T>
grpc::Status ToGrpcReply(absl::StatusOr<T> result, T* reply) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *reply = *std::move(result);
  return grpc::Status::OK;
}

// Message size limit of Pith's control plane. Bulk tensors travel over UCX, not gRPC.
inline constexpr int kDefaultMaxMessageBytes = 64 << 20;

// A channel to `address` with `credentials` (mutual TLS or plaintext: see
// security/tls.h) that sends and receives messages up to kDefaultMaxMessageBytes, like
// Pith's servers (gRPC's own default receive limit is 4 MiB: a large job's assignment
// would not arrive), and that reconnects within 2 s of the peer's return. Every Pith
// channel is made here.
std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                          std::shared_ptr<grpc::ChannelCredentials> credentials);

}  // namespace pith

#endif  // PITH_COMMON_GRPC_STATUS_H_
