#include "server/coordinator/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "pith/v1/coordinator.pb.h"
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
template <typename Router>
double SendsPerToken(const ComputePlan& plan, std::vector<Router>& routers, int workers, int tokens,
                     uint64_t seed) {
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

// A store joins: the share of blob copies (all kinds of every expert) that move.
double StoreJoinShare(int layers, int experts, int store_count, int replicas) {
  std::vector<std::string> stores;
  for (int s = 0; s < store_count; ++s) stores.push_back(absl::StrCat("store-", s));
  std::vector<std::string> grown = stores;
  grown.push_back(absl::StrCat("store-", store_count));
  int64_t moved = 0, copies = 0;
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) {
      const std::string group = absl::StrCat("job/", l, "/", e);
      const auto before = RendezvousStores(group, stores, replicas);
      const auto after = RendezvousStores(group, grown, replicas);
      const std::set<std::string> had(before.begin(), before.end());
      for (const std::string& s : after) moved += !had.count(s);
      copies += after.size();
    }
  }
  return copies ? static_cast<double>(moved) / copies : 0;
}

// Routing sampled from a trace's totals: the first expert by its token count, each next
// one by its co-activation with those already chosen (a little of its own count mixed in
// so that every expert stays reachable).
class TraceRouter {
 public:
  TraceRouter(std::vector<double> counts, std::map<std::pair<int, int>, double> pairs, int top_k)
      : k_(top_k), counts_(std::move(counts)), pairs_(std::move(pairs)) {
    first_ = std::discrete_distribution<int>(counts_.begin(), counts_.end());
    double total = 0;
    for (double c : counts_) total += c;
    floor_ = total > 0 ? 1e-3 / total : 1e-3;
  }

  void Route(std::mt19937_64& rng, std::vector<int>* chosen) {
    chosen->clear();
    chosen->push_back(first_(rng));
    const int experts = static_cast<int>(counts_.size());
    std::vector<double> w(experts);
    while (static_cast<int>(chosen->size()) < std::min(k_, experts)) {
      for (int e = 0; e < experts; ++e) {
        if (std::find(chosen->begin(), chosen->end(), e) != chosen->end()) {
          w[e] = 0;
          continue;
        }
        double x = floor_ * counts_[e];
        for (int c : *chosen) {
          auto it = pairs_.find({std::min(c, e), std::max(c, e)});
          if (it != pairs_.end()) x += it->second;
        }
        w[e] = x;
      }
      std::discrete_distribution<int> next(w.begin(), w.end());
      chosen->push_back(next(rng));
    }
  }

 private:
  int k_;
  std::vector<double> counts_;
  std::map<std::pair<int, int>, double> pairs_;
  std::discrete_distribution<int> first_;
  double floor_;
};

// Plans from `heat` (timed), and measures the plan, the no-heat plan and round-robin on
// tokens from `routers` and on the expert loads `counts_fn()` returns (called after the
// sends are measured).
template <typename Router, typename CountsFn>
SimResult Evaluate(const SimOptions& o, const HeatMap& heat, std::vector<Router>& routers,
                   int eval_tokens, CountsFn counts_fn) {
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
  const ComputePlan rr = RoundRobinPlan(heat.layers(), heat.experts(), o.workers);
  r.cross_worker_sends_per_token = SendsPerToken(plan, routers, o.workers, eval_tokens, o.seed + 1);
  r.rr_cross_worker_sends_per_token =
      SendsPerToken(rr, routers, o.workers, eval_tokens, o.seed + 1);
  const std::vector<std::vector<double>> counts = counts_fn();
  r.max_over_mean_load = MaxOverMeanLoad(plan, counts, o.workers);
  r.max_over_mean_load_no_heat = MaxOverMeanLoad(no_heat, counts, o.workers);
  r.moved_blobs_on_store_join =
      StoreJoinShare(heat.layers(), heat.experts(), o.stores, o.store_replicas);
  return r;
}

absl::StatusOr<SimResult> RunTrace(const SimOptions& o) {
  std::ifstream in(o.trace_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read trace ", o.trace_path));
  std::vector<v1::HeatReport> reports;
  std::string line;
  int line_no = 0, layers = 0, experts = 0;
  double assignments = 0, tokens = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    v1::HeatReport r;
    if (!google::protobuf::util::JsonStringToMessage(line, &r).ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.trace_path, ":", line_no, ": not a pith.v1.HeatReport"));
    }
    for (const v1::LayerRouting& l : r.layers()) {
      if (l.layer() < 0 || l.tokens_per_expert_size() == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(o.trace_path, ":", line_no, ": bad layer routing"));
      }
      layers = std::max(layers, l.layer() + 1);
      experts = std::max(experts, l.tokens_per_expert_size());
      if (l.layer() == 0) {
        for (uint64_t c : l.tokens_per_expert()) assignments += c;
        tokens += r.tokens();
      }
    }
    reports.push_back(std::move(r));
  }
  if (reports.empty()) return absl::InvalidArgumentError(o.trace_path + ": empty trace");
  const int top_k =
      tokens > 0 ? std::max(1, static_cast<int>(std::lround(assignments / tokens))) : o.top_k;

  HeatMap heat(layers, experts, o.heat_decay);
  std::vector<std::vector<double>> counts(layers, std::vector<double>(experts, 0));
  std::vector<std::map<std::pair<int, int>, double>> pairs(layers);
  std::sort(reports.begin(), reports.end(),
            [](const v1::HeatReport& a, const v1::HeatReport& b) { return a.step() < b.step(); });
  int64_t step = reports.front().step();
  for (const v1::HeatReport& r : reports) {
    if (r.step() != step) {
      heat.EndStep();
      step = r.step();
    }
    for (const v1::LayerRouting& l : r.layers()) {
      RETURN_IF_ERROR(heat.Add(l));
      for (int e = 0; e < l.tokens_per_expert_size(); ++e)
        counts[l.layer()][e] += l.tokens_per_expert(e);
      for (int i = 0, idx = 0; i < experts; ++i) {
        for (int j = i + 1; j < experts; ++j, ++idx) {
          if (idx < l.coactivation_size() && l.coactivation(idx) > 0) {
            pairs[l.layer()][{i, j}] += l.coactivation(idx);
          }
        }
      }
    }
  }
  std::vector<TraceRouter> routers;
  for (int l = 0; l < layers; ++l) routers.emplace_back(counts[l], pairs[l], top_k);

  return Evaluate(o, heat, routers, std::min(o.eval_tokens, 2048), [&] { return counts; });
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
  if (!o.trace_path.empty()) {
    if (o.workers < 1 || o.stores < 1) {
      return absl::InvalidArgumentError("simulate: need workers, stores >= 1");
    }
    return RunTrace(o);
  }
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

  // Loads from a large sample of fresh routing (drawn after the sends are measured),
  // computed exactly rather than sampled.
  return Evaluate(o, heat, routers, o.eval_tokens, [&] {
    std::vector<std::vector<double>> counts(o.layers, std::vector<double>(o.experts, 0));
    for (int l = 0; l < o.layers; ++l) {
      for (int t = 0; t < 4 * o.eval_tokens; ++t) {
        routers[l].Route(rng, &chosen);
        for (int e : chosen) counts[l][e] += 1;
      }
    }
    return counts;
  });
}

}  // namespace pith::coordinator
