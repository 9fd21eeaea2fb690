// Two UCX workers in one process: active messages with replies, rendezvous payloads
// received straight into registered memory, refused payloads, and addresses refused
// before UCX reads them.
#include "common/ucx.h"

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
