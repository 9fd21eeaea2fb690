// cluster_bench: a real local cluster (1 coordinator, 2 stores, 2 workers, loopback)
// training the demo model (deploy/demo/spec.json's model and batch) on generated text,
// measured against anchors from the same run:
//   prefetch    step time with a worker cache of 25% of the expert bytes / step time with
//               every owned expert resident
//   compactness (expert weights + master + moments) / a worker's peak RSS (VmHWM, read
//               from /proc as the job ends), with the step time ratio against the same
//               job with every expert resident: for the demo model at the 25% cache, and
//               for a wide model (L2 d64 f128, --wide_experts a layer: 2,048 by default,
//               1.09 GB of expert state) whose workers have --memory_bytes=16 MiB (the
//               state is 64x that) and whose stores' RAM tiers (64 MiB) hold a 16th of it
//   tls         step time with mutual TLS on every gRPC port (as users run) / step time
//               with --insecure plaintext, every expert resident (--tls_rounds pairs)
//   pytorch     tokens/s of the cluster / tokens/s of tests/golden/moe_gpt_reference.py
//               training the same spec in one process (when /usr/bin/python3 has torch),
//               with the OpenBLAS kernels pith-worker picks (BetterBlasCore)
// Step times are the coordinator's per-step wall times (commit to commit) and PyTorch's
// own per-step times, each averaged over the steps after the first three (no start-up).
// The cluster sides run in rounds of a pair, resident then 25% and 25% then resident in
// turn (--rounds, even, 8 by default), between two PyTorch runs: every ratio compares means
// centred on the same moment, so a drift of the machine's speed during the run cancels
// instead of favouring a side, and the slow and fast spells of this VM (tens of percent,
// seconds long) fall on both sides about alike. With 4 rounds one slow spell on one side
// moved the prefetch ratio by +-0.07 between runs of the same build; 8 halve the spread.
// Usage: cluster_bench [--steps=N] [--rounds=N] [--tls_rounds=N] [--wide_steps=N]
//                      [--wide_experts=N] [--repo=DIR] [--verbose]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../e2e/child_process.h"
#include "../e2e/test_tls.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/job.grpc.pb.h"
#include "worker/compute/cpu_backend.h"

namespace {

using pith::testing::ChildProcess;

int g_steps = 30;
int g_rounds = 8;
int g_tls_rounds = 4;
int g_wide_steps = 12;
int g_wide_experts = 2048;
bool g_verbose = false;          // --verbose: every run's per-step times on stderr
constexpr int kWarmupSteps = 3;  // steps timed by neither side (start-up, first fetches)
std::string g_repo = PITH_SOURCE_DIR;

// L4 d128 E16 k2 f256 T64 B16: the demo model.
std::string Spec(const std::string& data, int steps) {
  return R"({"name": "bench", "model": {"vocab_size": 256, "seq_len": 64, "d_model": 128,
  "n_layer": 4, "n_head": 4, "n_expert": 16, "top_k": 2, "d_ff": 256, "capacity_factor": 1.25,
  "aux_loss_coef": 0.01, "z_loss_coef": 0.001}, "train": {"data_path": ")" +
         data + R"(", "batch": 16, "steps": )" + std::to_string(steps) +
         R"(, "lr": 0.003, "warmup": 5, "seed": 1337}, "cluster": {"workers": 2,
  "store_replicas": 2}})";
}

constexpr int64_t kExpertFloats = 2 * 128 * 256 + 256 + 128;
constexpr int64_t kExperts = 4 * 16;
constexpr int64_t kExpertBytes = kExpertFloats * kExperts * 4;

// L2 d64 k2 f128 T32 B8 with --wide_experts a layer: experts far beyond a worker's memory.
std::string WideSpec(const std::string& data, int steps) {
  return R"({"name": "wide", "model": {"vocab_size": 256, "seq_len": 32, "d_model": 64,
  "n_layer": 2, "n_head": 4, "n_expert": )" +
         std::to_string(g_wide_experts) + R"(, "top_k": 2, "d_ff": 128, "capacity_factor": 2.0,
  "aux_loss_coef": 0.01, "z_loss_coef": 0.001}, "train": {"data_path": ")" +
         data + R"(", "batch": 8, "steps": )" + std::to_string(steps) +
         R"(, "lr": 0.003, "warmup": 2, "grad_clip": 1.0, "seed": 7}, "cluster": {"workers": 2,
  "store_replicas": 2}})";
}
int64_t WideExpertBytes() { return (2 * 64 * 128 + 128 + 64) * int64_t{2} * g_wide_experts * 4; }
constexpr uint64_t kWideWorkerMemory = 16 << 20;
constexpr uint64_t kWideStoreRam = 64 << 20;

