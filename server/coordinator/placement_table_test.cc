// The placement table's pure functions: building a job's placement, judging a re-plan,
// the stores a group belongs on, and keeping a compute plan across a store change.
#include "server/coordinator/placement_table.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pith::coordinator {
namespace {

v1::Job SmallJob(int replicas = 2) {
  v1::Job job;
  job.set_job_id("j");
  job.mutable_spec()->mutable_model()->set_n_layer(2);
  job.mutable_spec()->mutable_model()->set_n_expert(4);
  job.mutable_spec()->mutable_cluster()->set_store_replicas(replicas);
  return job;
}

TEST(PlacementTableTest, GroupsAreNamedByJobLayerAndExpertAndTheDenseTensorsAreOne) {
  EXPECT_EQ(GroupName("j", -1, 7), "j/dense");
  EXPECT_EQ(GroupName("j", 3, 5), "j/3/5");
  EXPECT_EQ(GroupOf(-1, 7), std::make_pair(-1, 0));
  EXPECT_EQ(GroupOf(3, 5), std::make_pair(3, 5));
}

TEST(PlacementTableTest, KeepsExistingCopiesAndPlacesNewGroupsByRendezvous) {
  v1::Job job;
  job.set_job_id("j");
  job.mutable_spec()->mutable_model()->set_n_layer(2);
  job.mutable_spec()->mutable_model()->set_n_expert(4);
  job.mutable_spec()->mutable_cluster()->set_store_replicas(2);
  const ComputePlan plan = RoundRobinPlan(2, 4, 2);
  const v1::PlacementTable first =
      BuildPlacement(job, {"w0", "w1"}, {"s0", "s1", "s2"}, plan, nullptr, 1, 0);
  ASSERT_EQ(first.experts_size(), 9);
  for (const v1::ExpertPlacement& e : first.experts()) {
    EXPECT_EQ(e.store_ids_size(), 2);
    EXPECT_EQ(
        std::vector<std::string>(e.store_ids().begin(), e.store_ids().end()),
        RendezvousStores(e.layer() < 0 ? "j/dense" : absl::StrCat("j/", e.layer(), "/", e.expert()),
                         std::vector<std::string>{"s0", "s1", "s2"}, 2));
  }
  // A new store does not pull existing groups onto itself: readers only see complete copies.
  const v1::PlacementTable second =
      BuildPlacement(job, {"w0", "w1"}, {"s0", "s1", "s2", "s3"}, plan, &first, 2, 5);
  EXPECT_EQ(second.epoch(), 2);
  EXPECT_EQ(second.effective_step(), 5);
  for (int i = 0; i < first.experts_size(); ++i) {
    EXPECT_EQ(second.experts(i).store_ids(0), first.experts(i).store_ids(0));
    EXPECT_EQ(second.experts(i).store_ids(1), first.experts(i).store_ids(1));
  }
}

TEST(PlacementTableTest, ComputeOwnersComeFromThePlanByRank) {
  const v1::Job job = SmallJob();
  const ComputePlan plan = RoundRobinPlan(2, 4, 2);
  const v1::PlacementTable t = BuildPlacement(job, {"w0", "w1"}, {"s0"}, plan, nullptr, 1, 0);
  EXPECT_EQ(t.experts(0).owners_size(), 0);  // the dense group is computed everywhere
  for (const v1::ExpertPlacement& e : t.experts()) {
    if (e.layer() < 0) continue;
    ASSERT_EQ(e.owners_size(), 1);
    const int rank = (e.expert() + e.layer()) % 2;
    EXPECT_EQ(e.owners(0).rank(), rank);
    EXPECT_EQ(e.owners(0).worker_id(), rank == 0 ? "w0" : "w1");
    EXPECT_DOUBLE_EQ(e.owners(0).token_share(), 1.0);
  }
  // As many workers keep the plan by rank (a spare in a dead worker's rank takes its
  // experts); fewer or more void it.
  const std::optional<ComputePlan> kept = KeptPlan(t, 2, 2, job.spec().model());
  ASSERT_TRUE(kept.has_value());
  EXPECT_EQ(*kept, plan);
  const v1::PlacementTable spare = BuildPlacement(job, {"w9", "w1"}, {}, *kept, &t, 2, 0);
  for (const v1::ExpertPlacement& e : spare.experts()) {
    if (e.layer() < 0) continue;
    EXPECT_EQ(e.owners(0).worker_id(), e.owners(0).rank() == 0 ? "w9" : "w1");
  }
  EXPECT_FALSE(KeptPlan(t, 1, 2, job.spec().model()).has_value());
  EXPECT_FALSE(KeptPlan(t, 0, 2, job.spec().model()).has_value());
  EXPECT_FALSE(KeptPlan(t, 2, 3, job.spec().model()).has_value());
  // A plan for one worker grown to two: planned afresh, also where the count before is
  // not known (every rank must own an expert then).
  const v1::PlacementTable one =
      BuildPlacement(job, {"w0"}, {"s0"}, RoundRobinPlan(2, 4, 1), nullptr, 1, 0);
  EXPECT_TRUE(KeptPlan(one, 1, 1, job.spec().model()).has_value());
  EXPECT_FALSE(KeptPlan(one, 2, 1, job.spec().model()).has_value());
  EXPECT_FALSE(KeptPlan(one, 2, 0, job.spec().model()).has_value());
  // More workers than experts: the last rank owns none, and its plan is kept all the same
  // for as many workers.
  const v1::PlacementTable many = BuildPlacement(job, {"w0", "w1", "w2", "w3", "w4"}, {"s0"},
                                                 RoundRobinPlan(2, 4, 4), nullptr, 1, 0);
  EXPECT_TRUE(KeptPlan(many, 5, 5, job.spec().model()).has_value());
  // With no workers the owners wait in the table, ranks and all, for the next ones.
  const v1::PlacementTable waiting = BuildPlacement(job, {}, {}, {}, &t, 2, 0);
  EXPECT_EQ(KeptPlan(waiting, 2, 0, job.spec().model()), plan);
  const v1::PlacementTable no_workers = BuildPlacement(job, {}, {"s0"}, {}, nullptr, 1, 0);
  EXPECT_FALSE(KeptPlan(no_workers, 2, 0, job.spec().model()).has_value());
}

TEST(PlacementTableTest, NoHeatPlansEveryExpertAsAverage) {
  const v1::Job job = SmallJob();
  const ComputePlan plan = PlanJobCompute(job, 2, std::nullopt);
  ASSERT_EQ(plan.size(), 2u);
  int owned[2] = {0, 0};
  for (const auto& layer : plan) {
    ASSERT_EQ(layer.size(), 4u);
    for (const Owners& owners : layer) {
      ASSERT_EQ(owners.size(), 1u);
      ++owned[owners[0].first];
    }
  }
  EXPECT_EQ(owned[0], 4);
  EXPECT_EQ(owned[1], 4);
  EXPECT_TRUE(PlanJobCompute(job, 0, std::nullopt).empty());
}

// A heat map of 2 layers x 4 experts with `hot` of layer 0 at 70, every other at 10.
HeatMap Heat(int hot) {
  HeatMap heat(2, 4, 0.9);
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 4; ++e) heat.SetHeat(l, e, l == 0 && e == hot ? 70 : 10);
  }
  return heat;
}

