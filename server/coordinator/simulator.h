// The placement simulator (`pith-coordinator --simulate`): synthetic routing with Zipf
// expert popularity and clustered co-activation (or a heat trace recorded from a real
// job), fed through the real HeatMap and placement code, to plan clusters bigger than the
// one at hand.
//
// Thread safety: RunSimulation runs on the calling thread.
#ifndef PITH_SERVER_COORDINATOR_SIMULATOR_H_
#define PITH_SERVER_COORDINATOR_SIMULATOR_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace pith::coordinator {

struct SimOptions {
  int layers = 58;
  int experts = 256;
  int top_k = 8;
  int workers = 256;
  int stores = 32;
  int store_replicas = 2;
  double zipf = 1.2;
  int steps = 10;  // steps of routing that build the heat map
  int tokens_per_step = 4096;
  int eval_tokens = 8192;  // tokens the placements are measured on
  int max_replicas = 0;    // compute replicas per expert; 0 = as many as workers
  double heat_decay = 0.9;
  uint64_t seed = 1;
  // Replay this heat trace (JSON lines of pith.v1.HeatReport, as `pith-coordinator
  // --heat_trace_dir` records them) instead of synthetic routing: layers, experts and
  // top_k come from the trace, the heat map is built from its reports, and the placements
  // are measured on tokens sampled from its expert and co-activation counts.
  std::string trace_path;
};

struct SimResult {
  double max_over_mean_load = 0;          // with heat replication and affinity
  double max_over_mean_load_no_heat = 0;  // one owner per expert, balanced by heat only
  double cross_worker_sends_per_token = 0;
  double rr_cross_worker_sends_per_token = 0;
  double replan_ms = 0;
  double moved_blobs_on_store_join = 0;  // share of blob copies moved when a store joins

  // "max_over_mean_load=... cross_worker_sends_per_token=... ..." (one line).
  std::string ToString() const;
};

absl::StatusOr<SimResult> RunSimulation(const SimOptions& options);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_SIMULATOR_H_
