#include "worker/runtime/step_loop.h"

#include <deque>
#include <functional>
#include <optional>
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
    if (s != fail_compute) return absl::OkStatus();
    if (stop_at_failed_compute) stop->store(true);  // as a stop abandons the peer waits
    return absl::InternalError("compute");
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
  bool stop_at_failed_compute = false;
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

// A stop (SIGTERM) abandons the attempt's waits on peers, which fails its compute: the
// step did not fail, so nothing is reported and the run ends cleanly.
TEST(StepLoopTest, AComputeEndedByAStopIsNotReported) {
  FakeDriver d;
  std::atomic<bool> stop{false};
  d.stop = &stop;
  d.fail_compute = 2;
  d.stop_at_failed_compute = true;
  EXPECT_TRUE(RunSteps(d, 0, 5, stop).ok());
  EXPECT_THAT(d.calls, ElementsAre("load", "compute 1", "write 1", "pending 1", "compute 2",
                                   "finish 1", "clear"));
}

TEST(StepLoopTest, AFailedWriteIsReported) {
  FakeDriver d;
  d.fail_write = 1;
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, -1, 5, stop).code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(d.calls, ElementsAre("init", "pending 0", "compute 1", "finish 0", "clear", "write 1",
                                   "failed 1 write"));
}

// A failed load is the next step's failure: the coordinator ignores one for step 7,
// which it has committed, and the job would then never fail.
TEST(StepLoopTest, AFailedStartIsReportedForTheStepAfterTheCommittedOne) {
  FakeDriver d;
  d.load_status = absl::DataLossError("load");
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, 7, 9, stop).code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(d.calls, ElementsAre("load", "failed 8 load"));
}

// A store down or slow for now is retried (the run starts over), not held against the job.
TEST(StepLoopTest, APassingLoadFailureIsNotReported) {
  FakeDriver d;
  d.load_status = absl::UnavailableError("store");
  std::atomic<bool> stop{false};
  EXPECT_EQ(RunSteps(d, 7, 9, stop).code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(d.calls, ElementsAre("load"));
  // Unless the same attempt failed so again and again: then the coordinator hears of it.
  FakeDriver again;
  again.load_status = absl::DeadlineExceededError("store");
  EXPECT_EQ(RunSteps(again, 7, 9, stop, /*report_passing=*/true).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(again.calls, ElementsAre("load", "failed 8 store"));
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

// Rounds that answer "not yet" (nullopt), then how the step settled.
struct ScriptedRounds {
  absl::StatusOr<std::optional<Settled>> operator()() {
    ++asked;
    if (answers.empty()) return std::optional<Settled>();
    auto next = answers.front();
    answers.pop_front();
    if (stop != nullptr) stop->store(stop_after_first);
    return next;
  }
  std::deque<absl::StatusOr<std::optional<Settled>>> answers;
  int asked = 0;
  std::atomic<bool>* stop = nullptr;
  bool stop_after_first = false;
};

TEST(WaitSettledTest, AsksUntilTheStepSettles) {
  ScriptedRounds r;
  r.answers = {std::nullopt, std::nullopt, Settled::kReassigned};
  std::atomic<bool> stop{false};
  absl::StatusOr<Settled> settled = WaitSettled(std::ref(r), &stop);
  ASSERT_TRUE(settled.ok()) << settled.status();
  EXPECT_EQ(*settled, Settled::kReassigned);
  EXPECT_EQ(r.asked, 3);
}

// The coordinator's "not settled yet" at a round's end (an OK answer, not a deadline) is
// where a stopping worker leaves: it does not wait for a step that may never settle.
TEST(WaitSettledTest, AStopEndsTheWaitAfterTheRoundThatDidNotSettle) {
  ScriptedRounds r;
  std::atomic<bool> stop{false};
  r.stop = &stop;
  r.stop_after_first = true;
  r.answers = {std::nullopt, Settled::kCommitted};
  absl::StatusOr<Settled> settled = WaitSettled(std::ref(r), &stop);
  ASSERT_TRUE(settled.ok()) << settled.status();
  EXPECT_EQ(*settled, Settled::kStop);
  EXPECT_EQ(r.asked, 1);
}

TEST(WaitSettledTest, ASettledAnswerWinsOverAStopAndAnErrorEndsTheWait) {
  ScriptedRounds r;
  std::atomic<bool> stop{true};
  r.answers = {Settled::kCommitted};
  EXPECT_EQ(*WaitSettled(std::ref(r), &stop), Settled::kCommitted);
  r.answers = {absl::UnavailableError("coordinator")};
  EXPECT_EQ(WaitSettled(std::ref(r), nullptr).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pith::runtime
