// Bounded memory on real processes (1 coordinator, 2 stores, 2 workers on loopback): a
// worker's peak RSS, read from /proc while its job runs, is flat as the model's experts
// grow (16 vs 1,024 per layer, the same --memory_bytes), while stores whose RAM tiers hold
// a fraction of the expert state spill the rest to RocksDB and the job trains to the end;
// a job whose dense state alone does not fit a worker's budget fails with the reason.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "child_process.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pith/v1/job.grpc.pb.h"
#include "test_tls.h"

namespace pith {
namespace {

using pith::testing::ChildProcess;

constexpr uint64_t kWorkerMemory = 24ull << 20;
constexpr uint64_t kStoreRam = 64ull << 20;

std::string Spec(const std::string& data, int experts, int steps, uint64_t cache_bytes) {
  return R"({"name": "memory", "model": {"vocab_size": 256, "seq_len": 32, "d_model": 64,
  "n_layer": 2, "n_head": 4, "n_expert": )" +
         std::to_string(experts) + R"(, "top_k": 2, "d_ff": 128, "capacity_factor": 2.0,
  "aux_loss_coef": 0.01, "z_loss_coef": 0.001}, "train": {"data_path": ")" +
         data + R"(", "batch": 8, "steps": )" + std::to_string(steps) +
         R"(, "lr": 0.003, "warmup": 2, "grad_clip": 1.0, "seed": 7}, "cluster": {"workers": 2,
  "store_replicas": 2, "cache_bytes": )" +
         std::to_string(cache_bytes) + "}}";
}

// One local cluster and one job on it.
class MemoryRun {
 public:
  MemoryRun(const std::string& name, uint64_t worker_memory)
      : dir_(::testing::TempDir() + "/worker_memory_" + name + "_" + std::to_string(getpid())),
        worker_memory_(worker_memory) {}
  ~MemoryRun() {
    for (auto& w : workers_) w->Terminate();
    for (auto& s : stores_) s->Terminate();
    if (coordinator_) coordinator_->Terminate();
    if (std::getenv("PITH_KEEP_TEST_DIR") == nullptr) std::filesystem::remove_all(dir_);
  }

  void Start() {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::ofstream text(dir_ + "/tokens.bin", std::ios::binary);
    for (int i = 0; i < 300; ++i) text << "Sparse experts, bounded memory: line " << i << ".\n";
    text.close();
    tls_ = std::make_unique<pith::testing::TestTls>(dir_ + "/tls");
    coordinator_ = std::make_unique<ChildProcess>(
        PITH_COORDINATOR_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir_ + "/coordinator", tls_->CoordinatorFlag()},
        dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->WaitReady()) << coordinator_->Log();
    address_ = "127.0.0.1:" + std::to_string(coordinator_->grpc_port);
    stub_ = v1::JobService::NewStub(tls_->AdminChannel(address_));
    for (int n = 0; n < 2; ++n) {
      const std::string id = std::to_string(n);
      stores_.push_back(std::make_unique<ChildProcess>(
          PITH_STORE_BINARY,
          std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                   "--data_dir=" + dir_ + "/store" + id,
                                   "--ram_bytes=" + std::to_string(kStoreRam),
                                   "--max_blob_bytes=" + std::to_string(1 << 20),
                                   "--coordinator=" + address_, tls_->MemberFlag("store" + id)},
          dir_ + "/store" + id + ".log"));
      ASSERT_TRUE(stores_.back()->WaitReady()) << stores_.back()->Log();
    }
    for (int n = 0; n < 2; ++n) {
      workers_.push_back(std::make_unique<ChildProcess>(
          PITH_WORKER_BINARY,
          std::vector<std::string>{"--coordinator=" + address_, "--threads=1",
                                   "--memory_bytes=" + std::to_string(worker_memory_),
                                   "--scratch_dir=" + dir_,
                                   tls_->MemberFlag("worker" + std::to_string(n))},
          dir_ + "/worker" + std::to_string(n) + ".log"));
    }
  }

  // Submits the job and polls it until it ends; the workers' peak RSS is read meanwhile.
  v1::Job Train(int experts, int steps, int seconds = 300, uint64_t cache_bytes = 0) {
    v1::SubmitJobRequest submit;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(
                    Spec(dir_ + "/tokens.bin", experts, steps, cache_bytes), submit.mutable_spec())
                    .ok());
    v1::SubmitJobResponse submitted;
    {
      grpc::ClientContext ctx;
      grpc::Status s = stub_->SubmitJob(&ctx, submit, &submitted);
      EXPECT_TRUE(s.ok()) << s.error_message();
    }
    v1::Job job;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (std::chrono::steady_clock::now() < deadline) {
      grpc::ClientContext ctx;
      v1::GetJobRequest get;
      get.set_job_id(submitted.job().job_id());
      if (!stub_->GetJob(&ctx, get, &job).ok()) break;
      for (auto& w : workers_) peak_rss_ = std::max(peak_rss_, w->PeakRss());
      if (job.state() == v1::JOB_STATE_SUCCEEDED || job.state() == v1::JOB_STATE_FAILED) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return job;
  }

  uint64_t peak_rss() const { return peak_rss_; }
  std::string Logs() const {
    std::string logs;
    for (auto& w : workers_) logs += w->Log() + "\n";
    for (auto& s : stores_) logs += s->Log() + "\n";
    return logs;
  }

 private:
  const std::string dir_;
  const uint64_t worker_memory_;
  std::unique_ptr<pith::testing::TestTls> tls_;
  std::unique_ptr<ChildProcess> coordinator_;
  std::vector<std::unique_ptr<ChildProcess>> stores_, workers_;
  std::string address_;
  std::unique_ptr<v1::JobService::Stub> stub_;
  uint64_t peak_rss_ = 0;
};

