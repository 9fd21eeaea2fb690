#include "client/connection.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"

namespace pith {

absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address,
                                                    absl::Duration timeout) {
  if (address.empty()) return absl::InvalidArgumentError("no server address given");
  std::shared_ptr<grpc::Channel> channel = NewChannel(address);
  if (!channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach ", address, " within ", absl::FormatDuration(timeout)));
  }
  return channel;
}

}  // namespace pith