// A placement computing experts by `rank_of(layer, expert)` on w0/w1.
template <typename Fn>
v1::PlacementTable Owned(Fn rank_of) {
  ComputePlan plan(2, std::vector<Owners>(4));
  for (int l = 0; l < 2; ++l) {
    for (int e = 0; e < 4; ++e) plan[l][e] = {{rank_of(l, e), 1.0}};
  }
  return BuildPlacement(SmallJob(), {"w0", "w1"}, {"s0"}, plan, nullptr, 1, 0);
}

TEST(PlacementTableTest, LockstepLoadIsTheBusiestWorkerOfEachLayerSummed) {
  const HeatMap heat = Heat(/*hot=*/0);
  // Layer 0: w0 has 70 + 10, w1 has 10 + 10; layer 1: 20 and 20.
  const v1::PlacementTable halves = Owned([](int, int e) { return e < 2 ? 0 : 1; });
  EXPECT_DOUBLE_EQ(LockstepLoad(halves, heat), 80 + 20);
  // The hot expert alone on w0: 70 and 30; layer 1 as before.
  const v1::PlacementTable alone =
      Owned([](int l, int e) { return l == 0 ? (e == 0 ? 0 : 1) : e % 2; });
  EXPECT_DOUBLE_EQ(LockstepLoad(alone, heat), 70 + 20);
  EXPECT_FALSE(SameOwners(halves, alone));
  EXPECT_TRUE(SameOwners(halves, halves));
  // A cut of 10 of 100 is not worth moving experts; a cut of more than a tenth is.
  EXPECT_FALSE(ReplanPays(halves, alone, heat));
  EXPECT_FALSE(ReplanPays(halves, halves, std::nullopt));  // no change
  EXPECT_TRUE(ReplanPays(halves, alone, std::nullopt));    // no heat: any change
  HeatMap hotter = Heat(0);
  hotter.SetHeat(0, 0, 200);  // all of layer 0 on w0: 230 + 40; the hot one alone: 200 + 20
  const v1::PlacementTable all_w0 = Owned([](int l, int) { return l == 0 ? 0 : 1; });
  EXPECT_DOUBLE_EQ(LockstepLoad(all_w0, hotter), 230 + 40);
  EXPECT_TRUE(ReplanPays(all_w0, alone, hotter));  // 270 -> 220
}

TEST(PlacementTableTest, AHotExpertWantsMoreStoresThanTheReplicaCount) {
  v1::Job job = SmallJob(/*replicas=*/2);
  job.mutable_spec()->mutable_cluster()->mutable_replication()->set_hot_threshold(2.0);
  job.mutable_spec()->mutable_cluster()->mutable_replication()->set_max_store_replicas(3);
  const HeatMap heat = Heat(/*hot=*/1);
  const std::vector<double> means = LayerMeans(heat);
  ASSERT_EQ(means.size(), 2u);
  EXPECT_DOUBLE_EQ(means[0], 25);
  EXPECT_DOUBLE_EQ(means[1], 10);
  const std::vector<std::string> live = {"s0", "s1", "s2", "s3"};
  EXPECT_EQ(DesiredStores(job, 0, 1, live, &heat, means), RendezvousStores("j/0/1", live, 3));
  EXPECT_EQ(DesiredStores(job, 0, 2, live, &heat, means), RendezvousStores("j/0/2", live, 2));
  EXPECT_EQ(DesiredStores(job, 0, 1, live, nullptr, {}), RendezvousStores("j/0/1", live, 2));
  EXPECT_EQ(DesiredStores(job, -1, 0, live, &heat, means), RendezvousStores("j/dense", live, 2));
}

}  // namespace
}  // namespace pith::coordinator
