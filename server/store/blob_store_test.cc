// BlobStore on the in-memory cold tier: versions, commit and abort, crash recovery, RAM
// demotion and promotion under a small budget, pinning, bad input.
#include "server/store/blob_store.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "common/buffer.h"
#include "common/crc32c.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/store/blob_key.h"

namespace pith::store {
namespace {

v1::BlobKey Expert(int layer, int expert, v1::BlobKind kind = v1::BLOB_KIND_WEIGHTS,
                   const std::string& job = "job-1") {
  v1::BlobKey k;
  k.set_job_id(job);
  k.set_layer(layer);
  k.set_expert(expert);
  k.set_kind(kind);
  return k;
}

v1::BlobKey Dense(const std::string& tensor, const std::string& job = "job-1") {
  v1::BlobKey k;
  k.set_job_id(job);
  k.set_layer(-1);
  k.set_tensor(tensor);
  k.set_kind(v1::BLOB_KIND_WEIGHTS);
  return k;
}

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

// Forwards to a MemoryColdTier, calling `before_put` with the bytes of each PutData first.
class HookedTier final : public ForwardingColdTier {
 public:
  HookedTier(MemoryColdTier* tier, std::function<void(absl::Span<const uint8_t>)> before_put)
      : ForwardingColdTier(tier), before_put_(std::move(before_put)) {}
  absl::Status PutData(absl::string_view k, int64_t v, absl::Span<const uint8_t> b) override {
    before_put_(b);
    return ForwardingColdTier::PutData(k, v, b);
  }

 private:
  const std::function<void(absl::Span<const uint8_t>)> before_put_;
};

class BlobStoreTest : public ::testing::Test {
 protected:
  void Open(uint64_t ram_bytes = 4 << 20, uint64_t admission_window = 4096) {
    store_.reset();
    options_.ram_bytes = ram_bytes;
    options_.admission_window = admission_window;
    options_.max_blob_bytes = 1 << 20;
    if (arena_.size() < ram_bytes) arena_ = *Buffer::Allocate(ram_bytes);
    // The tier outlives the store: a restart opens a store over what it holds.
    auto store = BlobStore::Open(options_, ForwardTo(&cold_), arena_.data());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }
  void SetUp() override { Open(); }
  // Open's store again over the same tier, each PutData first passing its bytes to
  // `before_put` (a write held inside the cold tier).
  void OpenHooked(std::function<void(absl::Span<const uint8_t>)> before_put) {
    store_.reset();
    auto store = BlobStore::Open(
        options_, std::make_unique<HookedTier>(&cold_, std::move(before_put)), arena_.data());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }

  std::vector<uint8_t> Read(const v1::BlobKey& key, int64_t version = -1) {
    auto ref = store_->Get(key, version);
    EXPECT_TRUE(ref.ok()) << ref.status();
    if (!ref.ok()) return {};
    return std::vector<uint8_t>(ref->data(), ref->data() + ref->size());
  }

  MemoryColdTier cold_;
  Buffer arena_;
  BlobStoreOptions options_;
  std::unique_ptr<BlobStore> store_;
};

TEST_F(BlobStoreTest, KeysRoundTripAndOrderByJob) {
  for (const v1::BlobKey& k :
       {Expert(0, 0), Expert(3, 17, v1::BLOB_KIND_ADAM_V), Dense("h.0.ln1.w")}) {
    auto back = DecodeBlobKey(EncodeBlobKey(k));
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->SerializeAsString(), k.SerializeAsString());
  }
  EXPECT_LT(EncodeBlobKey(Dense("wte")), EncodeBlobKey(Expert(0, 0)));
  EXPECT_LT(EncodeBlobKey(Expert(0, 9)), EncodeBlobKey(Expert(1, 0)));
  EXPECT_EQ(ValidateBlobKey(Expert(0, 0, v1::BLOB_KIND_UNSPECIFIED)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBlobKey(Dense("")).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBlobKey(Expert(-2, 0)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(DecodeBlobKey("x").ok());
}

TEST_F(BlobStoreTest, PendingVersionsBecomeCurrentOnCommit) {
  const auto v0 = Bytes(10000, 1), v1 = Bytes(10000, 2);
  ASSERT_TRUE(store_->Put(Expert(0, 1), 0, v0).ok());
  // Nothing is committed yet.
  EXPECT_EQ(store_->Get(Expert(0, 1)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Read(Expert(0, 1), 0), v0);  // the writer may read its pending version
  auto c = store_->CommitStep("job-1", 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->blobs_committed, 1u);
  EXPECT_EQ(Read(Expert(0, 1)), v0);

  ASSERT_TRUE(store_->Put(Expert(0, 1), 1, v1).ok());
  EXPECT_EQ(Read(Expert(0, 1)), v0);  // version 0 stays readable while 1 is pending
  auto info = store_->Stat(Expert(0, 1), 1);
  ASSERT_TRUE(info.ok());
  EXPECT_FALSE(info->committed());
  EXPECT_EQ(info->crc32c(), Crc32c(v1.data(), v1.size()));
  ASSERT_TRUE(store_->CommitStep("job-1", 1).ok());
  EXPECT_EQ(Read(Expert(0, 1)), v1);
  EXPECT_EQ(store_->Get(Expert(0, 1), 0).status().code(), absl::StatusCode::kNotFound);  // freed
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
  EXPECT_EQ(store_->CommittedStep("job-1"), 1);
  // A version not newer than the committed one is refused.
  EXPECT_EQ(store_->Put(Expert(0, 1), 1, v0).status().code(),
            absl::StatusCode::kFailedPrecondition);
  // Committing again is a no-op.
  auto again = store_->CommitStep("job-1", 1);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->blobs_committed, 0u);
  EXPECT_TRUE(again->already);
}

TEST_F(BlobStoreTest, ACommitMustBeTheJobsNextStep) {
  ASSERT_TRUE(store_->Put(Expert(0, 1), 0, Bytes(100, 1)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0, -1).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 1, Bytes(100, 2)).ok());
  // A step that skips steps, by the coordinator's own account, is refused.
  EXPECT_EQ(store_->CommitStep("job-1", 3, 1).status().code(), absl::StatusCode::kInvalidArgument);
  // A far-future commit (no coordinator asks for it; one who can reach the port might) ...
  auto future = store_->CommitStep("job-1", 1000);
  ASSERT_TRUE(future.ok());
  EXPECT_FALSE(future->already);
  // ... makes the real next commit fail loudly, not answer OK with 0 blobs.
  auto real = store_->CommitStep("job-1", 1, 0);
  EXPECT_EQ(real.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(real.status().message(), testing::HasSubstr("at step 1000"));
  // A store that missed steps (it joined the job's groups by a copy) commits.
  ASSERT_TRUE(store_->Put(Expert(0, 2, v1::BLOB_KIND_WEIGHTS, "job-2"), 7, Bytes(100, 3)).ok());
  auto late = store_->CommitStep("job-2", 7, 6);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->blobs_committed, 1u);
}

// Garbage collection's deletions: one group, or all but the committed weights, or all.
TEST_F(BlobStoreTest, DeleteJobTakesAGroupOrKeepsTheWeightsOrTakesAll) {
  for (v1::BlobKind kind : {v1::BLOB_KIND_WEIGHTS, v1::BLOB_KIND_ADAM_M}) {
    for (int e = 0; e < 2; ++e) ASSERT_TRUE(store_->Put(Expert(0, e, kind), 0, Bytes(100, e)).ok());
    v1::BlobKey wte = Dense("wte");
    wte.set_kind(kind);
    ASSERT_TRUE(store_->Put(wte, 0, Bytes(100, 9)).ok());
  }
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 1, Bytes(100, 5)).ok());  // pending
  auto jobs = store_->Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].blobs(), 6u);
  EXPECT_EQ(jobs[0].blobs_besides_weights(), 4u);  // 3 adam_m, and weights with a pending one
  EXPECT_EQ(jobs[0].committed_step(), 0);

  auto group = store_->DeleteJob("job-1", {.group = std::make_pair(0, 0)});
  ASSERT_TRUE(group.ok());
  EXPECT_EQ(group->first, 2u);  // expert (0, 0): weights and adam_m
  EXPECT_EQ(store_->Stat(Expert(0, 0)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(store_->Stat(Expert(0, 1)).ok());

  ASSERT_TRUE(store_->DeleteJob("job-1", {.keep_weights = true}).ok());
  jobs = store_->Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].blobs(), 2u);  // the committed weights of expert (0, 1) and of wte
  EXPECT_EQ(jobs[0].blobs_besides_weights(), 0u);
  EXPECT_EQ(Read(Expert(0, 1)), Bytes(100, 1));
  EXPECT_EQ(store_->Stat(Expert(0, 1), 1).status().code(), absl::StatusCode::kNotFound);

  ASSERT_TRUE(store_->DeleteJob("job-1").ok());
  EXPECT_TRUE(store_->Jobs().empty());
  EXPECT_EQ(store_->CommittedStep("job-1"), -1);
}

