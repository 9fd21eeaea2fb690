// The worker's metrics (DESIGN §7), made once per process and shared by its job runs.
//
// Thread safety: the prometheus metrics are thread-safe; the struct is not modified after
// MakeWorkerMetrics.
#ifndef PITH_WORKER_RUNTIME_WORKER_METRICS_H_
#define PITH_WORKER_RUNTIME_WORKER_METRICS_H_

#include "absl/status/statusor.h"
#include "common/metrics.h"
#include "worker/runtime/memory_plan.h"

namespace pith::runtime {

struct WorkerMetrics {
  prometheus::Counter* tokens = nullptr;
  prometheus::Histogram* step_seconds = nullptr;
  prometheus::Counter* hits = nullptr;
  prometheus::Counter* misses = nullptr;
  prometheus::Counter* fetch_bytes = nullptr;
  prometheus::Histogram* fetch_seconds = nullptr;
  prometheus::Counter* put_bytes = nullptr;
  prometheus::Counter* rows_sent = nullptr;
  prometheus::Counter* prefetch_hits = nullptr;
  prometheus::Gauge* resident = nullptr;
  prometheus::Gauge* step = nullptr;
  prometheus::Gauge* loss = nullptr;
  // pith_worker_memory_bytes{kind}: what the job's memory plan gives each kind.
  prometheus::Gauge* memory_dense = nullptr;
  prometheus::Gauge* memory_activations = nullptr;
  prometheus::Gauge* memory_cache = nullptr;
  prometheus::Gauge* memory_gradients = nullptr;
  prometheus::Gauge* memory_moments = nullptr;
  // The gradient pool's spills to its scratch file.
  prometheus::Counter* gradient_spills = nullptr;
  // A GPU worker's device memory held, and its uploads of cache slots to the device.
  prometheus::Gauge* device_memory = nullptr;
  prometheus::Counter* device_uploads = nullptr;
  // Steps whose dense gradients summed on the device group (NCCL), not the peer group,
  // and grouped exchanges on it (token rows, replica gradients).
  prometheus::Counter* dense_sums = nullptr;
  prometheus::Counter* device_exchanges = nullptr;
};

// What the current Dispatch has counted since it was made: slot uploads to the device and
// grouped exchanges on the device group.
struct DeviceCounts {
  uint64_t uploads = 0;
  uint64_t exchanges = 0;
};

absl::StatusOr<WorkerMetrics> MakeWorkerMetrics(MetricsRegistry& registry);
// pith_worker_memory_bytes{kind} from a job's memory plan.
void ReportMemoryPlan(const WorkerMetrics& metrics, const MemoryPlan& plan);
// The device memory held and what the current Dispatch counted so far (`*observed`: its
// counts last time, reset when a new Dispatch counts from 0).
void ReportDevice(const WorkerMetrics& metrics, uint64_t device_bytes, DeviceCounts counts,
                  DeviceCounts* observed);

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_WORKER_METRICS_H_
