// Load test: 8 client threads (on two StoreClients) fetching and writing against one
// real pith-store for PITH_LOAD_SECONDS (default 60) seconds: 0 errors, every byte as
// written, and the store's RSS bounded.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "common/crc32c.h"
#include "common/grpc_util.h"
#include "gtest/gtest.h"
#include "pith/v1/store.grpc.pb.h"
#include "scratch_dir.h"
#include "server/store/store_client.h"
#include "test_tls.h"

namespace pith::store {
namespace {

constexpr size_t kBlobBytes = 256 << 10;

v1::BlobKey Key(const std::string& job, int layer, int expert) {
  v1::BlobKey k;
  k.set_job_id(job);
  k.set_layer(layer);
  k.set_expert(expert);
  k.set_kind(v1::BLOB_KIND_WEIGHTS);
  return k;
}

// The content of (job, layer, expert) at `version`, recomputable by any reader.
void Fill(uint8_t* out, const v1::BlobKey& key, int64_t version) {
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(key.job_id()) ^
                                         (key.layer() * 7919 + key.expert() * 104729 + version)));
  for (size_t i = 0; i < kBlobBytes; i += 4) {
    const uint32_t r = rng();
    std::memcpy(out + i, &r, 4);
  }
}

constexpr int kShared = 64;  // blobs of the shared job every thread reads
constexpr int kThreads = 8;

absl::Status Commit(v1::StoreService::Stub& stub, const std::string& job, int64_t step) {
  grpc::ClientContext ctx;
  v1::CommitStepRequest req;
  req.set_job_id(job);
  req.set_step(step);
  v1::CommitStepResponse resp;
  return FromGrpcStatus(stub.CommitStep(&ctx, req, &resp));
}

// What the threads did, and each one's first error.
struct LoadStats {
  std::atomic<int64_t> errors{0}, fetched{0}, written{0}, bytes{0};
  std::vector<std::string> first_error = std::vector<std::string>(kThreads);
};

// One client thread: mostly fetches of shared blobs, sometimes a step of its own job
// written, committed and read back; every byte checked.
class LoadThread {
 public:
  LoadThread(int t, StoreClient& client, int peer, v1::StoreService::Stub& stub, LoadStats& stats)
      : t_(t), client_(client), peer_(peer), stub_(stub), stats_(stats), rng_(t) {}

  void Run(const std::atomic<bool>& stop) {
    auto region = client_.AllocateBuffer(8 * kBlobBytes);
    if (!region.ok()) {
      ++stats_.errors;
      return;
    }
    region_ = region->get();
    while (!stop) {
      if (rng_() % 4 != 0) {
        FetchShared();
      } else {
        WriteStep();
      }
    }
  }

 private:
  void Fail(const std::string& what) {
    if (stats_.errors++ == 0 || stats_.first_error[t_].empty()) stats_.first_error[t_] = what;
  }

  // Fetches 4 random shared blobs in one call and checks every byte.
  void FetchShared() {
    std::vector<StoreClient::FetchItem> items(4);
    for (int i = 0; i < 4; ++i) {
      items[i].key = Key("shared", 0, static_cast<int>(rng_() % kShared));
      items[i].buffer = region_->data() + i * kBlobBytes;
      items[i].capacity = kBlobBytes;
      items[i].memh = region_->handle();
    }
    absl::Status s = client_.Fetch(peer_, absl::MakeSpan(items));
    if (!s.ok()) {
      Fail(s.ToString());
      return;
    }
    for (auto& item : items) {
      Fill(expect_.data(), item.key, 0);
      if (std::memcmp(item.buffer, expect_.data(), kBlobBytes) != 0) Fail("wrong bytes");
    }
    stats_.fetched += 4;
    stats_.bytes += 4 * kBlobBytes;
  }

  // Writes this thread's 4 blobs as the next step, commits it, reads it back.
  void WriteStep() {
    ++step_;
    for (int e = 0; e < 4; ++e) {
      uint8_t* p = region_->data() + (4 + e) * kBlobBytes;
      Fill(p, Key(job_, 1, e), step_);
      auto info = client_.Put(peer_, Key(job_, 1, e), step_, p, kBlobBytes, region_->handle());
      if (!info.ok()) Fail(info.status().ToString());
    }
    if (absl::Status s = Commit(stub_, job_, step_); !s.ok()) Fail(s.ToString());
    stats_.written += 4;
    std::vector<StoreClient::FetchItem> items(4);
    for (int e = 0; e < 4; ++e) {
      items[e].key = Key(job_, 1, e);
      items[e].buffer = region_->data() + e * kBlobBytes;
      items[e].capacity = kBlobBytes;
    }
    if (absl::Status s = client_.Fetch(peer_, absl::MakeSpan(items)); !s.ok()) Fail(s.ToString());
    for (auto& item : items) {
      Fill(expect_.data(), item.key, step_);
      if (item.info.version() != step_ ||
          std::memcmp(item.buffer, expect_.data(), kBlobBytes) != 0) {
        Fail("read-back mismatch");
      }
    }
  }