// A store that left every group of a job forgets its step of the job, durably: a copy of
// a group it takes later (pulled, not committed here) does not make it look behind.
TEST_F(BlobStoreTest, TheLastGroupOfAJobTakesItsStepWithIt) {
  ASSERT_TRUE(store_->Put(Expert(0, 0), 3, Bytes(100, 1)).ok());
  ASSERT_TRUE(store_->Put(Dense("wte"), 3, Bytes(100, 2)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 3, 2).ok());
  ASSERT_TRUE(store_->DeleteJob("job-1", {.group = std::make_pair(0, 0)}).ok());
  EXPECT_EQ(store_->CommittedStep("job-1"), 3);  // it holds the dense group still
  ASSERT_TRUE(store_->DeleteJob("job-1", {.group = std::make_pair(-1, 0)}).ok());
  EXPECT_EQ(store_->CommittedStep("job-1"), -1);
  Open();  // and after a restart
  EXPECT_EQ(store_->CommittedStep("job-1"), -1);
}

TEST_F(BlobStoreTest, AbortDiscardsPendingVersions) {
  ASSERT_TRUE(store_->Put(Dense("wte"), 0, Bytes(100, 1)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  ASSERT_TRUE(store_->Put(Dense("wte"), 1, Bytes(100, 2)).ok());
  ASSERT_TRUE(store_->Put(Expert(2, 2), 1, Bytes(100, 3)).ok());  // new blob, never committed
  auto n = store_->AbortStep("job-1", 1);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 2u);
  EXPECT_EQ(Read(Dense("wte")), Bytes(100, 1));
  EXPECT_EQ(store_->Stat(Expert(2, 2)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
  // The step can be written again and committed.
  ASSERT_TRUE(store_->Put(Dense("wte"), 1, Bytes(100, 4)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 1).ok());
  EXPECT_EQ(Read(Dense("wte")), Bytes(100, 4));
}

TEST_F(BlobStoreTest, CrashBeforeCommitKeepsTheCommittedVersionsOnly) {
  for (int e = 0; e < 4; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 0, Bytes(5000, e)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  for (int e = 0; e < 4; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 1, Bytes(5000, 10 + e)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 1).ok());
  for (int e = 0; e < 2; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 2, Bytes(5000, 20 + e)).ok());
  store_.reset();
  cold_.Crash();  // unsynced writes of step 2 are lost, or not: either way it never committed
  Open();
  for (int e = 0; e < 4; ++e) EXPECT_EQ(Read(Expert(0, e)), Bytes(5000, 10 + e)) << e;
  EXPECT_EQ(store_->Stat(Expert(0, 0), 2).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
  EXPECT_EQ(store_->CommittedStep("job-1"), 1);
  auto contents = cold_.Load();
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(contents->data.size(), 4u);  // recovery deleted every other version

  // Pending data that did reach the disk is discarded on restart as well.
  ASSERT_TRUE(store_->Put(Expert(0, 0), 2, Bytes(5000, 30)).ok());
  ASSERT_TRUE(cold_.Apply(ColdBatch{}, true).ok());
  store_.reset();
  Open();
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 10));
  EXPECT_EQ(cold_.Load()->data.size(), 4u);
}

TEST_F(BlobStoreTest, RamBudgetFarBelowTheDataDemotesAndPromotes) {
  Open(2 << 20);  // 2 MiB of RAM for 40 blobs of 200 KiB (8 MiB)
  const int kBlobs = 40;
  for (int e = 0; e < kBlobs; ++e)
    ASSERT_TRUE(store_->Put(Expert(1, e), 0, Bytes(200 << 10, e)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  // The working set moves through the data in groups of 8 (which fit the RAM tier), each
  // group read three times: its second reads promote it, demoting the group before.
  for (int round = 0; round < 2; ++round) {
    for (int group = 0; group < kBlobs; group += 8) {
      for (int pass = 0; pass < 3; ++pass) {
        for (int e = group; e < group + 8; ++e) {
          ASSERT_EQ(Read(Expert(1, e)), Bytes(200 << 10, e)) << e;
        }
      }
    }
  }
  const v1::StoreStats s = store_->Stats();
  EXPECT_LE(s.ram_bytes(), 2u << 20);
  EXPECT_GT(s.demotions(), 40u);
  EXPECT_GE(s.promotions(), 40u);
  EXPECT_GT(s.rocksdb_gets(), 40u);
  EXPECT_EQ(s.rocksdb_bytes(), static_cast<uint64_t>(kBlobs) * (200 << 10));
}

TEST_F(BlobStoreTest, AScanLargerThanRamLeavesTheHotBlobsResident) {
  Open(2 << 20);  // 2 MiB: 10 blobs of 200 KiB
  const int kBlobs = 40;
  for (int e = 0; e < kBlobs; ++e)
    ASSERT_TRUE(store_->Put(Expert(1, e), 0, Bytes(200 << 10, e)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  // Blobs 0-3 are hot: read between every two scanned blobs. The rest is scanned
  // round-robin, a cycle far longer than the RAM tier holds.
  for (int round = 0; round < 3; ++round) {
    for (int e = 4; e < kBlobs; ++e) {
      ASSERT_EQ(Read(Expert(1, e % 4)), Bytes(200 << 10, e % 4));
      ASSERT_EQ(Read(Expert(1, e)), Bytes(200 << 10, e)) << e;
    }
  }
  const v1::StoreStats before = store_->Stats();
  for (int e = 0; e < 4; ++e) {
    auto hot = store_->Get(Expert(1, e));
    ASSERT_TRUE(hot.ok());
    EXPECT_TRUE(hot->in_ram()) << e;
  }
  // The scanned blobs were served in place: promoting them would only have evicted blobs
  // used more recently than their own last read.
  EXPECT_LE(before.promotions(), 4u);
  EXPECT_EQ(store_->Stats().rocksdb_gets(), before.rocksdb_gets());
}

TEST_F(BlobStoreTest, AdmissionPromotesOnTheSecondColdRead) {
  Open(1 << 20);  // one 1 MiB block
  ASSERT_TRUE(store_->Put(Expert(0, 0), 0, Bytes(600 << 10, 1)).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 0, Bytes(600 << 10, 2)).ok());  // demotes e0
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  auto first = store_->Get(Expert(0, 0));
  ASSERT_TRUE(first.ok());
  EXPECT_FALSE(first->in_ram());  // served in place from the cold tier
  EXPECT_EQ(std::vector<uint8_t>(first->data(), first->data() + first->size()),
            Bytes(600 << 10, 1));
  EXPECT_EQ(store_->Stats().promotions(), 0u);
  auto second = store_->Get(Expert(0, 0));
  ASSERT_TRUE(second.ok());
  EXPECT_TRUE(second->in_ram());  // read again: promoted
  EXPECT_EQ(store_->Stats().promotions(), 1u);
  EXPECT_EQ(std::vector<uint8_t>(second->data(), second->data() + second->size()),
            Bytes(600 << 10, 1));
}

TEST_F(BlobStoreTest, PinnedBlobsStayWhileRead) {
  Open(2 << 20, /*admission_window=*/0);  // two 1 MiB blocks; every read promotes
  for (int e = 0; e < 3; ++e)
    ASSERT_TRUE(store_->Put(Expert(0, e), 0, Bytes(600 << 10, e + 1)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  auto pinned = store_->Get(Expert(0, 0));
  auto pinned2 = store_->Get(Expert(0, 2));
  ASSERT_TRUE(pinned.ok() && pinned2.ok());
  // Both blocks are pinned: a third blob cannot come in, and is read in place instead.
  {
    auto in_place = store_->Get(Expert(0, 1));
    ASSERT_TRUE(in_place.ok()) << in_place.status();
    EXPECT_FALSE(in_place->in_ram());
    EXPECT_EQ(std::vector<uint8_t>(in_place->data(), in_place->data() + in_place->size()),
              Bytes(600 << 10, 2));
  }
  EXPECT_EQ(std::vector<uint8_t>(pinned->data(), pinned->data() + pinned->size()),
            Bytes(600 << 10, 1));
  *pinned = BlobRef();  // unpin
  EXPECT_EQ(Read(Expert(0, 1)), Bytes(600 << 10, 2));
  *pinned2 = BlobRef();
  // A pinned version replaced by a commit stays readable until released.
  auto old = store_->Get(Expert(0, 1));
  ASSERT_TRUE(old.ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 1, Bytes(100, 3)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 1).ok());
  EXPECT_EQ(std::vector<uint8_t>(old->data(), old->data() + old->size()), Bytes(600 << 10, 2));
}

// A step that writes many times the RAM tier: each put's bytes are in the cold tier when
// it lands, so its RAM copy makes room for the next; the step commits and reads back.
TEST_F(BlobStoreTest, PendingVersionsBeyondRamGoToTheColdTierAndCommit) {
  Open(1 << 20);  // 1 MiB of RAM for 2 versions of 32 blobs of 100 KiB (6.4 MiB)
  for (int step = 0; step < 2; ++step) {
    for (int e = 0; e < 32; ++e) {
      ASSERT_TRUE(store_->Put(Expert(0, e), step, Bytes(100 << 10, e + 100 * step)).ok()) << e;
    }
    auto committed = store_->CommitStep("job-1", step);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->blobs_committed, 32u);
  }
  for (int e = 0; e < 32; ++e) EXPECT_EQ(Read(Expert(0, e)), Bytes(100 << 10, e + 100)) << e;
  EXPECT_LE(store_->Stats().ram_bytes(), 1u << 20);
}

// Receives in flight hold RAM until they land: a put that finds no room is told to wait
// (UNAVAILABLE, naming what holds the RAM), and gets room once one lands.
TEST_F(BlobStoreTest, PutsWaitWhileReceivesHoldTheRam) {
  Open(1 << 20);
  auto a = store_->BeginPut(Expert(0, 0), 0, 600 << 10);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = store_->BeginPut(Expert(0, 1), 0, 100 << 10);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(b.status().message().find("in puts being received"), std::string::npos) << b.status();
  std::memset(a->data(), 1, a->size());
  ASSERT_TRUE(store_->FinishPut(std::move(*a)).ok());
  // The landed version is in the cold tier: it is demoted for the next put.
  auto c = store_->BeginPut(Expert(0, 1), 0, 700 << 10);
  ASSERT_TRUE(c.ok()) << c.status();
  std::memset(c->data(), 2, c->size());
  ASSERT_TRUE(store_->FinishPut(std::move(*c)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  EXPECT_EQ(Read(Expert(0, 0)), std::vector<uint8_t>(600 << 10, 1));
  // A blob the RAM tier could never hold is refused outright, not told to wait.
  Open(256 << 10);
  EXPECT_EQ(store_->BeginPut(Expert(0, 2), 0, 300 << 10).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(store_->Put(Expert(0, 2), 0, Bytes(200 << 10, 3)).ok());
}

TEST_F(BlobStoreTest, BadInput) {
  EXPECT_EQ(store_->Put(Expert(0, 0), 0, Bytes((1 << 20) + 1, 1)).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->Put(Dense(""), 0, Bytes(10, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Put(Expert(0, 0), -1, Bytes(10, 1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Get(Expert(5, 5)).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->CommitStep("", 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->DeleteBlob(Expert(5, 5)).status().code(), absl::StatusCode::kNotFound);
  auto r = store_->BeginPut(Expert(0, 0), 0, 8);
  ASSERT_TRUE(r.ok());
  std::memset(r->data(), 7, 8);
  EXPECT_EQ(store_->FinishPut(std::move(*r), 12345u).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(store_->Stats().ram_bytes(), 0u);  // the reservation's RAM came back
}

TEST_F(BlobStoreTest, ListPagesAndDeleteJob) {
  for (int e = 0; e < 5; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 0, Bytes(10, e)).ok());
  ASSERT_TRUE(store_->Put(Dense("wte"), 0, Bytes(10, 9)).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 0, v1::BLOB_KIND_WEIGHTS, "job-2"), 0, Bytes(10, 9)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  std::string next;
  auto page = store_->List("job-1", -2, "", 4, &next);
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->size(), 4u);
  EXPECT_EQ((*page)[0].key().tensor(), "wte");  // dense first
  ASSERT_FALSE(next.empty());
  auto rest = store_->List("job-1", -2, next, 4, &next);
  ASSERT_TRUE(rest.ok());
  EXPECT_EQ(rest->size(), 2u);
  EXPECT_TRUE(next.empty());
  auto layer0 = store_->List("job-1", 0, "", 0, &next);
  EXPECT_EQ(layer0->size(), 5u);
  auto deleted = store_->DeleteJob("job-1");
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(deleted->first, 6u);
  EXPECT_EQ(store_->List("job-1", -2, "", 0, &next)->size(), 0u);
  EXPECT_TRUE(
      store_->Stat(Expert(0, 0, v1::BLOB_KIND_WEIGHTS, "job-2"), 0).ok());  // other job kept
}

TEST(RocksColdTierTest, SurvivesReopenAndCheckpoints) {
  const std::string dir = testing::TempDir() + "/rocks_tier";
  std::filesystem::remove_all(dir);
  {
    auto tier = OpenRocksColdTier(dir);
    ASSERT_TRUE(tier.ok()) << tier.status();
    const auto data = Bytes(3000, 5);
    ASSERT_TRUE((*tier)->PutData("k1", 3, data).ok());
    ColdBatch b;
    b.set_records.push_back({"k1", {3, 3000, 42}});
    b.set_job_steps["job"] = 3;
    ASSERT_TRUE((*tier)->Apply(b, true).ok());
    std::filesystem::remove_all(dir + "_cp");
    ASSERT_TRUE((*tier)->Checkpoint(dir + "_cp").ok());
  }
  for (const std::string& d : {dir, dir + "_cp"}) {
    auto tier = OpenRocksColdTier(d);
    ASSERT_TRUE(tier.ok()) << tier.status();
    auto contents = (*tier)->Load();
    ASSERT_TRUE(contents.ok());
    EXPECT_EQ(contents->records.at("k1").version, 3);
    EXPECT_EQ(contents->records.at("k1").crc, 42u);
    EXPECT_EQ(contents->job_steps.at("job"), 3);
    ASSERT_EQ(contents->data.size(), 1u);
    std::vector<uint8_t> out(3000);
    ASSERT_TRUE((*tier)->ReadData("k1", 3, absl::MakeSpan(out)).ok());
    EXPECT_EQ(out, Bytes(3000, 5));
    std::vector<uint8_t> wrong(10);
    EXPECT_EQ((*tier)->ReadData("k1", 3, absl::MakeSpan(wrong)).code(),
              absl::StatusCode::kDataLoss);
    EXPECT_EQ((*tier)->ReadData("k1", 4, absl::MakeSpan(out)).code(), absl::StatusCode::kNotFound);
  }
}

int LogFiles(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/blobs"))
    n += e.is_regular_file();
  return n;
}

// What a commit does: name the versions, then drop the ones they replace.
void Commit(ColdTier& tier, const std::vector<std::string>& keys, int64_t version, uint64_t size) {
  ColdBatch commit;
  for (const auto& k : keys) commit.set_records.push_back({k, {version, size, 0}});
  ASSERT_TRUE(tier.Apply(commit, true).ok());
  ColdBatch cleanup;
  for (const auto& k : keys) cleanup.delete_data.push_back({k, version - 1});
  ASSERT_TRUE(tier.Apply(cleanup, false).ok());
}

// A prepared step outlives the process (not a power cut: the prepare is not synced), so a
// commit the coordinator decided meanwhile finds it after the restart.
TEST_F(BlobStoreTest, APreparedStepOutlivesTheProcessAndCommitsAfterIt) {
  for (int e = 0; e < 3; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 0, Bytes(5000, e)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  for (int e = 0; e < 3; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 1, Bytes(5000, 10 + e)).ok());
  auto prepared = store_->PrepareStep("job-1", 1);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(*prepared, 3u);
  EXPECT_EQ(*store_->PrepareStep("job-1", 1), 3u);                  // a retry: the same
  ASSERT_TRUE(store_->Put(Expert(0, 7), 1, Bytes(5000, 17)).ok());  // after it: not prepared
  store_.reset();  // the process dies; what went through the tier's WAL stays
  Open();
  EXPECT_EQ(store_->Stats().pending_blobs(), 3u);
  EXPECT_EQ(store_->Stat(Expert(0, 7), 1).status().code(), absl::StatusCode::kNotFound);
  auto committed = store_->CommitStep("job-1", 1, /*previous=*/0);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->blobs_committed, 3u);
  for (int e = 0; e < 3; ++e) EXPECT_EQ(Read(Expert(0, e)), Bytes(5000, 10 + e)) << e;
  EXPECT_TRUE(cold_.Load()->pending.empty());

  // A step written again after its prepare (a retried attempt) keeps the new bytes; the
  // prepare of the retry makes them the ones that survive.
  for (int e = 0; e < 3; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 2, Bytes(5000, 20 + e)).ok());
  ASSERT_TRUE(store_->PrepareStep("job-1", 2).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 0), 2, Bytes(5000, 30)).ok());
  EXPECT_EQ(Read(Expert(0, 0), 2), Bytes(5000, 30));
  EXPECT_EQ(cold_.Load()->pending.size(), 2u);
  EXPECT_EQ(*store_->PrepareStep("job-1", 2), 3u);
  store_.reset();
  Open();
  ASSERT_TRUE(store_->CommitStep("job-1", 2).ok());
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 30));
  EXPECT_EQ(Read(Expert(0, 1)), Bytes(5000, 21));

  // An aborted prepared step is gone, across a restart too; a committed step is not
  // prepared again; a power cut takes an unsynced prepare with it.
  ASSERT_TRUE(store_->Put(Expert(0, 1), 3, Bytes(5000, 40)).ok());
  ASSERT_TRUE(store_->PrepareStep("job-1", 3).ok());
  EXPECT_EQ(*store_->AbortStep("job-1", 3), 1u);
  store_.reset();
  Open();
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
  EXPECT_TRUE(cold_.Load()->pending.empty());
  EXPECT_EQ(store_->PrepareStep("job-1", 2).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(store_->PrepareStep("", 3).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(store_->Put(Expert(0, 1), 3, Bytes(5000, 41)).ok());
  ASSERT_TRUE(store_->PrepareStep("job-1", 3).ok());
  store_.reset();
  cold_.Crash();
  Open();
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
  EXPECT_EQ(store_->CommittedStep("job-1"), 2);
}

// Versions one attempt prepared and nobody wrote since belong to a voided attempt (its
// abort missed the store, down at the time): the next attempt's prepare drops them, and a
// commit of another attempt does not make them current.
TEST_F(BlobStoreTest, AVoidedAttemptsPreparedVersionsAreDroppedNotCommitted) {
  for (int e = 0; e < 3; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 0, Bytes(5000, e)).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0).ok());
  for (int e = 0; e < 3; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 1, Bytes(5000, 10 + e)).ok());
  EXPECT_EQ(*store_->PrepareStep("job-1", 1, /*attempt=*/7), 3u);
  store_.reset();
  Open();
  // Attempt 8 writes experts 0 and 1 again (not 2) and prepares.
  for (int e = 0; e < 2; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 1, Bytes(5000, 20 + e)).ok());
  EXPECT_EQ(*store_->PrepareStep("job-1", 1, /*attempt=*/8), 2u);
  EXPECT_EQ(store_->Stat(Expert(0, 2), 1).status().code(), absl::StatusCode::kNotFound);
  auto committed = store_->CommitStep("job-1", 1, 0, /*attempt=*/8);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->blobs_committed, 2u);
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 20));
  EXPECT_EQ(Read(Expert(0, 2)), Bytes(5000, 2));

  // A commit of attempt 10 over versions attempt 9 prepared commits none of them.
  ASSERT_TRUE(store_->Put(Expert(0, 2), 2, Bytes(5000, 32)).ok());
  ASSERT_TRUE(store_->PrepareStep("job-1", 2, /*attempt=*/9).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 2, Bytes(5000, 31)).ok());  // unprepared: attempt 10's
  committed = store_->CommitStep("job-1", 2, 1, /*attempt=*/10);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->blobs_committed, 1u);
  EXPECT_EQ(Read(Expert(0, 1)), Bytes(5000, 31));
  EXPECT_EQ(Read(Expert(0, 2)), Bytes(5000, 2));
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
  EXPECT_TRUE(cold_.Load()->pending.empty());
}

