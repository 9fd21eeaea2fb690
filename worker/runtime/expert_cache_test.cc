// ExpertCache: hits and LRU reuse, pinning, every slot pinned, fetch errors, the
// prefetcher fetching ahead of a consumer that follows the schedule, a layer's experts
// taken in the order they are ready, and compute waiting for updates in flight.
#include "worker/runtime/expert_cache.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pith::runtime {
namespace {

constexpr size_t kSlotBytes = 4096;

class ExpertCacheTest : public ::testing::Test {
 protected:
  void SetUp() override { worker_ = *ucx::Worker::Create(); }
  void TearDown() override {
    cache_.reset();
    worker_.reset();
  }
  void Open(int slots, absl::Duration fetch_time = absl::ZeroDuration()) {
    auto memory = worker_->Allocate(kSlotBytes * slots);
    ASSERT_TRUE(memory.ok());
    auto cache = ExpertCache::Create(
        std::move(*memory), kSlotBytes, slots,
        [this, fetch_time](absl::Span<ExpertCache::FetchRequest> requests, size_t bytes,
                           ucp_mem_h) {
          ++calls_;
          largest_call_ = std::max<int>(largest_call_, static_cast<int>(requests.size()));
          absl::SleepFor(fetch_time);
          absl::Status first;
          for (ExpertCache::FetchRequest& r : requests) {
            ++fetches_;
            {
              absl::MutexLock lock(&fetched_mu_);
              ++fetched_[r.expert];
            }
            if (r.updating) ++updating_fetches_;
            if (r.expert.first < 0) {
              r.status = absl::NotFoundError("no such expert");
              first.Update(r.status);
              continue;
            }
            float* f = static_cast<float*>(r.dst);
            for (size_t i = 0; i < bytes / sizeof(float); ++i)
              f[i] = r.expert.first * 100.0f + r.expert.second;
          }
          return first;
        });
    ASSERT_TRUE(cache.ok()) << cache.status();
    cache_ = std::move(*cache);
  }
  float Read(ExpertCache::Expert x) {
    auto w = cache_->Acquire(x);
    EXPECT_TRUE(w.ok()) << w.status();
    const float v = w.ok() ? (*w)[kSlotBytes / sizeof(float) - 1] : -1;
    cache_->Release(x);
    return v;
  }
  // Takes every one of `layer`'s experts with AcquireAny, as compute does (each checked to
  // hold its own weights, then released); returns their expert numbers in the order taken.
  std::vector<int> TakeLayer(std::vector<ExpertCache::Expert> layer) {
    std::vector<int> order;
    while (!layer.empty()) {
      auto got = cache_->AcquireAny(layer);
      EXPECT_TRUE(got.ok()) << got.status();
      if (!got.ok()) break;
      const auto [i, w] = *got;
      const ExpertCache::Expert x = layer[i];
      EXPECT_EQ(w[0], x.first * 100.0f + x.second);
      order.push_back(x.second);
      cache_->Release(x);
      layer.erase(layer.begin() + static_cast<std::ptrdiff_t>(i));
    }
    return order;
  }

  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<ExpertCache> cache_;
  std::atomic<int> fetches_{0};           // experts fetched
  std::atomic<int> calls_{0};             // fetch calls (the prefetcher's take several)
  std::atomic<int> largest_call_{0};      // experts in the largest call
  std::atomic<int> updating_fetches_{0};  // fetches told an update is in flight
  absl::Mutex fetched_mu_;
  std::map<ExpertCache::Expert, int> fetched_ ABSL_GUARDED_BY(fetched_mu_);  // times each
};

TEST_F(ExpertCacheTest, HitsMissesAndLeastRecentlyUsedReuse) {
  Open(2);
  EXPECT_EQ(Read({0, 1}), 1.0f);
  EXPECT_EQ(Read({0, 2}), 2.0f);
  EXPECT_EQ(Read({0, 1}), 1.0f);  // hit
  EXPECT_EQ(fetches_.load(), 2);
  EXPECT_EQ(Read({1, 3}), 103.0f);  // evicts (0, 2), the least recently used
  EXPECT_EQ(Read({0, 1}), 1.0f);    // still there
  EXPECT_EQ(fetches_.load(), 3);
  const ExpertCache::Stats s = cache_->stats();
  EXPECT_EQ(s.hits, 2u);
  EXPECT_EQ(s.misses, 3u);
  EXPECT_EQ(s.resident_bytes, 2 * kSlotBytes);
  // A failed fetch is an error, and leaves no entry behind.
  EXPECT_EQ(cache_->Acquire({-1, 0}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->Acquire({-1, 0}).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ExpertCacheTest, CountsEachExpertsFetchesUntilTaken) {
  Open(2);
  Read({0, 1});
  Read({0, 2});
  Read({0, 1});  // a hit: no fetch
  Read({1, 3});  // evicts (0, 2)
  Read({0, 2});  // fetched again
  using Counts = std::map<ExpertCache::Expert, uint64_t>;
  EXPECT_EQ(cache_->TakeFetchCounts(), (Counts{{{0, 1}, 1}, {{0, 2}, 2}, {{1, 3}, 1}}));
  EXPECT_EQ(cache_->TakeFetchCounts(), Counts{});
}

TEST_F(ExpertCacheTest, PinnedSlotsAreNeverReused) {
  Open(2);
  auto a = cache_->Acquire({0, 0});
  auto b = cache_->Acquire({0, 1});
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(cache_->Acquire({0, 2}).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*a)[0], 0.0f);
  cache_->Release({0, 0});
  EXPECT_EQ(Read({0, 2}), 2.0f);  // took (0, 0)'s slot
  EXPECT_EQ((*b)[0], 1.0f);       // (0, 1) stayed put
  cache_->Release({0, 1});
}

TEST_F(ExpertCacheTest, ThePrefetcherFetchesSeveralExpertsPerCall) {
  // Eight slots, a schedule of 16 experts read slowly: the prefetcher fills the free slots
  // several at a time, never more than kPrefetchBatch per call.
  Open(8, absl::Milliseconds(5));
  std::vector<ExpertCache::Expert> order;
  for (int e = 0; e < 16; ++e) order.push_back({1, e});
  cache_->SetSchedule(order);
  absl::SleepFor(absl::Milliseconds(100));  // the first slots fill before compute starts
  for (const auto& x : order) {
    EXPECT_EQ(Read(x), 100.0f + x.second);
    absl::SleepFor(absl::Milliseconds(5));
  }
  EXPECT_EQ(fetches_.load(), 16);
  EXPECT_LT(calls_.load(), 16);
  EXPECT_GT(largest_call_.load(), 1);
  EXPECT_LE(largest_call_.load(), ExpertCache::kPrefetchBatch);
}

TEST_F(ExpertCacheTest, OneFailedExpertOfAPrefetchLeavesTheOthers) {
  // The prefetcher asks for a missing expert together with good ones: the good ones land,
  // the missing one is an error for the consumer that reads it.
  Open(4, absl::Milliseconds(5));
  cache_->SetSchedule({{0, 1}, {-1, 0}, {0, 2}, {0, 3}});
  // Until the prefetcher has fetched the good ones (a loaded machine may take longer than
  // the 5 ms a fetch lasts here), then a moment for them to be marked resident.
  const auto fetched = [&] {
    absl::MutexLock lock(&fetched_mu_);
    return fetched_.count({0, 1}) && fetched_.count({0, 2}) && fetched_.count({0, 3});
  };
  for (int i = 0; i < 500 && !fetched(); ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(Read({0, 1}), 1.0f);
  EXPECT_EQ(cache_->Acquire({-1, 0}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Read({0, 2}), 2.0f);
  EXPECT_EQ(Read({0, 3}), 3.0f);
  // The good ones were all prefetched: every read of them a hit.
  const ExpertCache::Stats st = cache_->stats();
  EXPECT_EQ(st.hits, 3u);
  EXPECT_EQ(st.prefetch_hits, 3u);
  EXPECT_GT(largest_call_.load(), 1);
}

TEST_F(ExpertCacheTest, ExpectedExpertsAreFetchedFirst) {
  // The schedule guessed wrong (last step's routing); the layer's routing says which
  // experts come now: the prefetcher fetches them at once, in one call.
  Open(4, absl::Milliseconds(5));
  cache_->SetSchedule({{2, 0}, {2, 1}});
  absl::SleepFor(absl::Milliseconds(50));
  const int calls = calls_.load();
  const std::vector<ExpertCache::Expert> now = {{2, 5}, {2, 6}, {2, 7}};
  cache_->Expect(2, now);
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(calls_.load(), calls + 1);
  for (const auto& x : now) EXPECT_EQ(Read(x), 200.0f + x.second);
  const ExpertCache::Stats st = cache_->stats();
  EXPECT_EQ(st.prefetch_hits, 3u);
  EXPECT_EQ(st.misses, 0u);
}

TEST_F(ExpertCacheTest, ExpectReplacesTheLayersGuesses) {
  // Guesses for two layers fill three of the four slots; each layer's routing then
  // replaces its guesses: the prefetcher fetches the routed experts, never the stale guesses again.
  Open(4, absl::Milliseconds(5));
  cache_->SetSchedule({{0, 0}, {0, 1}, {1, 0}, {1, 1}});
  absl::SleepFor(absl::Milliseconds(60));
  EXPECT_EQ(fetches_.load(), 3);  // a slot's worth ahead, less one
  const std::vector<ExpertCache::Expert> layer0 = {{0, 2}, {0, 3}}, layer1 = {{1, 2}, {1, 3}};
  cache_->Expect(0, layer0);
  absl::SleepFor(absl::Milliseconds(60));
  for (const auto& x : layer0) EXPECT_EQ(Read(x), static_cast<float>(x.second));
  cache_->Expect(1, layer1);
  absl::SleepFor(absl::Milliseconds(60));
  for (const auto& x : layer1) EXPECT_EQ(Read(x), 100.0f + x.second);
  absl::SleepFor(absl::Milliseconds(60));
  // 3 guesses and 4 routed experts, and the last guess of layer 1 when the prefetcher had a
  // free slot before layer 1's routing came (a slow machine); nothing fetched twice.
  EXPECT_GE(fetches_.load(), 7);
  EXPECT_LE(fetches_.load(), 8);
  {
    absl::MutexLock lock(&fetched_mu_);
    for (const auto& [x, n] : fetched_) EXPECT_EQ(n, 1) << x.first << "/" << x.second;
  }
  const ExpertCache::Stats st = cache_->stats();
  EXPECT_EQ(st.misses, 0u);
  EXPECT_EQ(st.prefetch_hits, 4u);
}

TEST_F(ExpertCacheTest, ThePrefetcherFetchesAheadOfTheSchedule) {
  Open(3, absl::Milliseconds(20));
  std::vector<ExpertCache::Expert> order;
  for (int e = 0; e < 8; ++e) order.push_back({0, e});
  cache_->SetSchedule(order);
  for (const auto& x : order) {
    EXPECT_EQ(Read(x), static_cast<float>(x.second));
    absl::SleepFor(absl::Milliseconds(25));  // compute while the next one arrives
  }
  const ExpertCache::Stats s = cache_->stats();
  EXPECT_GE(s.prefetch_hits, 5u) << "hits " << s.hits << " misses " << s.misses;
  EXPECT_EQ(s.hits + s.misses, 8u);
}

TEST_F(ExpertCacheTest, AcquireAnyTakesAResidentExpertBeforeOneOnItsWay) {
  // A layer's experts: the second and fourth are resident, the first is being fetched
  // (slowly); compute takes the resident ones first and the first last.
  Open(4, absl::Milliseconds(80));
  EXPECT_EQ(Read({1, 1}), 101.0f);
  EXPECT_EQ(Read({1, 3}), 103.0f);
  const int fetched = fetches_.load();
  std::vector<ExpertCache::Expert> layer = {{1, 0}, {1, 1}, {1, 3}};
  cache_->SetSchedule(layer);
  absl::SleepFor(absl::Milliseconds(20));  // the prefetcher is on (1, 0) now
  EXPECT_EQ(TakeLayer(layer), (std::vector<int>{1, 3, 0}));
  EXPECT_EQ(fetches_.load(), fetched + 1);  // (1, 0), once
  const ExpertCache::Stats st = cache_->stats();
  EXPECT_EQ(st.hits + st.misses, 5u);
}

TEST_F(ExpertCacheTest, AcquireAnyTakesAnUpdatedExpertFirstAndFetchesWhenNothingComes) {
  Open(4);
  // Nothing resident, nothing on its way: the first, fetched here.
  std::vector<ExpertCache::Expert> layer = {{0, 0}, {0, 1}};
  auto first = cache_->AcquireAny(layer);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->first, 0u);
  cache_->Release({0, 0});
  EXPECT_EQ(Read({0, 1}), 1.0f);
  // Both resident, the first waits for its update: the second is taken, then the first
  // once updated.
  cache_->BeginUpdates({{0, 0}});
  auto second = cache_->AcquireAny(layer);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->first, 1u);
  cache_->Release({0, 1});
  std::thread update([&] {
    absl::SleepFor(absl::Milliseconds(30));
    auto w = cache_->AcquireForUpdate({0, 0});
    EXPECT_TRUE(w.ok()) << w.status();
    if (w.ok()) {
      (*w)[0] = 7.0f;
      cache_->Release({0, 0});
    }
    cache_->Updated({0, 0});  // whatever happened: the take below must not hang
  });
  auto third = cache_->AcquireAny(absl::MakeConstSpan(layer).subspan(0, 1));
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(third->second[0], 7.0f);  // after its update
  cache_->Release({0, 0});
  update.join();
  cache_->EndUpdates(absl::OkStatus());
}

TEST_F(ExpertCacheTest, AcquireAnyDropsTheLayersEntriesNotComputedHere) {
  // The backward's schedule names (1, 3), which has no rows here this step (a replica's
  // share of none): taking the layer's other two moves the consumer on to the next
  // layer, whose (0, 2) the prefetcher then fetches.
  Open(3, absl::Milliseconds(10));
  EXPECT_EQ(Read({1, 1}), 101.0f);
  EXPECT_EQ(Read({1, 5}), 105.0f);
  cache_->SetSchedule({{1, 5}, {1, 3}, {1, 1}, {0, 2}});
  TakeLayer({{1, 5}, {1, 1}});
  absl::SleepFor(absl::Milliseconds(100));
  const ExpertCache::Stats before = cache_->stats();
  EXPECT_EQ(Read({0, 2}), 2.0f);
  EXPECT_EQ(cache_->stats().prefetch_hits, before.prefetch_hits + 1);
}

TEST_F(ExpertCacheTest, AcquireAnyLeavesTheUpdatesEntriesAfterTheBackward) {
  // The backward's last layer, (0, 3) and (0, 1), is followed by the updates' entries of
  // the same layer, (0, 2) among them (updated here, no rows here this step): taking the
  // backward's two leaves them, so the prefetcher fetches (0, 2) for its update.
  Open(3, absl::Milliseconds(10));
  EXPECT_EQ(Read({0, 3}), 3.0f);
  EXPECT_EQ(Read({0, 1}), 1.0f);
  cache_->SetSchedule({{0, 3}, {0, 1}, {0, 2}, {0, 3}});
  TakeLayer({{0, 3}, {0, 1}});
  absl::SleepFor(absl::Milliseconds(100));
  const ExpertCache::Stats before = cache_->stats();
  auto w = cache_->AcquireForUpdate({0, 2});
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ((*w)[0], 2.0f);
  cache_->Release({0, 2});
  EXPECT_EQ(cache_->stats().prefetch_hits, before.prefetch_hits + 1);
}

TEST_F(ExpertCacheTest, ComputeWaitsForAnUpdateInFlight) {
  Open(4);
  const std::vector<ExpertCache::Expert> updating = {{0, 1}, {0, 2}};
  cache_->BeginUpdates(updating);
  EXPECT_EQ(Read({0, 3}), 3.0f);  // not being updated: no wait
  std::atomic<bool> read{false};
  float seen = -1;
  std::thread compute([&] {
    auto w = cache_->Acquire({0, 1});
    ASSERT_TRUE(w.ok()) << w.status();
    seen = (*w)[0];
    read = true;
    cache_->Release({0, 1});
  });
  // The update's own read does not wait; it changes the weights in place.
  auto w = cache_->AcquireForUpdate({0, 1});
  ASSERT_TRUE(w.ok()) << w.status();
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(read.load());  // compute still waits for the update
  (*w)[0] = 42.0f;
  cache_->Updated({0, 1});
  compute.join();
  EXPECT_EQ(seen, 42.0f);  // it read the updated weights, not the fetched ones
  cache_->Release({0, 1});
  // The backward waits for every update.
  std::atomic<bool> awaited{false};
  std::thread backward([&] {
    EXPECT_TRUE(cache_->AwaitUpdates().ok());
    awaited = true;
  });
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(awaited.load());
  cache_->Updated({0, 2});
  backward.join();
  cache_->EndUpdates(absl::OkStatus());
  EXPECT_TRUE(cache_->AwaitUpdates().ok());
}

TEST_F(ExpertCacheTest, AFailedUpdateLeavesItsExpertsUnreadable) {
  Open(4);
  const std::vector<ExpertCache::Expert> updating = {{0, 1}, {0, 2}};
  cache_->BeginUpdates(updating);
  std::thread compute([&] {
    EXPECT_EQ(cache_->Acquire({0, 2}).status().code(), absl::StatusCode::kUnavailable);
  });
  cache_->Updated({0, 1});
  EXPECT_EQ(Read({0, 1}), 1.0f);
  cache_->EndUpdates(absl::UnavailableError("a store went away"));
  compute.join();
  EXPECT_EQ(cache_->AwaitUpdates().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(cache_->Acquire({0, 2}).status().code(), absl::StatusCode::kUnavailable);
  // An update that ends "OK" with experts left over is a bug, not a silent stale read.
  cache_->BeginUpdates(updating);
  cache_->Updated({0, 1});
  cache_->EndUpdates(absl::OkStatus());
  EXPECT_EQ(cache_->Acquire({0, 2}).status().code(), absl::StatusCode::kInternal);
  // The next step's updates start clean.
  cache_->BeginUpdates({});
  EXPECT_EQ(Read({0, 2}), 2.0f);
}

TEST_F(ExpertCacheTest, AFetchInFlightWhenUpdatesBeginIsFetchedAgain) {
  Open(4, absl::Milliseconds(100));
  // The update's read starts before its updates are begun: it may have asked the stores
  // for a newer version than the update starts from, so its bytes are thrown away.
  std::thread update([&] {
    auto w = cache_->AcquireForUpdate({0, 1});
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ((*w)[0], 1.0f);
    cache_->Release({0, 1});
  });
  absl::SleepFor(absl::Milliseconds(30));
  const std::vector<ExpertCache::Expert> updating = {{0, 1}};
  cache_->BeginUpdates(updating);
  update.join();
  EXPECT_EQ(fetches_.load(), 2);
  EXPECT_EQ(updating_fetches_.load(), 1);  // the second one, told the update is in flight
  cache_->Updated({0, 1});
  cache_->EndUpdates(absl::OkStatus());
  EXPECT_EQ(Read({0, 1}), 1.0f);  // resident: no third fetch
  EXPECT_EQ(fetches_.load(), 2);
}

}  // namespace
}  // namespace pith::runtime
