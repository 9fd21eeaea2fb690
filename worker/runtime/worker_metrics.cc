#include "worker/runtime/worker_metrics.h"

#include <algorithm>
#include <string>
#include <utility>

#include "common/status.h"
#include "common/ucx_auth.h"

namespace pith::runtime {

void ReportMemoryPlan(const WorkerMetrics& metrics, const MemoryPlan& plan) {
  metrics.memory_dense->Set(static_cast<double>(plan.dense_bytes));
  metrics.memory_activations->Set(static_cast<double>(plan.activation_bytes));
  metrics.memory_cache->Set(static_cast<double>(plan.cache_bytes));
  metrics.memory_gradients->Set(static_cast<double>(plan.gradient_bytes));
  metrics.memory_moments->Set(static_cast<double>(plan.moment_bytes));
}

void ReportDevice(const WorkerMetrics& metrics, uint64_t device_bytes, DeviceCounts counts,
                  DeviceCounts* observed) {
  auto since = [](uint64_t now, uint64_t then) {
    return static_cast<double>(now - std::min(now, then));
  };
  metrics.device_memory->Set(static_cast<double>(device_bytes));
  metrics.device_uploads->Increment(since(counts.uploads, observed->uploads));
  metrics.device_exchanges->Increment(since(counts.exchanges, observed->exchanges));
  *observed = counts;
}

absl::StatusOr<WorkerMetrics> MakeWorkerMetrics(MetricsRegistry& r) {
  WorkerMetrics m;
  ASSIGN_OR_RETURN(m.tokens, r.Counter("pith_worker_tokens_total", "Tokens trained on"));
  ASSIGN_OR_RETURN(prometheus::Counter * dropped,
                   r.Counter("pith_worker_unauthenticated_messages_total",
                             "UCX messages dropped for a missing or wrong tag"));
  // The registry outlives the worker's UCX workers, whose threads run the hook.
  ucx::OnUnauthenticatedDrop([dropped] { dropped->Increment(); });
  ASSIGN_OR_RETURN(m.step_seconds, r.Histogram("pith_worker_step_seconds", "Wall time of a step",
                                               MetricsRegistry::LatencyBuckets()));
  ASSIGN_OR_RETURN(m.hits, r.Counter("pith_worker_expert_cache_hits_total",
                                     "Expert weights found resident when a step needed them"));
  ASSIGN_OR_RETURN(m.misses, r.Counter("pith_worker_expert_cache_misses_total",
                                       "Expert weights fetched from a store when needed"));
  ASSIGN_OR_RETURN(m.fetch_bytes,
                   r.Counter("pith_worker_fetch_bytes_total", "Bytes fetched from stores"));
  ASSIGN_OR_RETURN(m.fetch_seconds, r.Histogram("pith_worker_fetch_seconds",
                                                "Time of one batched fetch from a store",
                                                MetricsRegistry::LatencyBuckets()));
  ASSIGN_OR_RETURN(m.put_bytes,
                   r.Counter("pith_worker_put_bytes_total",
                             "Payload bytes sent to stores (a blob sent as a reference to "
                             "its sibling's bytes counts none)"));
  ASSIGN_OR_RETURN(
      m.rows_sent,
      r.Counter("pith_worker_dispatch_rows_sent_total",
                "Token rows sent to other workers for their experts (a token once per worker)"));
  ASSIGN_OR_RETURN(m.prefetch_hits,
                   r.Counter("pith_worker_expert_cache_prefetch_hits_total",
                             "Expert weights the prefetcher had fetched before they were needed"));
  ASSIGN_OR_RETURN(m.resident, r.Gauge("pith_worker_expert_cache_resident_bytes",
                                       "Bytes of expert weights resident in the cache"));
  ASSIGN_OR_RETURN(m.step, r.Gauge("pith_job_step", "Last step this worker saw committed"));
  ASSIGN_OR_RETURN(m.loss, r.Gauge("pith_job_loss", "Loss of the last committed step"));
  const std::string memory_help =
      "Memory the current job's plan gives each kind: dense state, activations, expert cache, "
      "gradient pool, AdamW moment buffers";
  for (const auto& [kind, gauge] :
       {std::pair{"dense", &m.memory_dense}, std::pair{"activations", &m.memory_activations},
        std::pair{"cache", &m.memory_cache}, std::pair{"gradients", &m.memory_gradients},
        std::pair{"moments", &m.memory_moments}}) {
    ASSIGN_OR_RETURN(*gauge, r.Gauge("pith_worker_memory_bytes", memory_help, {{"kind", kind}}));
  }
  ASSIGN_OR_RETURN(m.device_memory,
                   r.Gauge("pith_worker_device_memory_bytes",
                           "Device memory the worker's backend holds (buffers, scratch, the expert "
                           "cache's device slots); 0 on the CPU"));
  ASSIGN_OR_RETURN(m.device_uploads,
                   r.Counter("pith_worker_expert_device_uploads_total",
                             "Expert weights copied from the cache's host slots to the device "
                             "(only when no device slot holds their bytes)"));
  ASSIGN_OR_RETURN(m.dense_sums,
                   r.Counter("pith_worker_dense_device_sums_total",
                             "Steps whose dense gradients summed on the workers' device group "
                             "(NCCL) instead of through the peer group's host copies"));
  ASSIGN_OR_RETURN(m.device_exchanges,
                   r.Counter("pith_worker_dispatch_device_exchanges_total",
                             "Grouped exchanges between the workers' devices (NCCL) of token "
                             "rows and replica gradients, instead of the peer group's host "
                             "copies"));
  ASSIGN_OR_RETURN(m.gradient_spills,
                   r.Counter("pith_worker_gradient_spills_total",
                             "Expert gradients written to the scratch file to free a buffer"));
  return m;
}

}  // namespace pith::runtime
