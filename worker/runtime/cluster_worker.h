// ClusterWorker: `pith-worker --coordinator`. It registers with the coordinator, takes
// its assignment (rank, world, expert ownership, placement) and trains the job's steps
// with its peers (DESIGN §6): its rows of each global batch (i % W == rank), experts run
// by their owners through Dispatch, dense gradients all-reduced, the global grad norm
// summed, then the updates — each dense tensor by the worker it is dealt to, each owner
// its experts that got tokens — written to the stores as the step's new versions (weights, master,
// AdamW moments and, for experts, the update count), reported, and committed by the coordinator.
// Step 0 writes the initial weights.
//
// Stateless: everything it holds is rebuilt from the stores after an abort or a new
// assignment (weights, moments, counts of the committed step). The loss it logs is the
// global one (every worker computes the same bits).
//
// Thread safety: Run blocks the calling thread until shutdown.
#ifndef PITH_WORKER_RUNTIME_CLUSTER_WORKER_H_
#define PITH_WORKER_RUNTIME_CLUSTER_WORKER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "common/export_path.h"
#include "common/metrics.h"
#include "pith/v1/common.pb.h"
#include "security/tls.h"
#include "worker/compute/backend.h"

namespace pith::runtime {

struct ClusterWorkerOptions {
  std::string coordinator;  // host:port
  // Mutual TLS with a member's certificate, or plaintext to a loopback coordinator.
  security::TransportSecurity security;
  std::string listen;           // advertised gRPC address (host:port)
  std::string metrics_address;  // advertised /metrics address, if any
  uint64_t cache_bytes = 0;     // expert cache budget (advertised; 0: unlimited)
  uint64_t memory_bytes = 0;    // the job's whole memory here (memory_plan.h; 0: none)
  std::string scratch_dir;      // where gradients beyond the pool wait (GradPool)
  int threads = 0;              // CPU backend threads; 0 = one per core
  std::string loss_log;         // "<step> <loss> <ce>" per committed step (rank 0 only)
  // Where a job's train.data_path and train.init_path may lie and may not (ReadPath);
  // empty: anywhere this process can read.
  ReadRules data_rules;
  // The training backend of each job run (a failed backend stays failed, so each run
  // makes its own), and its kind as the coordinator sees it. Empty: the CPU backend with
  // `threads`. Host-memory work (the expert updates, norms over the gradient pool) runs
  // on a CPU backend whatever this is.
  std::function<absl::StatusOr<std::unique_ptr<compute::Backend>>()> make_backend;
  v1::Backend backend_kind = v1::BACKEND_CPU;
  // Called once the worker has registered with the coordinator (pith-worker's ready line:
  // a worker that cannot join never says it is ready).
  std::function<void()> on_joined;
};

// Runs until `stop` becomes true (checked between steps and while idle). The worker's
// metrics go into `metrics` (which the caller exposes).
absl::Status RunClusterWorker(const ClusterWorkerOptions& options, MetricsRegistry& metrics,
                              const std::atomic<bool>& stop);

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_CLUSTER_WORKER_H_
