// Placement (DESIGN §5): which stores hold a blob group (rendezvous hashing with R
// replicas, so a store joining or leaving moves only its share) and which workers compute
// each expert (heat-proportional compute replicas, co-activated experts kept together,
// load balanced across workers).
//
// Thread safety: pure functions.
#ifndef PITH_SERVER_COORDINATOR_PLACEMENT_H_
#define PITH_SERVER_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "server/coordinator/heat_map.h"

namespace pith::coordinator {

// A stable 64-bit hash (the same in every process and release).
uint64_t StableHash(absl::string_view data);

// The `replicas` stores (or all, if fewer) with the highest rendezvous score for `group`,
// best first: the first is the primary.
std::vector<std::string> RendezvousStores(absl::string_view group,
                                          absl::Span<const std::string> stores, int replicas);

struct ComputePlanOptions {
  int workers = 1;
  // Most workers computing one expert.
  int max_replicas = 1;
  // Keep often co-activated experts on the same worker.
  bool affinity = true;
  // A worker may take up to (1 + slack) x the mean load when that keeps co-activated
  // experts together.
  double slack = 0.25;
  // An expert gets one owner per `replica_load` x the mean worker load of its heat (up to
  // max_replicas): below 1, hot experts are spread wider than balance alone needs, so that
  // more of their tokens are computed where they already are.
  double replica_load = 0.03;
};

// One expert's owners: (worker, share of its tokens), shares summing to 1.
using Owners = std::vector<std::pair<int, double>>;

// Per layer, per expert: its owners.
using ComputePlan = std::vector<std::vector<Owners>>;

// Plans compute ownership from the heat map. Experts with no heat yet count as average.
ComputePlan PlanCompute(const HeatMap& heat, const ComputePlanOptions& options);

// Expert e of layer l on worker (e + l) % W: the baseline the policy is measured against.
ComputePlan RoundRobinPlan(int layers, int experts, int workers);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_PLACEMENT_H_
