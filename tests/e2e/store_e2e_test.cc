// A real pith-store process over UCX loopback: put, get, commit, abort, batched get, a RAM
// budget far below the data, kill -9 mid-step and restart, a power cut right after a
// commit (root: ext4 on a loop device), and bad input on both planes.

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "child_process.h"
#include "common/crc32c.h"
#include "common/grpc_util.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/tmpfs_testing.h"
#include "gtest/gtest.h"
#include "pith/v1/store.grpc.pb.h"
#include "scratch_dir.h"
#include "server/store/store_client.h"
#include "test_tls.h"

namespace pith::store {
namespace {

using pith::testing::ChildProcess;

// The certificates of every process and call of this test (mutual TLS, as users run it).
pith::testing::TestTls& Tls() {
  static auto* tls = new pith::testing::TestTls(::testing::TempDir() + "/store_e2e_tls_" +
                                                std::to_string(getpid()));
  return *tls;
}

v1::BlobKey Key(int layer, int expert, v1::BlobKind kind = v1::BLOB_KIND_WEIGHTS) {
  v1::BlobKey k;
  k.set_job_id("job");
  k.set_layer(layer);
  k.set_expert(expert);
  k.set_kind(kind);
  return k;
}

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (size_t i = 0; i + 4 <= n; i += 4) {
    const uint32_t r = rng();
    std::memcpy(v.data() + i, &r, 4);
  }
  for (size_t i = n / 4 * 4; i < n; ++i) v[i] = static_cast<uint8_t>(rng());
  return v;
}

class StoreE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/store_e2e_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }

  // A passing test leaves nothing behind (its stores' data run to a GiB); a failing one
  // keeps its logs and data for a look.
  void TearDown() override {
    store_.reset();
    if (HasFailure()) return;
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // A store on `data_dir` (empty: dir_/data) with `extra` flags.
  void StartStore(uint64_t ram_bytes = 64 << 20, uint64_t max_blob = 4 << 20,
                  const std::string& data_dir = "", std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--listen=127.0.0.1:0",
                                     "--metrics_port=0",
                                     "--data_dir=" + (data_dir.empty() ? dir_ + "/data" : data_dir),
                                     "--ram_bytes=" + std::to_string(ram_bytes),
                                     "--max_blob_bytes=" + std::to_string(max_blob),
                                     Tls().MemberFlag("store")};
    args.insert(args.end(), extra.begin(), extra.end());
    store_ = std::make_unique<ChildProcess>(PITH_STORE_BINARY, args,
                                            dir_ + "/store." + std::to_string(++starts_) + ".log");
    ASSERT_TRUE(store_->WaitReady()) << store_->Log();
    // NOTE: the client's UCX worker is created after the fork, each time: UCX state does
    // not survive a fork of its process.
    client_.reset();
    auto client = StoreClient::Create(retired_linger_);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    channel_ = Tls().CoordinatorChannel("127.0.0.1:" + std::to_string(store_->grpc_port));
    stub_ = v1::StoreService::NewStub(channel_);
    grpc::ClientContext ctx;
    v1::UcxAddress address;
    ASSERT_TRUE(stub_->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address).ok());
    ucx_address_ = address.worker_address();
    auto peer = client_->Connect(ucx_address_);
    ASSERT_TRUE(peer.ok()) << peer.status();
    peer_ = *peer;
  }

  absl::Status Commit(int64_t step) {
    grpc::ClientContext ctx;
    v1::CommitStepRequest req;
    req.set_job_id("job");
    req.set_step(step);
    v1::CommitStepResponse resp;
    return FromGrpcStatus(stub_->CommitStep(&ctx, req, &resp));
  }

  absl::StatusOr<v1::BlobInfo> Stat(const v1::BlobKey& key, int64_t version = -1) {
    grpc::ClientContext ctx;
    v1::StatBlobRequest req;
    *req.mutable_key() = key;
    req.set_version(version);
    v1::BlobInfo info;
    absl::Status s = FromGrpcStatus(stub_->StatBlob(&ctx, req, &info));
    if (!s.ok()) return s;
    return info;
  }

  v1::StoreStats Stats() {
    grpc::ClientContext ctx;
    v1::StoreStats stats;
    EXPECT_TRUE(stub_->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok());
    return stats;
  }

  absl::Status PutBytes(const v1::BlobKey& key, int64_t version, const std::vector<uint8_t>& data,
                        absl::Duration timeout = absl::Seconds(30)) {
    return client_->Put(peer_, key, version, data.data(), data.size(), nullptr, timeout).status();
  }

  // Fetches `keys` (committed versions) in one batched call and returns their bytes.
  std::vector<std::vector<uint8_t>> FetchAll(const std::vector<v1::BlobKey>& keys,
                                             size_t capacity) {
    auto region = client_->AllocateBuffer(capacity * keys.size());
    EXPECT_TRUE(region.ok());
    std::vector<StoreClient::FetchItem> items(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      items[i].key = keys[i];
      items[i].buffer = (*region)->data() + i * capacity;
      items[i].capacity = capacity;
      items[i].memh = (*region)->handle();
    }
    absl::Status s = client_->Fetch(peer_, absl::MakeSpan(items));
    EXPECT_TRUE(s.ok()) << s;
    std::vector<std::vector<uint8_t>> out;
    for (auto& item : items) {
      const uint8_t* p = static_cast<const uint8_t*>(item.buffer);
      out.emplace_back(p, p + item.info.size_bytes());
      EXPECT_EQ(Crc32c(p, item.info.size_bytes()), item.info.crc32c());
    }
    return out;
  }

  friend int BlobsAtStepOneAfterAPowerCut(StoreE2eTest*, const std::vector<std::string>&);
  std::string dir_;
  std::unique_ptr<ChildProcess> store_;
  std::unique_ptr<StoreClient> client_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::StoreService::Stub> stub_;
  int peer_ = -1;
  std::string ucx_address_;  // the store's, from GetUcxAddress
  int starts_ = 0;
  absl::Duration retired_linger_ = StoreClient::kRetiredLinger;  // of the next StartStore's client
};