// One cluster run's setup: the job and the flags its workers and stores get.
struct Setup {
  std::string spec;
  std::string worker_flag;  // e.g. --cache_bytes=N
  uint64_t store_ram = 256 << 20;
  bool tls = true;  // mutual TLS on every gRPC port (as users run); false: --insecure
};

struct Measured {
  double seconds = 0;         // summed over the timed steps (> 3) of every run
  double tokens = 0;          // trained in them
  int steps = 0;              // how many
  double cache_hit_rate = 0;  // of the last step of the last run
  uint64_t peak_rss = 0;      // the most any worker of any run held
  double step_seconds() const { return seconds / steps; }
  double tokens_per_second() const { return tokens / seconds; }
};

// Runs `setup`'s job on a fresh cluster, adding its timed steps and its workers' peak RSS
// to `m`; false on failure.
bool RunCluster(const std::string& dir, const Setup& setup, Measured* m) {
  std::filesystem::remove_all(dir + "/cluster");
  std::filesystem::create_directories(dir + "/cluster");
  const std::string d = dir + "/cluster";
  pith::testing::TestTls tls(d + "/tls");
  const auto security = [&](pith::security::Role role, const std::string& name) {
    return setup.tls ? tls.Flag(role, name) : std::string("--insecure");
  };
  ChildProcess coordinator(PITH_COORDINATOR_BINARY,
                           {"--listen=127.0.0.1:0", "--metrics_port=-1", "--data_dir=" + d + "/c",
                            security(pith::security::Role::kCoordinator, "coordinator")},
                           d + "/coordinator.log");
  if (!coordinator.WaitReady()) return false;
  const std::string address = "127.0.0.1:" + std::to_string(coordinator.grpc_port);
  std::vector<std::unique_ptr<ChildProcess>> procs;
  for (int n = 0; n < 2; ++n) {
    procs.push_back(std::make_unique<ChildProcess>(
        PITH_STORE_BINARY,
        std::vector<std::string>{
            "--listen=127.0.0.1:0", "--metrics_port=-1",
            "--data_dir=" + d + "/s" + std::to_string(n),
            "--ram_bytes=" + std::to_string(setup.store_ram), "--coordinator=" + address,
            security(pith::security::Role::kMember, "store" + std::to_string(n))},
        d + "/store" + std::to_string(n) + ".log"));
    if (!procs.back()->WaitReady()) return false;
  }
  for (int n = 0; n < 2; ++n) {
    procs.push_back(std::make_unique<ChildProcess>(
        PITH_WORKER_BINARY,
        std::vector<std::string>{
            "--coordinator=" + address, "--threads=1", setup.worker_flag, "--scratch_dir=" + d,
            security(pith::security::Role::kMember, "worker" + std::to_string(n))},
        d + "/worker" + std::to_string(n) + ".log"));
  }
  auto stub = pith::v1::JobService::NewStub(
      setup.tls ? tls.AdminChannel(address)
                : grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  pith::v1::SubmitJobRequest submit;
  if (!google::protobuf::util::JsonStringToMessage(setup.spec, submit.mutable_spec()).ok()) {
    return false;
  }
  std::string job_id;
  {
    grpc::ClientContext ctx;
    pith::v1::SubmitJobResponse resp;
    if (!stub->SubmitJob(&ctx, submit, &resp).ok()) return false;
    job_id = resp.job().job_id();
  }
  // Every committed step's wall time, from the job's event stream.
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  pith::v1::WatchJobRequest watch;
  watch.set_job_id(job_id);
  auto stream = stub->WatchJob(&ctx, watch);
  pith::v1::JobEvent event;
  double seconds = 0, tokens = 0;
  int counted = 0;
  int64_t last_step = -1;
  std::string times;
  while (stream->Read(&event)) {
    if (event.step() > kWarmupSteps && event.step() != last_step && event.step_seconds() > 0) {
      if (g_verbose) times += " " + std::to_string(std::lround(1000 * event.step_seconds()));
      seconds += event.step_seconds();
      tokens += event.tokens_per_second() * event.step_seconds();
      ++counted;
      m->cache_hit_rate = event.cache_hit_rate();
    }
    last_step = event.step();
    if (event.state() == pith::v1::JOB_STATE_SUCCEEDED ||
        event.state() == pith::v1::JOB_STATE_FAILED) {
      break;
    }
  }
  if (event.state() != pith::v1::JOB_STATE_SUCCEEDED || counted == 0) {
    std::fprintf(stderr, "the job did not succeed: %s\n", event.ShortDebugString().c_str());
    return false;
  }
  uint64_t rss = 0;
  for (size_t n = 2; n < procs.size(); ++n) rss = std::max(rss, procs[n]->PeakRss());
  if (g_verbose) {
    std::fprintf(stderr, "%s mean %.1f ms, peak worker RSS %.1f MB, steps (ms):%s\n",
                 setup.worker_flag.c_str(), 1000 * seconds / counted, rss / 1e6, times.c_str());
  }
  m->seconds += seconds;
  m->tokens += tokens;
  m->steps += counted;
  m->peak_rss = std::max(m->peak_rss, rss);
  for (auto& p : procs) p->Terminate();
  coordinator.Terminate();
  return true;
}

// `rounds` pairs of runs of `a` and `b`, a first in even rounds and b first in odd ones
// (so a drift of the machine's speed falls on both sides alike); false on failure.
bool Alternate(const std::string& dir, const Setup& a, const Setup& b, int rounds, Measured* ma,
               Measured* mb) {
  for (int round = 0; round < rounds; ++round) {
    const bool a_first = round % 2 == 0;
    if (!RunCluster(dir, a_first ? a : b, a_first ? ma : mb) ||
        !RunCluster(dir, a_first ? b : a, a_first ? mb : ma)) {
      std::fprintf(stderr, "cluster_bench: a cluster run failed; logs under %s\n", dir.c_str());
      return false;
    }
  }
  return true;
}

// Runs the PyTorch reference training the same spec in one process, adding its timed
// steps to `m`; false without torch.
bool RunPytorch(const std::string& dir, Measured* m) {
  const std::string spec = dir + "/spec.json";
  std::ofstream(spec) << Spec(dir + "/tokens.bin", g_steps);
  const std::string init = dir + "/init.safetensors";
  {
    ChildProcess w(PITH_WORKER_BINARY,
                   {"--standalone", "--spec=" + spec, "--steps=0", "--export_init=" + init},
                   dir + "/init.log");
    if (w.Wait(60) != 0) return false;
  }
  // The kernels pith-worker runs with (it re-executes itself with them), so both sides
  // multiply with the same sgemm.
  const std::optional<std::string> core = pith::compute::BetterBlasCore();
  const std::string command =
      (core ? "OPENBLAS_CORETYPE=" + *core + " " : std::string()) + "/usr/bin/python3 " + g_repo +
      "/tests/golden/moe_gpt_reference.py --spec " + spec + " --init " + init + " --loss_log " +
      dir + "/torch.log --step_times " + dir + "/torch_times.txt > " + dir + "/torch.out 2>&1";
  if (std::system(command.c_str()) != 0) return false;
  std::ifstream times(dir + "/torch_times.txt");
  int step;
  double seconds, total = 0;
  int counted = 0;
  while (times >> step >> seconds) {
    if (step <= kWarmupSteps) continue;
    total += seconds;
    ++counted;
  }
  if (counted == 0) return false;
  m->seconds += total;
  m->tokens += counted * 16.0 * 64.0;
  m->steps += counted;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--steps=", 8) == 0) {
      g_steps = std::atoi(argv[i] + 8);
    } else if (std::strncmp(argv[i], "--rounds=", 9) == 0) {
      g_rounds = std::max(2, std::atoi(argv[i] + 9) + std::atoi(argv[i] + 9) % 2);  // even
    } else if (std::strncmp(argv[i], "--tls_rounds=", 13) == 0) {
      g_tls_rounds = std::max(0, std::atoi(argv[i] + 13) + std::atoi(argv[i] + 13) % 2);  // even
    } else if (std::strncmp(argv[i], "--wide_experts=", 15) == 0) {
      g_wide_experts = std::max(1, std::atoi(argv[i] + 15));
    } else if (std::strncmp(argv[i], "--wide_steps=", 13) == 0) {
      g_wide_steps = std::atoi(argv[i] + 13);
    } else if (std::strcmp(argv[i], "--verbose") == 0) {
      g_verbose = true;
    } else if (std::strncmp(argv[i], "--repo=", 7) == 0) {
      g_repo = argv[i] + 7;
    } else {
      std::fprintf(stderr,
                   "usage: cluster_bench [--steps=N] [--rounds=N] [--tls_rounds=N] "
                   "[--wide_steps=N] [--wide_experts=N] [--repo=DIR] [--verbose]\n");
      return 2;
    }
  }
  if (g_steps < 6) g_steps = 6;
  const std::string dir = "/tmp/pith_cluster_bench_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  {
    std::ofstream text(dir + "/tokens.bin", std::ios::binary);
    for (int i = 0; i < 4000; ++i) {
      text << "Experts live in the stores and come to the workers when they are needed; "
           << "line " << i << " of the benchmark corpus.\n";
    }
  }
  Measured resident, cached, torch, wide_resident, wide_bounded, tls_on, tls_off;
  const uint64_t quarter = kExpertBytes / 4;
  const std::string spec = Spec(dir + "/tokens.bin", g_steps);
  const Setup all{spec, "--cache_bytes=0"};
  const Setup part{spec, "--cache_bytes=" + std::to_string(quarter)};
  const bool have_torch = RunPytorch(dir, &torch);
  if (!Alternate(dir, all, part, g_rounds, &resident, &cached)) return 1;
  if (have_torch && !RunPytorch(dir, &torch)) {
    std::fprintf(stderr, "cluster_bench: the second PyTorch run failed; see %s\n", dir.c_str());
    return 1;
  }
  Setup plaintext = all;
  plaintext.tls = false;
  if (g_tls_rounds > 0 && !Alternate(dir, all, plaintext, g_tls_rounds, &tls_on, &tls_off)) {
    return 1;
  }
  const std::string wide = WideSpec(dir + "/tokens.bin", g_wide_steps);
  const Setup wide_all{wide, "--memory_bytes=0", kWideStoreRam};
  const Setup wide_part{wide, "--memory_bytes=" + std::to_string(kWideWorkerMemory), kWideStoreRam};
  if (g_wide_steps > kWarmupSteps &&
      !Alternate(dir, wide_all, wide_part, 2, &wide_resident, &wide_bounded)) {
    return 1;
  }
  std::printf(
      "prefetch step_seconds_resident=%.4f step_seconds_cache25=%.4f ratio=%.3f "
      "(cache hit rate %.2f vs %.2f)\n",
      resident.step_seconds(), cached.step_seconds(),
      cached.step_seconds() / resident.step_seconds(), cached.cache_hit_rate,
      resident.cache_hit_rate);
  std::printf(
      "compactness model=demo expert_state_bytes=%lld worker_peak_rss_bytes=%llu ratio=%.2f "
      "step_time_ratio=%.3f (cache 25%%)\n",
      static_cast<long long>(4 * kExpertBytes), static_cast<unsigned long long>(cached.peak_rss),
      4.0 * kExpertBytes / static_cast<double>(cached.peak_rss),
      cached.step_seconds() / resident.step_seconds());
  if (wide_bounded.steps > 0) {
    std::printf(
        "compactness model=wide expert_state_bytes=%lld worker_peak_rss_bytes=%llu ratio=%.2f "
        "step_seconds_resident=%.4f step_seconds_bounded=%.4f step_time_ratio=%.3f "
        "(--memory_bytes=%llu; resident workers peaked at %llu bytes; store RAM tiers %llu)\n",
        static_cast<long long>(4 * WideExpertBytes()),
        static_cast<unsigned long long>(wide_bounded.peak_rss),
        4.0 * WideExpertBytes() / static_cast<double>(wide_bounded.peak_rss),
        wide_resident.step_seconds(), wide_bounded.step_seconds(),
        wide_bounded.step_seconds() / wide_resident.step_seconds(),
        static_cast<unsigned long long>(kWideWorkerMemory),
        static_cast<unsigned long long>(wide_resident.peak_rss),
        static_cast<unsigned long long>(kWideStoreRam));
  }
  if (tls_on.steps > 0) {
    std::printf("tls step_seconds_tls=%.4f step_seconds_plaintext=%.4f ratio=%.3f\n",
                tls_on.step_seconds(), tls_off.step_seconds(),
                tls_on.step_seconds() / tls_off.step_seconds());
  }
  if (have_torch) {
    std::printf("pytorch cluster_tokens_per_s=%.0f pytorch_tokens_per_s=%.0f ratio=%.3f\n",
                resident.tokens_per_second(), torch.tokens_per_second(),
                resident.tokens_per_second() / torch.tokens_per_second());
  } else {
    std::printf("pytorch skipped: /usr/bin/python3 with torch is not available\n");
  }
  std::filesystem::remove_all(dir);
  return 0;
}