// Puts name their attempt: once a job named a newer one here, an older attempt's put and
// prepare are refused (a stalled worker's late write never joins its successor's step),
// across a restart too; a late put that lands before the newer attempt wrote that blob
// is left out of the newer attempt's prepare and commit. Puts naming none are not fenced.
TEST_F(BlobStoreTest, AVoidedAttemptsLatePutsNeverJoinTheStep) {
  for (int e = 0; e < 3; ++e) ASSERT_TRUE(store_->Put(Expert(0, e), 0, Bytes(5000, e), 4).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0, std::nullopt, /*attempt=*/4).ok());
  // Attempt 5 writes expert 0 of step 1, and is voided; attempt 6 writes experts 0 and 1.
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, Bytes(5000, 50), 5).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, Bytes(5000, 60), 6).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 1, Bytes(5000, 61), 6).ok());
  // Attempt 5's late puts: refused, whether or not attempt 6 wrote the blob.
  for (int e : {0, 2}) {
    auto late = store_->Put(Expert(0, e), 1, Bytes(5000, 70 + e), 5);
    EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << e;
    EXPECT_THAT(late.status().message(),
                ::testing::HasSubstr("a put of attempt 5 of job job-1: attempt 6 replaced it"));
  }
  EXPECT_EQ(Read(Expert(0, 0), 1), Bytes(5000, 60));
  EXPECT_EQ(store_->Stat(Expert(0, 2), 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->PrepareStep("job-1", 1, 5).status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(*store_->PrepareStep("job-1", 1, 6), 2u);
  store_.reset();  // the fence outlives the process, in the prepared records
  Open();
  EXPECT_EQ(store_->Put(Expert(0, 2), 1, Bytes(5000, 72), 5).status().code(),
            absl::StatusCode::kAborted);
  ASSERT_TRUE(store_->CommitStep("job-1", 1, 0, 6).ok());
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 60));

  // A late put of attempt 7 (voided: its abort missed the store) lands before attempt 8
  // names itself here: attempt 8 writes another blob, prepares and commits without it.
  ASSERT_TRUE(store_->Put(Expert(0, 2), 2, Bytes(5000, 72), 7).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 2, Bytes(5000, 81), 8).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 0), 2, Bytes(5000, 80)).ok());  // naming none
  EXPECT_EQ(*store_->PrepareStep("job-1", 2, 8), 2u);
  EXPECT_EQ(store_->Stat(Expert(0, 2), 2).status().code(), absl::StatusCode::kNotFound);
  auto committed = store_->CommitStep("job-1", 2, 1, 8);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->blobs_committed, 2u);
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 80));
  EXPECT_EQ(Read(Expert(0, 1)), Bytes(5000, 81));
  EXPECT_EQ(Read(Expert(0, 2)), Bytes(5000, 2));
  // Other jobs have fences of their own.
  EXPECT_TRUE(store_->Put(Expert(0, 0, v1::BLOB_KIND_WEIGHTS, "job-2"), 0, Bytes(100, 1), 1).ok());
}