// 600 blobs: their fetch's keys are far more than one UCX message header holds (the
// client splits it).
TEST_F(StoreE2eTest, ManyPutsInFlightAtOnceLandWhereTheyBelongAndComeBackInOneFetch) {
  StartStore();
  constexpr int kBlobs = 600;
  std::vector<v1::BlobKey> keys;
  std::vector<std::vector<uint8_t>> data;
  std::vector<StoreClient::PutItem> items;
  for (int i = 0; i < kBlobs; ++i) {
    keys.push_back(Key(i / 16, i % 16));
    data.push_back(Bytes(100 + 997 * (i % 40), i + 1));
  }
  for (int i = 0; i < kBlobs; ++i) {
    StoreClient::PutItem item;
    item.peer = peer_;
    item.key = keys[i];
    item.version = 0;
    item.data = data[i].data();
    item.size = data[i].size();
    items.push_back(item);
  }
  ASSERT_TRUE(client_->PutMany(absl::MakeSpan(items)).ok());
  for (int i = 0; i < kBlobs; ++i) {
    ASSERT_TRUE(items[i].status.ok());
    EXPECT_EQ(items[i].info.key().expert(), keys[i].expert());
    EXPECT_EQ(items[i].info.size_bytes(), data[i].size());
  }
  ASSERT_TRUE(Commit(0).ok());
  auto got = FetchAll(keys, 64 << 10);
  for (int i = 0; i < kBlobs; ++i) EXPECT_EQ(got[i], data[i]) << i;
}

TEST_F(StoreE2eTest, AMasterFromTheWeightsBufferGoesAsAReferenceToThem) {
  StartStore();
  constexpr size_t kSize = 30000;
  std::vector<std::vector<uint8_t>> data;
  for (int e = 0; e < 11; ++e) data.push_back(Bytes(kSize, e + 1));
  const std::vector<uint8_t> copy = data[10];  // equal bytes, another buffer: sent
  std::vector<StoreClient::PutItem> items;
  auto add = [&](int e, v1::BlobKind kind, const std::vector<uint8_t>& bytes) {
    StoreClient::PutItem item;
    item.peer = peer_;
    item.key = Key(0, e, kind);
    item.version = 0;
    item.data = bytes.data();
    item.size = bytes.size();
    items.push_back(item);
  };
  for (int e = 0; e < 10; ++e) {  // either kind first
    add(e, e % 2 ? v1::BLOB_KIND_MASTER : v1::BLOB_KIND_WEIGHTS, data[e]);
    add(e, e % 2 ? v1::BLOB_KIND_WEIGHTS : v1::BLOB_KIND_MASTER, data[e]);
  }
  add(10, v1::BLOB_KIND_WEIGHTS, data[10]);
  add(10, v1::BLOB_KIND_MASTER, copy);
  // The buffers are free once the payloads are answered, before the references go.
  int freed = 0, answered_then = 0;
  ASSERT_TRUE(client_
                  ->PutMany(absl::MakeSpan(items), absl::Seconds(30),
                            [&](const absl::Status& st) {
                              EXPECT_TRUE(st.ok()) << st;
                              ++freed;
                              for (const auto& item : items)
                                answered_then += item.info.size_bytes() > 0;
                            })
                  .ok());
  EXPECT_EQ(freed, 1);
  EXPECT_EQ(answered_then, 12);  // 11 weights and the master sent from its own buffer
  int references = 0;
  for (const auto& item : items) {
    ASSERT_TRUE(item.status.ok()) << item.status;
    EXPECT_EQ(item.info.size_bytes(), kSize);
    references += item.by_reference;
  }
  EXPECT_EQ(references, 10);  // what the worker's put_bytes leaves out
  // RAM holds the 11 weights and the one master that was sent; the ten references share
  // their weights' bytes on disk.
  const uint64_t ram = Stats().ram_bytes();
  EXPECT_GE(ram, 12 * kSize);
  EXPECT_LT(ram, 16 * kSize);
  ASSERT_TRUE(Commit(0).ok());
  std::vector<v1::BlobKey> masters;
  for (int e = 0; e < 11; ++e) masters.push_back(Key(0, e, v1::BLOB_KIND_MASTER));
  auto got = FetchAll(masters, 64 << 10);
  for (int e = 0; e < 11; ++e) EXPECT_EQ(got[e], data[e]) << e;
}

