// PlanMemory: a budget bounds the pools whatever the number of experts; a budget too small
// for the dense state says what does not fit; no budget keeps everything resident.
#include "worker/runtime/memory_plan.h"

#include "gtest/gtest.h"

namespace pith::runtime {
namespace {

MemoryInput Input(int owned) {
  MemoryInput in;
  in.dense_bytes = 4 << 20;
  in.activation_bytes = 2 << 20;
  in.expert_bytes = 64 << 10;
  in.owned = owned;
  in.updated = owned;
  return in;
}

TEST(MemoryPlanTest, ABudgetHoldsWhateverTheExperts) {
  for (int owned : {16, 1024, 65536}) {
    MemoryInput in = Input(owned);
    in.memory_bytes = 16 << 20;
    auto plan = PlanMemory(in);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_LE(plan->total(), in.memory_bytes) << owned;
    EXPECT_GE(plan->cache_slots, 2);
    EXPECT_GE(plan->grad_buffers, 2);
    if (owned >= 1024) {
      EXPECT_FALSE(plan->moments.resident);
      EXPECT_GT(plan->total(), in.memory_bytes * 9 / 10) << "the budget is used";
    }
  }
}

TEST(MemoryPlanTest, ALargeBudgetKeepsEverythingResident) {
  MemoryInput in = Input(16);
  in.memory_bytes = 1ull << 30;
  auto plan = PlanMemory(in);
  ASSERT_TRUE(plan.ok());
  EXPECT_EQ(plan->cache_slots, 17);
  EXPECT_EQ(plan->grad_buffers, 17);
  EXPECT_TRUE(plan->moments.resident);
  EXPECT_EQ(plan->moment_bytes, 2u * 16 * (64 << 10));
}

// A cache budget beside a memory budget caps the cache within it (the job asked for a
// small cache: it gets one, however much memory the worker has).
TEST(MemoryPlanTest, ACacheBudgetCapsTheCacheWithinAMemoryBudget) {
  MemoryInput in = Input(16);
  in.memory_bytes = 1ull << 30;
  in.cache_bytes = 4 * (64 << 10);
  auto plan = PlanMemory(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->cache_slots, 4);
  // The memory budget holds every moment, but resident moments hold a slot per expert
  // updated while the next step computes: with 4 slots for 16 experts they are fetched.
  EXPECT_FALSE(plan->moments.resident);
  EXPECT_LE(plan->total(), in.memory_bytes);
  // 20 computed, 16 updated: a slot for each updated one and one more is enough.
  in.owned = 20;
  in.cache_bytes = 17 * (64 << 10);
  auto roomy = PlanMemory(in);
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  EXPECT_EQ(roomy->cache_slots, 17);
  EXPECT_TRUE(roomy->moments.resident);
  in.cache_bytes = 16 * (64 << 10);
  auto tight = PlanMemory(in);
  ASSERT_TRUE(tight.ok()) << tight.status();
  EXPECT_EQ(tight->cache_slots, 16);
  EXPECT_FALSE(tight->moments.resident);
  in.owned = 16;
  in.memory_bytes = 16 << 20;  // and the memory budget caps it in turn
  in.cache_bytes = 1ull << 30;
  auto small = PlanMemory(in);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_LE(small->total(), in.memory_bytes);
  EXPECT_GE(small->cache_slots, 2);
}

TEST(MemoryPlanTest, NoBudgetOrACacheBudget) {
  MemoryInput in = Input(100);
  auto none = PlanMemory(in);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->cache_slots, 101);
  EXPECT_TRUE(none->moments.resident);
  in.cache_bytes = 10 * (64 << 10);
  auto cache = PlanMemory(in);
  ASSERT_TRUE(cache.ok());
  EXPECT_EQ(cache->cache_slots, 10);
  EXPECT_EQ(cache->grad_buffers, 10);
  EXPECT_FALSE(cache->moments.resident);
  EXPECT_EQ(cache->moments.batch, 1);
  EXPECT_EQ(cache->moments.ring, 4);
}

// A bf16 job: its cache slots hold the bf16 weights blob (about half an expert), its
// update buffers the fp32 master beside both moments.
TEST(MemoryPlanTest, Bf16SlotsAreSmallerAndTheMasterIsCounted) {
  MemoryInput in = Input(1024);
  in.memory_bytes = 16 << 20;
  auto fp32 = PlanMemory(in);
  ASSERT_TRUE(fp32.ok());
  in.slot_bytes = in.expert_bytes / 2 + 64;
  in.moment_kinds = 3;
  auto bf16 = PlanMemory(in);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_LE(bf16->total(), in.memory_bytes);
  EXPECT_GT(bf16->total(), in.memory_bytes * 9 / 10) << "the budget is used";
  EXPECT_GT(bf16->cache_slots, fp32->cache_slots);
  EXPECT_EQ(bf16->cache_bytes, bf16->cache_slots * in.slot_bytes);
  EXPECT_EQ(bf16->moment_bytes, 3 * in.expert_bytes * bf16->moments.ring * bf16->moments.batch);

  MemoryInput roomy = Input(16);
  roomy.memory_bytes = 1ull << 30;
  roomy.slot_bytes = roomy.expert_bytes / 2;
  roomy.moment_kinds = 3;
  auto resident = PlanMemory(roomy);
  ASSERT_TRUE(resident.ok());
  EXPECT_TRUE(resident->moments.resident);
  EXPECT_EQ(resident->moment_bytes, 3u * 16 * (64 << 10));
  EXPECT_EQ(resident->cache_bytes, 17u * (32 << 10));
}

TEST(MemoryPlanTest, ABudgetBelowTheDenseStateSaysWhy) {
  MemoryInput in = Input(16);
  in.memory_bytes = 5 << 20;
  auto plan = PlanMemory(in);
  ASSERT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(plan.status().message().find("--memory_bytes=5242880"), std::string::npos)
      << plan.status();
  EXPECT_NE(plan.status().message().find("dense state (4194304 bytes"), std::string::npos)
      << plan.status();
}

}  // namespace
}  // namespace pith::runtime
