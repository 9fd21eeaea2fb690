// JobStateBytes against what a real scheduler holds for a job at its peak (the step in
// flight, after one committed, with every worker's heat report and all but one written
// report in, and one
// assignment being answered): the allocator's in-use bytes before and after, for models
// wide, deep, with co-activated pairs and small. The estimate must bound the measure and
// not overstate it more than 4-fold (admission would refuse jobs the coordinator holds).
#include "server/coordinator/job_memory.h"

#include <malloc.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/job_spec_testing.h"
#include "common/step_protocol.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "server/coordinator/heat_registry.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/scheduler.h"
#include "server/coordinator/store_control_testing.h"

namespace pith::coordinator {
namespace {

uint64_t InUseBytes() {
  malloc_trim(0);
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

struct Shape {
  int layers, experts, replicas, workers;
};

v1::JobSpec SpecOf(const Shape& s) {
  v1::JobSpec spec;
  EXPECT_TRUE(
      google::protobuf::util::JsonStringToMessage(pith::testing::kDesignExampleSpecJson, &spec)
          .ok());
  spec.mutable_model()->set_n_layer(s.layers);
  spec.mutable_model()->set_n_expert(s.experts);
  spec.mutable_model()->set_d_model(16);
  spec.mutable_model()->set_n_head(2);
  spec.mutable_model()->set_d_ff(16);
  spec.mutable_cluster()->set_workers(s.workers);
  spec.mutable_cluster()->set_store_replicas(s.replicas);
  ApplyJobSpecDefaults(&spec);
  EXPECT_TRUE(ValidateJobSpec(spec).ok()) << ValidateJobSpec(spec);
  return spec;
}

// The written report of `worker`: the three blobs of each expert it updates, and the
// dense tensors' (ten per layer) from rank 0.
v1::StepWrittenRequest Written(const v1::Assignment& a, const std::string& worker, int64_t step) {
  v1::StepWrittenRequest r;
  r.set_job_id(a.job_id());
  r.set_worker_id(worker);
  r.set_step(step);
  r.set_ok(true);
  r.set_assignment_version(a.assignment_version());
  auto add = [&](int layer, int expert, const std::string& tensor, v1::BlobKind kind) {
    v1::BlobInfo* b = r.add_written();
    b->mutable_key()->set_job_id(a.job_id());
    b->mutable_key()->set_layer(layer);
    b->mutable_key()->set_expert(expert);
    b->mutable_key()->set_tensor(tensor);
    b->mutable_key()->set_kind(kind);
    b->set_version(step);
  };
  const v1::BlobKind kinds[] = {v1::BLOB_KIND_WEIGHTS, v1::BLOB_KIND_ADAM_M, v1::BLOB_KIND_ADAM_V};
  for (const v1::ExpertPlacement& e : a.placement().experts()) {
    if (e.layer() < 0 && a.rank() == 0) {
      for (int l = 0; l < a.spec().model().n_layer() * 10; ++l) {
        for (v1::BlobKind k : kinds) add(-1, 0, absl::StrCat("blocks.", l, ".tensor"), k);
      }
    } else if (e.layer() >= 0 && e.owners(0).rank() == a.rank()) {
      for (v1::BlobKind k : kinds) add(e.layer(), e.expert(), "", k);
    }
  }
  return r;
}

v1::HeatReport HeatOf(const v1::Assignment& a, const std::string& worker, int64_t step) {
  v1::HeatReport r;
  r.set_job_id(a.job_id());
  r.set_worker_id(worker);
  r.set_step(step);
  r.set_tokens(512);
  const int E = a.spec().model().n_expert();
  for (int l = 0; l < a.spec().model().n_layer(); ++l) {
    v1::LayerRouting* routing = r.add_layers();
    routing->set_layer(l);
    for (int e = 0; e < E; ++e) routing->add_tokens_per_expert(1 + (e * 7 + l) % 13);
    for (int e = 0; e < E; ++e) routing->add_fetches_per_expert(e % 3);  // as workers send
    if (E > kMaxCoactivationExperts) continue;
    for (int64_t i = 0; i < int64_t{E} * (E - 1) / 2; ++i) routing->add_coactivation(1 + i % 3);
  }
  return r;
}

// Runs one job of `shape` to its peak; returns the bytes it added.
uint64_t MeasuredBytes(const Shape& shape, const std::string& dir) {
  std::filesystem::remove_all(dir);
  absl::Time now = absl::FromUnixSeconds(1000);
  Membership members(absl::Seconds(3), [&now] { return now; });
  HeatRegistry heat;
  testing::NoStores stores;
  auto jobs = JobRegistry::Open(dir);
  EXPECT_TRUE(jobs.ok()) << jobs.status();
  SchedulerOptions options;
  options.clock = [&now] { return now; };
  Scheduler scheduler(jobs->get(), &members, &heat, &stores, nullptr, options);
  EXPECT_TRUE(scheduler.Recover().ok());
  std::vector<std::string> workers;
  for (int i = 0; i < shape.replicas + shape.workers; ++i) {
    v1::MemberInfo m;
    m.set_role(i < shape.replicas ? v1::MEMBER_ROLE_STORE : v1::MEMBER_ROLE_WORKER);
    m.set_backend(v1::BACKEND_CPU);
    m.set_grpc_address("127.0.0.1:1");
    auto id = members.Register(m);
    EXPECT_TRUE(id.ok()) << id.status();
    if (i >= shape.replicas) workers.push_back(*id);
  }
  const v1::JobSpec spec = SpecOf(shape);
  const uint64_t before = InUseBytes();
  auto job = (*jobs)->Submit(spec);
  EXPECT_TRUE(job.ok()) << job.status();
  scheduler.Tick();
  std::vector<v1::Assignment> assignments;
  for (const std::string& w : workers) assignments.push_back(*scheduler.GetAssignment(w));
  // Step 0 commits (the heat map gains its pairs); step 1 is measured in flight.
  for (int64_t step = 0; step < 2; ++step) {
    for (size_t i = 0; i < workers.size(); ++i) {
      EXPECT_TRUE(
          heat.Report((*jobs)->Get(job->job_id()).value(), HeatOf(assignments[i], workers[i], step))
              .ok());
    }
    const size_t reporting = step == 0 ? workers.size() : workers.size() - 1;
    for (size_t i = 0; i < reporting; ++i) {
      EXPECT_TRUE(scheduler.ReportStepWritten(Written(assignments[i], workers[i], step)).ok());
    }
  }
  EXPECT_EQ((*jobs)->Get(job->job_id())->committed_step(), 0);
  assignments.resize(1);  // one being answered
  assignments.shrink_to_fit();
  const uint64_t after = InUseBytes();
  return after > before ? after - before : 0;
}

TEST(JobMemoryTest, TheEstimateBoundsWhatTheSchedulerHolds) {
  const Shape shapes[] = {
      {8, 1024, 2, 4}, {16, 1024, 1, 1}, {128, 64, 1, 4}, {2, 4096, 3, 8}, {2, 8, 2, 1}};
  for (const Shape& s : shapes) {
    const std::string dir = absl::StrCat(::testing::TempDir(), "/job_memory_", getpid());
    const uint64_t measured = MeasuredBytes(s, dir);
    const uint64_t estimate = JobStateBytes(SpecOf(s));
    std::filesystem::remove_all(dir);
    const std::string what =
        absl::StrCat(s.layers, " layers x ", s.experts, " experts, R=", s.replicas, ", ", s.workers,
                     " workers: measured ", measured, " bytes, estimated ", estimate);
    std::printf("%s\n", what.c_str());
    EXPECT_GE(estimate, measured) << what;
    EXPECT_LE(estimate, 4 * measured + (2 << 20)) << what;
  }
}

// Admission: jobs are taken while their state fits beside the unfinished ones; the one
// that does not is refused alone (nothing recorded), and fits once another job ended.
TEST(JobMemoryTest, AJobTheCoordinatorCannotHoldIsRefusedAlone) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/job_admit_", getpid());
  std::filesystem::remove_all(dir);
  const v1::JobSpec small = SpecOf({2, 8, 2, 1}), wide = SpecOf({64, 2048, 2, 4});
  auto jobs = JobRegistry::Open(dir, 2 * JobStateBytes(small) + JobStateBytes(small) / 2);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  auto refused = (*jobs)->Submit(wide);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("the coordinator cannot hold this job: its state (64 layers x "
                                   "2048 experts, 2 store copies, 4 workers) takes about"));
  auto first = (*jobs)->Submit(small);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*jobs)->Submit(small).ok());
  refused = (*jobs)->Submit(small);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("2 unfinished job"));
  EXPECT_EQ((*jobs)->List({}, 0).size(), 2u);  // the refused ones were not recorded
  ASSERT_TRUE((*jobs)->Cancel(first->job_id(), "").ok());
  EXPECT_TRUE((*jobs)->Submit(small).ok());
  jobs->reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pith::coordinator