// A voided attempt's put that passed its check stalls before its bytes reach the cold
// tier; a newer attempt's put of the same version comes meanwhile. The newer one waits for
// it, so the cold tier ends up with the bytes its record names (before, the stalled write
// landed last, under the newer record: a cold read failed its checksum).
TEST_F(BlobStoreTest, AStalledVoidedPutNeverOverwritesANewerAttemptsBytes) {
  const std::vector<uint8_t> late = Bytes(5000, 50), newer = Bytes(5000, 60);
  absl::Notification late_writing, newer_writing;
  ASSERT_NO_FATAL_FAILURE(OpenHooked([&](absl::Span<const uint8_t> b) {
    if (std::equal(b.begin(), b.end(), late.begin(), late.end())) {
      late_writing.Notify();
      // Held until the newer put writes (before the fix), or for a second (it waits for
      // this one).
      newer_writing.WaitForNotificationWithTimeout(absl::Seconds(1));
    } else if (std::equal(b.begin(), b.end(), newer.begin(), newer.end())) {
      newer_writing.Notify();
    }
  }));
  absl::StatusOr<v1::BlobInfo> late_put, newer_put;
  std::thread stalled([&] { late_put = store_->Put(Expert(0, 0), 1, late, 5); });
  late_writing.WaitForNotification();
  // The successor names itself before the stalled put goes on (whenever that is).
  auto reserved = store_->BeginPut(Expert(0, 0), 1, newer.size(), 6);
  ASSERT_TRUE(reserved.ok()) << reserved.status();
  std::memcpy(reserved->data(), newer.data(), newer.size());
  std::thread successor([&] { newer_put = store_->FinishPut(std::move(*reserved)); });
  stalled.join();
  successor.join();
  EXPECT_EQ(late_put.status().code(), absl::StatusCode::kAborted) << late_put.status();
  ASSERT_TRUE(newer_put.ok()) << newer_put.status();
  std::vector<uint8_t> cold(newer.size());
  ASSERT_TRUE(cold_.ReadData(EncodeBlobKey(Expert(0, 0)), 1, absl::MakeSpan(cold)).ok());
  EXPECT_EQ(cold, newer);
  EXPECT_EQ(Read(Expert(0, 0), 1), newer);
}

