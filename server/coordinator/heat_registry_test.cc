// HeatRegistry: reports build the decayed map, Save/Restore round-trips it, recording
// writes a trace that the simulator replays through the real placement code.
#include "server/coordinator/heat_registry.h"

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "common/step_protocol.h"
#include "gtest/gtest.h"
#include "server/coordinator/simulator.h"

namespace pith::coordinator {
namespace {

v1::Job MakeJob() {
  v1::Job job;
  job.set_job_id("trace-1");
  job.mutable_spec()->mutable_model()->set_n_layer(2);
  job.mutable_spec()->mutable_model()->set_n_expert(8);
  job.mutable_spec()->mutable_cluster()->mutable_replication()->set_heat_decay(0.9);
  return job;
}

// One worker's report of `step`: tokens pick pairs (2e, 2e+1), expert 0's pair hottest.
v1::HeatReport Report(int step, std::mt19937& rng) {
  v1::HeatReport r;
  r.set_job_id("trace-1");
  r.set_worker_id("worker-0");
  r.set_step(step);
  r.set_tokens(256);
  for (int l = 0; l < 2; ++l) {
    v1::LayerRouting* routing = r.add_layers();
    routing->set_layer(l);
    routing->mutable_tokens_per_expert()->Resize(8, 0);
    routing->mutable_coactivation()->Resize(8 * 7 / 2, 0);
    routing->mutable_fetches_per_expert()->Resize(8, 0);
    routing->set_fetches_per_expert(7 - l, 2);  // expert 7 of layer 0, 6 of layer 1
    std::discrete_distribution<int> pair({8, 2, 1, 1});
    for (int t = 0; t < 256; ++t) {
      const int a = 2 * pair(rng), b = a + 1;
      routing->set_tokens_per_expert(a, routing->tokens_per_expert(a) + 1);
      routing->set_tokens_per_expert(b, routing->tokens_per_expert(b) + 1);
      const int64_t idx = HeatMap::PairIndex(8, a, b);
      routing->set_coactivation(idx, routing->coactivation(idx) + 1);
    }
  }
  return r;
}

// A step redone after an abort counts once: a worker's second report of a step replaces
// its first, and DropStep forgets a voided attempt's reports.
TEST(HeatRegistryTest, ARedoneStepCountsOnce) {
  std::mt19937 rng(5);
  const v1::HeatReport step1 = Report(1, rng), step2 = Report(2, rng);
  HeatRegistry once, twice, dropped;
  ASSERT_TRUE(once.Report(MakeJob(), step1).ok());
  ASSERT_TRUE(once.Report(MakeJob(), step2).ok());
  ASSERT_TRUE(twice.Report(MakeJob(), step1).ok());
  ASSERT_TRUE(twice.Report(MakeJob(), step1).ok());  // the step, redone
  ASSERT_TRUE(twice.Report(MakeJob(), step2).ok());
  v1::HeatReport other = step1;  // a worker that died before the abort
  other.set_worker_id("worker-9");
  ASSERT_TRUE(dropped.Report(MakeJob(), other).ok());
  dropped.DropStep("trace-1", 2);  // not the latest step: nothing goes
  dropped.DropStep("trace-1", 1);
  ASSERT_TRUE(dropped.Report(MakeJob(), step1).ok());
  ASSERT_TRUE(dropped.Report(MakeJob(), step2).ok());
  const auto a = once.Heat("trace-1", -1, -1);
  ASSERT_TRUE(a.ok());
  for (HeatRegistry* h : {&twice, &dropped}) {
    const auto b = h->Heat("trace-1", -1, -1);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
  }
  EXPECT_GT(a->experts(0).heat(), step2.layers(0).tokens_per_expert(0));  // step 1 decayed in
}

// Layers wider than kMaxCoactivationExperts take token counts only: the pairs a job keeps
// stay bounded whatever a report says.
TEST(HeatRegistryTest, AWideLayersPairsAreRefused) {
  v1::Job job = MakeJob();
  const int wide = kMaxCoactivationExperts + 1;
  job.mutable_spec()->mutable_model()->set_n_expert(wide);
  v1::HeatReport r;
  r.set_job_id(job.job_id());
  r.set_worker_id("worker-0");
  r.set_step(1);
  v1::LayerRouting* routing = r.add_layers();
  routing->mutable_tokens_per_expert()->Resize(wide, 1);
  HeatRegistry heat;
  EXPECT_TRUE(heat.Report(job, r).ok());
  routing->mutable_coactivation()->Resize(wide * (wide - 1) / 2, 1);
  const absl::Status refused = heat.Report(job, r);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
}

// Fetches are counts, summed over every step and never decayed; a bad count is refused.
TEST(HeatRegistryTest, FetchesAddUpOverSteps) {
  HeatRegistry heat;
  std::mt19937 rng(4);
  for (int step = 1; step <= 3; ++step) ASSERT_TRUE(heat.Report(MakeJob(), Report(step, rng)).ok());
  const auto h = heat.Heat("trace-1", -1, -1);
  ASSERT_TRUE(h.ok()) << h.status();
  for (const v1::ExpertHeatEntry& e : h->experts()) {
    const bool fetched = e.expert().expert() == 7 - e.expert().layer();
    EXPECT_EQ(e.fetches(), fetched ? 6u : 0u) << e.ShortDebugString();
  }
  v1::HeatReport bad = Report(4, rng);
  bad.mutable_layers(0)->add_fetches_per_expert(1);
  EXPECT_EQ(heat.Report(MakeJob(), bad).code(), absl::StatusCode::kInvalidArgument);
}

TEST(HeatRegistryTest, SaveRestoreRoundTrips) {
  HeatRegistry heat;
  std::mt19937 rng(3);
  for (int step = 1; step <= 3; ++step) ASSERT_TRUE(heat.Report(MakeJob(), Report(step, rng)).ok());
  const std::string saved = heat.Save("trace-1");
  HeatRegistry other;
  ASSERT_TRUE(other.Restore(MakeJob(), saved).ok());
  auto a = heat.Heat("trace-1", -1, -1);
  auto b = other.Heat("trace-1", -1, -1);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
  EXPECT_EQ(other.Restore(MakeJob(), "not a heat map").code(), absl::StatusCode::kDataLoss);
  v1::Job smaller = MakeJob();
  smaller.mutable_spec()->mutable_model()->set_n_expert(4);
  EXPECT_EQ(other.Restore(smaller, saved).code(), absl::StatusCode::kDataLoss);
}

TEST(HeatRegistryTest, ARecordedTraceReplaysThroughTheSimulator) {
  const std::string dir = ::testing::TempDir() + "/heat_trace_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  HeatRegistry heat;
  heat.RecordTo(dir);
  std::mt19937 rng(5);
  for (int step = 1; step <= 20; ++step)
    ASSERT_TRUE(heat.Report(MakeJob(), Report(step, rng)).ok());

  SimOptions o;
  o.trace_path = dir + "/trace-1.heat.jsonl";
  o.workers = 4;
  o.stores = 2;
  absl::StatusOr<SimResult> r = RunSimulation(o);
  ASSERT_TRUE(r.ok()) << r.status();
  // Pairs always co-activate: affinity keeps them together, so a token crosses to at
  // most one other worker, fewer than round-robin (which splits every pair).
  EXPECT_LT(r->cross_worker_sends_per_token, r->rr_cross_worker_sends_per_token);
  EXPECT_LE(r->cross_worker_sends_per_token, 0.6 * r->rr_cross_worker_sends_per_token);
  EXPECT_GT(r->max_over_mean_load, 0.99);
  EXPECT_LE(r->max_over_mean_load, r->max_over_mean_load_no_heat + 1e-9);

  std::ofstream(dir + "/bad.jsonl") << "{\"step\": 1}\nnot json\n";
  o.trace_path = dir + "/bad.jsonl";
  EXPECT_EQ(RunSimulation(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.trace_path = dir + "/missing.jsonl";
  EXPECT_EQ(RunSimulation(o).status().code(), absl::StatusCode::kNotFound);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pith::coordinator
