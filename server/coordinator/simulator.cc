#include "server/coordinator/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "server/coordinator/heat_map.h"
#include "server/coordinator/placement.h"

namespace pith::coordinator {
namespace {

// Routing of one layer: Zipf popularity over a random order of experts; experts grouped
// in clusters of 2k that tokens tend to pick together.
class LayerRouter {
 public:
  LayerRouter(int experts, int top_k, double zipf, std::mt19937_64& rng) : k_(top_k) {
    std::vector<int> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    weight_.resize(experts);
    for (int rank = 0; rank < experts; ++rank)
      weight_[order[rank]] = 1.0 / std::pow(rank + 1, zipf);
    std::shuffle(order.begin(), order.end(), rng);
    const int size = std::min(experts, 2 * top_k);
    for (int start = 0; start < experts; start += size) {
      clusters_.emplace_back(order.begin() + start,
                             order.begin() + std::min(experts, start + size));
    }
    std::vector<double> cluster_weight;
    for (const auto& c : clusters_) {
      double w = 0;
      for (int e : c) w += weight_[e];
      cluster_weight.push_back(w);
      std::vector<double> member_weight;
      for (int e : c) member_weight.push_back(weight_[e]);
      within_.emplace_back(member_weight.begin(), member_weight.end());
    }
    pick_cluster_ = std::discrete_distribution<int>(cluster_weight.begin(), cluster_weight.end());
    global_ = std::discrete_distribution<int>(weight_.begin(), weight_.end());
  }

  // The k distinct experts one token chooses: mostly from one cluster.
  void Route(std::mt19937_64& rng, std::vector<int>* chosen) {
    chosen->clear();
    const int c = pick_cluster_(rng);
    std::uniform_real_distribution<double> coin(0, 1);
    while (static_cast<int>(chosen->size()) < k_) {
      const int e = coin(rng) < 0.75 ? clusters_[c][within_[c](rng)] : global_(rng);
      if (std::find(chosen->begin(), chosen->end(), e) == chosen->end()) chosen->push_back(e);
    }
  }

