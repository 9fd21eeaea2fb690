// The data-plane tag: off until required, a message with the right tag passes, and one
// without it (or tagged for another message id, or with another key) is dropped and
// counted, in the process's total and through the metrics hook.
#include "common/ucx_auth.h"

#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace pith::ucx {
namespace {

TEST(UcxAuthTest, OnlyTheRightTagPassesAndEveryDropIsCounted) {
  int hooked = 0;
  OnUnauthenticatedDrop([&hooked] { ++hooked; });
  EXPECT_EQ(internal::Tag(3, "header"), "header");  // auth off: nothing added, all pass
  EXPECT_EQ(internal::Check(3, "header"), 6u);

  RequireDataPlaneAuth();  // no key yet: everything is dropped
  EXPECT_EQ(internal::Check(3, "header"), std::nullopt);
  EXPECT_EQ(hooked, 1);

  const std::string key = MakeDataPlaneKey();
  ASSERT_EQ(key.size(), kDataPlaneKeyBytes);
  SetDataPlaneKey(key);
  const std::string tagged = internal::Tag(3, "header");
  ASSERT_EQ(tagged.size(), 6 + kAuthTagBytes);
  EXPECT_EQ(internal::Check(3, tagged), 6u);
  EXPECT_EQ(internal::Check(4, tagged), std::nullopt);  // the tag covers the message id
  std::string flipped = tagged;
  flipped[0] ^= 1;
  EXPECT_EQ(internal::Check(3, flipped), std::nullopt);  // and the header
  SetDataPlaneKey(MakeDataPlaneKey());
  EXPECT_EQ(internal::Check(3, tagged), std::nullopt);  // and the key
  EXPECT_EQ(hooked, 4);
  EXPECT_EQ(DroppedUnauthenticated(), 4u);
  OnUnauthenticatedDrop(nullptr);
}

// The tag is HMAC-SHA256 of id (little-endian) || header, cut to kAuthTagBytes: RFC 4231's
// test case 2 (key "Jefe", data "what do ya want for nothing?") with the id as its first
// two bytes, on this thread and on a fresh one (each keeps its own context).
TEST(UcxAuthTest, TheTagIsRfc4231sHmacSha256OfIdAndHeader) {
  SetDataPlaneKey("Jefe");
  const uint16_t id = 'w' | ('h' << 8);
  const std::string header = "at do ya want for nothing?";
  const std::string expected = "\x5b\xdc\xc1\x46\xbf\x60\x75\x4e\x6a\x04\x24\x26\x08\x95\x75\xc7";
  std::string here = internal::Tag(id, header), there;
  std::thread([&] { there = internal::Tag(id, header); }).join();
  EXPECT_EQ(here, header + expected);
  EXPECT_EQ(internal::Tag(id, header), here);  // the context reset, not keyed again
  EXPECT_EQ(there, here);
  SetDataPlaneKey("another key");  // a thread's context takes the new key
  EXPECT_NE(internal::Tag(id, header), here);
  SetDataPlaneKey("Jefe");
  EXPECT_EQ(internal::Tag(id, header), here);
}

}  // namespace
}  // namespace pith::ucx