// A second put of a version (a retry) passed its checks and stalls before its bytes reach
// the cold tier while the step commits. The commit waits for it and commits what it
// wrote; before, the put wrote its bytes under the committed record of the first put's
// (a cold read failed its checksum).
TEST_F(BlobStoreTest, APutInFlightWhileItsStepCommitsLeavesBytesAndRecordAgreeing) {
  const std::vector<uint8_t> first = Bytes(5000, 30), retry = Bytes(5000, 31);
  absl::Notification retry_writing, committed;
  ASSERT_NO_FATAL_FAILURE(OpenHooked([&](absl::Span<const uint8_t> b) {
    if (std::equal(b.begin(), b.end(), retry.begin(), retry.end())) {
      retry_writing.Notify();
      committed.WaitForNotificationWithTimeout(absl::Seconds(1));
    }
  }));
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, first, 3).ok());
  absl::StatusOr<v1::BlobInfo> retried;
  std::thread put([&] { retried = store_->Put(Expert(0, 0), 1, retry, 3); });
  retry_writing.WaitForNotification();
  ASSERT_TRUE(store_->CommitStep("job-1", 1, std::nullopt, 3).ok());
  committed.Notify();
  put.join();
  store_.reset();
  Open();
  const std::vector<uint8_t> got = Read(Expert(0, 0));
  EXPECT_TRUE(got == first || got == retry) << "the committed bytes are neither put's";
  // A put of the committed step after the commit writes nothing.
  EXPECT_EQ(store_->Put(Expert(0, 0), 1, Bytes(5000, 32), 3).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Read(Expert(0, 0)), got);
}