  const int t_;
  StoreClient& client_;
  const int peer_;
  v1::StoreService::Stub& stub_;
  LoadStats& stats_;
  std::mt19937 rng_;
  const std::string job_ = "job-" + std::to_string(t_);
  int64_t step_ = 0;
  std::vector<uint8_t> expect_ = std::vector<uint8_t>(kBlobBytes);
  ucx::MemoryRegion* region_ = nullptr;  // Run's, 8 blobs: 4 to fetch into, 4 to write from
};

TEST(StoreLoadTest, EightThreadsFetchingAndWriting) {
  const char* env = std::getenv("PITH_LOAD_SECONDS");
  const double seconds = env ? std::atof(env) : 60.0;
  const pith::testing::ScratchDir scratch(::testing::TempDir() + "/store_load_" +
                                          std::to_string(getpid()));
  const std::string& dir = scratch.dir;
  constexpr uint64_t kRamBytes = 32 << 20;
  pith::testing::TestTls tls(dir + "/tls");
  pith::testing::ChildProcess store(
      PITH_STORE_BINARY,
      {"--listen=127.0.0.1:0", "--metrics_port=0", "--data_dir=" + dir + "/data",
       "--ram_bytes=" + std::to_string(kRamBytes), "--max_blob_bytes=1048576",
       tls.MemberFlag("store")},
      dir + "/store.log");
  ASSERT_TRUE(store.WaitReady()) << store.Log();
  auto channel = tls.CoordinatorChannel("127.0.0.1:" + std::to_string(store.grpc_port));
  auto stub = v1::StoreService::NewStub(channel);
  v1::UcxAddress address;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address).ok());
  }

  std::vector<std::unique_ptr<StoreClient>> clients;
  std::vector<int> peers;
  for (int i = 0; i < 2; ++i) {
    auto c = StoreClient::Create();
    ASSERT_TRUE(c.ok());
    auto peer = (*c)->Connect(address.worker_address());
    ASSERT_TRUE(peer.ok());
    peers.push_back(*peer);
    clients.push_back(std::move(*c));
  }

  // A shared job of 64 blobs (16 MiB, half the RAM tier) that every thread reads.
  {
    auto buf = clients[0]->AllocateBuffer(kBlobBytes);
    ASSERT_TRUE(buf.ok());
    for (int e = 0; e < kShared; ++e) {
      Fill((*buf)->data(), Key("shared", 0, e), 0);
      ASSERT_TRUE(
          clients[0]
              ->Put(peers[0], Key("shared", 0, e), 0, (*buf)->data(), kBlobBytes, (*buf)->handle())
              .ok());
    }
    ASSERT_TRUE(Commit(*stub, "shared", 0).ok());
  }

  LoadStats stats;
  std::atomic<bool> stop{false};
  std::vector<std::unique_ptr<LoadThread>> loops;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    loops.push_back(std::make_unique<LoadThread>(t, *clients[t % 2], peers[t % 2], *stub, stats));
    threads.emplace_back([&loop = *loops.back(), &stop] { loop.Run(stop); });
  }
  const auto start = std::chrono::steady_clock::now();
  uint64_t rss_early = 0, rss_max = 0;
  while (std::chrono::steady_clock::now() - start < std::chrono::duration<double>(seconds)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const uint64_t rss = store.RssBytes();
    rss_max = std::max(rss_max, rss);
    if (rss_early == 0 &&
        std::chrono::steady_clock::now() - start > std::chrono::duration<double>(seconds / 3)) {
      rss_early = rss;
    }
  }
  stop = true;
  for (auto& t : threads) t.join();
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "load: %.0f s, %lld fetched, %lld written, %.2f GB/s fetched, store RSS max %.0f MiB\n",
      elapsed, static_cast<long long>(stats.fetched.load()),
      static_cast<long long>(stats.written.load()), stats.bytes.load() / elapsed / 1e9,
      rss_max / 1048576.0);
  for (int t = 0; t < kThreads; ++t)
    EXPECT_TRUE(stats.first_error[t].empty()) << "thread " << t << ": " << stats.first_error[t];
  EXPECT_EQ(stats.errors.load(), 0);
  EXPECT_GT(stats.fetched.load(), 0);
  EXPECT_GT(stats.written.load(), 0);
  // Bounded: the RAM tier, RocksDB's memtable and caches, and no growth after warm-up.
  EXPECT_LT(rss_max, 512ull << 20);
  EXPECT_LT(rss_max, rss_early + (96ull << 20))
      << "RSS kept growing: " << rss_early << " -> " << rss_max;
  EXPECT_EQ(store.Terminate(), 0) << store.Log();
}

}  // namespace
}  // namespace pith::store
