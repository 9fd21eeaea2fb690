// A job's placement table (DESIGN §5): the pure functions that build one from the
// placement policy (placement.h), judge a re-plan, and say where a group's copies
// belong. The scheduler calls them with its own state; nothing here keeps any.
//
// Thread safety: pure functions.
#ifndef PITH_SERVER_COORDINATOR_PLACEMENT_TABLE_H_
#define PITH_SERVER_COORDINATOR_PLACEMENT_TABLE_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pith/v1/common.pb.h"
#include "pith/v1/job.pb.h"
#include "pith/v1/spec.pb.h"
#include "server/coordinator/heat_map.h"
#include "server/coordinator/placement.h"

namespace pith::coordinator {

// The rendezvous name of a group: "<job>/dense" for the dense tensors (layer < 0),
// "<job>/<layer>/<expert>" for an expert.
std::string GroupName(const std::string& job_id, int layer, int expert);

// A group's (layer, expert) key: every dense tensor is group (layer, 0).
std::pair<int, int> GroupOf(int layer, int expert);

// The placement of a job over `workers` (member ids by rank) and `stores`: every expert
// group keeps the store copies `previous` lists, new groups get RendezvousStores over
// `stores` with the spec's replica count; compute owners come from `plan` (with no
// workers, from `previous`: a job waiting for workers keeps its plan by rank). The dense
// tensors are one group (layer -1, empty tensor name): every dense blob of the job lives
// on its stores.
v1::PlacementTable BuildPlacement(const v1::Job& job, const std::vector<std::string>& workers,
                                  const std::vector<std::string>& stores, const ComputePlan& plan,
                                  const v1::PlacementTable* previous, int64_t epoch,
                                  int64_t effective_step);

// Compute ownership of the job's experts for `workers` from `heat` (the job's heat
// snapshot; none yet: every expert average), with the spec's replication options.
ComputePlan PlanJobCompute(const v1::Job& job, int workers, std::optional<HeatMap> heat);

// What a placement's compute ownership costs under `heat`: each layer's experts run in
// lockstep across the workers, so per layer the heat on its busiest worker (an expert's
// heat split by token share), summed over the layers.
double LockstepLoad(const v1::PlacementTable& t, const HeatMap& heat);

// Whether two placements give every expert the same compute owners and shares.
bool SameOwners(const v1::PlacementTable& a, const v1::PlacementTable& b);

// Whether `next` (same stores, a new compute plan) changes `current`'s compute owners and
// pays for itself: moving experts costs the step computed meanwhile (done again under the
// new plan) and their state fetched by the new owners, so a change is taken only when it
// cuts the lockstep load under `heat` (the heat it was planned from; none: any change is
// taken) by a tenth.
bool ReplanPays(const v1::PlacementTable& current, const v1::PlacementTable& next,
                const std::optional<HeatMap>& heat);

// Mean heat per layer, for the hot-expert test of DesiredStores.
std::vector<double> LayerMeans(const HeatMap& heat);

// The stores a group should be on: R of `live` by rendezvous (a hot expert, heat above
// hot_threshold x its layer's mean, up to max_store_replicas). `means` is
// LayerMeans(*heat) when `heat` is set.
std::vector<std::string> DesiredStores(const v1::Job& job, int layer, int expert,
                                       const std::vector<std::string>& live, const HeatMap* heat,
                                       const std::vector<double>& means);

// The compute owners of `placement` as a plan for `workers` ranks, by rank (whichever
// worker now holds a rank takes its experts), when that plan was made for as many ranks:
// `planned_for` (the job's worker count before; 0 when not known: then every rank below
// `workers` must own an expert) equals `workers`, no owner's rank is `workers` or above,
// and every expert has owners. nullopt otherwise (the count changed, or no owners).
std::optional<ComputePlan> KeptPlan(const v1::PlacementTable& placement, int workers,
                                    int planned_for, const v1::ModelConfig& m);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_PLACEMENT_TABLE_H_