// A put of a voided attempt, admitted before its successor named itself here, lands after
// the successor wrote and prepared the same version: it is refused before it can drop the
// prepared version (it used to drop it first, and the commit then missed the blob).
TEST_F(BlobStoreTest, ALateVoidedPutLeavesItsSuccessorsPreparedVersion) {
  ASSERT_TRUE(store_->Put(Expert(0, 0), 0, Bytes(5000, 1), 4).ok());
  ASSERT_TRUE(store_->CommitStep("job-1", 0, std::nullopt, 4).ok());
  auto late = store_->BeginPut(Expert(0, 0), 1, 5000, /*attempt=*/5);
  ASSERT_TRUE(late.ok()) << late.status();
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, Bytes(5000, 60), 6).ok());
  ASSERT_EQ(*store_->PrepareStep("job-1", 1, 6), 1u);
  const std::vector<uint8_t> stale = Bytes(5000, 50);
  std::memcpy(late->data(), stale.data(), stale.size());
  EXPECT_EQ(store_->FinishPut(std::move(*late)).status().code(), absl::StatusCode::kAborted);
  auto committed = store_->CommitStep("job-1", 1, 0, 6);
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->blobs_committed, 1u);
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 60));
}

// An abort that names the attempt replacing the aborted one, arriving after that attempt
// wrote: the successor's versions stay, the older ones (and those naming no attempt) go,
// and the aborted attempt's later puts are refused.
TEST_F(BlobStoreTest, ALateAbortKeepsWhatItsSuccessorWrote) {
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, Bytes(5000, 50), 5).ok());
  ASSERT_TRUE(store_->Put(Expert(0, 1), 1, Bytes(5000, 51)).ok());  // naming none
  ASSERT_TRUE(store_->Put(Expert(0, 2), 1, Bytes(5000, 62), 6).ok());
  auto discarded = store_->AbortStep("job-1", 1, /*successor=*/6);
  ASSERT_TRUE(discarded.ok()) << discarded.status();
  EXPECT_EQ(*discarded, 2u);
  EXPECT_EQ(store_->Stat(Expert(0, 0), 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Stat(Expert(0, 1), 1).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Read(Expert(0, 2), 1), Bytes(5000, 62));
  EXPECT_EQ(store_->Put(Expert(0, 0), 1, Bytes(5000, 52), 5).status().code(),
            absl::StatusCode::kAborted);
  // The successor itself is admitted (no newer attempt named itself), and an abort naming
  // none still takes every pending version of the step.
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, Bytes(5000, 60), 6).ok());
  EXPECT_EQ(*store_->AbortStep("job-1", 1), 2u);
}

// A copy installed over a prepared version of the same number replaces it whole.
TEST_F(BlobStoreTest, AnInstalledCopyReplacesAPreparedVersion) {
  ASSERT_TRUE(store_->Put(Expert(0, 0), 1, Bytes(5000, 1)).ok());
  ASSERT_TRUE(store_->PrepareStep("job-1", 1).ok());
  ASSERT_TRUE(store_->InstallCommitted(Expert(0, 0), 1, Bytes(5000, 2)).ok());
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 2));
  EXPECT_TRUE(cold_.Load()->pending.empty());
  store_.reset();
  Open();
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 2));
  EXPECT_EQ(store_->Stats().pending_blobs(), 0u);
}

// A put reserved before its version was committed (here by an installed copy) and
// finished after: its bytes never replace the committed ones, on disk or in RAM.
TEST_F(BlobStoreTest, APutFinishedAfterItsVersionWasCommittedLeavesTheCommittedBytes) {
  auto late = store_->BeginPut(Expert(0, 0), 1, 5000, 0);
  ASSERT_TRUE(late.ok()) << late.status();
  std::memcpy(late->data(), Bytes(5000, 7).data(), 5000);
  ASSERT_TRUE(store_->InstallCommitted(Expert(0, 0), 1, Bytes(5000, 2)).ok());
  EXPECT_EQ(store_->FinishPut(*std::move(late)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 2));
  store_.reset();
  Open();
  EXPECT_EQ(Read(Expert(0, 0)), Bytes(5000, 2));
}

TEST(RocksColdTierTest, LogFilesGoWithTheirVersionsAndUnnamedVersionsDoNotSurviveReopen) {
  const std::string dir = testing::TempDir() + "/rocks_tier_log";
  std::filesystem::remove_all(dir);
  const std::vector<std::string> keys = {"a", "b", "c", "d"};
  {
    auto tier = OpenRocksColdTier(dir, /*log_file_bytes=*/16 << 10);
    ASSERT_TRUE(tier.ok()) << tier.status();
    for (int64_t step = 1; step <= 20; ++step) {
      for (size_t i = 0; i < keys.size(); ++i) {
        ASSERT_TRUE((*tier)->PutData(keys[i], step, Bytes(6000, step * 10 + i)).ok());
      }
      Commit(**tier, keys, step, 6000);
      // Two steps of 24 KB in 16 KB files: old files go, so only a few stay.
      EXPECT_LE(LogFiles(dir), 4) << "step " << step;
    }
    // Written but never named by a synced batch: gone after a restart.
    ASSERT_TRUE((*tier)->PutData("a", 21, Bytes(6000, 99)).ok());
  }
  auto tier = OpenRocksColdTier(dir, 16 << 10);
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto contents = (*tier)->Load();
  ASSERT_TRUE(contents.ok());
  ASSERT_EQ(contents->data.size(), keys.size());
  for (const auto& d : contents->data) EXPECT_EQ(d.version, 20) << d.key;
  for (size_t i = 0; i < keys.size(); ++i) {
    std::vector<uint8_t> got(6000);
    ASSERT_TRUE((*tier)->ReadData(keys[i], 20, absl::MakeSpan(got)).ok());
    EXPECT_EQ(got, Bytes(6000, 200 + i));
    auto pinned = (*tier)->ReadPinned(keys[i], 20);
    ASSERT_TRUE(pinned.ok());
    EXPECT_EQ(std::vector<uint8_t>(pinned->data, pinned->data + pinned->size),
              Bytes(6000, 200 + i));
  }
  std::vector<uint8_t> out(6000);
  EXPECT_EQ((*tier)->ReadData("a", 21, absl::MakeSpan(out)).code(), absl::StatusCode::kNotFound);
}

