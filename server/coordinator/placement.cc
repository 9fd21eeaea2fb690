#include "server/coordinator/placement.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace pith::coordinator {
namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t StableHash(absl::string_view data) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then mixed
  for (unsigned char c : data) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return Mix(h);
}

std::vector<std::string> RendezvousStores(absl::string_view group,
                                          absl::Span<const std::string> stores, int replicas) {
  std::vector<std::pair<uint64_t, const std::string*>> scored;
  scored.reserve(stores.size());
  const uint64_t g = StableHash(group);
  for (const std::string& s : stores) scored.push_back({Mix(g ^ StableHash(s)), &s});
  const size_t n = std::min<size_t>(stores.size(), static_cast<size_t>(std::max(replicas, 0)));
  std::partial_sort(scored.begin(), scored.begin() + n, scored.end(),
                    [](const auto& a, const auto& b) {
                      return a.first != b.first ? a.first > b.first : *a.second < *b.second;
                    });
  std::vector<std::string> out;
  for (size_t i = 0; i < n; ++i) out.push_back(*scored[i].second);
  return out;
}

ComputePlan RoundRobinPlan(int layers, int experts, int workers) {
  ComputePlan plan(layers, std::vector<Owners>(experts));
  for (int l = 0; l < layers; ++l) {
    for (int e = 0; e < experts; ++e) plan[l][e] = {{(e + l) % workers, 1.0}};
  }
  return plan;
}

ComputePlan PlanCompute(const HeatMap& heat, const ComputePlanOptions& options) {
  const int W = std::max(1, options.workers);
  const int E = heat.experts();
  ComputePlan plan(heat.layers(), std::vector<Owners>(E));
  for (int l = 0; l < heat.layers(); ++l) {
    std::vector<double> h(E);
    double total = 0;
    for (int e = 0; e < E; ++e) total += (h[e] = heat.heat(l, e));
    if (total <= 0) {  // nothing reported yet: every expert counts the same
      std::fill(h.begin(), h.end(), 1.0);
      total = E;
    }
    const double mean = total / W;
    // Hot experts get several owners, each taking an equal share of its tokens.
    struct Shard {
      int expert;
      double load;
    };
    std::vector<Shard> shards;
    std::vector<int> replicas(E, 1);
    for (int e = 0; e < E; ++e) {
      replicas[e] = std::clamp(static_cast<int>(std::ceil(h[e] / mean - 1e-9)), 1,
                               std::min(options.max_replicas, W));
      for (int r = 0; r < replicas[e]; ++r) shards.push_back({e, h[e] / replicas[e]});
    }
    // Largest first onto the least loaded worker (LPT), but onto a worker that already
    // holds experts co-activated with this one when that stays within the slack.
    std::stable_sort(shards.begin(), shards.end(),
                     [](const Shard& a, const Shard& b) { return a.load > b.load; });
    // Each expert's strongest partners, in tokens that chose both.
    std::vector<std::vector<std::pair<int, double>>> partners(E);
    if (options.affinity) {
      for (const auto& [pair, weight] : heat.Pairs(l)) {
        if (partners[pair.first].size() < 16) partners[pair.first].push_back({pair.second, weight});
        if (partners[pair.second].size() < 16)
          partners[pair.second].push_back({pair.first, weight});
      }
    }
    std::vector<double> load(W, 0.0);
    std::vector<std::vector<int>> workers_of(E);  // workers holding each expert so far
    const double cap = mean * (1.0 + options.slack);
    std::vector<double> together(W, 0.0);
    std::vector<int> touched;
    auto holds = [&](int w, int e) {
      return std::find(workers_of[e].begin(), workers_of[e].end(), w) != workers_of[e].end();
    };
    for (const Shard& s : shards) {
      int best = -1;
      for (int w = 0; w < W; ++w) {
        if ((best < 0 || load[w] < load[best]) && !holds(w, s.expert)) best = w;
      }
      // A worker that holds co-activated experts wins whenever it stays within the slack:
      // the most shared tokens first, the lighter load on ties. The cap bounds what
      // affinity may cost in balance.
      double best_together = 0;
      for (const auto& [partner, weight] : partners[s.expert]) {
        for (int w : workers_of[partner]) {
          if (together[w] == 0) touched.push_back(w);
          together[w] += weight / workers_of[partner].size();
        }
      }
      for (int w : touched) {
        const bool better =
            together[w] > best_together ||
            (together[w] == best_together && best_together > 0 && load[w] < load[best]);
        if (better && load[w] + s.load <= cap && !holds(w, s.expert)) {
          best = w;
          best_together = together[w];
        }
        together[w] = 0;
      }
      touched.clear();
      workers_of[s.expert].push_back(best);
      load[best] += s.load;
      plan[l][s.expert].push_back({best, 1.0 / replicas[s.expert]});
    }
  }
  return plan;
}

}  // namespace pith::coordinator
