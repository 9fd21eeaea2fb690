#include "server/coordinator/placement.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

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

namespace {

// One entry per expert: each of its replicas carries `load`.
struct Shard {
  int expert;
  double load;
};

// Each expert's strongest partners, in tokens that chose both.
using Partners = std::vector<std::vector<std::pair<int, double>>>;

// Layer `l`'s experts as shards, largest first, with their replica counts: hot experts
// get several owners, each taking an equal share of its tokens. Sets `mean`, the mean
// load of a worker.
std::vector<Shard> LayerShards(const HeatMap& heat, int l, int W, const ComputePlanOptions& options,
                               std::vector<int>& replicas, double& mean) {
  const int E = heat.experts();
  std::vector<double> h(E);
  double total = 0;
  for (int e = 0; e < E; ++e) total += (h[e] = heat.heat(l, e));
  if (total <= 0) {  // nothing reported yet: every expert counts the same
    std::fill(h.begin(), h.end(), 1.0);
    total = E;
  }
  mean = total / W;
  std::vector<Shard> shards;
  replicas.assign(E, 1);
  shards.reserve(E);
  for (int e = 0; e < E; ++e) {
    replicas[e] =
        std::clamp(static_cast<int>(std::ceil(h[e] / (mean * options.replica_load) - 1e-9)), 1,
                   std::min(options.max_replicas, W));
    shards.push_back({e, h[e] / replicas[e]});
  }
  // Largest first onto the least loaded worker (LPT), but onto a worker that already
  // holds experts co-activated with this one when that stays within the slack.
  std::stable_sort(shards.begin(), shards.end(),
                   [](const Shard& a, const Shard& b) { return a.load > b.load; });
  return shards;
}

// The partners of layer `l`'s experts (none without affinity).
Partners LayerPartners(const HeatMap& heat, int l, const std::vector<int>& replicas,
                       bool affinity) {
  Partners partners(heat.experts());
  const bool any_single = std::count(replicas.begin(), replicas.end(), 1) > 1;
  if (!affinity || !any_single) return partners;
  // Only single-owner experts look for partners, among single-owner partners: a
  // replicated expert is local almost everywhere already.
  heat.ForEachPair(l, [&](int a, int b, double weight) {
    if (replicas[a] > 1 || replicas[b] > 1) return;
    partners[a].push_back({b, weight});
    partners[b].push_back({a, weight});
  });
  constexpr size_t kPartners = 16;
  for (auto& p : partners) {
    auto stronger = [](const auto& x, const auto& y) {
      return x.second != y.second ? x.second > y.second : x.first < y.first;
    };
    if (p.size() > kPartners) {
      std::nth_element(p.begin(), p.begin() + kPartners, p.end(), stronger);
      p.resize(kPartners);
    }
    std::sort(p.begin(), p.end(), stronger);
  }
  return partners;
}

// Places one layer's shards on W workers (E experts), up to `cap` per worker where
// affinity decides: a replicated expert takes the r lightest workers at once; a
// single-owner one looks for its partners first.
void AssignShards(const std::vector<Shard>& shards, const std::vector<int>& replicas,
                  const Partners& partners, int W, int E, double cap, std::vector<Owners>& plan) {
  std::vector<double> load(W, 0.0);
  // The workers by (load, index), the lightest first (ties to the lower index), kept
  // sorted as loads grow: the r lightest are the first r, and a merge puts them back.
  // (A partial sort of every worker per expert took most of a 38-ms plan of 58 layers x
  // 256 experts on 256 workers, each expert on ~29 of them; with the run kept sorted, the
  // plan takes 14 ms.)
  std::vector<std::pair<double, int>> by_load(W), merged(W);
  for (int w = 0; w < W; ++w) by_load[w] = {0.0, w};
  const auto add_load = [&](int w, double more) {  // one worker, anywhere in the run
    auto at = std::lower_bound(by_load.begin(), by_load.end(), std::make_pair(load[w], w));
    load[w] += more;
    const std::pair<double, int> moved(load[w], w);
    auto to = std::lower_bound(at + 1, by_load.end(), moved);
    std::rotate(at, at + 1, to);
    *(to - 1) = moved;
  };
  std::vector<std::vector<int>> workers_of(E);  // workers holding each expert so far
  std::vector<char> held(static_cast<size_t>(W) * E, 0);
  std::vector<double> together(W, 0.0);
  std::vector<int> touched;
  auto holds = [&](int w, int e) { return held[static_cast<size_t>(w) * E + e] != 0; };
  for (const Shard& shard : shards) {
    const int expert = shard.expert;
    const int r = replicas[expert];
    if (r > 1) {  // the r lightest workers, lightest first
      plan[expert].reserve(r);
      workers_of[expert].reserve(r);
      for (int j = 0; j < r; ++j) {
        const int w = by_load[j].second;
        workers_of[expert].push_back(w);
        held[static_cast<size_t>(w) * E + expert] = 1;
        plan[expert].push_back({w, 1.0 / r});
        load[w] += shard.load;
        by_load[j].first = load[w];
      }
      // Still in order but for a tie a rounding may have made (a lighter worker of a
      // higher index now as heavy as another): sorted again before the merge.
      if (!std::is_sorted(by_load.begin(), by_load.begin() + r)) {
        std::sort(by_load.begin(), by_load.begin() + r);
      }
      std::merge(by_load.begin(), by_load.begin() + r, by_load.begin() + r, by_load.end(),
                 merged.begin());
      by_load.swap(merged);
      continue;
    }
    int best = by_load.front().second;
    // A worker that holds co-activated experts wins whenever it stays within the slack:
    // the most shared tokens first, the lighter load on ties. The cap bounds what
    // affinity may cost in balance.
    double best_together = 0;
    for (const auto& [partner, weight] : partners[expert]) {
      for (int w : workers_of[partner]) {
        if (together[w] == 0) touched.push_back(w);
        together[w] += weight / workers_of[partner].size();
      }
    }
    for (int w : touched) {
      const bool better =
          together[w] > best_together ||
          (together[w] == best_together && best_together > 0 && load[w] < load[best]);
      if (better && load[w] + shard.load <= cap && !holds(w, expert)) {
        best = w;
        best_together = together[w];
      }
      together[w] = 0;
    }
    touched.clear();
    workers_of[expert].push_back(best);
    held[static_cast<size_t>(best) * E + expert] = 1;
    add_load(best, shard.load);
    plan[expert].push_back({best, 1.0});
  }
}

}  // namespace

ComputePlan PlanCompute(const HeatMap& heat, const ComputePlanOptions& options) {
  const int W = std::max(1, options.workers);
  const int E = heat.experts();
  ComputePlan plan(heat.layers(), std::vector<Owners>(E));
  std::vector<int> replicas;
  for (int l = 0; l < heat.layers(); ++l) {
    double mean = 0;
    const std::vector<Shard> shards = LayerShards(heat, l, W, options, replicas, mean);
    const Partners partners = LayerPartners(heat, l, replicas, options.affinity);
    AssignShards(shards, replicas, partners, W, E, mean * (1.0 + options.slack), plan[l]);
  }
  return plan;
}
}  // namespace pith::coordinator
