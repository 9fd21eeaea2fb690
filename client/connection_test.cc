#include "client/connection.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include "absl/time/clock.h"
#include "common/grpc_util.h"
#include "gtest/gtest.h"
#include "pith/v1/job.grpc.pb.h"

namespace pith {
namespace {

// A loopback port that nothing listens on: bound, then closed.
int UnusedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

TEST(DialTest, ConnectsToARunningServer) {
  v1::JobService::Service service;  // every RPC UNIMPLEMENTED; Dial only connects
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Dial("127.0.0.1:" + std::to_string((*server)->port()),
                      security::TransportSecurity::Insecure(), absl::Seconds(5));
  EXPECT_TRUE(channel.ok()) << channel.status();
}

TEST(DialTest, UnreachableServerFailsWithinTheDeadline) {
  const absl::Time start = absl::Now();
  auto channel = Dial("127.0.0.1:" + std::to_string(UnusedPort()),
                      security::TransportSecurity::Insecure(), absl::Milliseconds(500));
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(channel.ok());
  EXPECT_EQ(channel.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(channel.status().message().find("cannot reach 127.0.0.1:"), std::string::npos);
  EXPECT_NE(channel.status().message().find("connection refused: nothing listens there"),
            std::string::npos)
      << channel.status();
  EXPECT_LT(took, absl::Seconds(3));
}

// Something takes the TCP connection but speaks no gRPC (here: a socket that listens and
// never answers; as a TLS server does for a plaintext client).
TEST(DialTest, AListenerThatNeverHandshakesIsNamedAsSuch) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  auto channel = Dial("127.0.0.1:" + std::to_string(ntohs(addr.sin_port)),
                      security::TransportSecurity::Insecure(), absl::Milliseconds(500));
  ::close(fd);
  ASSERT_FALSE(channel.ok());
  EXPECT_NE(channel.status().message().find("it takes connections, but no plaintext gRPC"),
            std::string::npos)
      << channel.status();
}

TEST(DialTest, AnAddressThatIsNotHostPortIsInvalidAtOnce) {
  for (const char* bad : {"127.0.0.1", "127.0.0.1:", ":7000", "127.0.0.1:99999", "host:port",
                          "::1:7000", "[::1]7000", "127.0.0.1:+7000", "127.0.0.1:7000\r"}) {
    auto channel = Dial(bad, security::TransportSecurity::Insecure(), absl::Seconds(5));
    EXPECT_EQ(channel.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  const std::string port = std::to_string(UnusedPort());
  auto v6 = Dial("[::1]:" + port, security::TransportSecurity::Insecure(), absl::Milliseconds(300));
  EXPECT_EQ(v6.status().code(), absl::StatusCode::kUnavailable) << v6.status();
}

TEST(DialTest, EmptyAddressIsInvalid) {
  EXPECT_EQ(Dial("", security::TransportSecurity::Insecure(), absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pith
