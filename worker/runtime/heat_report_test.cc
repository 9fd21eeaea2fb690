#include "worker/runtime/heat_report.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith::runtime {
namespace {

using ::testing::ElementsAre;

TEST(HeatReportTest, ReportsEachExpertsFetchesPerLayer) {
  HeatInput in;
  in.tokens = 1;
  in.experts = 3;
  in.top_k = 1;
  in.routed = {{1, 0, 0}, {0, 0, 1}};
  in.fetched = {{{0, 2}, 5}, {{1, 0}, 1}, {{1, 2}, 3}};
  const v1::HeatReport r = MakeHeatReport(in);
  ASSERT_EQ(r.layers_size(), 2);
  EXPECT_THAT(r.layers(0).fetches_per_expert(), ElementsAre(0, 0, 5));
  EXPECT_THAT(r.layers(1).fetches_per_expert(), ElementsAre(1, 0, 3));
}

TEST(HeatReportTest, CountsTokensAndCoactivatedPairs) {
  HeatInput in;
  in.job_id = "job";
  in.worker_id = "w1";
  in.step = 7;
  in.tokens = 3;
  in.experts = 4;
  in.top_k = 2;
  in.routed = {{1, 2, 0, 3}, {3, 0, 3, 0}};
  // Layer 0: tokens choose (0, 3), (3, 1), (1, 3); layer 1: (2, 0) three times, except
  // one token whose second choice was dropped (-1).
  const std::vector<std::vector<int32_t>> chosen = {{0, 3, 3, 1, 1, 3}, {2, 0, 0, 2, 2, -1}};
  in.chosen = [&](int layer, int32_t* out) {
    std::copy(chosen[layer].begin(), chosen[layer].end(), out);
    return true;
  };
  const v1::HeatReport r = MakeHeatReport(in);
  EXPECT_EQ(r.job_id(), "job");
  EXPECT_EQ(r.worker_id(), "w1");
  EXPECT_EQ(r.step(), 7);
  EXPECT_EQ(r.tokens(), 3u);
  ASSERT_EQ(r.layers_size(), 2);
  EXPECT_EQ(r.layers(1).layer(), 1);
  EXPECT_THAT(r.layers(0).tokens_per_expert(), ElementsAre(1, 2, 0, 3));
  // Pairs in packed upper-triangle order: 01 02 03 12 13 23.
  EXPECT_THAT(r.layers(0).coactivation(), ElementsAre(0, 0, 1, 0, 2, 0));
  EXPECT_THAT(r.layers(1).coactivation(), ElementsAre(0, 2, 0, 0, 0, 0));
  EXPECT_THAT(r.layers(0).fetches_per_expert(), ElementsAre(0, 0, 0, 0));
}

TEST(HeatReportTest, PackedIndexCoversTheTriangleOnce) {
  const int E = 5;
  std::vector<int> seen(E * (E - 1) / 2, 0);
  for (int a = 0; a < E; ++a) {
    for (int b = a + 1; b < E; ++b) ++seen[CoactivationIndex(a, b, E)];
  }
  EXPECT_THAT(seen, ::testing::Each(1));
}

TEST(HeatReportTest, WideLayersAndMissingChoicesReportTokenCountsOnly) {
  HeatInput in;
  in.tokens = 1;
  in.top_k = 2;
  in.experts = kMaxCoactivationExperts + 1;
  in.routed = {std::vector<int64_t>(in.experts, 0)};
  int asked = 0;
  in.chosen = [&](int, int32_t*) { return ++asked > 0; };
  v1::HeatReport r = MakeHeatReport(in);
  EXPECT_EQ(asked, 0);
  EXPECT_EQ(r.layers(0).tokens_per_expert_size(), in.experts);
  EXPECT_EQ(r.layers(0).coactivation_size(), 0);

  in.experts = 4;
  in.routed = {{1, 1, 0, 0}};
  in.chosen = [](int, int32_t*) { return false; };
  r = MakeHeatReport(in);
  EXPECT_EQ(r.layers(0).coactivation_size(), 0);
}

}  // namespace
}  // namespace pith::runtime
