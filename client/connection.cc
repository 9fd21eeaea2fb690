#include "client/connection.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/status.h"

namespace pith {

absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address,
                                                    const security::TransportSecurity& security,
                                                    absl::Duration timeout) {
  if (address.empty()) return absl::InvalidArgumentError("no server address given");
  RETURN_IF_ERROR(security.CheckDial(address));
  std::shared_ptr<grpc::Channel> channel = NewChannel(address, security.ChannelCredentials());
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::UnavailableError(absl::StrCat(
        "cannot reach ", address, " within ", absl::FormatDuration(timeout),
        security.tls() ? " (or the TLS handshake failed: is it a TLS server whose certificate "
                         "names this address, from the CA of --tls_dir?)"
                       : " (or it serves TLS, which a plaintext client cannot reach: is "
                         "--tls_dir missing?)"));
  }
  return channel;
}

}  // namespace pith
