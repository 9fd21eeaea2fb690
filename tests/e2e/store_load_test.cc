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
#include "server/store/store_client.h"

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

TEST(StoreLoadTest, EightThreadsFetchingAndWriting) {
  const char* env = std::getenv("PITH_LOAD_SECONDS");
  const double seconds = env ? std::atof(env) : 60.0;
  const std::string dir = ::testing::TempDir() + "/store_load_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  constexpr uint64_t kRamBytes = 32 << 20;
  pith::testing::ChildProcess store(
      PITH_STORE_BINARY,
      {"--listen=127.0.0.1:0", "--metrics_port=0", "--data_dir=" + dir + "/data",
       "--ram_bytes=" + std::to_string(kRamBytes), "--max_blob_bytes=1048576"},
      dir + "/store.log");
  ASSERT_TRUE(store.WaitReady()) << store.Log();
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(store.grpc_port),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::StoreService::NewStub(channel);
  v1::UcxAddress address;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address).ok());
  }
  auto commit = [&](const std::string& job, int64_t step) {
    grpc::ClientContext ctx;
    v1::CommitStepRequest req;
    req.set_job_id(job);
    req.set_step(step);
    v1::CommitStepResponse resp;
    return FromGrpcStatus(stub->CommitStep(&ctx, req, &resp));
  };

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
  constexpr int kShared = 64;
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
    ASSERT_TRUE(commit("shared", 0).ok());
  }

  std::atomic<int64_t> errors{0}, fetched{0}, written{0}, bytes{0};
  std::atomic<bool> stop{false};
  std::vector<std::string> first_error(8);
  auto worker = [&](int t) {
    StoreClient& client = *clients[t % 2];
    const int peer = peers[t % 2];
    auto region = client.AllocateBuffer(8 * kBlobBytes);
    if (!region.ok()) {
      ++errors;
      return;
    }
    std::vector<uint8_t> expect(kBlobBytes);
    std::mt19937 rng(t);
    const std::string job = "job-" + std::to_string(t);
    int64_t step = 0;
    auto fail = [&](const std::string& what) {
      if (errors++ == 0 || first_error[t].empty()) first_error[t] = what;
    };
    while (!stop) {
      if (rng() % 4 != 0) {
        // Fetch 4 random shared blobs in one call and check every byte.
        std::vector<StoreClient::FetchItem> items(4);
        for (int i = 0; i < 4; ++i) {
          items[i].key = Key("shared", 0, static_cast<int>(rng() % kShared));
          items[i].buffer = (*region)->data() + i * kBlobBytes;
          items[i].capacity = kBlobBytes;
          items[i].memh = (*region)->handle();
        }
        absl::Status s = client.Fetch(peer, absl::MakeSpan(items));
        if (!s.ok()) {
          fail(s.ToString());
          continue;
        }
        for (auto& item : items) {
          Fill(expect.data(), item.key, 0);
          if (std::memcmp(item.buffer, expect.data(), kBlobBytes) != 0) fail("wrong bytes");
        }
        fetched += 4;
        bytes += 4 * kBlobBytes;
      } else {
        // Write this thread's 4 blobs as the next step, commit it, read it back.
        ++step;
        for (int e = 0; e < 4; ++e) {
          uint8_t* p = (*region)->data() + (4 + e) * kBlobBytes;
          Fill(p, Key(job, 1, e), step);
          auto info = client.Put(peer, Key(job, 1, e), step, p, kBlobBytes, (*region)->handle());
          if (!info.ok()) fail(info.status().ToString());
        }
        if (absl::Status s = commit(job, step); !s.ok()) fail(s.ToString());
        written += 4;
        std::vector<StoreClient::FetchItem> items(4);
        for (int e = 0; e < 4; ++e) {
          items[e].key = Key(job, 1, e);
          items[e].buffer = (*region)->data() + e * kBlobBytes;
          items[e].capacity = kBlobBytes;
        }
        if (absl::Status s = client.Fetch(peer, absl::MakeSpan(items)); !s.ok()) fail(s.ToString());
        for (auto& item : items) {
          Fill(expect.data(), item.key, step);
          if (item.info.version() != step ||
              std::memcmp(item.buffer, expect.data(), kBlobBytes) != 0) {
            fail("read-back mismatch");
          }
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) threads.emplace_back(worker, t);
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
      elapsed, static_cast<long long>(fetched.load()), static_cast<long long>(written.load()),
      bytes.load() / elapsed / 1e9, rss_max / 1048576.0);
  for (int t = 0; t < 8; ++t)
    EXPECT_TRUE(first_error[t].empty()) << "thread " << t << ": " << first_error[t];
  EXPECT_EQ(errors.load(), 0);
  EXPECT_GT(fetched.load(), 0);
  EXPECT_GT(written.load(), 0);
  // Bounded: the RAM tier, RocksDB's memtable and caches, and no growth after warm-up.
  EXPECT_LT(rss_max, 512ull << 20);
  EXPECT_LT(rss_max, rss_early + (96ull << 20))
      << "RSS kept growing: " << rss_early << " -> " << rss_max;
  EXPECT_EQ(store.Terminate(), 0) << store.Log();
}

}  // namespace
}  // namespace pith::store
