// store_fetch_bench: fetches 64 KiB, 1 MiB and 16 MiB blobs from a real pith-store over
// UCX, from the RAM tier and from the RocksDB tier, and measures in the same run the
// anchors for each: ucx_perftest with the same operation (ucp_am_bw: active messages,
// rendezvous for large ones) and transports, and db_bench readrandom with the same value
// size on a warm page cache. One line per case:
//   fetch size=<bytes> tier=<ram|rocksdb> GB/s=<x> anchor_GB/s=<y> ratio=<x/y>
// Usage: store_fetch_bench [--seconds=S] [--pairs=N] [--size=BYTES] [--tier=ram|rocksdb]
//                          [--peer_netns=NS --peer_host=IP]
//   (RAM tier: the fetch and its anchor measured alternately N times each, 3 by default,
//   and their medians compared. GB = 1e9 bytes; --size and --tier run one case, e.g. to profile
//   it). With a peer namespace, the store and ucx_perftest's server run in NS on IP with UCX over
//   TCP only (run the bench itself in another namespace, as tests/bench/netns_fetch_bench.sh does):
//   the fetch against perftest between two hosts' network stacks.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "../e2e/child_process.h"
#include "../e2e/test_tls.h"
#include "common/grpc_util.h"
#include "common/ucx.h"
#include "pith/v1/store.grpc.pb.h"
#include "server/store/store_client.h"

