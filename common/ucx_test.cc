// Two UCX workers in one process: active messages with replies, rendezvous payloads
// received straight into registered memory, refused payloads, and addresses refused
// before UCX reads them.
#include "common/ucx.h"

#include <arpa/inet.h>
#include <ifaddrs.h>

#include <cstring>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/ucx_address.h"
#include "gtest/gtest.h"

namespace pith::ucx {
namespace {

TEST(UcxTest, ActiveMessagesWithRepliesAndRendezvousPayloads) {
  auto server = Worker::Create();
  auto client = Worker::Create();
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE(client.ok()) << client.status();
  auto target = (*server)->Allocate(8 << 20);
  ASSERT_TRUE(target.ok()) << target.status();

  absl::Notification received, replied;
  std::string reply_text;
  (*server)->SetHandler(1, [&](AmMessage& m) {
    ASSERT_NE(m.reply_ep, nullptr);
    ASSERT_EQ(m.header, "put");
    ucp_ep_h reply_ep = m.reply_ep;
    const size_t length = m.length;
    (*server)->ReceiveData(
        m, (*target)->data(), (*target)->handle(), [&, reply_ep, length](absl::Status s) {
          EXPECT_TRUE(s.ok()) << s;
          (*server)->Send(reply_ep, 2, "got " + std::to_string(length), nullptr, 0, nullptr, false,
                          [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; });
          received.Notify();
        });
  });
  (*client)->SetHandler(2, [&](AmMessage& m) {
    reply_text = m.header;
    replied.Notify();
  });
  ASSERT_TRUE((*server)->Start().ok());
  ASSERT_TRUE((*client)->Start().ok());

  std::vector<uint8_t> payload(4 << 20);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<uint8_t>(i * 7);
  absl::Status connect_status;
  (*client)->RunSync([&] {
    auto ep = (*client)->Connect((*server)->address(), [](absl::Status s) { ADD_FAILURE() << s; });
    connect_status = ep.status();
    if (!ep.ok()) return;
    (*client)->Send(*ep, 1, "put", payload.data(), payload.size(), nullptr, true,
                    [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; });
  });
  ASSERT_TRUE(connect_status.ok()) << connect_status;
  ASSERT_TRUE(received.WaitForNotificationWithTimeout(absl::Seconds(20)));
  ASSERT_TRUE(replied.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(reply_text, "got " + std::to_string(payload.size()));
  EXPECT_EQ(std::memcmp((*target)->data(), payload.data(), payload.size()), 0);
  target->reset();
  (*client)->Stop();
  (*server)->Stop();
}

// Junk, truncated or damaged addresses are refused before UCX reads them; the worker goes
// on serving.
// UCX's network devices follow --listen: loopback stays on "lo", a host address on its
// interface, 0.0.0.0 on every device; "all" and explicit lists are taken as given.
TEST(UcxTest, NetDevicesFollowTheListenAddress) {
  EXPECT_EQ(UcxNetDevices("127.0.0.1:7100", "auto"), "lo");
  EXPECT_EQ(UcxNetDevices("0.0.0.0:7100", "auto"), "");
  EXPECT_EQ(UcxNetDevices("", "auto"), "");  // a worker without --listen
  EXPECT_EQ(UcxNetDevices("127.0.0.1:7100", "all"), "");
  EXPECT_EQ(UcxNetDevices("127.0.0.1:7100", "eth1,mlx5_0:1"), "eth1,mlx5_0:1");
  EXPECT_EQ(UcxNetDevices("192.0.2.77:7100", "auto"), "");  // not this host's: UCX decides
  ifaddrs* list = nullptr;
  ASSERT_EQ(::getifaddrs(&list), 0);
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char host[INET_ADDRSTRLEN];
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, host,
                sizeof(host));
    if (std::string(host).rfind("127.", 0) == 0) continue;
    const std::string devices = UcxNetDevices(std::string(host) + ":7100", "auto");
    EXPECT_EQ(devices.substr(0, devices.find(',')), a->ifa_name) << host;
  }
  ::freeifaddrs(list);
}

// A worker without --listen keeps UCX to the interface that reaches its coordinator.
TEST(UcxTest, TheLocalAddressTowardATargetIsTheOneItsRouteLeavesBy) {
  EXPECT_EQ(LocalAddressToward("127.0.0.1:7000"), "127.0.0.1:0");
  EXPECT_EQ(UcxNetDevices(LocalAddressToward("localhost:7000"), "auto"), "lo");
  EXPECT_EQ(LocalAddressToward("no-port"), "");
  EXPECT_EQ(LocalAddressToward(""), "");
}

TEST(UcxTest, BadAddressesAreRefusedBeforeUcxSeesThem) {
  auto worker = Worker::Create();
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->Start().ok());
  const std::string good = (*worker)->address();
  std::string damaged = good;
  damaged[damaged.size() / 2] ^= 0x5a;
  for (const std::string& bad :
       {std::string("x"), std::string(300, '\xff'), good.substr(0, good.size() - 1), damaged,
        std::string("PUCX") + std::string(20, '\0')}) {
    absl::Status connected;
    (*worker)->RunSync([&] { connected = (*worker)->Connect(bad, [](absl::Status) {}).status(); });
    EXPECT_EQ(connected.code(), absl::StatusCode::kInvalidArgument) << bad.size() << connected;
  }
  (*worker)->Stop();
  EXPECT_TRUE(UnwrapUcxAddress(good).ok());
  EXPECT_EQ(WrapUcxAddress(*UnwrapUcxAddress(good)), good);
}

}  // namespace
}  // namespace pith::ucx
