// pith-worker: runs training steps (DESIGN §1, §6). With --coordinator it joins a cluster
// and trains the jobs it is assigned with its peers; with --standalone it trains a whole
// job alone from its spec, the reference the distributed path is compared against.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/export_path.h"
#include "common/job_spec.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/status.h"
#include "common/ucx.h"
#include "common/ucx_auth.h"
#include "glog/logging.h"
#include "security/flags.h"
#include "worker/backend/backend_select.h"
#include "worker/compute/cpu_backend.h"
#include "worker/runtime/cluster_worker.h"
#include "worker/trainer/standalone.h"

ABSL_FLAG(std::string, coordinator, "", "Join the cluster of this coordinator (host:port)");
ABSL_FLAG(std::string, listen, "",
          "Address this worker advertises (host:port; default 127.0.0.1:0). When given, "
          "/metrics and UCX keep to its interface; when not, UCX keeps to the interface "
          "that reaches --coordinator and /metrics binds every interface");
ABSL_FLAG(int, metrics_port, -1, "Prometheus /metrics port; -1 disables it, 0 picks one");
ABSL_FLAG(std::string, metrics_listen, "",
          "Host (interface address) /metrics binds; default: the host of --listen");
ABSL_FLAG(std::string, ucx_net_devices, "auto",
          "Network devices UCX may use: auto (those of --listen's address, or without it of "
          "the interface that reaches --coordinator, plus RDMA ports; "
          "every device for 0.0.0.0), all, or a UCX_NET_DEVICES list");
ABSL_FLAG(uint64_t, cache_bytes, 0,
          "Expert cache budget in bytes (0: unlimited); a gradient pool as large and the "
          "update scratch come beside it. With --memory_bytes: a cap on the cache within it");
ABSL_FLAG(uint64_t, memory_bytes, 0,
          "Memory for a job's model state here: dense state, activations, expert cache, "
          "gradient pool and update scratch (0: no bound; a job that does not fit fails)");
ABSL_FLAG(std::string, scratch_dir, "",
          "Directory for the gradients that wait beyond the gradient pool (an unlinked file; "
          "default $TMPDIR or /tmp)");
ABSL_FLAG(std::vector<std::string>, data_root, {},
          "Directories (comma-separated, absolute) a job's train.data_path and train.init_path "
          "must lie beneath (a relative path is taken under the first; symlinks out of them "
          "are refused); empty: any file this process can read");
ABSL_FLAG(std::vector<std::string>, data_exclude, {},
          "Directories (comma-separated) whose files no job may read, whatever --data_root "
          "says: keys, other services' data (pith up gives its cluster folder; the worker's "
          "own --tls_dir is always excluded)");
ABSL_FLAG(bool, standalone, false, "Train the job of --spec alone, in this process");
ABSL_FLAG(std::string, spec, "", "Job spec (JSON) for --standalone");
ABSL_FLAG(std::string, init, "", "Start from these weights (safetensors)");
ABSL_FLAG(std::string, export_init, "", "Write the weights training starts from (safetensors)");
ABSL_FLAG(int64_t, steps, -1, "Train this many steps instead of the spec's train.steps");
ABSL_FLAG(std::string, loss_log, "",
          "Write '<step> <loss> <ce>' per step here (step from 1; in a cluster, rank 0 "
          "appends each committed step)");
ABSL_FLAG(std::string, save, "", "Write the final weights here (safetensors)");
ABSL_FLAG(std::string, save_optimizer, "", "Write the final optimizer state here (safetensors)");
ABSL_FLAG(std::string, backend, "auto",
          "Compute backend: cpu, cuda, or auto (cuda when this build and host have it, else "
          "cpu). A cluster worker takes auto as cpu so far: --backend=cuda trains it on the GPU");
ABSL_FLAG(int, device, 0, "CUDA device ordinal for --backend=cuda|auto");
ABSL_FLAG(int, threads, 0, "Threads of the CPU backend's own loops; 0 = one per core");

namespace {

// A cluster worker's backend: the CPU's (--backend=cpu, and auto so far), or with
// --backend=cuda the GPU's, made now once (a missing device fails here with its reason)
// and then by each job run. On a GPU the cluster runtime reaches device memory through
// synchronous copies (DESIGN §2).
absl::Status ChooseClusterBackend(pith::runtime::ClusterWorkerOptions& options) {
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend == "cpu" || backend == "auto") return absl::OkStatus();
  if (backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend=", backend, ": expected cpu, cuda or auto"));
  }
  const pith::compute::BackendChoice choice{"cuda", absl::GetFlag(FLAGS_device),
                                            absl::GetFlag(FLAGS_threads)};
  std::string description;
  RETURN_IF_ERROR(pith::compute::MakeBackend(choice, &description).status());
  LOG(INFO) << "training on " << description;
  options.backend_kind = pith::v1::BACKEND_CUDA;
  options.make_backend = [choice] { return pith::compute::MakeBackend(choice); };
  return absl::OkStatus();
}