TEST_F(StoreE2eTest, PutGetCommitAbortAndBatchedGet) {
  StartStore();
  const std::vector<size_t> sizes = {100, 64 << 10, 1 << 20, 3 << 20};
  std::vector<v1::BlobKey> keys;
  for (size_t i = 0; i < sizes.size(); ++i) {
    keys.push_back(Key(0, static_cast<int>(i)));
    ASSERT_TRUE(PutBytes(keys[i], 0, Bytes(sizes[i], i)).ok())
        << PutBytes(keys[i], 0, Bytes(sizes[i], i)) << store_->Log();
  }
  ASSERT_TRUE(Commit(0).ok());
  auto got = FetchAll(keys, 4 << 20);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(got[i], Bytes(sizes[i], i)) << i;

  // Version 1 pending: readers still see version 0; abort drops it.
  ASSERT_TRUE(PutBytes(keys[2], 1, Bytes(sizes[2], 100)).ok());
  EXPECT_EQ(FetchAll({keys[2]}, 4 << 20)[0], Bytes(sizes[2], 2));
  EXPECT_FALSE(Stat(keys[2], 1)->committed());
  {
    grpc::ClientContext ctx;
    v1::AbortStepRequest req;
    req.set_job_id("job");
    req.set_step(1);
    v1::AbortStepResponse resp;
    ASSERT_TRUE(stub_->AbortStep(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.blobs_discarded(), 1u);
  }
  EXPECT_EQ(Stat(keys[2], 1).status().code(), absl::StatusCode::kNotFound);
  // Written again and committed, version 1 is what readers get.
  for (size_t i = 0; i < sizes.size(); ++i)
    ASSERT_TRUE(PutBytes(keys[i], 1, Bytes(sizes[i], 200 + i)).ok());
  ASSERT_TRUE(Commit(1).ok());
  got = FetchAll(keys, 4 << 20);
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(got[i], Bytes(sizes[i], 200 + i)) << i;
  EXPECT_EQ(Stat(keys[0])->version(), 1);
  EXPECT_EQ(store_->Terminate(), 0) << store_->Log();
}

TEST_F(StoreE2eTest, RamBudgetFarBelowTheData) {
  StartStore(/*ram_bytes=*/4 << 20, /*max_blob=*/1 << 20);  // 4 MiB of RAM, 32 MiB of data
  const int kBlobs = 64;
  std::vector<v1::BlobKey> keys;
  for (int e = 0; e < kBlobs; ++e) {
    keys.push_back(Key(e / 16, e % 16));
    ASSERT_TRUE(PutBytes(keys.back(), 0, Bytes(512 << 10, e)).ok());
  }
  ASSERT_TRUE(Commit(0).ok());
  // The working set moves through the data in shuffled groups of 8 blobs (which fit the
  // RAM tier), each group fetched three times in batches of 4: first cold reads are
  // served in place, second ones promote, and each group demotes the one before.
  std::mt19937 rng(5);
  std::vector<int> order(kBlobs);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  for (int group = 0; group < kBlobs; group += 8) {
    for (int pass = 0; pass < 3; ++pass) {
      for (int start = group; start < group + 8; start += 4) {
        std::vector<v1::BlobKey> batch;
        for (int j = start; j < start + 4; ++j) batch.push_back(keys[order[j]]);
        auto got = FetchAll(batch, 512 << 10);
        for (int j = 0; j < 4; ++j) ASSERT_EQ(got[j], Bytes(512 << 10, order[start + j]));
      }
    }
  }
  const v1::StoreStats s = Stats();
  EXPECT_LE(s.ram_bytes(), 4u << 20);
  EXPECT_GT(s.demotions(), 64u);
  EXPECT_GT(s.promotions(), 32u);
  EXPECT_GT(s.rocksdb_gets(), 64u);
  EXPECT_EQ(s.rocksdb_bytes(), 64u * (512 << 10));
}

TEST_F(StoreE2eTest, KillDashNineMidStepLosesNoCommittedVersion) {
  StartStore();
  const int kBlobs = 24, kSteps = 3;
  for (int step = 0; step < kSteps; ++step) {
    for (int e = 0; e < kBlobs; ++e)
      ASSERT_TRUE(PutBytes(Key(1, e), step, Bytes(200 << 10, step * 100 + e)).ok());
    ASSERT_TRUE(Commit(step).ok());
  }
  // Write step 3 from another thread and kill the store while it is at it.
  std::atomic<int> written{0};
  std::thread writer([&] {
    for (int e = 0; e < kBlobs; ++e) {
      // A dead store is noticed by the request deadline.
      if (!PutBytes(Key(1, e), kSteps, Bytes(200 << 10, 999 + e), absl::Seconds(3)).ok()) return;
      ++written;
    }
  });
  while (written < kBlobs / 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  store_->Kill();
  writer.join();
  ASSERT_GT(written.load(), 0);
  ASSERT_LT(written.load(), kBlobs) << "the kill came too late to land mid-step";

  StartStore();
  std::vector<v1::BlobKey> keys;
  for (int e = 0; e < kBlobs; ++e) keys.push_back(Key(1, e));
  auto got = FetchAll(keys, 200 << 10);
  for (int e = 0; e < kBlobs; ++e) {
    EXPECT_EQ(got[e], Bytes(200 << 10, (kSteps - 1) * 100 + e)) << e;
    auto info = Stat(Key(1, e));
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->version(), kSteps - 1);
    EXPECT_EQ(info->crc32c(), Crc32c(got[e].data(), got[e].size()));
    EXPECT_EQ(Stat(Key(1, e), kSteps).status().code(), absl::StatusCode::kNotFound);
  }
  EXPECT_EQ(Stats().pending_blobs(), 0u);
}

// The coordinator decides a step's commit only once the job's stores prepared it: a store
// process killed between the decision and its commit has the step after the restart and
// commits it, so the decision holds.
// A put names its step's attempt: once attempt 6 wrote here, attempt 5's late puts (a
// stalled worker of a voided attempt) are refused, sent or as references alike.
TEST_F(StoreE2eTest, AVoidedAttemptsLatePutsAreRefused) {
  StartStore();
  const std::vector<uint8_t> now = Bytes(30000, 1), late = Bytes(30000, 2);
  auto put = [&](int64_t attempt, const std::vector<uint8_t>& bytes, bool with_master) {
    std::vector<StoreClient::PutItem> items;
    for (v1::BlobKind kind : {v1::BLOB_KIND_WEIGHTS, v1::BLOB_KIND_MASTER}) {
      if (kind == v1::BLOB_KIND_MASTER && !with_master) continue;
      StoreClient::PutItem item;
      item.peer = peer_;
      item.key = Key(0, 0, kind);
      item.version = 1;
      item.attempt = attempt;
      item.data = bytes.data();
      item.size = bytes.size();
      items.push_back(item);
    }
    (void)client_->PutMany(absl::MakeSpan(items));
    return items;
  };
  for (const auto& item : put(6, now, true)) ASSERT_TRUE(item.status.ok()) << item.status;
  for (const auto& item : put(5, late, true)) {
    EXPECT_EQ(item.status.code(), absl::StatusCode::kAborted) << item.status;
    EXPECT_TRUE(absl::StrContains(item.status.message(), "attempt 6 replaced it")) << item.status;
  }
  for (const auto& item : put(7, late, false)) ASSERT_TRUE(item.status.ok()) << item.status;
  // The master of attempt 7, as a reference to its weights: accepted; one of attempt 6's
  // after it is not.
  std::vector<StoreClient::PutItem> refs = put(7, late, true);
  EXPECT_TRUE(refs[1].status.ok()) << refs[1].status;
  refs = put(6, late, true);
  EXPECT_EQ(refs[0].status.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(refs[1].status.code(), absl::StatusCode::kAborted);
}

TEST_F(StoreE2eTest, KillDashNineBetweenPrepareAndCommitLosesNothingPrepared) {
  StartStore();
  const int kBlobs = 12;
  for (int e = 0; e < kBlobs; ++e) ASSERT_TRUE(PutBytes(Key(1, e), 0, Bytes(200 << 10, e)).ok());
  ASSERT_TRUE(Commit(0).ok());
  for (int e = 0; e < kBlobs; ++e) {
    ASSERT_TRUE(PutBytes(Key(1, e), 1, Bytes(200 << 10, 100 + e)).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::PrepareStepRequest req;
    req.set_job_id("job");
    req.set_step(1);
    v1::PrepareStepResponse resp;
    ASSERT_TRUE(stub_->PrepareStep(&ctx, req, &resp).ok());
    EXPECT_EQ(resp.blobs_prepared(), static_cast<uint64_t>(kBlobs));
  }
  store_->Kill();

  StartStore();
  EXPECT_EQ(Stats().pending_blobs(), static_cast<uint64_t>(kBlobs));
  grpc::ClientContext ctx;
  v1::CommitStepRequest req;
  req.set_job_id("job");
  req.set_step(1);
  req.set_previous_step(0);
  v1::CommitStepResponse resp;
  ASSERT_TRUE(stub_->CommitStep(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.blobs_committed(), static_cast<uint64_t>(kBlobs));
  std::vector<v1::BlobKey> keys;
  for (int e = 0; e < kBlobs; ++e) keys.push_back(Key(1, e));
  auto got = FetchAll(keys, 200 << 10);
  for (int e = 0; e < kBlobs; ++e) EXPECT_EQ(got[e], Bytes(200 << 10, 100 + e)) << e;
  EXPECT_EQ(Stats().pending_blobs(), 0u);
}

// An ext4 file system on a loop device over an image file: the image is the disk, so a
// copy of it taken after the store was killed holds what a power cut would have left
// (the file system's dirty pages, written by the store but not synced, are not in it).
class LoopDisk {
 public:
  // Formats `image` (64 MiB) and mounts it at `mount`; false where this cannot be done.
  static bool Format(const std::string& image) {
    return Sh("truncate -s 64M " + image + " && mkfs.ext4 -q -F " + image);
  }
  // Mounts `image`; `commit=60`: the journal commits by itself only each minute, so what
  // nobody synced stays in the page cache.
  bool Mount(const std::string& image, const std::string& mount) {
    std::filesystem::create_directories(mount);
    mount_ = mount;
    mounted_ = Sh("mount -o loop,commit=60 " + image + " " + mount);
    return mounted_;
  }
  ~LoopDisk() {
    if (mounted_) Sh("umount " + mount_);
  }
  static bool Sh(const std::string& command) {
    return std::system(("(" + command + ") >/dev/null 2>&1").c_str()) == 0;
  }

 private:
  std::string mount_;
  bool mounted_ = false;
};

// Puts steps 0 and 1 of 8 blobs, kills the store right after the last commit returns and
// takes the disk as a power cut would leave it; then starts a store on that disk and
// returns how many blobs it has at step 1 (-1: the store did not start).
int BlobsAtStepOneAfterAPowerCut(StoreE2eTest* t, const std::vector<std::string>& flags);

// A put refused for want of disk reaches the client as such (the reply's disk_full: a
// worker names the store to the coordinator, which stops using it for jobs with other
// copies); a put refused for another limit does not. The store keeps serving.
TEST_F(StoreE2eTest, APutRefusedForWantOfDiskIsToldFromOtherLimits) {
  const std::string mnt = dir_ + "/mnt";
  const pith::testing::ScopedTmpfs tmpfs(mnt, "160m");
  if (!tmpfs.mounted()) GTEST_SKIP() << tmpfs.why();
  ASSERT_NO_FATAL_FAILURE(StartStore(64 << 20, 4 << 20, mnt + "/data",
                                     {"--disk_reserve_bytes=" + std::to_string(8 << 20)}));
  const std::vector<uint8_t> blob = Bytes(1 << 20, 3);
  absl::Status put;
  int landed = 0;
  for (; landed < 256; ++landed) {
    put = PutBytes(Key(0, landed), 0, blob);
    if (!put.ok()) break;
  }
  EXPECT_EQ(put.code(), absl::StatusCode::kResourceExhausted) << put;
  EXPECT_TRUE(IsDiskFull(put)) << put;
  EXPECT_NE(put.message().find("--disk_reserve_bytes"), std::string::npos) << put;
  EXPECT_GT(landed, 40);  // the log files' 64 MiB and the reserve aside
  const absl::Status big = PutBytes(Key(1, 0), 0, Bytes(5 << 20, 4));  // over --max_blob_bytes
  EXPECT_EQ(big.code(), absl::StatusCode::kResourceExhausted) << big;
  EXPECT_FALSE(IsDiskFull(big)) << big;
  EXPECT_TRUE(Commit(0).ok());  // the reserve keeps its index writable
  EXPECT_TRUE(Stat(Key(0, 0)).ok());
  store_.reset();  // before the unmount
}

// A step is reported committed only once it is on disk: cut the power (the disk as the
// kernel had written it when the store died) right after the commit returns, and the
// step is all there. With the interval sync (--sync_interval_ms) the same cut loses it:
// the test tells the two apart.
TEST_F(StoreE2eTest, AStepCommittedBeforeAPowerCutIsThereAfterIt) {
  if (geteuid() != 0 || !LoopDisk::Sh("command -v mkfs.ext4 && command -v losetup")) {
    GTEST_SKIP() << "needs root, mkfs.ext4 and loop devices";
  }
  const std::string small_disk = "--disk_reserve_bytes=" + std::to_string(4 << 20);
  const int synced = BlobsAtStepOneAfterAPowerCut(this, {small_disk});
  const int interval = BlobsAtStepOneAfterAPowerCut(this, {small_disk, "--sync_interval_ms=60000"});
  std::printf(
      "after the cut: %d of 8 blobs at the last committed step (sync at commit), %d "
      "(interval sync)\n",
      synced, interval);
  EXPECT_EQ(synced, 8);
  EXPECT_LT(interval, 8);
}

int BlobsAtStepOneAfterAPowerCut(StoreE2eTest* t, const std::vector<std::string>& flags) {
  static int cuts = 0;
  const std::string base = t->dir_ + "/cut" + std::to_string(++cuts);
  const std::string disk = base + ".img", after = base + ".after.img";
  if (!LoopDisk::Format(disk)) {
    ADD_FAILURE() << "mkfs.ext4 failed";
    return -1;
  }
  {
    LoopDisk mounted;
    if (!mounted.Mount(disk, base + "/mnt")) {
      ADD_FAILURE() << "cannot mount a loop device";
      return -1;
    }
    t->StartStore(64 << 20, 4 << 20, base + "/mnt/store", flags);
    if (::testing::Test::HasFatalFailure()) return -1;
    for (int step = 0; step < 2; ++step) {
      for (int e = 0; e < 8; ++e) {
        EXPECT_TRUE(t->PutBytes(Key(2, e), step, Bytes(100 << 10, step * 10 + e)).ok());
      }
      EXPECT_TRUE(t->Commit(step).ok());
    }
    t->store_->Kill();  // at once: what it wrote and did not sync is still dirty
    if (!LoopDisk::Sh("cp --sparse=always " + disk + " " + after)) {
      ADD_FAILURE() << "cannot copy the disk";
      return -1;
    }
  }
  LoopDisk restarted;
  if (!restarted.Mount(after, base + "/mnt_after")) {
    ADD_FAILURE() << "the disk left by the cut does not mount";
    return -1;
  }
  t->StartStore(64 << 20, 4 << 20, base + "/mnt_after/store", flags);
  if (::testing::Test::HasFatalFailure()) return -1;
  int whole = 0;
  for (int e = 0; e < 8; ++e) {
    absl::StatusOr<v1::BlobInfo> info = t->Stat(Key(2, e), 1);
    if (!info.ok()) continue;
    std::vector<std::vector<uint8_t>> got = t->FetchAll({Key(2, e)}, 100 << 10);
    if (got[0] == Bytes(100 << 10, 10 + e)) ++whole;
  }
  t->store_->Kill();
  return whole;
}

// Checkpoint writes only under the store's --export_root: a path outside it, through `..`
// or through a symlink is INVALID_ARGUMENT, an existing file ALREADY_EXISTS and kept, and
// nothing is written elsewhere; a path under the root is exported.
TEST_F(StoreE2eTest, CheckpointWritesOnlyUnderTheExportRoot) {
  const std::string root = dir_ + "/exports";
  StartStore(64 << 20, 4 << 20, "", {"--export_root=" + root});
  ASSERT_TRUE(PutBytes(Key(0, 0), 0, Bytes(4096, 1)).ok());
  ASSERT_TRUE(Commit(0).ok());
  std::filesystem::create_symlink(dir_, root + "/out");
  std::ofstream(root + "/taken.safetensors") << "mine";
  auto checkpoint = [&](const std::string& export_path, const std::string& checkpoint_dir) {
    grpc::ClientContext ctx;
    v1::CheckpointRequest req;
    req.set_export_job_id("job");
    req.set_export_path(export_path);
    req.set_checkpoint_dir(checkpoint_dir);
    v1::CheckpointResponse resp;
    return stub_->Checkpoint(&ctx, req, &resp).error_code();
  };
  for (const std::string& outside :
       {dir_ + "/elsewhere.safetensors", root + "/../elsewhere.safetensors",
        std::string("out/elsewhere.safetensors"), std::string("/tmp/elsewhere.safetensors")}) {
    EXPECT_EQ(checkpoint(outside, ""), grpc::StatusCode::INVALID_ARGUMENT) << outside;
  }
  EXPECT_EQ(checkpoint("", dir_ + "/rocks"), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(checkpoint("taken.safetensors", ""), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/elsewhere.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/rocks"));
  std::string kept;
  std::getline(std::ifstream(root + "/taken.safetensors"), kept);
  EXPECT_EQ(kept, "mine");
  EXPECT_EQ(checkpoint("jobs/job.safetensors", "rocks"), grpc::StatusCode::OK);
  EXPECT_TRUE(SafetensorsFile::Read(root + "/jobs/job.safetensors").ok());
  EXPECT_TRUE(std::filesystem::exists(root + "/rocks/CURRENT"));
}

// Clients killed (kill -9) with many writes half-sent, one after another: the store
// outlives every one (a dead peer's rendezvous requests still arriving must not reach a
// freed endpoint) and answers at once after each. PITH_FLOOD_KILLS sets the number of
// kills, PITH_FLOOD_BYTES one size for all the floods.
TEST_F(StoreE2eTest, ClientsKilledWithWritesInFlightLeaveTheStoreServing) {
  StartStore(/*ram_bytes=*/64 << 20, /*max_blob=*/1 << 20);
  const char* env = std::getenv("PITH_FLOOD_KILLS");
  // Two ways a dying client hurt a store: a crash inside UCX when it died with large
  // writes half-sent (once in ~16 kills: 1 MiB rendezvous payloads, every 8th flood here),
  // and, over UCX's shared-memory FIFOs, a store deaf to everyone once a client died in the
  // middle of writing a message into its FIFO (after 41, 95 and 144 kills of floods of
  // 7000-byte eager writes: the others here). After each kill the store must answer.
  const int kills = env ? std::atoi(env) : 300;
  const char* bytes_env = std::getenv("PITH_FLOOD_BYTES");
  std::mt19937 rng(7);
  for (int k = 0; k < kills; ++k) {
    const size_t flood_bytes = bytes_env ? std::atoll(bytes_env) : k % 8 == 0 ? 1 << 20 : 7000;
    const std::string log = dir_ + "/flood." + std::to_string(k) + ".log";
    ChildProcess flood(
        PITH_PUT_FLOOD_BINARY,
        {"127.0.0.1:" + std::to_string(store_->grpc_port), std::to_string(flood_bytes), "16",
         Tls().Dir(security::Role::kCoordinator, "coordinator")},
        log);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (flood.Log().find("flooding") == std::string::npos) {
      ASSERT_TRUE(flood.Running()) << "the flood client died: " << flood.Log();
      ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the flood never started";
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 50000));
    flood.Kill();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the store sees the reset
    ASSERT_TRUE(store_->Running())
        << "after kill " << k << " the store exited with status " << store_->exit_status() << ":\n"
        << store_->Log();
    absl::Status answered = PutBytes(Key(9, k % 4), k + 1, Bytes(4096, k), absl::Seconds(5));
    ASSERT_TRUE(answered.ok()) << "after kill " << k << ": " << answered;
  }
  const std::vector<uint8_t> data = Bytes(300 << 10, 5);
  ASSERT_TRUE(PutBytes(Key(1, 0), 0, data).ok());
  ASSERT_TRUE(Commit(0).ok());
  EXPECT_EQ(FetchAll({Key(1, 0)}, 300 << 10)[0], data);
  EXPECT_TRUE(store_->Running()) << store_->Log();
}

// Stops `pid` (SIGSTOP) and waits until it is stopped: a signal is delivered after kill()
// returns, and a request sent meanwhile could still be answered.
void Freeze(pid_t pid) {
  ::kill(pid, SIGSTOP);
  for (int i = 0; i < 1000; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T') return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ADD_FAILURE() << "process " << pid << " did not stop";
}

// Fetches blob (1, 0) from `peer` into `region` with a 2 s deadline: it must fail, and
// within 10 s.
void ExpectFetchFailsByItsDeadline(StoreClient& client, int peer, ucx::MemoryRegion& region) {
  StoreClient::FetchItem item;
  item.key = Key(1, 0);
  item.buffer = region.data();
  item.capacity = region.size();
  item.memh = region.handle();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(client.Fetch(peer, absl::MakeSpan(&item, 1), absl::Seconds(2)).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

// Runs `body` on a thread of its own; if it has not ended within 60 s (stuck in UCX:
// nothing can join it), reports `what`, runs `before_exit` and ends the process.
void RunOrExit(
    const std::function<void()>& body, const std::string& what,
    const std::function<void()>& before_exit = [] {}) {
  std::promise<void> finished;
  std::future<void> done = finished.get_future();
  std::thread runner([&] {
    body();
    finished.set_value();
  });
  if (done.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    ADD_FAILURE() << what << " hung";
    before_exit();
    std::_Exit(1);
  }
  runner.join();
}

TEST_F(StoreE2eTest, AStoreDeadBeforeTheConnectionFailsFetchesWithinTheirDeadline) {
  // A worker joining after a store died may still find it in a placement and connect to
  // its address: every fetch from it fails by its deadline (or at once), and the client
  // closes.
  StartStore();
  store_->Kill();
  RunOrExit(
      [&] {
        auto client = StoreClient::Create();
        ASSERT_TRUE(client.ok()) << client.status();
        auto region = (*client)->AllocateBuffer(1 << 20);
        ASSERT_TRUE(region.ok()) << region.status();
        for (int attempt = 0; attempt < 2; ++attempt) {
          auto peer = (*client)->Connect(ucx_address_);
          if (!peer.ok()) continue;  // refused at once: as good
          ExpectFetchFailsByItsDeadline(**client, *peer, **region);
        }
        region->reset();
        client->reset();
      },
      "fetching from a dead store");
}

TEST_F(StoreE2eTest, AStoreThatStopsAnsweringFailsFetchesByTheirDeadline) {
  // The store freezes (SIGSTOP) with a fetch in flight, then dies: the fetch fails by its
  // deadline, the endpoint is dropped without waiting for the peer, the next fetch fails at
  // once (the client backs off from that store), and the client closes.
  StartStore();
  ASSERT_TRUE(PutBytes(Key(1, 0), 0, Bytes(200 << 10, 1)).ok());
  ASSERT_TRUE(Commit(0).ok());
  FetchAll({Key(1, 0)}, 200 << 10);  // connected, wired up
  Freeze(store_->pid());
  RunOrExit(
      [&] {
        auto region = client_->AllocateBuffer(1 << 20);
        ASSERT_TRUE(region.ok()) << region.status();
        for (int attempt = 0; attempt < 2; ++attempt) {
          ExpectFetchFailsByItsDeadline(*client_, peer_, **region);
        }
        region->reset();
        client_.reset();
      },
      "fetching from a frozen store", [&] { store_->Kill(); });
  store_->Kill();
}

TEST_F(StoreE2eTest, AStoreThatAnswersAfterTheDeadlineLeavesTheClientServing) {
  // The store freezes with fetches in flight and wakes after their deadline: its late
  // answers (rendezvous sends naming the client's endpoint of the timed-out connection,
  // which the client left open) are dropped, and the client's next fetch from the same
  // peer id goes over a new connection by itself (a worker keeps its peer ids).
  StartStore();
  const std::vector<uint8_t> data = Bytes(200 << 10, 1);
  ASSERT_TRUE(PutBytes(Key(1, 0), 0, data).ok());
  ASSERT_TRUE(Commit(0).ok());
  auto region = client_->AllocateBuffer(1 << 20);
  ASSERT_TRUE(region.ok()) << region.status();
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(FetchAll({Key(1, 0)}, 200 << 10)[0], data);
    Freeze(store_->pid());
    std::memset((*region)->data(), 0xab, (*region)->size());
    ExpectFetchFailsByItsDeadline(*client_, peer_, **region);
    ::kill(store_->pid(), SIGCONT);
    // The late answers land meanwhile; a fetch within the backoff fails at once.
    StoreClient::FetchItem early;
    early.key = Key(1, 0);
    early.buffer = (*region)->data();
    early.capacity = (*region)->size();
    EXPECT_TRUE(absl::IsUnavailable(client_->Fetch(peer_, absl::MakeSpan(&early, 1))));
    absl::SleepFor(StoreClient::kReconnectBackoff);
    // Nothing landed in the buffer after the fetch gave up.
    EXPECT_EQ((*region)->data()[0], 0xab);
    EXPECT_EQ((*region)->data()[(200 << 10) - 1], 0xab);
  }
  EXPECT_EQ(FetchAll({Key(1, 0)}, 200 << 10)[0], data);
  EXPECT_TRUE(store_->Running()) << store_->Log();
}

// A client outlives any number of timeouts: each timed-out endpoint closes its linger
// (here 5 s) after its timeout. While kMaxRetiredEndpoints are open, a failed store is
// not connected again; once the oldest have closed, it is.
TEST_F(StoreE2eTest, TimedOutEndpointsCloseAfterTheirLingerAndTheStoreIsReachedAgain) {
  retired_linger_ = absl::Seconds(5);
  StartStore();
  const std::vector<uint8_t> data = Bytes(1000, 7);
  const absl::Status first = PutBytes(Key(1, 0), 0, data);
  ASSERT_TRUE(first.ok()) << first;
  Freeze(store_->pid());
  // A put tries again at once, over a new endpoint each time (64 in about 2 s here).
  for (size_t i = 0; i < StoreClient::kMaxRetiredEndpoints; ++i) {
    const absl::Status s = PutBytes(Key(1, 0), 1, data, absl::Milliseconds(20));
    ASSERT_TRUE(absl::IsDeadlineExceeded(s)) << "put " << i << ": " << s;
  }
  const absl::Status refused = PutBytes(Key(1, 0), 1, data, absl::Milliseconds(20));
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_NE(refused.message().find("not reconnected while 64 connections"), std::string::npos)
      << refused;
  ::kill(store_->pid(), SIGCONT);
  absl::SleepFor(absl::Milliseconds(5200));
  ASSERT_TRUE(PutBytes(Key(1, 0), 1, data).ok());
  ASSERT_TRUE(Commit(1).ok());
  EXPECT_EQ(FetchAll({Key(1, 0)}, data.size())[0], data);
  EXPECT_TRUE(store_->Running()) << store_->Log();
}

TEST_F(StoreE2eTest, BadInputOnBothPlanesAndTheStoreKeepsServing) {
  StartStore(64 << 20, 1 << 20);
  ASSERT_TRUE(PutBytes(Key(0, 0), 0, Bytes(1000, 1)).ok());
  ASSERT_TRUE(Commit(0).ok());

  // Unknown key: NOT_FOUND on both planes.
  EXPECT_EQ(Stat(Key(9, 9)).status().code(), absl::StatusCode::kNotFound);
  auto region = client_->AllocateBuffer(1 << 20);
  ASSERT_TRUE(region.ok());
  StoreClient::FetchItem item;
  item.key = Key(9, 9);
  item.buffer = (*region)->data();
  item.capacity = (*region)->size();
  EXPECT_EQ(client_->Fetch(peer_, absl::MakeSpan(&item, 1)).code(), absl::StatusCode::kNotFound);
  // A buffer too small: RESOURCE_EXHAUSTED, nothing written past it.
  item.key = Key(0, 0);
  item.capacity = 10;
  EXPECT_EQ(client_->Fetch(peer_, absl::MakeSpan(&item, 1)).code(),
            absl::StatusCode::kResourceExhausted);
  // Over the blob limit: RESOURCE_EXHAUSTED.
  const auto big = Bytes((1 << 20) + 1, 3);
  EXPECT_EQ(client_->Put(peer_, Key(0, 1), 0, big.data(), big.size()).status().code(),
            absl::StatusCode::kResourceExhausted);
  // Malformed: an invalid key on gRPC and on UCX.
  v1::BlobKey bad = Key(0, 0);
  bad.set_kind(v1::BLOB_KIND_UNSPECIFIED);
  EXPECT_EQ(Stat(bad).status().code(), absl::StatusCode::kInvalidArgument);
  const auto small = Bytes(10, 4);
  EXPECT_EQ(client_->Put(peer_, bad, 0, small.data(), small.size()).status().code(),
            absl::StatusCode::kInvalidArgument);
  {
    grpc::ClientContext ctx;
    v1::ListBlobsRequest req;
    req.set_job_id("job");
    req.set_page_token("%%%");
    v1::ListBlobsResponse resp;
    EXPECT_EQ(FromGrpcStatus(stub_->ListBlobs(&ctx, req, &resp)).code(),
              absl::StatusCode::kInvalidArgument);
  }
  // A raw UCX peer that says hello and then sends garbage gets INVALID_ARGUMENT back; one
  // that never said hello is not answered, and the store goes on serving.
  {
    auto raw = ucx::Worker::Create();
    ASSERT_TRUE(raw.ok());
    absl::Notification got_reply;
    v1::UcxBlobReply reply;
    (*raw)->SetHandler(v1::UCX_MESSAGE_GET_REPLY, [&](ucx::AmMessage& m) {
      reply.ParseFromString(m.header);
      got_reply.Notify();
    });
    ASSERT_TRUE((*raw)->Start().ok());
    ucp_ep_h ep = nullptr;
    (*raw)->RunSync([&] {
      auto connected = (*raw)->Connect(ucx_address_, nullptr);
      ASSERT_TRUE(connected.ok());
      ep = *connected;
    });
    ASSERT_NE(ep, nullptr);
    const auto send = [&](uint16_t id, std::string header) {
      (*raw)->RunSync([&] {
        (*raw)->Send(ep, id, std::move(header), nullptr, 0, nullptr, true, [](absl::Status) {});
      });
    };
    send(v1::UCX_MESSAGE_GET_REQUEST, "\xff\xff\xff garbage");
    EXPECT_FALSE(got_reply.WaitForNotificationWithTimeout(absl::Seconds(1)));
    v1::UcxHello hello;
    hello.set_client_id(77);
    hello.set_worker_address((*raw)->address());
    send(v1::UCX_MESSAGE_HELLO, hello.SerializeAsString());
    send(v1::UCX_MESSAGE_GET_REQUEST, "\xff\xff\xff garbage");
    ASSERT_TRUE(got_reply.WaitForNotificationWithTimeout(absl::Seconds(10)));
    EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  }
  // Still serving.
  EXPECT_EQ(FetchAll({Key(0, 0)}, 1 << 20)[0], Bytes(1000, 1));
  EXPECT_EQ(store_->Terminate(), 0) << store_->Log();
}

}  // namespace
}  // namespace pith::store

namespace pith::store {
namespace {

// A test's directory, made empty; removed at the end of a passing test (a failing one's
// stays for a look).

// Two stores: PullBlobs copies committed blobs from one to the other over UCX; Checkpoint
// writes a RocksDB checkpoint and a safetensors export.
TEST(StorePeerTest, PullBlobsAndCheckpoint) {
  const std::string dir = ::testing::TempDir() + "/store_peer_" + std::to_string(getpid());
  const pith::testing::ScratchDir scratch(
      dir);  // declared before the stores: removed after they stop
  std::vector<std::unique_ptr<pith::testing::ChildProcess>> stores;
  std::vector<std::unique_ptr<v1::StoreService::Stub>> stubs;
  std::vector<std::string> addresses;
  for (int i = 0; i < 2; ++i) {
    stores.push_back(std::make_unique<pith::testing::ChildProcess>(
        PITH_STORE_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir + "/data" + std::to_string(i),
                                 "--ram_bytes=64000000", "--export_root=" + dir,
                                 Tls().MemberFlag("store" + std::to_string(i))},
        dir + "/store" + std::to_string(i) + ".log"));
    ASSERT_TRUE(stores.back()->WaitReady()) << stores.back()->Log();
    stubs.push_back(v1::StoreService::NewStub(
        Tls().CoordinatorChannel("127.0.0.1:" + std::to_string(stores.back()->grpc_port))));
    grpc::ClientContext ctx;
    v1::UcxAddress address;
    ASSERT_TRUE(stubs.back()->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address).ok());
    addresses.push_back(address.worker_address());
  }
  auto client = StoreClient::Create();
  ASSERT_TRUE(client.ok());
  auto peer = (*client)->Connect(addresses[0]);
  ASSERT_TRUE(peer.ok());
  std::vector<v1::BlobKey> keys;
  for (int e = 0; e < 6; ++e) {
    keys.push_back(Key(2, e, e % 2 ? v1::BLOB_KIND_ADAM_M : v1::BLOB_KIND_WEIGHTS));
    const auto bytes = Bytes(100000 + 4 * e, e);
    ASSERT_TRUE((*client)->Put(*peer, keys.back(), 3, bytes.data(), bytes.size()).ok());
  }
  {
    grpc::ClientContext ctx;
    v1::CommitStepRequest req;
    req.set_job_id("job");
    req.set_step(3);
    v1::CommitStepResponse resp;
    ASSERT_TRUE(stubs[0]->CommitStep(&ctx, req, &resp).ok());
  }
  // Store 1 pulls them all from store 0.
  {
    grpc::ClientContext ctx;
    v1::PullBlobsRequest req;
    req.set_source_ucx_address(addresses[0]);
    for (const auto& k : keys) *req.add_keys() = k;
    v1::PullBlobsResponse resp;
    grpc::Status s = stubs[1]->PullBlobs(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(resp.pulled_size(), 6);
  }
  for (size_t e = 0; e < keys.size(); ++e) {
    grpc::ClientContext ctx;
    v1::StatBlobRequest req;
    *req.mutable_key() = keys[e];
    req.set_version(-1);
    v1::BlobInfo info;
    ASSERT_TRUE(stubs[1]->StatBlob(&ctx, req, &info).ok());
    EXPECT_EQ(info.version(), 3);
    EXPECT_TRUE(info.committed());
    const auto bytes = Bytes(100000 + 4 * e, e);
    EXPECT_EQ(info.crc32c(), Crc32c(bytes.data(), bytes.size()));
  }
  // Pulling an unknown blob fails cleanly and names it.
  {
    grpc::ClientContext ctx;
    v1::PullBlobsRequest req;
    req.set_source_ucx_address(addresses[0]);
    *req.add_keys() = Key(9, 9);
    v1::PullBlobsResponse resp;
    grpc::Status s = stubs[1]->PullBlobs(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  }
  // Checkpoint: a RocksDB copy and a safetensors export of the job.
  {
    grpc::ClientContext ctx;
    v1::CheckpointRequest req;
    req.set_checkpoint_dir(dir + "/checkpoint");
    req.set_export_job_id("job");
    req.set_export_path(dir + "/job.safetensors");
    v1::CheckpointResponse resp;
    grpc::Status s = stubs[1]->Checkpoint(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.step(), -1);  // pulled blobs carry versions, not a job step
    EXPECT_TRUE(std::filesystem::exists(dir + "/checkpoint/CURRENT"));
    auto file = SafetensorsFile::Read(dir + "/job.safetensors");
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->entries().size(), 6u);
    EXPECT_TRUE(file->Contains("h.2.moe.e0"));
    EXPECT_TRUE(file->Contains("m.h.2.moe.e1"));
    auto e2 = file->Get("h.2.moe.e2");
    ASSERT_TRUE(e2.ok());
    EXPECT_EQ(std::vector<uint8_t>(e2->bytes.begin(), e2->bytes.end()), Bytes(100008, 2));
    // A second checkpoint into the same directory is refused.
    grpc::ClientContext ctx2;
    EXPECT_EQ(stubs[1]->Checkpoint(&ctx2, req, &resp).error_code(),
              grpc::StatusCode::ALREADY_EXISTS);
  }
}

}  // namespace
// The store's RSS in bytes, from /proc.
uint64_t RssBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// A flood of hellos, each with a new client id (and a valid address: the flooder's own):
// the store keeps at most kMaxClients clients and closes retired endpoints past a bound,
// so its memory stays put; then it serves a new client as before.
TEST_F(StoreE2eTest, AFloodOfHellosDoesNotGrowTheStore) {
  StartStore();
  ASSERT_TRUE(PutBytes(Key(1, 0), 0, Bytes(1000, 1)).ok());
  ASSERT_TRUE(Commit(0).ok());
  FetchAll({Key(1, 0)}, 1000);
  const int hellos = 100000;
  const uint64_t before = RssBytes(store_->pid());
  const absl::Time start = absl::Now();
  {
    auto flooder = ucx::Worker::Create();
    ASSERT_TRUE(flooder.ok()) << flooder.status();
    ASSERT_TRUE((*flooder)->Start().ok());
    std::atomic<int> sent{0};
    for (int batch = 0; batch * 1000 < hellos; ++batch) {
      (*flooder)->RunSync([&] {
        auto ep = (*flooder)->Connect(ucx_address_, [](absl::Status) {});
        ASSERT_TRUE(ep.ok()) << ep.status();
        for (int i = 0; i < 1000; ++i) {
          v1::UcxHello hello;
          hello.set_client_id(1000000 + batch * 1000 + i);
          hello.set_worker_address((*flooder)->address());
          (*flooder)->Send(*ep, v1::UCX_MESSAGE_HELLO, hello.SerializeAsString(), nullptr, 0,
                           nullptr, false, [&](absl::Status) { ++sent; });
        }
      });
      while (sent.load() < (batch + 1) * 1000) absl::SleepFor(absl::Milliseconds(1));
    }
    // The store has taken them all once it answers a stat (its handlers run in order).
    absl::SleepFor(absl::Seconds(1));
  }
  const uint64_t after = RssBytes(store_->pid());
  std::cout << hellos << " hellos in " << absl::FormatDuration(absl::Now() - start)
            << ": store RSS " << before / 1024 << " KiB before, " << after / 1024 << " KiB after\n";
  EXPECT_LT(after, before + (20 << 20));
  auto client = StoreClient::Create();
  ASSERT_TRUE(client.ok()) << client.status();
  client_ = std::move(*client);
  auto peer = client_->Connect(ucx_address_);
  ASSERT_TRUE(peer.ok()) << peer.status();
  peer_ = *peer;
  EXPECT_EQ(FetchAll({Key(1, 0)}, 1000)[0], Bytes(1000, 1));
}

}  // namespace pith::store