// Runs `body` in a child process that then dies by SIGKILL, as `kill -9` would do it.
void RunAndKill(const std::function<void()>& body) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    body();
    if (::testing::Test::HasFailure()) _exit(9);  // an assertion in the child failed
    kill(getpid(), SIGKILL);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child failed: " << status;
}

TEST(RocksColdTierTest, AVersionNeverReplacedMovesOutOfAFileThatEmptiedAndSurvivesKill) {
  const std::string dir = testing::TempDir() + "/rocks_tier_forward";
  std::filesystem::remove_all(dir);
  RunAndKill([&] {
    auto tier = OpenRocksColdTier(dir, /*log_file_bytes=*/16 << 10);
    if (!tier.ok()) _exit(1);
    // "cold" is written once, beside "hot" versions that are replaced every step.
    if (!(*tier)->PutData("cold", 1, Bytes(2000, 7)).ok()) _exit(2);
    if (!(*tier)->PutData("hot", 1, Bytes(15000, 1)).ok()) _exit(3);
    ColdBatch first;
    first.set_records.push_back({"cold", {1, 2000, 0}});
    first.set_records.push_back({"hot", {1, 15000, 0}});
    if (!(*tier)->Apply(first, true).ok()) _exit(4);
    for (int64_t step = 2; step <= 40; ++step) {
      if (!(*tier)->PutData("hot", step, Bytes(15000, step)).ok()) _exit(5);
      Commit(**tier, {"hot"}, step, 15000);
    }
    // The first file held 2 KB of "cold" among 17 KB; it is gone, "cold" lives on.
    if (std::filesystem::exists(dir + "/blobs/00000001.log")) _exit(6);
    if (LogFiles(dir) > 3) _exit(7);
    (void)(*tier)->PutData("hot", 41, Bytes(15000, 41));  // never committed
  });
  EXPECT_FALSE(std::filesystem::exists(dir + "/blobs/00000001.log"));
  auto tier = OpenRocksColdTier(dir, 16 << 10);
  ASSERT_TRUE(tier.ok()) << tier.status();
  auto contents = (*tier)->Load();
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(contents->records.at("hot").version, 40);
  ASSERT_EQ(contents->data.size(), 2u);
  std::vector<uint8_t> cold(2000), hot(15000);
  ASSERT_TRUE((*tier)->ReadData("cold", 1, absl::MakeSpan(cold)).ok());
  EXPECT_EQ(cold, Bytes(2000, 7));
  ASSERT_TRUE((*tier)->ReadData("hot", 40, absl::MakeSpan(hot)).ok());
  EXPECT_EQ(hot, Bytes(15000, 40));
  EXPECT_EQ((*tier)->ReadData("hot", 41, absl::MakeSpan(hot)).code(), absl::StatusCode::kNotFound);
}

TEST(RocksColdTierTest, ASecondWriteOfACommittedVersionKeepsItsBytes) {
  const std::string dir = testing::TempDir() + "/rocks_tier_rewrite";
  std::filesystem::remove_all(dir);
  auto tier = OpenRocksColdTier(dir);
  ASSERT_TRUE(tier.ok()) << tier.status();
  ASSERT_TRUE((*tier)->PutData("k", 3, Bytes(100, 1)).ok());
  ColdBatch b;
  b.set_records.push_back({"k", {3, 100, 0}});
  ASSERT_TRUE((*tier)->Apply(b, true).ok());
  ASSERT_TRUE((*tier)->PutData("k", 3, Bytes(100, 2)).ok());  // a stale retry
  std::vector<uint8_t> out(100);
  ASSERT_TRUE((*tier)->ReadData("k", 3, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, Bytes(100, 1));
  ASSERT_TRUE((*tier)->PutData("z", 1, {}).ok());  // an empty blob keeps its (empty) file
  ColdBatch z;
  z.set_records.push_back({"z", {1, 0, 0}});
  ASSERT_TRUE((*tier)->Apply(z, true).ok());
  tier->reset();
  tier = OpenRocksColdTier(dir);
  ASSERT_TRUE(tier.ok()) << tier.status();
  ASSERT_TRUE((*tier)->ReadData("k", 3, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, Bytes(100, 1));
  EXPECT_TRUE((*tier)->ReadData("z", 1, {}).ok());
}

uint64_t LogBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/blobs")) n += e.file_size();
  return n;
}

// A store of 4 MiB of RAM for blobs of up to 1 MiB.
BlobStoreOptions SmallStoreOptions() {
  BlobStoreOptions options;
  options.ram_bytes = 4 << 20;
  options.max_blob_bytes = 1 << 20;
  return options;
}

TEST(RocksColdTierTest, WeightsAndAnEqualMasterAreStoredOnce) {
  const std::string dir = testing::TempDir() + "/rocks_tier_link";
  std::filesystem::remove_all(dir);
  Buffer arena = *Buffer::Allocate(4 << 20);
  const BlobStoreOptions options = SmallStoreOptions();
  const auto w1 = Bytes(50000, 1), m1 = Bytes(50000, 2), w2 = Bytes(50000, 3),
             master2 = Bytes(50000, 4);
  const auto weights = Expert(0, 1, v1::BLOB_KIND_WEIGHTS),
             master = Expert(0, 1, v1::BLOB_KIND_MASTER),
             moment = Expert(0, 1, v1::BLOB_KIND_ADAM_M);
  {
    auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Put(weights, 1, w1).ok());
    ASSERT_TRUE((*store)->Put(master, 1, w1).ok());  // fp32: the same bytes
    ASSERT_TRUE((*store)->Put(moment, 1, m1).ok());
    ASSERT_TRUE((*store)->CommitStep("job-1", 1).ok());
    EXPECT_EQ(LogBytes(dir), 2 * 50000u);  // weights and master share theirs
    // Step 2 replaces the weights only: master's version 1 keeps the shared bytes.
    ASSERT_TRUE((*store)->Put(weights, 2, w2).ok());
    ASSERT_TRUE((*store)->CommitStep("job-1", 2).ok());
    // Step 3: a master different from the weights is stored apart; an aborted pair that
    // shared bytes takes nothing with it.
    ASSERT_TRUE((*store)->Put(master, 3, master2).ok());
    ASSERT_TRUE((*store)->CommitStep("job-1", 3).ok());
    ASSERT_TRUE((*store)->Put(weights, 4, m1).ok());
    ASSERT_TRUE((*store)->Put(master, 4, m1).ok());
    ASSERT_TRUE((*store)->AbortStep("job-1", 4).ok());
  }
  auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
  ASSERT_TRUE(store.ok()) << store.status();
  auto read = [&](const v1::BlobKey& k) {
    auto ref = (*store)->Get(k);
    EXPECT_TRUE(ref.ok()) << ref.status();
    return ref.ok() ? std::vector<uint8_t>(ref->data(), ref->data() + ref->size())
                    : std::vector<uint8_t>();
  };
  EXPECT_EQ(read(weights), w2);
  EXPECT_EQ(read(master), master2);
  EXPECT_EQ(read(moment), m1);
}