absl::Status RunCluster() {
  // SIGTERM and SIGINT end the loop below cleanly; SIGHUP reloads the certificates. First,
  // so that neither can end the process while it starts.
  pith::ShutdownSignals signals;
  pith::runtime::ClusterWorkerOptions options;
  RETURN_IF_ERROR(ChooseClusterBackend(options));
  LOG(INFO) << "OpenBLAS kernels: " << pith::compute::BlasCoreName();
  options.coordinator = absl::GetFlag(FLAGS_coordinator);
  ASSIGN_OR_RETURN(options.security, pith::security::TransportSecurityFromFlags(
                                         "pith-worker", pith::security::Role::kMember));
  // A member of a TLS cluster takes no UCX message without the cluster's tag, from before
  // its first endpoint exists; the key comes with its registration (DESIGN §8).
  if (options.security.tls()) pith::ucx::RequireDataPlaneAuth();
  options.listen =
      absl::GetFlag(FLAGS_listen).empty() ? "127.0.0.1:0" : absl::GetFlag(FLAGS_listen);
  // The metrics endpoint is served from this (the main) thread's setup.
  pith::MetricsRegistry metrics;
  std::unique_ptr<pith::MetricsExposer> exposer;
  int metrics_port = -1;
  if (absl::GetFlag(FLAGS_metrics_port) >= 0) {
    const std::string bind = pith::MetricsBindAddress(
        absl::GetFlag(FLAGS_metrics_listen),
        absl::GetFlag(FLAGS_listen).empty() ? "0.0.0.0:0" : absl::GetFlag(FLAGS_listen),
        absl::GetFlag(FLAGS_metrics_port));
    ASSIGN_OR_RETURN(exposer, pith::MetricsExposer::Start(bind, metrics));
    metrics_port = exposer->port();
    std::string host = bind.substr(0, bind.rfind(':'));
    if (host == "0.0.0.0") host = "127.0.0.1";
    options.metrics_address = absl::StrCat(host, ":", metrics_port);
  }
  RETURN_IF_ERROR(pith::RegisterProcessMetrics(metrics, "worker"));
  options.cache_bytes = absl::GetFlag(FLAGS_cache_bytes);
  options.memory_bytes = absl::GetFlag(FLAGS_memory_bytes);
  options.scratch_dir = absl::GetFlag(FLAGS_scratch_dir);
  if (options.scratch_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    options.scratch_dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  }
  options.threads = absl::GetFlag(FLAGS_threads);
  options.loss_log = absl::GetFlag(FLAGS_loss_log);
  options.data_rules.roots = absl::GetFlag(FLAGS_data_root);
  RETURN_IF_ERROR(pith::ReadPath::CheckRoots(options.data_rules.roots));
  options.data_rules.excluded = absl::GetFlag(FLAGS_data_exclude);
  if (options.security.tls()) options.data_rules.excluded.push_back(options.security.dir());
  std::atomic<bool> stop{false};
  absl::Status result;
  // The same ready line as the servers' (a worker serves no gRPC of its own), once it has
  // joined the coordinator: `pith up` and scripts that wait for it then know it did.
  options.on_joined = [metrics_port] {
    LOG(INFO) << "pith-worker ready: grpc_port=0 metrics_port=" << metrics_port;
  };
  std::thread worker([&] { result = pith::runtime::RunClusterWorker(options, metrics, stop); });
  std::thread watcher([&] {
    signals.Wait();
    stop = true;
  });
  worker.join();
  if (!stop) {  // the worker failed on its own: release the signal watcher
    ::kill(::getpid(), SIGTERM);
  }
  watcher.join();
  return result;
}

absl::Status Run() {
  if (!absl::GetFlag(FLAGS_coordinator).empty()) return RunCluster();
  if (!absl::GetFlag(FLAGS_standalone)) {
    return absl::InvalidArgumentError("give --coordinator=HOST:PORT or --standalone");
  }
  if (absl::GetFlag(FLAGS_spec).empty()) return absl::InvalidArgumentError("--spec is required");
  if (absl::GetFlag(FLAGS_steps) < -1) return absl::InvalidArgumentError("--steps must be >= 0");
  pith::trainer::StandaloneOptions options;
  ASSIGN_OR_RETURN(options.spec, pith::LoadJobSpec(absl::GetFlag(FLAGS_spec)));
  options.init_path = absl::GetFlag(FLAGS_init);
  options.export_init_path = absl::GetFlag(FLAGS_export_init);
  options.steps = absl::GetFlag(FLAGS_steps);
  options.loss_log_path = absl::GetFlag(FLAGS_loss_log);
  options.save_path = absl::GetFlag(FLAGS_save);
  options.save_optimizer_path = absl::GetFlag(FLAGS_save_optimizer);
  std::string description;
  ASSIGN_OR_RETURN(
      std::unique_ptr<pith::compute::Backend> backend,
      pith::compute::MakeBackend(
          {absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_threads)},
          &description));
  ASSIGN_OR_RETURN(pith::trainer::StandaloneResult result,
                   pith::trainer::RunStandalone(options, *backend));
  LOG(INFO) << "trained " << result.steps << " steps, final loss " << result.final_loss << ", "
            << static_cast<int64_t>(result.tokens_per_second) << " tokens/s (" << description
            << ")";
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  pith::compute::ReexecWithBetterBlasCore(argv);
  pith::InitProcess(
      argc, argv,
      "runs Pith training steps.\n"
      "Usage: pith-worker --coordinator=HOST:PORT (--tls_dir=DIR | --insecure) "
      "[--metrics_port=PORT "
      "--memory_bytes=N --cache_bytes=N --scratch_dir=DIR]\n"
      "       pith-worker --standalone --spec=SPEC.json [--backend=auto|cpu|cuda --device=N] "
      "[--init=FILE] "
      "[--export_init=FILE] [--steps=N] [--loss_log=FILE] [--save=FILE]");
  // Without --listen, UCX keeps to the coordinator's route: one path to peers and stores.
  // (Over every interface, two workers of a local cluster talking TCP over lo and eth0 at
  // once waited out a peer's message once in ~10 runs; on lo alone, none in 24.)
  std::string ucx_listen = absl::GetFlag(FLAGS_listen);
  if (ucx_listen.empty())
    ucx_listen = pith::ucx::LocalAddressToward(absl::GetFlag(FLAGS_coordinator));
  pith::ucx::RestrictUcxDevices(ucx_listen, absl::GetFlag(FLAGS_ucx_net_devices));
  return pith::ExitStatus("pith-worker", Run());
}
