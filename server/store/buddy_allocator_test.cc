#include "server/store/buddy_allocator.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include "gtest/gtest.h"

namespace pith::store {
namespace {

TEST(BuddyAllocatorTest, SplitsAndCoalesces) {
  BuddyAllocator a(1 << 20, 4096, 1 << 20);  // one top block of 1 MiB
  EXPECT_EQ(a.capacity(), 1u << 20);
  auto x = a.Allocate(4096);
  auto y = a.Allocate(5000);  // rounds to 8 KiB
  ASSERT_TRUE(x && y);
  EXPECT_EQ(a.BlockSize(*y), 8192u);
  EXPECT_EQ(a.used(), 4096u + 8192u);
  EXPECT_FALSE(a.Allocate(1 << 20));  // the top block is split
  a.Free(*x);
  a.Free(*y);
  EXPECT_EQ(a.used(), 0u);
  auto whole = a.Allocate(1 << 20);  // coalesced back
  ASSERT_TRUE(whole);
  EXPECT_EQ(*whole, 0u);
  EXPECT_FALSE(a.Allocate(1));
  EXPECT_FALSE(a.Allocate(0));
  EXPECT_FALSE(a.Allocate((1 << 20) + 1));
}

TEST(BuddyAllocatorTest, RandomWorkloadNeverOverlapsAndReturnsEverything) {
  BuddyAllocator a(8 << 20, 4096, 1 << 20);
  std::mt19937 rng(1);
  std::map<uint64_t, uint64_t> live;  // offset -> block size
  for (int i = 0; i < 20000; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const uint64_t size = 1 + rng() % (300 << 10);
      auto off = a.Allocate(size);
      if (!off) continue;
      const uint64_t block = a.BlockSize(*off);
      ASSERT_GE(block, size);
      ASSERT_EQ(*off % block, 0u);  // buddy blocks are aligned to their size
      ASSERT_LE(*off + block, a.capacity());
      auto next = live.lower_bound(*off);
      if (next != live.end()) {
        ASSERT_LE(*off + block, next->first);
      }
      if (next != live.begin()) {
        auto prev = std::prev(next);
        ASSERT_LE(prev->first + prev->second, *off);
      }
      live[*off] = block;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      a.Free(it->first);
      live.erase(it);
    }
    uint64_t used = 0;
    for (auto& [o, b] : live) used += b;
    ASSERT_EQ(a.used(), used);
  }
  for (auto& [o, b] : live) a.Free(o);
  EXPECT_EQ(a.used(), 0u);
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(a.Allocate(1 << 20)) << i;  // fully coalesced
}

}  // namespace
}  // namespace pith::store
