// Opening a gRPC channel to a Pith server with a deadline, so that an unreachable
// coordinator is one clear error instead of a hang.
//
// Thread safety: free function; the returned channel is thread-safe.
#ifndef PITH_CLIENT_CONNECTION_H_
#define PITH_CLIENT_CONNECTION_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "security/tls.h"

namespace pith {

// A connected channel to the coordinator at `address` ("host:port") with `security`
// (mutual TLS, where its certificate must name the coordinator's role: tls.h; or
// plaintext to loopback only). UNAVAILABLE, naming the address and the deadline, when no
// connection is up within `timeout`, and why: the host does not resolve, nothing listens
// (refused), nothing answers, or something takes TCP connections but no handshake comes
// up (a TLS server for a plaintext client, a certificate that does not fit). INVALID_ARGUMENT
// for an address that is not HOST:PORT (port 1 to 65535) or a plaintext one off this host.
absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address,
                                                    const security::TransportSecurity& security,
                                                    absl::Duration timeout);

}  // namespace pith

#endif  // PITH_CLIENT_CONNECTION_H_
