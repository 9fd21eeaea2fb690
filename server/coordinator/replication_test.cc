// Replication without a scheduler: what a step boundary does to a job's placement
// (ApplyCopies), and the replicator's plan, copies and bookkeeping (PlanCopies, Copy,
// Finish) over a store seam that reaches no stores.
#include "server/coordinator/replication.h"

#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "server/coordinator/placement_table.h"
#include "server/coordinator/store_control_testing.h"

namespace pith::coordinator {
namespace {

v1::Job TwoExpertJob() {
  v1::Job job;
  job.set_job_id("j");
  job.mutable_spec()->mutable_model()->set_n_layer(1);
  job.mutable_spec()->mutable_model()->set_n_expert(2);
  job.mutable_spec()->mutable_cluster()->set_store_replicas(2);
  return job;
}

// Every group of the job on s0 alone.
v1::PlacementTable OnS0(const v1::Job& job) {
  return BuildPlacement(job, {"w0"}, {"s0"}, RoundRobinPlan(1, 2, 1), nullptr, 1, 0);
}

Alive Stores(const std::vector<std::string>& ids) {
  Alive alive;
  for (const std::string& id : ids) {
    alive.stores[id].set_member_id(id);
    alive.known.insert(id);
  }
  return alive;
}

std::set<std::string> Ids(const google::protobuf::RepeatedPtrField<std::string>& ids) {
  return {ids.begin(), ids.end()};
}

TEST(ReplicationTest, AFinishedCopyReadsAndAJoinerThatMissedACommitLeaves) {
  const v1::Job job = TwoExpertJob();
  v1::PlacementTable placement = OnS0(job);
  ASSERT_EQ(placement.experts_size(), 3);  // dense, expert 0, expert 1
  *placement.mutable_experts(1)->add_joining_store_ids() = "s1";
  *placement.mutable_experts(2)->add_joining_store_ids() = "s2";
  JobCopies copies;
  copies.joined_at[{{0, 0}, "s1"}] = 3;
  copies.joined_at[{{0, 1}, "s2"}] = 3;
  copies.committed_on = {"s0", "s1"};          // s2 died and missed step 5
  copies.copied.push_back({{0, 0}, "s1", 4});  // begun after s1 joined: complete
  EXPECT_TRUE(
      Replication::ApplyCopies(job, 5, Stores({"s0", "s1"}), std::nullopt, copies, placement));
  EXPECT_EQ(Ids(placement.experts(1).store_ids()), (std::set<std::string>{"s0", "s1"}));
  EXPECT_EQ(placement.experts(1).joining_store_ids_size(), 0);
  EXPECT_EQ(Ids(placement.experts(2).store_ids()), std::set<std::string>{"s0"});
  EXPECT_EQ(placement.experts(2).joining_store_ids_size(), 0);
  EXPECT_TRUE(copies.joined_at.empty());
  EXPECT_TRUE(copies.copied.empty());
  EXPECT_TRUE(copies.committed_on.empty());
  // Nothing else to do at the next boundary.
  copies.committed_on = {"s0", "s1"};
  EXPECT_FALSE(
      Replication::ApplyCopies(job, 6, Stores({"s0", "s1"}), std::nullopt, copies, placement));
}

TEST(ReplicationTest, AGroupShortOfAStoreJoinsItThenItsCopyIsPulled) {
  const v1::Job job = TwoExpertJob();
  v1::PlacementTable placement = OnS0(job);
  const Alive alive = Stores({"s0", "s1"});
  Replication replication(nullptr);
  JobCopies copies;
  std::vector<CopyTask> tasks;
  replication.PlanCopies(job, placement, 2, alive, std::nullopt, 2, copies, &tasks);
  EXPECT_TRUE(tasks.empty());  // s1 joins at the step boundary first
  ASSERT_EQ(copies.join_requests.size(), 3u);
  for (const auto& [group, target] : copies.join_requests) EXPECT_EQ(target, "s1");
  copies.committed_on = {"s0"};
  EXPECT_TRUE(Replication::ApplyCopies(job, 2, alive, std::nullopt, copies, placement));
  for (const v1::ExpertPlacement& e : placement.experts()) {
    EXPECT_EQ(Ids(e.joining_store_ids()), std::set<std::string>{"s1"});
  }
  replication.PlanCopies(job, placement, 2, alive, std::nullopt, 2, copies, &tasks);
  ASSERT_EQ(tasks.size(), 2u);  // max_pulls
  EXPECT_EQ(replication.MovesOn("s1"), 2u);
  EXPECT_EQ(replication.MovesOn("s0"), 2u);
  testing::NoStores stores;
  for (const CopyTask& t : tasks) {
    EXPECT_EQ(t.source.member_id(), "s0");
    EXPECT_EQ(t.target.member_id(), "s1");
    EXPECT_EQ(t.start_step, 2);
    const CopyResult result = Replication::Copy(stores, t, 1 << 20);
    ASSERT_TRUE(result.status.ok()) << result.status;
    EXPECT_TRUE(replication.Finish(t, result, &copies));
  }
  EXPECT_EQ(replication.MovesOn("s1"), 0u);
  EXPECT_EQ(copies.copied.size(), 2u);
  EXPECT_TRUE(copies.copying.empty());
  v1::ClusterStatusResponse status;
  replication.Report(/*deficit=*/3, &status);
  EXPECT_EQ(status.moves_size(), 0);
  EXPECT_EQ(status.replica_deficit(), 3u);
  // A copy whose job ended meanwhile does not count.
  tasks.clear();
  replication.PlanCopies(job, placement, 2, alive, std::nullopt, 2, copies, &tasks);
  ASSERT_EQ(tasks.size(), 1u);  // the third group's copy; the others are done
  EXPECT_FALSE(replication.Finish(tasks[0], CopyResult(), nullptr));
  EXPECT_EQ(replication.MovesOn("s1"), 0u);
}

}  // namespace
}  // namespace pith::coordinator
