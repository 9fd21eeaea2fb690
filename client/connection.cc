#include "client/connection.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_util.h"
#include "common/status.h"

namespace pith {
namespace {

// An open socket, closed when it goes.
struct Socket {
  explicit Socket(int fd) : fd(fd) {}
  ~Socket() {
    if (fd >= 0) ::close(fd);
  }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  const int fd;
};

// Whether a TCP connection to `a` is taken within `timeout`: 0, else the errno that says
// why not (ETIMEDOUT when nothing answered).
int TryConnect(const addrinfo& a, absl::Duration timeout) {
  const Socket s(
      ::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol));
  if (s.fd < 0) return errno;
  if (::connect(s.fd, a.ai_addr, a.ai_addrlen) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  const absl::Time deadline = absl::Now() + timeout;
  pollfd p{s.fd, POLLOUT, 0};
  int ready;
  do {
    ready = ::poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now())));
  } while (ready < 0 && errno == EINTR && absl::Now() < deadline);
  if (ready != 1) return ETIMEDOUT;
  int error = 0;
  socklen_t len = sizeof(error);
  if (::getsockopt(s.fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) return errno;
  return error;
}

// Why no gRPC connection came up at host:port: empty when a TCP connection is taken
// there (something listens: the handshake is what failed), else what stops it.
std::string WhyUnreached(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_ADDRCONFIG | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::StrCat("cannot resolve ", host, " (", ::gai_strerror(rc), ")");
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> own(found, &::freeaddrinfo);
  bool refused = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(1);  // for all of them
  for (const addrinfo* a = found; a != nullptr && absl::Now() < deadline; a = a->ai_next) {
    const int error = TryConnect(*a, deadline - absl::Now());
    if (error == 0) return "";
    refused = refused || error == ECONNREFUSED;
  }
  return refused ? "connection refused: nothing listens there"
                 : "no answer (the host is down, or a firewall drops the connection)";
}

// `address` split into host and port: "host:port" or "[v6]:port", the port 1 to 65535.
absl::Status SplitHostPort(const std::string& address, std::string* host, std::string* port) {
  const size_t colon = address.rfind(':');
  const bool bracketed = absl::StartsWith(address, "[");
  if (colon == std::string::npos || colon == 0 ||
      (bracketed ? address[colon - 1] != ']' : address.find(':') != colon)) {
    return absl::InvalidArgumentError(
        absl::StrCat(address, " is not HOST:PORT",
                     std::count(address.begin(), address.end(), ':') > 1
                         ? " (an IPv6 address goes in brackets: [ADDRESS]:PORT)"
                         : ""));
  }
  *host = bracketed ? address.substr(1, colon - 2) : address.substr(0, colon);
  *port = address.substr(colon + 1);
  int number = 0;
  if (port->empty() || port->size() > 5 ||
      port->find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(*port, &number) || number < 1 || number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("the port of ", address, " is not a number from 1 to 65535"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address,
                                                    const security::TransportSecurity& security,
                                                    absl::Duration timeout) {
  if (address.empty()) return absl::InvalidArgumentError("no server address given");
  std::string host, port;
  RETURN_IF_ERROR(SplitHostPort(address, &host, &port));
  RETURN_IF_ERROR(security.CheckDial(address));
  std::shared_ptr<grpc::Channel> channel =
      NewChannel(address, security.ChannelCredentials(security::Role::kCoordinator));
  if (channel->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout))) return channel;
  const std::string why = WhyUnreached(host, port);
  if (!why.empty()) {
    return absl::UnavailableError(absl::StrCat("cannot reach ", address, " within ",
                                               absl::FormatDuration(timeout), ": ", why));
  }
  return absl::UnavailableError(absl::StrCat(
      "cannot reach ", address, " within ", absl::FormatDuration(timeout),
      security.tls() ? ": it takes connections, but no TLS handshake with the coordinator came "
                       "up (is it this cluster's coordinator, its certificate of the CA of "
                       "--tls_dir, naming this address?)"
                     : ": it takes connections, but no plaintext gRPC answers (a TLS server? "
                       "is --tls_dir missing?)"));
}

}  // namespace pith