TEST(RocksColdTierTest, AMasterPutAsItsWeightsSiblingSharesTheirBytesAndSurvivesRestart) {
  const std::string dir = testing::TempDir() + "/rocks_tier_sibling";
  std::filesystem::remove_all(dir);
  Buffer arena = *Buffer::Allocate(4 << 20);
  const BlobStoreOptions options = SmallStoreOptions();
  const auto w1 = Bytes(50000, 1);
  const uint32_t crc = Crc32c(w1.data(), w1.size());
  const auto weights = Expert(0, 1, v1::BLOB_KIND_WEIGHTS),
             master = Expert(0, 1, v1::BLOB_KIND_MASTER),
             moment = Expert(0, 1, v1::BLOB_KIND_ADAM_M);
  {
    auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
    ASSERT_TRUE(store.ok()) << store.status();
    // No weights version 1 yet, then the wrong size or checksum, or no sibling kind.
    EXPECT_EQ((*store)->PutSibling(master, 1, w1.size(), crc).status().code(),
              absl::StatusCode::kFailedPrecondition);
    ASSERT_TRUE((*store)->Put(weights, 1, w1).ok());
    EXPECT_EQ((*store)->PutSibling(master, 1, w1.size() - 1, crc).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*store)->PutSibling(master, 1, w1.size(), crc + 1).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*store)->PutSibling(moment, 1, w1.size(), crc).status().code(),
              absl::StatusCode::kInvalidArgument);
    auto info = (*store)->PutSibling(master, 1, w1.size(), crc);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->crc32c(), crc);
    EXPECT_EQ(info->size_bytes(), w1.size());
    ASSERT_TRUE((*store)->CommitStep("job-1", 1).ok());
    EXPECT_EQ(LogBytes(dir), 50000u);  // written once
    auto ref = (*store)->Get(master);
    ASSERT_TRUE(ref.ok()) << ref.status();
    EXPECT_EQ(std::vector<uint8_t>(ref->data(), ref->data() + ref->size()), w1);
    // A version already committed is not written again.
    EXPECT_EQ((*store)->PutSibling(master, 1, w1.size(), crc).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
  ASSERT_TRUE(store.ok()) << store.status();
  auto ref = (*store)->Get(master);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(std::vector<uint8_t>(ref->data(), ref->data() + ref->size()), w1);
}

TEST(RocksColdTierTest, ASharedVersionOutlivesTheOneItWasLinkedTo) {
  const std::string dir = testing::TempDir() + "/rocks_tier_link2";
  std::filesystem::remove_all(dir);
  Buffer arena = *Buffer::Allocate(4 << 20);
  const BlobStoreOptions options = SmallStoreOptions();
  const auto w1 = Bytes(50000, 1), w2 = Bytes(50000, 3);
  const auto weights = Expert(0, 1, v1::BLOB_KIND_WEIGHTS),
             master = Expert(0, 1, v1::BLOB_KIND_MASTER);
  {
    auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
    ASSERT_TRUE(store.ok()) << store.status();
    ASSERT_TRUE((*store)->Put(weights, 1, w1).ok());
    ASSERT_TRUE((*store)->Put(master, 1, w1).ok());
    ASSERT_TRUE((*store)->CommitStep("job-1", 1).ok());
    ASSERT_TRUE((*store)->Put(weights, 2, w2).ok());  // master stays at version 1
    ASSERT_TRUE((*store)->CommitStep("job-1", 2).ok());
  }
  auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
  ASSERT_TRUE(store.ok()) << store.status();
  auto ref = (*store)->Get(master);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(ref->version(), 1);
  EXPECT_EQ(std::vector<uint8_t>(ref->data(), ref->data() + ref->size()), w1);
}

// kill -9 between a step's prepare and its commit: the restarted store has the prepared
// versions (a weights/master pair sharing bytes among them) and commits them; what was
// written after the prepare is gone.
TEST(RocksColdTierTest, APreparedStepSurvivesKillDashNineAndCommits) {
  const std::string dir = testing::TempDir() + "/rocks_tier_prepare";
  std::filesystem::remove_all(dir);
  Buffer arena = *Buffer::Allocate(4 << 20);
  const BlobStoreOptions options = SmallStoreOptions();
  const auto weights = Expert(0, 1, v1::BLOB_KIND_WEIGHTS),
             master = Expert(0, 1, v1::BLOB_KIND_MASTER),
             moment = Expert(0, 1, v1::BLOB_KIND_ADAM_M), late = Expert(0, 2);
  RunAndKill([&] {
    auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
    if (!store.ok()) _exit(1);
    if (!(*store)->Put(weights, 0, Bytes(50000, 1)).ok()) _exit(2);
    if (!(*store)->CommitStep("job-1", 0).ok()) _exit(3);
    const auto w1 = Bytes(50000, 2);
    if (!(*store)->Put(weights, 1, w1).ok()) _exit(4);
    if (!(*store)->PutSibling(master, 1, w1.size(), Crc32c(w1.data(), w1.size())).ok()) _exit(5);
    if (!(*store)->Put(moment, 1, Bytes(50000, 3)).ok()) _exit(6);
    auto prepared = (*store)->PrepareStep("job-1", 1);
    if (!prepared.ok() || *prepared != 3) _exit(7);
    if (!(*store)->Put(late, 1, Bytes(50000, 4)).ok()) _exit(8);
  });
  {
    auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
    ASSERT_TRUE(store.ok()) << store.status();
    EXPECT_EQ((*store)->Stats().pending_blobs(), 3u);
    EXPECT_EQ((*store)->Stat(late, 1).status().code(), absl::StatusCode::kNotFound);
    auto committed = (*store)->CommitStep("job-1", 1, /*previous=*/0);
    ASSERT_TRUE(committed.ok()) << committed.status();
    EXPECT_EQ(committed->blobs_committed, 3u);
  }
  auto store = BlobStore::Open(options, *OpenRocksColdTier(dir), arena.data());
  ASSERT_TRUE(store.ok()) << store.status();
  for (const auto& [key, want] : std::vector<std::pair<v1::BlobKey, std::vector<uint8_t>>>{
           {weights, Bytes(50000, 2)}, {master, Bytes(50000, 2)}, {moment, Bytes(50000, 3)}}) {
    auto ref = (*store)->Get(key);
    ASSERT_TRUE(ref.ok()) << ref.status();
    EXPECT_EQ(ref->version(), 1);
    EXPECT_EQ(std::vector<uint8_t>(ref->data(), ref->data() + ref->size()), want);
  }
  EXPECT_EQ((*store)->Stats().pending_blobs(), 0u);
  EXPECT_TRUE((*store)->cold().Load()->pending.empty());
}

}  // namespace
}  // namespace pith::store
