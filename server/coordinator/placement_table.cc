#include "server/coordinator/placement_table.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"

namespace pith::coordinator {
namespace {

// The least relative cut of the lockstep load (LockstepLoad) for which a re-plan moves
// experts between workers.
constexpr double kReplanGain = 0.1;

}  // namespace

std::string GroupName(const std::string& job_id, int layer, int expert) {
  return layer < 0 ? absl::StrCat(job_id, "/dense") : absl::StrCat(job_id, "/", layer, "/", expert);
}

std::pair<int, int> GroupOf(int layer, int expert) { return {layer, layer < 0 ? 0 : expert}; }

v1::PlacementTable BuildPlacement(const v1::Job& job, const std::vector<std::string>& workers,
                                  const std::vector<std::string>& stores, const ComputePlan& plan,
                                  const v1::PlacementTable* previous, int64_t epoch,
                                  int64_t effective_step) {
  const v1::ModelConfig& m = job.spec().model();
  const int replicas = std::max(1, job.spec().cluster().store_replicas());
  std::map<std::pair<int, int>, const v1::ExpertPlacement*> before;
  if (previous != nullptr) {
    for (const v1::ExpertPlacement& e : previous->experts()) {
      before[GroupOf(e.layer(), e.expert())] = &e;
    }
  }
  v1::PlacementTable table;
  table.set_job_id(job.job_id());
  table.set_epoch(epoch);
  table.set_effective_step(effective_step);
  auto place = [&](int layer, int expert) {
    v1::ExpertPlacement* e = table.add_experts();
    e->set_layer(layer);
    e->set_expert(layer < 0 ? 0 : expert);
    auto it = before.find({layer, layer < 0 ? 0 : expert});
    if (it != before.end() && it->second->store_ids_size() > 0) {
      *e->mutable_store_ids() = it->second->store_ids();
      *e->mutable_joining_store_ids() = it->second->joining_store_ids();
    } else {
      for (std::string& id :
           RendezvousStores(GroupName(job.job_id(), layer, expert), stores, replicas)) {
        e->add_store_ids(std::move(id));
      }
    }
    if (layer < 0) return;
    if (workers.empty()) {  // its owners' ranks wait for the workers that take them
      if (it != before.end()) *e->mutable_owners() = it->second->owners();
      return;
    }
    for (const auto& [rank, share] : plan.at(layer).at(expert)) {
      v1::ComputeOwner* o = e->add_owners();
      o->set_worker_id(workers.at(rank));
      o->set_rank(rank);
      o->set_token_share(share);
    }
  };
  place(-1, 0);
  for (int l = 0; l < m.n_layer(); ++l) {
    for (int x = 0; x < m.n_expert(); ++x) place(l, x);
  }
  return table;
}

ComputePlan PlanJobCompute(const v1::Job& job, int workers, std::optional<HeatMap> map) {
  if (workers == 0) return {};
  const v1::ModelConfig& m = job.spec().model();
  const v1::ReplicationConfig& r = job.spec().cluster().replication();
  if (!map) map.emplace(m.n_layer(), m.n_expert(), r.heat_decay());
  ComputePlanOptions options;
  options.workers = workers;
  options.max_replicas = std::max(1, r.max_compute_replicas());
  options.affinity = !r.disable_affinity();
  return PlanCompute(*map, options);
}

double LockstepLoad(const v1::PlacementTable& t, const HeatMap& heat) {
  std::map<std::pair<int, std::string>, double> load;  // (layer, worker)
  for (const v1::ExpertPlacement& e : t.experts()) {
    if (e.layer() < 0 || e.layer() >= heat.layers() || e.expert() >= heat.experts()) continue;
    for (const v1::ComputeOwner& o : e.owners()) {
      load[{e.layer(), o.worker_id()}] += heat.heat(e.layer(), e.expert()) * o.token_share();
    }
  }
  std::vector<double> busiest(heat.layers(), 0.0);
  for (const auto& [at, l] : load) busiest[at.first] = std::max(busiest[at.first], l);
  double sum = 0;
  for (double b : busiest) sum += b;
  return sum;
}

bool SameOwners(const v1::PlacementTable& a, const v1::PlacementTable& b) {
  if (a.experts_size() != b.experts_size()) return false;
  for (int i = 0; i < a.experts_size(); ++i) {
    const auto& x = a.experts(i).owners();
    const auto& y = b.experts(i).owners();
    if (x.size() != y.size()) return false;
    for (int j = 0; j < x.size(); ++j) {
      if (x[j].worker_id() != y[j].worker_id() ||
          std::abs(x[j].token_share() - y[j].token_share()) > 1e-9) {
        return false;
      }
    }
  }
  return true;
}

bool ReplanPays(const v1::PlacementTable& current, const v1::PlacementTable& next,
                const std::optional<HeatMap>& heat) {
  return !SameOwners(next, current) &&
         (!heat || LockstepLoad(next, *heat) < (1 - kReplanGain) * LockstepLoad(current, *heat));
}

std::vector<double> LayerMeans(const HeatMap& heat) {
  std::vector<double> means(heat.layers(), 0);
  for (int l = 0; l < heat.layers(); ++l) {
    for (int e = 0; e < heat.experts(); ++e) means[l] += heat.heat(l, e);
    means[l] /= std::max(1, heat.experts());
  }
  return means;
}

std::vector<std::string> DesiredStores(const v1::Job& job, int layer, int expert,
                                       const std::vector<std::string>& live, const HeatMap* heat,
                                       const std::vector<double>& means) {
  const v1::ClusterConfig& c = job.spec().cluster();
  int want = std::max(1, c.store_replicas());
  if (heat != nullptr && layer >= 0 && layer < heat->layers() && expert < heat->experts() &&
      means[layer] > 0 &&
      heat->heat(layer, expert) > c.replication().hot_threshold() * means[layer]) {
    want = std::max(want, c.replication().max_store_replicas());
  }
  return RendezvousStores(GroupName(job.job_id(), layer, expert), live, want);
}

std::optional<ComputePlan> KeptPlan(const v1::PlacementTable& placement, int workers,
                                    int planned_for, const v1::ModelConfig& m) {
  if (workers <= 0 || (planned_for > 0 && planned_for != workers)) return std::nullopt;
  ComputePlan plan(m.n_layer(), std::vector<Owners>(m.n_expert()));
  std::vector<bool> owns(workers, false);
  for (const v1::ExpertPlacement& e : placement.experts()) {
    if (e.layer() < 0) continue;
    if (e.layer() >= m.n_layer() || e.expert() >= m.n_expert()) return std::nullopt;
    for (const v1::ComputeOwner& o : e.owners()) {
      if (o.rank() < 0 || o.rank() >= workers) return std::nullopt;
      owns[o.rank()] = true;
      plan[e.layer()][e.expert()].push_back({o.rank(), o.token_share()});
    }
  }
  // A plan made for fewer ranks (the job grew) would leave the new ones idle: plan afresh.
  if (planned_for == 0 && std::find(owns.begin(), owns.end(), false) != owns.end()) {
    return std::nullopt;
  }
  for (const auto& layer : plan) {
    for (const Owners& owners : layer) {
      if (owners.empty()) return std::nullopt;
    }
  }
  return plan;
}

}  // namespace pith::coordinator
