#include "security/client_limits.h"

#include "gtest/gtest.h"

namespace pith::security {
namespace {

class ClientLimitsTest : public ::testing::Test {
 protected:
  absl::Time now_ = absl::FromUnixSeconds(1000);
  ClientLimits limits_{{.requests_per_second = 10, .burst = 5, .streams = 2},
                       [this] { return now_; }};
};

TEST_F(ClientLimitsTest, ABurstThenTheSustainedRateEachClientOnItsOwn) {
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(limits_.Admit("alice (user)").ok()) << i;
  absl::Status over = limits_.Admit("alice (user)");
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find("alice (user) makes more than 10 requests a second"),
            std::string::npos)
      << over;
  EXPECT_TRUE(limits_.Admit("bob (user)").ok());  // another client's budget is its own
  now_ += absl::Milliseconds(100);                // one request's worth comes back
  EXPECT_TRUE(limits_.Admit("alice (user)").ok());
  EXPECT_FALSE(limits_.Admit("alice (user)").ok());
  now_ += absl::Seconds(60);  // never more than the burst
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(limits_.Admit("alice (user)").ok()) << i;
  EXPECT_FALSE(limits_.Admit("alice (user)").ok());
}

TEST_F(ClientLimitsTest, StreamsAreCountedUntilTheirSlotsGo) {
  auto a = limits_.OpenStream("alice (user)");
  auto b = limits_.OpenStream("alice (user)");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(limits_.OpenStream("alice (user)").status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(limits_.OpenStream("bob (user)").ok());
  *a = ClientLimits::StreamSlot();  // a watch ends
  EXPECT_TRUE(limits_.OpenStream("alice (user)").ok());
}

TEST_F(ClientLimitsTest, AFloodOfClientsCostsBoundedMemory) {
  for (size_t i = 0; i < kMaxTrackedClients + 500; ++i) {
    (void)limits_.Admit("host-" + std::to_string(i));
  }
  EXPECT_LE(limits_.tracked(), kMaxTrackedClients);
}

}  // namespace
}  // namespace pith::security