TEST(WorkerMemoryTest, PeakRssIsFlatAsExpertsGrowAndStoresSpillToDisk) {
  constexpr int kSteps = 3;
  uint64_t rss[2];
  const int experts[2] = {16, 1024};
  for (int i = 0; i < 2; ++i) {
    std::string name = std::to_string(experts[i]);
    name += "_experts";
    MemoryRun run(name, kWorkerMemory);
    ASSERT_NO_FATAL_FAILURE(run.Start());
    const v1::Job job = run.Train(experts[i], kSteps);
    ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.ShortDebugString() << run.Logs();
    EXPECT_EQ(job.committed_step(), kSteps);
    rss[i] = run.peak_rss();
    ASSERT_GT(rss[i], 0u);
  }
  // Weights, master and both moments of every expert of the 1,024-expert model.
  const uint64_t expert_bytes = (2 * 64 * 128 + 128 + 64) * sizeof(float);
  const uint64_t state = 4 * 2 * 1024 * expert_bytes;
  std::cout << "worker peak RSS: " << rss[0] / 1e6 << " MB at 16 experts a layer, " << rss[1] / 1e6
            << " MB at 1024 (expert state " << state / 1e6 << " MB, "
            << static_cast<double>(state) / static_cast<double>(rss[1])
            << "x the worker; stores' RAM tiers " << kStoreRam / 1e6 << " MB each)\n";
  EXPECT_LT(rss[1] - std::min(rss[0], rss[1]), state / 10)
      << "peak RSS grew by more than 10% of the expert state";
  // And the process itself stays small: a worker that linked CUDA's libraries held ~155 MB
  // more from its start, and would be at about 2x here.
#ifndef __SANITIZE_ADDRESS__  // ASan's shadow memory and quarantine are not the worker's
  EXPECT_LT(rss[1], state / 4) << "a worker holds over a quarter of the expert state";
#endif
  // The state is over 4x a store's RAM tier: the rest went to RocksDB, and trained.
  EXPECT_GT(state, 4 * kStoreRam);
}

// A job's small cache (cluster.cache_bytes: 4 slots for the 16 experts each worker
// updates) within a memory budget that would hold every moment: the moments are fetched
// each step, as the slots cannot all be held while the next step computes. (Kept resident,
// every step failed with "every one of the 4 expert cache slots is in use".)
TEST(WorkerMemoryTest, AJobsSmallCacheWithinALargeBudgetTrains) {
  const uint64_t expert_blob = (2 * 64 * 128 + 128 + 64) * sizeof(float);
  MemoryRun run("small_cache", 256ull << 20);
  ASSERT_NO_FATAL_FAILURE(run.Start());
  const v1::Job job = run.Train(16, 3, /*seconds=*/120, /*cache_bytes=*/4 * expert_blob);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.ShortDebugString() << run.Logs();
  EXPECT_EQ(job.committed_step(), 3);
}

TEST(WorkerMemoryTest, AJobWhoseDenseStateDoesNotFitFailsWithTheReason) {
  MemoryRun run("small", 1 << 20);
  ASSERT_NO_FATAL_FAILURE(run.Start());
  const v1::Job job = run.Train(16, 3, /*seconds=*/60);
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED) << job.ShortDebugString();
  EXPECT_NE(job.failure_reason().find("--memory_bytes=1048576"), std::string::npos)
      << job.failure_reason();
}

}  // namespace
}  // namespace pith