namespace pith::store {
namespace {

using pith::testing::ChildProcess;

double g_seconds = 2.0;
int g_pairs = 3;           // RAM tier: fetch and anchor measured alternately this many times each
std::string g_peer_netns;  // empty: the store and perftest's server run here
std::string g_peer_host = "127.0.0.1";  // where they listen

// A child process of `binary`, inside the peer namespace (UCX over TCP) when there is one.
// The certificates of the store and of the bench's own control calls (mutual TLS), naming
// the address the store listens on.
pith::testing::TestTls& Tls() {
  static auto* tls = new pith::testing::TestTls(
      "/tmp/pith_fetch_bench_tls_" + std::to_string(getpid()), {g_peer_host});
  return *tls;
}

std::unique_ptr<ChildProcess> StartPeer(const std::string& binary, std::vector<std::string> args,
                                        const std::string& log) {
  if (g_peer_netns.empty()) return std::make_unique<ChildProcess>(binary, args, log);
  std::vector<std::string> wrapped = {
      "ip", "netns", "exec", g_peer_netns, "env", "UCX_TLS=tcp,self", binary};
  wrapped.insert(wrapped.end(), args.begin(), args.end());
  return std::make_unique<ChildProcess>("/usr/bin/env", wrapped, log);
}

int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::string Run(const std::string& command) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

// ucx_perftest ucp_am_bw between two processes on this host, in GB/s.
double UcxPerftestGBps(size_t size) {
  const int port = FreePort();
  const long iters = std::max<long>(200, static_cast<long>(4e9 * g_seconds / 2 / size));
  const std::string args = " -t ucp_am_bw -s " + std::to_string(size) + " -n " +
                           std::to_string(iters) + " -p " + std::to_string(port);
  std::unique_ptr<ChildProcess> server =
      StartPeer("/usr/bin/ucx_perftest",
                {"-t", "ucp_am_bw", "-s", std::to_string(size), "-n", std::to_string(iters), "-p",
                 std::to_string(port)},
                "/tmp/pith_perftest_server.log");
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const std::string out = Run("ucx_perftest " + g_peer_host + args + " 2>&1");
  std::smatch m;
  // Final: iters  latency(50%) avg overall  bw-avg(MB/s) bw-overall(MB/s) ...
  const std::regex final_line(R"(Final:\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+([\d.]+))");
  if (!std::regex_search(out, m, final_line)) {
    std::fprintf(stderr, "ucx_perftest gave no result:\n%s\n", out.c_str());
    return 0;
  }
  return std::stod(m[1]) * 1048576.0 / 1e9;  // ucx_perftest's "MB/s" is MiB/s
}

// db_bench readrandom with `size`-byte values, warm page cache, block checksums verified,
// in GB/s: the best of three runs over one filled database (the anchor's noise goes
// against Pith, not for it).
double DbBenchGBps(size_t size, const std::string& dir) {
  const long num = std::max<long>(16, static_cast<long>((256ull << 20) / size));
  const long reads = std::max<long>(100, static_cast<long>(3e9 * g_seconds / 2 / size));
  std::filesystem::remove_all(dir);
  // Checksums verified on read, as the store's RocksDB reads do.
  const std::string common =
      " --compression_type=none --threads=1 --verify_checksum=1 --value_size=" +
      std::to_string(size) + " --num=" + std::to_string(num) + " --db=" + dir;
  Run("db_bench --benchmarks=fillseq" + common + " >/dev/null 2>&1");
  const std::regex line(
      R"(readrandom\s*:\s*[\d.]+ micros/op\s+[\d]+ ops/sec[^;]*;\s*([\d.]+) MB/s)");
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    const std::string out = Run("db_bench --benchmarks=readrandom --use_existing_db=1 --reads=" +
                                std::to_string(reads) + common + " 2>&1");
    std::smatch m;
    if (!std::regex_search(out, m, line)) {
      std::fprintf(stderr, "db_bench gave no result:\n%s\n", out.c_str());
      return 0;
    }
    best = std::max(best, std::stod(m[1]) * 1048576.0 / 1e9);  // db_bench's "MB/s" is MiB/s
  }
  return best;
}

struct Store {
  std::unique_ptr<ChildProcess> process;
  std::unique_ptr<StoreClient> client;
  std::unique_ptr<v1::StoreService::Stub> stub;
  int peer = -1;
};

Store StartStore(const std::string& dir, uint64_t ram_bytes) {
  Store s;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  s.process = StartPeer(PITH_STORE_BINARY,
                        {"--listen=" + g_peer_host + ":0", "--metrics_port=-1",
                         "--data_dir=" + dir + "/data", "--ram_bytes=" + std::to_string(ram_bytes),
                         "--max_blob_bytes=" + std::to_string(16 << 20), Tls().MemberFlag("store")},
                        dir + "/store.log");
  if (!s.process->WaitReady()) {
    std::fprintf(stderr, "pith-store did not start:\n%s\n", s.process->Log().c_str());
    std::exit(1);
  }
  s.stub = v1::StoreService::NewStub(
      Tls().CoordinatorChannel(g_peer_host + ":" + std::to_string(s.process->grpc_port)));
  grpc::ClientContext ctx;
  v1::UcxAddress address;
  if (!s.stub->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address).ok()) std::exit(1);
  s.client = *StoreClient::Create();
  s.peer = *s.client->Connect(address.worker_address());
  return s;
}

v1::BlobKey Key(const std::string& job, int i) {
  v1::BlobKey k;
  k.set_job_id(job);
  k.set_layer(i / 1024);
  k.set_expert(i % 1024);
  k.set_kind(v1::BLOB_KIND_WEIGHTS);
  return k;
}

v1::StoreStats Stats(Store& s) {
  grpc::ClientContext ctx;
  v1::StoreStats stats;
  if (!s.stub->GetStats(&ctx, v1::GetStatsRequest(), &stats).ok()) std::exit(1);
  return stats;
}

