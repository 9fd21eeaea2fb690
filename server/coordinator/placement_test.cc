// Placement: rendezvous store placement (balance, minimal movement on join and leave),
// the heat map, heat replication and affinity, and the simulator end to end.
#include "server/coordinator/placement.h"

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/coordinator/heat_map.h"
#include "server/coordinator/simulator.h"

namespace pith::coordinator {
namespace {

std::vector<std::string> Stores(int n) {
  std::vector<std::string> s;
  for (int i = 0; i < n; ++i) s.push_back(absl::StrCat("store-", i));
  return s;
}

TEST(PlacementTest, RendezvousIsBalancedStableAndDistinct) {
  const auto stores = Stores(8);
  std::map<std::string, int> primaries;
  for (int g = 0; g < 8000; ++g) {
    const auto set = RendezvousStores(absl::StrCat("job/", g), stores, 3);
    ASSERT_EQ(set.size(), 3u);
    EXPECT_EQ(std::set<std::string>(set.begin(), set.end()).size(), 3u);
    EXPECT_EQ(set, RendezvousStores(absl::StrCat("job/", g), stores, 3));  // deterministic
    ++primaries[set[0]];
  }
  for (const auto& [store, n] : primaries) {
    EXPECT_NEAR(n, 1000, 150) << store;  // each store is primary for ~1/8
  }
  EXPECT_EQ(RendezvousStores("g", Stores(2), 5).size(), 2u);
  EXPECT_EQ(StableHash("pith"), StableHash("pith"));
  EXPECT_NE(StableHash("pith"), StableHash("pitH"));
}

TEST(PlacementTest, AStoreJoiningOrLeavingMovesOnlyItsShare) {
  const int S = 16, R = 2, groups = 20000;
  const auto stores = Stores(S);
  auto grown = stores;
  grown.push_back("store-new");
  auto shrunk = stores;
  shrunk.erase(shrunk.begin() + 5);
  int64_t moved_join = 0, moved_leave = 0, copies = 0;
  for (int g = 0; g < groups; ++g) {
    const std::string group = absl::StrCat("job/", g);
    const auto before = RendezvousStores(group, stores, R);
    const std::set<std::string> had(before.begin(), before.end());
    for (const auto& s : RendezvousStores(group, grown, R)) moved_join += !had.count(s);
    for (const auto& s : RendezvousStores(group, shrunk, R)) moved_leave += !had.count(s);
    copies += R;
  }
  // Joining: the new store takes its 1/(S+1) share and nothing else moves.
  EXPECT_LE(static_cast<double>(moved_join) / copies, 1.2 / S);
  EXPECT_GT(static_cast<double>(moved_join) / copies, 0.5 / S);
  // Leaving: only the copies the store held move (1/S of them).
  EXPECT_LE(static_cast<double>(moved_leave) / copies, 1.2 / S);
}

TEST(HeatMapTest, DecaysAndCountsPairs) {
  HeatMap heat(2, 4, 0.5);
  v1::LayerRouting r;
  r.set_layer(1);
  for (int e = 0; e < 4; ++e) r.add_tokens_per_expert(e == 2 ? 10 : 1);
  for (int i = 0; i < 6; ++i) r.add_coactivation(0);
  r.set_coactivation(static_cast<int>(HeatMap::PairIndex(4, 1, 2)), 7);
  ASSERT_TRUE(heat.Add(r).ok());
  EXPECT_EQ(heat.heat(1, 2), 10);
  EXPECT_EQ(heat.coactivation(1, 2, 1), 7);
  heat.EndStep();
  EXPECT_EQ(heat.heat(1, 2), 5);
  EXPECT_EQ(heat.coactivation(1, 1, 2), 3.5);
  ASSERT_EQ(heat.Pairs(1).size(), 1u);
  r.set_layer(2);
  EXPECT_EQ(heat.Add(r).code(), absl::StatusCode::kInvalidArgument);
  r.set_layer(0);
  r.add_tokens_per_expert(1);
  EXPECT_EQ(heat.Add(r).code(), absl::StatusCode::kInvalidArgument);
}

// A layer whose expert 0 takes half the tokens and whose experts pair up (2k, 2k+1).
HeatMap SkewedPairs(int experts) {
  HeatMap heat(1, experts, 1.0);
  v1::LayerRouting r;
  r.set_layer(0);
  for (int e = 0; e < experts; ++e) r.add_tokens_per_expert(e == 0 ? experts * 100 : 100);
  r.mutable_coactivation()->Resize(experts * (experts - 1) / 2, 0);
  for (int e = 0; e + 1 < experts; e += 2) {
    r.set_coactivation(static_cast<int>(HeatMap::PairIndex(experts, e, e + 1)), 90);
  }
  EXPECT_TRUE(heat.Add(r).ok());
  return heat;
}

TEST(PlacementTest, HotExpertsGetReplicasAndLoadIsBalanced) {
  const int E = 32, W = 8;
  const HeatMap heat = SkewedPairs(E);
  ComputePlanOptions options;
  options.workers = W;
  options.max_replicas = W;
  const ComputePlan plan = PlanCompute(heat, options);
  ASSERT_EQ(plan.size(), 1u);
  std::vector<double> load(W, 0);
  for (int e = 0; e < E; ++e) {
    double shares = 0;
    std::set<int> workers;
    for (const auto& [w, share] : plan[0][e]) {
      shares += share;
      workers.insert(w);
      load[w] += share * heat.heat(0, e);
    }
    EXPECT_NEAR(shares, 1.0, 1e-9) << e;
    EXPECT_EQ(workers.size(), plan[0][e].size()) << "an expert twice on one worker";
  }
  EXPECT_GE(plan[0][0].size(), 4u);  // the hot expert is spread out
  const double mean = std::accumulate(load.begin(), load.end(), 0.0) / W;
  EXPECT_LE(*std::max_element(load.begin(), load.end()) / mean, 1.3);
  // Without replication the hot expert's worker carries half the load.
  options.max_replicas = 1;
  const ComputePlan single = PlanCompute(heat, options);
  EXPECT_EQ(single[0][0].size(), 1u);
}

TEST(PlacementTest, AffinityKeepsCoactivatedExpertsTogether) {
  const int E = 32, W = 8;
  const HeatMap heat = SkewedPairs(E);
  ComputePlanOptions options;
  options.workers = W;
  options.max_replicas = 1;
  int together_with = 0, together_without = 0;
  for (bool affinity : {true, false}) {
    options.affinity = affinity;
    const ComputePlan plan = PlanCompute(heat, options);
    int together = 0;
    for (int e = 2; e + 1 < E; e += 2) together += plan[0][e][0].first == plan[0][e + 1][0].first;
    (affinity ? together_with : together_without) = together;
  }
  EXPECT_GT(together_with, together_without);
  EXPECT_GE(together_with, 10);  // of 15 pairs
}

TEST(SimulatorTest, SmallClusterMeetsTheTargetsShape) {
  SimOptions o;
  o.layers = 4;
  o.experts = 64;
  o.top_k = 4;
  o.workers = 16;
  o.stores = 8;
  o.steps = 4;
  o.tokens_per_step = 2048;
  o.eval_tokens = 4096;
  absl::StatusOr<SimResult> r = RunSimulation(o);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_LT(r->max_over_mean_load, r->max_over_mean_load_no_heat);
  EXPECT_LT(r->cross_worker_sends_per_token, r->rr_cross_worker_sends_per_token);
  EXPECT_LE(r->moved_blobs_on_store_join, 1.2 / o.stores);
  EXPECT_NE(r->ToString().find("max_over_mean_load="), std::string::npos);
  o.top_k = 100;
  EXPECT_EQ(RunSimulation(o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pith::coordinator
