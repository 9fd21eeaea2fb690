#include "worker/runtime/step_loop.h"

#include <deque>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith::runtime {
namespace {

using ::testing::ElementsAre;

// Records every call; settles steps as scripted (kCommitted when the script runs out).
class FakeDriver : public StepDriver {
 public:
  absl::Status WriteInitial() override {
    calls.push_back("init");
    return init_status;
  }
  absl::Status LoadCommitted() override {
    calls.push_back("load");
    return load_status;
  }
  void SetPending(int64_t s) override { calls.push_back(absl::StrCat("pending ", s)); }
  void ClearPending() override { calls.push_back("clear"); }
  absl::Status Compute(int64_t s) override {
    calls.push_back(absl::StrCat("compute ", s));
    return s == fail_compute ? absl::InternalError("compute") : absl::OkStatus();
  }
  absl::StatusOr<Settled> Finish(int64_t s) override {
    calls.push_back(absl::StrCat("finish ", s));
    if (!finish_error.ok()) return finish_error;
    if (settles.empty()) return Settled::kCommitted;
    const Settled next = settles.front();
    settles.pop_front();
    return next;
  }
  absl::StatusOr<bool> Adopt() override {
    calls.push_back("adopt");
    if (!adopt_error.ok()) return adopt_error;
    return adopt;
  }
  absl::Status Write(int64_t s) override {
    calls.push_back(absl::StrCat("write ", s));
    if (s == stop_after_write) stop->store(true);
    return s == fail_write ? absl::UnavailableError("write") : absl::OkStatus();
  }
  void ReportFailure(int64_t s, const absl::Status& why) override {
    calls.push_back(absl::StrCat("failed ", s, " ", why.message()));
  }

  std::vector<std::string> calls;
  absl::Status init_status, load_status;
  std::deque<Settled> settles;
  absl::Status finish_error;  // every Finish fails with it
  bool adopt = true;
  absl::Status adopt_error;
  int64_t fail_compute = -1, fail_write = -1, stop_after_write = -1;
  std::atomic<bool>* stop = nullptr;
};

TEST(StepLoopTest, FreshJobWritesStepZeroThenOverlapsComputeWithCommit) {
  FakeDriver d;
  std::atomic<bool> stop{false};
  EXPECT_TRUE(RunSteps(d, /*committed_step=*/-1, /*steps=*/2, stop).ok());
  EXPECT_THAT(d.calls, ElementsAre("init", "pending 0", "compute 1", "finish 0", "clear", "write 1",
                                   "pending 1", "compute 2", "finish 1", "clear", "write 2",
                                   "finish 2", "clear"));
}

TEST(StepLoopTest, ResumesFromTheLastCommit) {
  FakeDriver d;
  std::atomic<bool> stop{false};
  EXPECT_TRUE(RunSteps(d, /*committed_step=*/5, /*steps=*/6, stop).ok());
  // Nothing is pending after a load: step 6 computes without waiting for a commit.
  EXPECT_THAT(d.calls, ElementsAre("load", "compute 6", "write 6", "finish 6", "clear"));
}

TEST(StepLoopTest, AJobAlreadyDoneEndsAtOnce) {
  FakeDriver d;
  std::atomic<bool> stop{false};
  EXPECT_TRUE(RunSteps(d, 3, 3, stop).ok());
  EXPECT_THAT(d.calls, ElementsAre("load"));
}

TEST(StepLoopTest, AnAbortedStepEndsTheRunToStartOverFromTheCommit) {
  FakeDriver d;
  d.settles = {Settled::kCommitted, Settled::kStop};
  std::atomic<bool> stop{false};
  EXPECT_TRUE(RunSteps(d, 0, 5, stop).ok());
  EXPECT_THAT(d.calls,
              ElementsAre("load", "compute 1", "write 1", "pending 1", "compute 2", "finish 1",
                          "clear", "write 2", "pending 2", "compute 3", "finish 2", "clear"));
}

TEST(StepLoopTest, AnAdoptedPlacementComputesTheStepAgain) {
  FakeDriver d;
  d.settles = {Settled::kReassigned};
  std::atomic<bool> stop{false};
  EXPECT_TRUE(RunSteps(d, 0, 2, stop).ok());
  EXPECT_THAT(d.calls,
              ElementsAre("load", "compute 1", "write 1", "pending 1", "compute 2", "finish 1",
                          "clear", "adopt", "compute 2", "write 2", "finish 2", "clear"));
}

TEST(StepLoopTest, APlacementThatCannotBeAdoptedEndsTheRun) {
  for (const bool fails : {false, true}) {
    FakeDriver d;
    d.settles = {Settled::kReassigned};
    d.adopt = false;
    if (fails) {
      d.adopt = true;
      d.adopt_error = absl::UnavailableError("gone");
    }
    std::atomic<bool> stop{false};
    EXPECT_TRUE(RunSteps(d, 0, 4, stop).ok());
    EXPECT_THAT(d.calls, ElementsAre("load", "compute 1", "write 1", "pending 1", "compute 2",
                                     "finish 1", "clear", "adopt"));
  }
}

TEST(StepLoopTest, AnUnreachableCoordinatorEndsTheRunWithItsError) {
  FakeDriver d;
  d.finish_error = absl::UnavailableError("coordinator");
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, -1, 3, stop).code(), absl::StatusCode::kUnavailable);
  // Not a step failure: nothing reported.
  EXPECT_THAT(d.calls, ElementsAre("init", "pending 0", "compute 1", "finish 0", "clear"));
}

TEST(StepLoopTest, AFailedComputeIsReportedForTheStepOnceTheOneBeforeCommits) {
  FakeDriver d;
  d.fail_compute = 2;
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, 0, 5, stop).code(), absl::StatusCode::kInternal);
  EXPECT_THAT(d.calls, ElementsAre("load", "compute 1", "write 1", "pending 1", "compute 2",
                                   "finish 1", "clear", "failed 2 compute"));
}

TEST(StepLoopTest, AFailedWriteIsReported) {
  FakeDriver d;
  d.fail_write = 1;
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, -1, 5, stop).code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(d.calls, ElementsAre("init", "pending 0", "compute 1", "finish 0", "clear", "write 1",
                                   "failed 1 write"));
}

TEST(StepLoopTest, AFailedStartIsReportedForTheCommittedStep) {
  FakeDriver d;
  d.load_status = absl::DataLossError("load");
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, 7, 9, stop).code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(d.calls, ElementsAre("load", "failed 7 load"));
}

TEST(StepLoopTest, StopIsCheckedBetweenSteps) {
  FakeDriver d;
  std::atomic<bool> stop{false};
  d.stop = &stop;
  d.stop_after_write = 2;
  EXPECT_TRUE(RunSteps(d, 0, 10, stop).ok());
  EXPECT_THAT(d.calls, ElementsAre("load", "compute 1", "write 1", "pending 1", "compute 2",
                                   "finish 1", "clear", "write 2"));
}

}  // namespace
}  // namespace pith::runtime
