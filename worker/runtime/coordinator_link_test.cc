#include "worker/runtime/coordinator_link.h"

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "worker/runtime/store_io.h"

namespace pith::runtime {
namespace {

// A coordinator that takes every call and answers none until the caller gives up (as one
// that froze mid-call, SIGSTOP, would).
class FrozenCoordinator final : public v1::CoordinatorService::Service {
 public:
  grpc::Status ReportStepWritten(grpc::ServerContext* ctx, const v1::StepWrittenRequest*,
                                 v1::StepWrittenResponse*) override {
    return Hold(ctx);
  }
  grpc::Status GetAssignment(grpc::ServerContext* ctx, const v1::GetAssignmentRequest*,
                             v1::Assignment*) override {
    return Hold(ctx);
  }

  std::atomic<int> calls{0};

 private:
  grpc::Status Hold(grpc::ServerContext* ctx) {
    ++calls;
    while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "gave up");
  }
};

// `service` served on a loopback port, and a stub to it; shut down when it goes.
struct LocalCoordinator {
  explicit LocalCoordinator(grpc::Service* service) {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service);
    server = builder.BuildAndStart();
    if (server == nullptr) return;  // the test checks
    stub = v1::CoordinatorService::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                               grpc::InsecureChannelCredentials()));
  }
  ~LocalCoordinator() {
    if (server != nullptr) server->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::CoordinatorService::Stub> stub;
};

class CoordinatorLinkTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NE(local_.server, nullptr); }

  FrozenCoordinator service_;
  LocalCoordinator local_{&service_};
  v1::CoordinatorService::Stub* const stub_ = local_.stub.get();
};