// Writes `count` blobs of `size` bytes to job `job` as committed version 0.
void Fill(Store& s, const std::string& job, int count, size_t size) {
  auto buf = *s.client->AllocateBuffer(size);
  for (size_t i = 0; i < size; ++i) buf->data()[i] = static_cast<uint8_t>(i * 31);
  for (int i = 0; i < count; ++i) {
    auto info = s.client->Put(s.peer, Key(job, i), 0, buf->data(), size, buf->handle());
    if (!info.ok()) {
      std::fprintf(stderr, "put failed: %s\n", info.status().ToString().c_str());
      std::exit(1);
    }
  }
  grpc::ClientContext ctx;
  v1::CommitStepRequest req;
  req.set_job_id(job);
  req.set_step(0);
  v1::CommitStepResponse resp;
  s.stub->CommitStep(&ctx, req, &resp);
  // Let RocksDB finish flushing and compacting what was just written before anything is
  // timed, as db_bench's readrandom runs on a database its fill left settled.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  while (std::chrono::steady_clock::now() < deadline) {
    grpc::ClientContext stats_ctx;
    v1::StoreStats stats;
    if (!s.stub->GetStats(&stats_ctx, v1::GetStatsRequest(), &stats).ok()) std::exit(1);
    if (stats.rocksdb_background_jobs() == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Fetches blobs [0, count) of `job`, `batch` per call, from `threads` threads at once (so
// one batch's replies are in flight while another's are consumed, as ucx_perftest keeps a
// window of messages in flight), for g_seconds; GB/s. Each thread reads its own share of
// the blobs round-robin (all of them when there are fewer blobs than threads).
// With `one_buffer` every item of a batch lands in the same buffer (the data is the same
// blob), which keeps source and target cache-resident exactly as ucx_perftest's one
// send and one receive buffer are.
double FetchGBps(Store& s, const std::string& job, int count, size_t size, int batch,
                 int threads = 2, bool one_buffer = false) {
  std::atomic<uint64_t> bytes{0};
  std::atomic<bool> stop{false};
  auto run = [&](int t) {
    auto buf = *s.client->AllocateBuffer(size * batch);
    std::vector<StoreClient::FetchItem> items(batch);
    int lo = (t * count) / threads, hi = ((t + 1) * count) / threads;
    if (lo == hi) lo = 0, hi = count;
    int next = lo;
    auto round = [&] {
      for (int i = 0; i < batch; ++i) {
        items[i].key = Key(job, next);
        next = next + 1 == hi ? lo : next + 1;
        items[i].version = -1;
        items[i].buffer = buf->data() + (one_buffer ? 0 : i * size);
        items[i].capacity = size;
        items[i].memh = buf->handle();
      }
      absl::Status st = s.client->Fetch(s.peer, absl::MakeSpan(items));
      if (!st.ok()) {
        std::fprintf(stderr, "fetch failed: %s\n", st.ToString().c_str());
        std::exit(1);
      }
    };
    // Warm-up: one pass over the whole data set (maps the RocksDB files' pages into the
    // store, as db_bench's fill leaves them warm for its reads).
    for (int done = 0; done < std::max(count / threads, 1); done += batch) round();
    while (!stop) {
      round();
      bytes += size * batch;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(run, t);
  while (bytes.load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const uint64_t start_bytes = bytes.load();
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::duration<double>(g_seconds));
  const uint64_t moved = bytes.load() - start_bytes;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stop = true;
  for (auto& t : pool) t.join();
  return moved / elapsed / 1e9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

std::string Samples(const std::vector<double>& v) {
  std::string out;
  char one[32];
  for (double x : v) {
    std::snprintf(one, sizeof(one), "%s%.3f", out.empty() ? "" : " ", x);
    out += one;
  }
  return out;
}

void Print(size_t size, const char* tier, double gbps, double anchor) {
  std::printf("fetch size=%zu tier=%s GB/s=%.3f anchor_GB/s=%.3f ratio=%.3f\n", size, tier, gbps,
              anchor, anchor > 0 ? gbps / anchor : 0.0);
  std::fflush(stdout);
}

}  // namespace
}  // namespace pith::store

int main(int argc, char** argv) {
  using namespace pith::store;
  size_t only_size = 0;
  std::string only_tier;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seconds=", 10) == 0) {
      g_seconds = std::atof(argv[i] + 10);
    } else if (std::strncmp(argv[i], "--pairs=", 8) == 0) {
      g_pairs = std::max(1, std::atoi(argv[i] + 8));
    } else if (std::strncmp(argv[i], "--size=", 7) == 0) {
      only_size = std::strtoull(argv[i] + 7, nullptr, 10);
    } else if (std::strncmp(argv[i], "--tier=", 7) == 0) {
      only_tier = argv[i] + 7;
    } else if (std::strncmp(argv[i], "--peer_netns=", 13) == 0) {
      g_peer_netns = argv[i] + 13;
    } else if (std::strncmp(argv[i], "--peer_host=", 12) == 0) {
      g_peer_host = argv[i] + 12;
    } else {
      std::fprintf(stderr,
                   "usage: store_fetch_bench [--seconds=S] [--pairs=N] [--size=BYTES] "
                   "[--tier=ram|rocksdb] "
                   "[--peer_netns=NS --peer_host=IP]\n");
      return 2;
    }
  }
  // The store, this client and ucx_perftest on the same UCX transports: Pith's default
  // (no shared-memory FIFOs; see common/ucx.h) unless UCX_TLS says otherwise.
  ::setenv("UCX_TLS", pith::ucx::Transports().c_str(), 1);
  const std::string base = "/tmp/pith_store_fetch_bench_" + std::to_string(getpid());
  const size_t sizes[] = {64 << 10, 1 << 20, 16 << 20};
  auto wanted = [&](size_t size, const char* tier) {
    return (only_size == 0 || only_size == size) && (only_tier.empty() || only_tier == tier);
  };
  if (only_tier.empty() || only_tier == "ram") {
    // RAM tier. The required line mirrors ucx_perftest: one blob, fetched again and again
    // into one buffer, 16 in flight per call. The "ram_many" line fetches 64 MiB of
    // distinct blobs into distinct buffers: memory-bound, for reference.
    Store s = StartStore(base + "/ram", 512ull << 20);
    for (size_t size : sizes) {
      if (!wanted(size, "ram")) continue;
      const std::string job = "ram" + std::to_string(size);
      const int count = static_cast<int>(std::max<size_t>(4, (64ull << 20) / size));
      Fill(s, job, count, size);
      // Both sides move by 25% or more from one measurement to the next (the anchor most):
      // measured alternately, each pair in the other order, and compared by their medians.
      std::vector<double> fetched, anchors;
      for (int pair = 0; pair < g_pairs; ++pair) {
        if (pair % 2 == 1) anchors.push_back(UcxPerftestGBps(size));
        fetched.push_back(FetchGBps(s, job, 1, size, 16, 1, /*one_buffer=*/true));
        if (pair % 2 == 0) anchors.push_back(UcxPerftestGBps(size));
      }
      std::fprintf(stderr, "  (fetch GB/s %s; ucx_perftest GB/s %s)\n", Samples(fetched).c_str(),
                   Samples(anchors).c_str());
      const double anchor = Median(anchors);
      Print(size, "ram", Median(fetched), anchor);
      Print(size, "ram_many", FetchGBps(s, job, count, size, std::min(count, 16)), anchor);
    }
  }
  if (only_tier.empty() || only_tier == "rocksdb") {
    // RocksDB tier: 256 MiB of blobs behind a 64 MiB RAM tier, each thread reading its
    // share round-robin (warm page cache, as db_bench's). Each size gets a fresh store,
    // as db_bench gets a fresh database filled with that size only.
    for (size_t size : sizes) {
      if (!wanted(size, "rocksdb")) continue;
      Store s = StartStore(base + "/rocks" + std::to_string(size), 64ull << 20);
      const int count = static_cast<int>((256ull << 20) / size);
      const std::string job = "rocks" + std::to_string(size);
      Fill(s, job, count, size);
      const int batch =
          static_cast<int>(std::max<size_t>(1, std::min<size_t>(32, (16ull << 20) / size)));
      const pith::v1::StoreStats before = Stats(s);
      const double gbps = FetchGBps(s, job, count, size, batch);
      const pith::v1::StoreStats after = Stats(s);
      std::fprintf(stderr, "  (rocksdb reads %lu, ram reads %lu, promotions %lu)\n",
                   after.rocksdb_gets() - before.rocksdb_gets(),
                   after.ram_gets() - before.ram_gets(), after.promotions() - before.promotions());
      Print(size, "rocksdb", gbps, DbBenchGBps(size, base + "/db_bench"));
    }
  }
  std::filesystem::remove_all(base);
  std::filesystem::remove_all("/tmp/pith_fetch_bench_tls_" + std::to_string(getpid()));
  return 0;
}
