#include "common/grpc_status.h"

#include <string>

namespace pith {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::shared_ptr<grpc::Channel> NewChannel(const std::string& address,
                                          std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kDefaultMaxMessageBytes);
  args.SetMaxSendMessageSize(kDefaultMaxMessageBytes);
  // Reconnect within 2 s of a peer's return, however long it was gone: gRPC's default
  // backoff grows to 120 s, which after a coordinator restart kept members (leases of a
  // few seconds) and their jobs waiting for minutes. One connection attempt per channel
  // every 2 s at most is nothing to a Pith server.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 500);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  return grpc::CreateCustomChannel(address, std::move(credentials), args);
}

}  // namespace pith