// A stopping worker does not wait out a minute-long ReportStepWritten to a coordinator
// that does not answer: Cancel ends it, and every later call fails at once.
TEST_F(CoordinatorLinkTest, CancelEndsTheCallInFlightAndEveryLaterOne) {
  CoordinatorLink link(stub_, "worker-0");
  absl::Status reported;
  absl::Time ended;
  std::thread caller([&] {
    reported = link.ReportStepWritten(v1::StepWrittenRequest());
    ended = absl::Now();
  });
  for (int i = 0; i < 1000 && service_.calls == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(service_.calls, 1) << "the call never reached the coordinator";
  const absl::Time cancelled = absl::Now();
  link.Cancel();
  caller.join();
  EXPECT_EQ(reported.code(), absl::StatusCode::kCancelled) << reported;
  EXPECT_LT(ended - cancelled, absl::Seconds(2));

  const absl::Time start = absl::Now();
  EXPECT_EQ(link.GetAssignment(absl::Seconds(30)).status().code(), absl::StatusCode::kCancelled);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

// A stop before the run's peer group started its attempt (SIGTERM during the setup, before
// the join) still ends that attempt's waits once the join starts it: the watch keeps
// abandoning the attempt it watches for as long as it stops.
TEST_F(CoordinatorLinkTest, AStoppingWatchAbandonsAnAttemptStartedAfterTheStop) {
  CoordinatorLink link(stub_, "worker-0");
  std::atomic<uint64_t> current{3};  // the peer group's attempt: the previous run's
  std::atomic<bool> abandoned{false}, stop{true};
  AbortWatch watch(
      &link, "job", /*step=*/0, /*version=*/7,
      [&](uint64_t version) {
        if (current.load() == version) abandoned = true;
      },
      &stop);
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_FALSE(abandoned) << "attempt 3 is not the watched attempt 7";
  current = 7;  // the join starts attempt 7
  for (int i = 0; i < 200 && !abandoned; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_TRUE(abandoned) << "attempt 7 went on after the stop";
}

// A coordinator whose job went on without the caller: step 331 committed under attempt
// 5 (or, `same_attempt`, under the caller's attempt 3).
class MovedOnCoordinator final : public v1::CoordinatorService::Service {
 public:
  grpc::Status WaitStep(grpc::ServerContext*, const v1::WaitStepRequest* req,
                        v1::StepStatus* st) override {
    st->set_job_id(req->job_id());
    st->set_step(req->step());
    st->set_committed_step(331);
    st->set_assignment_version(same_attempt ? 3 : 5);
    if (ended) {  // as the coordinator answers once the run is gone: no assignment
      st->set_job_ended(true);
      st->set_assignment_version(0);
    }
    return grpc::Status::OK;
  }
  std::atomic<bool> same_attempt{false};
  std::atomic<bool> ended{false};
};

// A worker paused past its lease (SIGSTOP) and resumed finds the step it computes long
// committed under a newer attempt: its peers went on to that attempt, so its waits on them
// are abandoned at once (they waited out kPeerReceiveTimeout, 120 s, holding the job).
// A step committed under the same attempt is only settled, and so is a job that ended
// with the step (its normal end: nothing is abandoned); one that ended before or after
// the worker's step is left.
TEST(AbortWatchTest, AWorkerLeftBehindAbandonsItsAttempt) {
  MovedOnCoordinator service;
  LocalCoordinator local(&service);
  ASSERT_NE(local.server, nullptr);
  CoordinatorLink link(local.stub.get(), "worker-0");
  for (const std::string kind :
       {"same attempt", "newer attempt", "ended after it", "ended with it", "ended before it"}) {
    SCOPED_TRACE(kind);
    service.same_attempt = kind == "same attempt";
    service.ended = absl::StartsWith(kind, "ended");
    const int64_t step = kind == "ended with it" ? 331 : kind == "ended before it" ? 332 : 58;
    std::atomic<int> abandoned{0};
    {
      AbortWatch watch(
          &link, "job", step, /*version=*/3,
          [&](uint64_t version) {
            EXPECT_EQ(version, 3u);
            ++abandoned;
          },
          nullptr);
      for (int i = 0; i < 200 && abandoned == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(abandoned > 0, kind != "same attempt" && kind != "ended with it");
  }
}

// A put refused for want of disk is named after the store of the put it came from (not
// the first failed put's: a reference put to another store that missed its deadline), and
// the failure report carries that store (full_store_id) for the coordinator to drop it.
TEST(FullStoreReportTest, TheFailureNamesTheStoreThatRefusedThePut) {
  const std::map<std::string, int> store_peer = {{"store-1", 4}, {"store-2", 7}};
  std::vector<store::StoreClient::PutItem> items(3);
  items[0].peer = 4;
  items[0].status = absl::DeadlineExceededError("not sent: the deadline passed");
  items[1].peer = 7;
  items[1].status = DiskFullError("the disk under /data/blobs is full");
  items[2].peer = 4;  // landed
  const absl::Status named = NamePutFailure(items, store_peer, items[1].status);
  EXPECT_EQ(named.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(named.message(), "store store-2: the disk under /data/blobs is full");
  EXPECT_EQ(DiskFullStore(Annotate(named, "step 5")), "store-2");  // survives on its way up
  const absl::Status late = NamePutFailure(items, store_peer, items[0].status);
  EXPECT_EQ(late.message(), "store store-1: not sent: the deadline passed");
  EXPECT_FALSE(IsDiskFull(late));
  EXPECT_EQ(DiskFullStore(late), "");

  class Recorder final : public v1::CoordinatorService::Service {
   public:
    grpc::Status ReportStepWritten(grpc::ServerContext*, const v1::StepWrittenRequest* r,
                                   v1::StepWrittenResponse*) override {
      absl::MutexLock lock(&mu);
      reports.push_back(*r);
      return grpc::Status::OK;
    }
    absl::Mutex mu;
    std::vector<v1::StepWrittenRequest> reports ABSL_GUARDED_BY(mu);
  } service;
  LocalCoordinator local(&service);
  ASSERT_NE(local.server, nullptr);
  CoordinatorLink link(local.stub.get(), "worker-0");
  link.ReportFailure("job", 3, 5, named);
  link.ReportFailure("job", 3, 5, late);
  absl::MutexLock lock(&service.mu);
  ASSERT_EQ(service.reports.size(), 2u);
  EXPECT_EQ(service.reports[0].full_store_id(), "store-2");
  EXPECT_EQ(service.reports[0].failure(), "store store-2: the disk under /data/blobs is full");
  EXPECT_EQ(service.reports[1].full_store_id(), "");
}

}  // namespace
}  // namespace pith::runtime
