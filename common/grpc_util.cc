#include "common/grpc_util.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/health_check_service_interface.h"

namespace pith {

GrpcServer::GrpcServer(std::unique_ptr<grpc::Server> server, int port)
    : server_(std::move(server)), port_(port) {}

GrpcServer::~GrpcServer() { Shutdown(absl::ZeroDuration()); }

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options) {
  // gRPC refuses to start a server without a service of its own to poll for.
  if (options.services.empty()) {
    return absl::InvalidArgumentError("gRPC: a server needs at least one service");
  }
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      options.listen_address,
      options.credentials != nullptr ? options.credentials : grpc::InsecureServerCredentials(),
      &port);
  // NOTE: without this a second process could bind the same port and silently take half
  // of the calls; Pith wants "address in use" instead.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  for (grpc::Service* service : options.services) builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("gRPC: cannot listen on ", options.listen_address));
  }
  return std::unique_ptr<GrpcServer>(new GrpcServer(std::move(server), port));
}

void GrpcServer::Shutdown(absl::Duration grace) {
  if (server_ == nullptr) return;
  server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
  server_->Wait();
  server_.reset();
}

}  // namespace pith