 private:
  int k_;
  std::vector<double> weight_;
  std::vector<std::vector<int>> clusters_;
  std::vector<std::discrete_distribution<int>> within_;
  std::discrete_distribution<int> pick_cluster_, global_;
};

// Expected load per worker, exactly, from the experts' assignment counts: a token from a
// source that owns the expert stays there; any other goes to an owner by share.
double MaxOverMeanLoad(const ComputePlan& plan, const std::vector<std::vector<double>>& counts,
                       int workers) {
  double worst = 0;
  for (size_t l = 0; l < plan.size(); ++l) {
    std::vector<double> load(workers, 0);
    for (size_t e = 0; e < plan[l].size(); ++e) {
      const Owners& owners = plan[l][e];
      const double remote =
          static_cast<double>(workers - static_cast<int>(owners.size())) / workers;
      for (const auto& [w, share] : owners)
        load[w] += counts[l][e] * (1.0 / workers + remote * share);
    }
    const double mean = std::accumulate(load.begin(), load.end(), 0.0) / workers;
    if (mean > 0) worst = std::max(worst, *std::max_element(load.begin(), load.end()) / mean);
  }
  return worst;
}

// Routes eval tokens (each from a uniformly random source worker) through `plan`: an
// expert with an owner on the source worker is computed there; otherwise one owner is
// picked by its share. Returns the distinct other workers a token is sent to, per layer.
double SendsPerToken(const ComputePlan& plan, std::vector<LayerRouter>& routers, int workers,
                     int tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> source(0, workers - 1);
  std::uniform_real_distribution<double> coin(0, 1);
  std::vector<int> chosen, dest;
  double sends = 0;
  for (size_t l = 0; l < plan.size(); ++l) {
    for (int t = 0; t < tokens; ++t) {
      const int src = source(rng);
      routers[l].Route(rng, &chosen);
      dest.clear();
      for (int e : chosen) {
        const Owners& owners = plan[l][e];
        int to = -1;
        for (const auto& [w, share] : owners) {
          if (w == src) to = src;
        }
        if (to < 0) {
          double r = coin(rng);
          to = owners.back().first;
          for (const auto& [w, share] : owners) {
            if ((r -= share) <= 0) {
              to = w;
              break;
            }
          }
        }
        if (to != src && std::find(dest.begin(), dest.end(), to) == dest.end()) dest.push_back(to);
      }
      sends += dest.size();
    }
  }
  return sends / (static_cast<double>(tokens) * plan.size());
}

}  // namespace

std::string SimResult::ToString() const {
  return absl::StrFormat(
      "max_over_mean_load=%.3f cross_worker_sends_per_token=%.3f "
      "rr_cross_worker_sends_per_token=%.3f replan_ms=%.1f moved_blobs_on_store_join=%.4f "
      "max_over_mean_load_without_heat_replication=%.3f",
      max_over_mean_load, cross_worker_sends_per_token, rr_cross_worker_sends_per_token, replan_ms,
      moved_blobs_on_store_join, max_over_mean_load_no_heat);
}

absl::StatusOr<SimResult> RunSimulation(const SimOptions& o) {
  if (o.layers < 1 || o.experts < 1 || o.top_k < 1 || o.top_k > o.experts || o.workers < 1 ||
      o.stores < 1 || o.zipf < 0 || o.steps < 1 || o.tokens_per_step < 1) {
    return absl::InvalidArgumentError(
        "simulate: need layers, experts, workers, stores, steps >= 1, 1 <= top_k <= experts, "
        "zipf >= 0");
  }
  std::mt19937_64 rng(o.seed);
  std::vector<LayerRouter> routers;
  for (int l = 0; l < o.layers; ++l) routers.emplace_back(o.experts, o.top_k, o.zipf, rng);

  // Heat from `steps` steps of routing, reported as the workers would.
  HeatMap heat(o.layers, o.experts, o.heat_decay);
  std::vector<int> chosen;
  const int64_t packed = int64_t{o.experts} * (o.experts - 1) / 2;
  for (int s = 0; s < o.steps; ++s) {
    for (int l = 0; l < o.layers; ++l) {
      v1::LayerRouting report;
      report.set_layer(l);
      report.mutable_tokens_per_expert()->Resize(o.experts, 0);
      report.mutable_coactivation()->Resize(static_cast<int>(packed), 0);
      for (int t = 0; t < o.tokens_per_step; ++t) {
        routers[l].Route(rng, &chosen);
        std::sort(chosen.begin(), chosen.end());
        for (size_t i = 0; i < chosen.size(); ++i) {
          report.set_tokens_per_expert(chosen[i], report.tokens_per_expert(chosen[i]) + 1);
          for (size_t j = i + 1; j < chosen.size(); ++j) {
            const int64_t idx = HeatMap::PairIndex(o.experts, chosen[i], chosen[j]);
            report.set_coactivation(static_cast<int>(idx), report.coactivation(idx) + 1);
          }
        }
      }
      RETURN_IF_ERROR(heat.Add(report));
    }
    heat.EndStep();
  }

  SimResult r;
  ComputePlanOptions options;
  options.workers = o.workers;
  options.max_replicas = o.max_replicas > 0 ? o.max_replicas : o.workers;
  const auto start = std::chrono::steady_clock::now();
  const ComputePlan plan = PlanCompute(heat, options);
  r.replan_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();

  ComputePlanOptions plain = options;
  plain.max_replicas = 1;
  plain.affinity = false;
  const ComputePlan no_heat = PlanCompute(heat, plain);
  const ComputePlan rr = RoundRobinPlan(o.layers, o.experts, o.workers);

  r.cross_worker_sends_per_token =
      SendsPerToken(plan, routers, o.workers, o.eval_tokens, o.seed + 1);
  r.rr_cross_worker_sends_per_token =
      SendsPerToken(rr, routers, o.workers, o.eval_tokens, o.seed + 1);
  // Loads from a large sample of fresh routing, computed exactly rather than sampled.
  std::vector<std::vector<double>> counts(o.layers, std::vector<double>(o.experts, 0));
  for (int l = 0; l < o.layers; ++l) {
    for (int t = 0; t < 4 * o.eval_tokens; ++t) {
      routers[l].Route(rng, &chosen);
      for (int e : chosen) counts[l][e] += 1;
    }
  }
  r.max_over_mean_load = MaxOverMeanLoad(plan, counts, o.workers);
  r.max_over_mean_load_no_heat = MaxOverMeanLoad(no_heat, counts, o.workers);

  // A store joins: the share of blob copies (all kinds of every expert) that move.
  std::vector<std::string> stores;
  for (int s = 0; s < o.stores; ++s) stores.push_back(absl::StrCat("store-", s));
  std::vector<std::string> grown = stores;
  grown.push_back(absl::StrCat("store-", o.stores));
  int64_t moved = 0, copies = 0;
  for (int l = 0; l < o.layers; ++l) {
    for (int e = 0; e < o.experts; ++e) {
      const std::string group = absl::StrCat("job/", l, "/", e);
      const auto before = RendezvousStores(group, stores, o.store_replicas);
      const auto after = RendezvousStores(group, grown, o.store_replicas);
      const std::set<std::string> had(before.begin(), before.end());
      for (const std::string& s : after) moved += !had.count(s);
      copies += after.size();
    }
  }
  r.moved_blobs_on_store_join = copies ? static_cast<double>(moved) / copies : 0;
  return r;
}

}  // namespace pith::coordinator
