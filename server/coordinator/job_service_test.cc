// The job API on an ephemeral port: submit (every validation error named), get, list,
// cancel, watch, and the registry surviving a reopen.
#include "server/coordinator/job_service.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/strings/str_replace.h"
#include "common/file.h"
#include "common/grpc_util.h"
#include "common/job_spec_testing.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/store_control_testing.h"

namespace pith::coordinator {
namespace {

constexpr const char* kSpec = pith::testing::kDesignExampleSpecJson;

v1::JobSpec SpecFrom(const std::string& json) {
  v1::JobSpec spec;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(json, &spec).ok()) << json;
  return spec;
}

class JobServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/jobs_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    Start();
  }
  // The registry's folder goes with a passing test (a failing one keeps it to look at).
  void TearDown() override {
    server_.reset();
    members_service_.reset();
    service_.reset();
    scheduler_.reset();
    jobs_.reset();
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  void Start() {
    server_.reset();
    service_.reset();
    members_service_.reset();
    scheduler_.reset();
    jobs_.reset();
    auto jobs = JobRegistry::Open(dir_);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    jobs_ = std::move(*jobs);
    scheduler_ = std::make_unique<Scheduler>(jobs_.get(), &members_, &heat_, &stores_);
    std::filesystem::create_directories(dir_ + "/exports");
    service_ = std::make_unique<JobServiceImpl>(jobs_.get(), &members_, &heat_, scheduler_.get(),
                                                dir_ + "/downloads", dir_ + "/exports");
    members_service_ =
        std::make_unique<CoordinatorServiceImpl>(&members_, jobs_.get(), &heat_, scheduler_.get());
    auto server = GrpcServer::Start(
        {.listen_address = "127.0.0.1:0", .services = {service_.get(), members_service_.get()}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(server_->port()),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::JobService::NewStub(channel);
    members_stub_ = v1::CoordinatorService::NewStub(channel);
  }

  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec) {
    grpc::ClientContext ctx;
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    absl::Status s = FromGrpcStatus(stub_->SubmitJob(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.job();
  }

  std::string dir_;
  std::unique_ptr<JobRegistry> jobs_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
  Membership members_{absl::Seconds(3), [this] { return now_; }};
  HeatRegistry heat_;
  std::unique_ptr<JobServiceImpl> service_;
  testing::NoStores stores_;
  std::unique_ptr<Scheduler> scheduler_;
  std::unique_ptr<CoordinatorServiceImpl> members_service_;
  std::unique_ptr<v1::CoordinatorService::Stub> members_stub_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<v1::JobService::Stub> stub_;
};

TEST_F(JobServiceTest, SubmitGetListCancel) {
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(job->spec().train().beta2(), 0.95);  // defaults filled in
  auto second = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->job_id(), job->job_id());

  grpc::ClientContext get_ctx;
  v1::GetJobRequest get;
  get.set_job_id(job->job_id());
  v1::Job got;
  ASSERT_TRUE(stub_->GetJob(&get_ctx, get, &got).ok());
  EXPECT_EQ(got.spec().name(), "demo");

  grpc::ClientContext cancel_ctx;
  v1::CancelJobRequest cancel;
  cancel.set_job_id(job->job_id());
  cancel.set_reason("operator asked");
  v1::Job cancelled;
  ASSERT_TRUE(stub_->CancelJob(&cancel_ctx, cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(cancelled.failure_reason(), "operator asked");
  grpc::ClientContext again_ctx;
  EXPECT_EQ(stub_->CancelJob(&again_ctx, cancel, &cancelled).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  grpc::ClientContext list_ctx;
  v1::ListJobsRequest list;
  list.add_states(v1::JOB_STATE_PENDING);
  v1::ListJobsResponse listed;
  ASSERT_TRUE(stub_->ListJobs(&list_ctx, list, &listed).ok());
  ASSERT_EQ(listed.jobs_size(), 1);
  EXPECT_EQ(listed.jobs(0).job_id(), second->job_id());

  grpc::ClientContext missing_ctx;
  get.set_job_id("nope");
  EXPECT_EQ(stub_->GetJob(&missing_ctx, get, &got).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(JobServiceTest, EveryInvalidFieldIsNamed) {
  struct Case {
    std::string from, to, field;
  };
  const std::string long_path = "\"" + std::string(4097, 'a') + "\"";
  const Case cases[] = {
      {"\"name\": \"demo\"", "\"name\": \"\"", "name"},
      {"\"data_path\": \"tokens.bin\"", "\"data_path\": " + long_path, "train.data_path"},
      {"\"init_path\": \"\"", "\"init_path\": " + long_path, "train.init_path"},
      {"\"data_path\": \"tokens.bin\"", "\"data_path\": \"a\\u0000b\"", "train.data_path"},
      {"\"data_path\": \"tokens.bin\"", "\"data_path\": \"a\\nE1207 forged\"", "train.data_path"},
      {"\"vocab_size\": 256", "\"vocab_size\": 1", "model.vocab_size"},
      {"\"seq_len\": 64", "\"seq_len\": 0", "model.seq_len"},
      {"\"d_model\": 128", "\"d_model\": 0", "model.d_model"},
      {"\"n_layer\": 4", "\"n_layer\": 0", "model.n_layer"},
      {"\"n_head\": 4", "\"n_head\": 3", "model.n_head"},
      {"\"n_expert\": 16", "\"n_expert\": 0", "model.n_expert"},
      {"\"top_k\": 2", "\"top_k\": 17", "model.top_k"},
      {"\"d_ff\": 256", "\"d_ff\": 0", "model.d_ff"},
      {"\"aux_loss_coef\": 0.01", "\"aux_loss_coef\": -1", "model.aux_loss_coef"},
      {"\"z_loss_coef\": 0.001", "\"z_loss_coef\": -1", "model.z_loss_coef"},
      {"\"data_path\": \"tokens.bin\"", "\"data_path\": \"\"", "train.data_path"},
      {"\"batch\": 16", "\"batch\": 0", "train.batch"},
      {"\"steps\": 300", "\"steps\": 0", "train.steps"},
      {"\"lr\": 0.003", "\"lr\": 0", "train.lr"},
      {"\"warmup\": 20", "\"warmup\": -1", "train.warmup"},
      {"\"min_lr_ratio\": 0.1", "\"min_lr_ratio\": 2", "train.min_lr_ratio"},
      {"\"weight_decay\": 0.1", "\"weight_decay\": -1", "train.weight_decay"},
      {"\"grad_clip\": 1.0", "\"grad_clip\": -1", "train.grad_clip"},
      {"\"workers\": 2", "\"workers\": -1", "cluster.workers"},
      {"\"store_replicas\": 2", "\"store_replicas\": 99", "cluster.store_replicas"},
      {"\"cache_bytes\": 0", "\"cache_bytes\": -1", "cluster.cache_bytes"},
  };
  for (const Case& c : cases) {
    const std::string json = absl::StrReplaceAll(kSpec, {{c.from, c.to}});
    ASSERT_NE(json, kSpec) << c.from;
    auto job = Submit(SpecFrom(json));
    ASSERT_FALSE(job.ok()) << c.field;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_EQ(job.status().message().find("JobSpec " + c.field + ":"), 0u)
        << c.field << ": " << job.status().message();
  }
  grpc::ClientContext ctx;
  v1::SubmitJobResponse resp;
  EXPECT_EQ(stub_->SubmitJob(&ctx, v1::SubmitJobRequest(), &resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

// A job with a blob larger than a store accepts is refused at submit, naming the sizes,
// instead of failing its first step over and over.
TEST_F(JobServiceTest, AJobWithBlobsTooLargeForTheStoresIsRefusedAtSubmit) {
  v1::MemberInfo store;
  store.set_role(v1::MEMBER_ROLE_STORE);
  store.set_grpc_address("127.0.0.1:1");
  store.set_max_blob_bytes(256 << 10);
  ASSERT_TRUE(members_.Register(store).ok());
  // d 128, f 256: an expert is (2 * 128 * 256 + 256 + 128) floats = 263,680 bytes.
  absl::StatusOr<v1::Job> refused = Submit(SpecFrom(kSpec));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("263680 bytes, more than store store-0's "
                                            "--max_blob_bytes=262144"),
            std::string::npos)
      << refused.status();
  const std::string small = absl::StrReplaceAll(kSpec, {{"\"d_ff\": 256", "\"d_ff\": 32"}});
  EXPECT_TRUE(Submit(SpecFrom(small)).ok());  // 33,408-byte experts; attn.qkv.w 196,608
}

// A bf16 job trains on CUDA workers only: refused at submit, with the reason, while the
// cluster has none alive; accepted once one has joined.
TEST_F(JobServiceTest, ABf16JobNeedsALiveCudaWorker) {
  const std::string bf16 =
      absl::StrReplaceAll(kSpec, {{"\"top_k\": 2", "\"top_k\": 2, \"compute_dtype\": \"bf16\""}});
  ASSERT_NE(bf16, kSpec);
  v1::MemberInfo cpu;
  cpu.set_role(v1::MEMBER_ROLE_WORKER);
  cpu.set_grpc_address("127.0.0.1:1");
  cpu.set_backend(v1::BACKEND_CPU);
  ASSERT_TRUE(members_.Register(cpu).ok());
  absl::StatusOr<v1::Job> refused = Submit(SpecFrom(bf16));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("bf16 trains on CUDA workers"), std::string::npos)
      << refused.status();
  v1::MemberInfo gpu = cpu;
  gpu.set_grpc_address("127.0.0.1:2");
  gpu.set_backend(v1::BACKEND_CUDA);
  ASSERT_TRUE(members_.Register(gpu).ok());
  EXPECT_TRUE(Submit(SpecFrom(bf16)).ok());
}

TEST_F(JobServiceTest, WatchStreamsChangesUntilTheJobEnds) {
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok());
  grpc::ClientContext ctx;
  v1::WatchJobRequest req;
  req.set_job_id(job->job_id());
  auto reader = stub_->WatchJob(&ctx, req);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  EXPECT_EQ(event.state(), v1::JOB_STATE_PENDING);
  std::thread updater([&] {
    ASSERT_TRUE(jobs_
                    ->Update(job->job_id(),
                             [](v1::Job& j) {
                               j.set_state(v1::JOB_STATE_RUNNING);
                               j.set_committed_step(3);
                               j.set_last_loss(4.5);
                               return absl::OkStatus();
                             })
                    .ok());
    ASSERT_TRUE(jobs_->Cancel(job->job_id(), "done watching").ok());
  });
  std::vector<v1::JobEvent> events;
  while (reader->Read(&event)) events.push_back(event);
  updater.join();
  EXPECT_TRUE(reader->Finish().ok());
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(JobServiceTest, MembersRegisterHeartbeatAndExpire) {
  v1::RegisterRequest reg;
  reg.mutable_member()->set_role(v1::MEMBER_ROLE_STORE);
  reg.mutable_member()->set_grpc_address("127.0.0.1:7100");
  v1::RegisterResponse registered;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(members_stub_->Register(&ctx, reg, &registered).ok());
  }
  EXPECT_EQ(registered.member_id(), "store-0");
  EXPECT_EQ(registered.lease_ms(), 3000);
  reg.mutable_member()->set_role(v1::MEMBER_ROLE_WORKER);
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(members_stub_->Register(&ctx, reg, &registered).ok());
    EXPECT_EQ(registered.member_id(), "worker-0");
  }
  auto status = [&] {
    grpc::ClientContext ctx;
    v1::ClusterStatusResponse resp;
    EXPECT_TRUE(stub_->ClusterStatus(&ctx, v1::ClusterStatusRequest(), &resp).ok());
    return resp;
  };
  ASSERT_EQ(status().stores_size(), 1);
  EXPECT_EQ(status().stores(0).state(), v1::MEMBER_STATE_ALIVE);

  // The store keeps heartbeating, the worker goes silent past its lease.
  now_ += absl::Seconds(2);
  v1::HeartbeatRequest beat;
  beat.set_member_id("store-0");
  beat.mutable_status()->set_ram_bytes(4096);
  v1::HeartbeatResponse beat_reply;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(members_stub_->Heartbeat(&ctx, beat, &beat_reply).ok());
    EXPECT_FALSE(beat_reply.reregister());
  }
  now_ += absl::Seconds(2);
  const auto after = status();
  EXPECT_EQ(after.stores(0).state(), v1::MEMBER_STATE_ALIVE);
  EXPECT_EQ(after.stores(0).ram_bytes(), 4096u);
  EXPECT_EQ(after.workers(0).state(), v1::MEMBER_STATE_DEAD);
  // A dead or unknown member is told to register again.
  beat.set_member_id("worker-0");
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(members_stub_->Heartbeat(&ctx, beat, &beat_reply).ok());
    EXPECT_TRUE(beat_reply.reregister());
  }
  // Bad registrations are named.
  v1::RegisterRequest bad;
  bad.mutable_member()->set_grpc_address("x:1");
  grpc::ClientContext ctx;
  EXPECT_EQ(members_stub_->Register(&ctx, bad, &registered).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(JobServiceTest, HeatReportsShowInExpertHeat) {
  auto job = Submit(SpecFrom(kSpec));  // 4 layers x 16 experts, heat decay 0.9
  ASSERT_TRUE(job.ok());
  auto report = [&](int64_t step, int expert, uint64_t tokens, bool pair,
                    const std::string& worker = "worker-0") {
    v1::HeatReport r;
    r.set_job_id(job->job_id());
    r.set_worker_id(worker);
    r.set_step(step);
    v1::LayerRouting* l = r.add_layers();
    l->set_layer(2);
    for (int e = 0; e < 16; ++e) l->add_tokens_per_expert(e == expert ? tokens : 0);
    if (pair) {
      l->mutable_coactivation()->Resize(16 * 15 / 2, 0);
      l->set_coactivation(static_cast<int>(HeatMap::PairIndex(16, 3, 9)), 5);
    }
    grpc::ClientContext ctx;
    v1::HeatReportResponse resp;
    return FromGrpcStatus(members_stub_->ReportHeat(&ctx, r, &resp));
  };
  ASSERT_TRUE(report(1, 3, 100, true).ok());
  ASSERT_TRUE(report(1, 3, 20, false, "worker-1").ok());  // a second worker: adds up
  ASSERT_TRUE(report(2, 9, 10, false).ok());              // next step: decay first
  grpc::ClientContext ctx;
  v1::ExpertHeatRequest req;
  req.set_job_id(job->job_id());
  req.set_layer(2);
  v1::ExpertHeatResponse heat;
  ASSERT_TRUE(stub_->ExpertHeat(&ctx, req, &heat).ok());
  ASSERT_EQ(heat.experts_size(), 16);
  EXPECT_NEAR(heat.experts(3).heat(), 108.0, 1e-9);  // 0.9 * 120
  EXPECT_NEAR(heat.experts(9).heat(), 10.0, 1e-9);
  EXPECT_EQ(heat.step(), 2);
  ASSERT_EQ(heat.pairs_size(), 1);
  EXPECT_EQ(heat.pairs(0).expert_a(), 3);
  EXPECT_EQ(heat.pairs(0).expert_b(), 9);
  // An older step, a wrong layer and an unknown job are refused.
  EXPECT_EQ(report(1, 3, 1, false).code(), absl::StatusCode::kFailedPrecondition);
  grpc::ClientContext ctx2;
  req.set_layer(4);
  EXPECT_EQ(stub_->ExpertHeat(&ctx2, req, &heat).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext ctx3;
  req.set_job_id("nope");
  EXPECT_EQ(stub_->ExpertHeat(&ctx3, req, &heat).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(JobServiceTest, JobsSurviveAReopen) {
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok());
  ASSERT_TRUE(jobs_
                  ->Update(job->job_id(),
                           [](v1::Job& j) {
                             j.set_committed_step(7);
                             return absl::OkStatus();
                           })
                  .ok());
  Start();  // a new registry over the same directory
  auto again = jobs_->Get(job->job_id());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->committed_step(), 7);
  auto next = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->job_id(), job->job_id());  // ids are not reused
}

// An ended job is removed for good (a reopened registry does not bring it back, and its
// id is not handed out again); one still pending is refused, and so is a second removal.
TEST_F(JobServiceTest, RemoveForgetsAnEndedJobForGood) {
  auto kept = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(kept.ok());
  auto job = Submit(SpecFrom(kSpec));  // the newest: its id is the counter's last
  ASSERT_TRUE(job.ok());
  auto remove = [&](const std::string& id, v1::Job* out) {
    grpc::ClientContext ctx;
    v1::RemoveJobRequest req;
    req.set_job_id(id);
    return stub_->RemoveJob(&ctx, req, out);
  };
  v1::Job last;
  grpc::Status pending = remove(job->job_id(), &last);
  EXPECT_EQ(pending.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(pending.error_message(), ::testing::HasSubstr("is pending; only an ended job"));
  // A watcher of the job (it has ended) sees it go.
  ASSERT_TRUE(jobs_->Cancel(job->job_id(), "done").ok());
  const int64_t seen = jobs_->Version(job->job_id());
  absl::StatusOr<v1::Job> woken;
  std::thread watcher(
      [&] { woken = jobs_->WaitForChange(job->job_id(), seen, absl::Seconds(30)); });
  ASSERT_TRUE(remove(job->job_id(), &last).ok());
  watcher.join();
  EXPECT_EQ(woken.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(last.job_id(), job->job_id());
  EXPECT_EQ(last.state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(last.spec().name(), "demo");  // its last record, whole
  for (int reopen = 0; reopen < 2; ++reopen) {
    absl::StatusOr<v1::Job> gone = jobs_->Get(job->job_id());
    EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound);
    EXPECT_THAT(gone.status().message(), ::testing::HasSubstr("was removed (cancelled)"));
    EXPECT_TRUE(jobs_->Removed(job->job_id()));
    EXPECT_FALSE(jobs_->Removed(kept->job_id()));
    const std::vector<v1::Job> all = jobs_->List({}, 0);
    ASSERT_EQ(all.size(), 1u);
    EXPECT_EQ(all[0].job_id(), kept->job_id());
    EXPECT_EQ(jobs_->CountByState()[v1::JOB_STATE_CANCELLED], 0);
    EXPECT_EQ(jobs_->Cancel(job->job_id(), "again").status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(remove(job->job_id(), &last).error_code(), grpc::StatusCode::NOT_FOUND);
    Start();  // a new registry over the same directory
  }
  auto next = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(next.ok());
  EXPECT_NE(next->job_id(), job->job_id());
  EXPECT_EQ(remove("nope", &last).error_code(), grpc::StatusCode::NOT_FOUND);
}

// A job id that is no id is refused before it is echoed in an error: a 4000-byte one
// overflowed gRPC's metadata, control characters reached the caller's terminal.
TEST_F(JobServiceTest, AnIdThatIsNoIdIsRefusedWithoutBeingEchoed) {
  for (const std::string& id :
       {std::string(4000, 'a'), std::string("x\ny\x1b[31m"), std::string("../demo-1"),
        std::string("d\xc2\x9b-1"), std::string()}) {
    grpc::ClientContext ctx;
    v1::RemoveJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    const grpc::Status s = stub_->RemoveJob(&ctx, req, &job);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_LT(s.error_message().size(), 100u);
    EXPECT_EQ(s.error_message().find('\n'), std::string::npos);
  }
  // A cancel's reason is shown to whoever reads the job: bounded, no control characters.
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok());
  for (const std::string& reason : {std::string(600, 'r'), std::string("done\x1b]0;pwned\x07")}) {
    grpc::ClientContext ctx;
    v1::CancelJobRequest req;
    req.set_job_id(job->job_id());
    req.set_reason(reason);
    v1::Job cancelled;
    EXPECT_EQ(stub_->CancelJob(&ctx, req, &cancelled).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(jobs_->Get(job->job_id())->state(), v1::JOB_STATE_PENDING);
}

// An owner's unfinished jobs are counted under the registry's lock with the submit; an
// ended one makes room, other owners are not held.
TEST_F(JobServiceTest, AnOwnersUnfinishedJobsAreBounded) {
  const v1::JobSpec spec = SpecFrom(kSpec);
  auto first = jobs_->Submit(spec, "alice", 2);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(jobs_->Submit(spec, "alice", 2).ok());
  absl::StatusOr<v1::Job> third = jobs_->Submit(spec, "alice", 2);
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(third.status().message(), ::testing::HasSubstr("alice has 2 unfinished job(s)"));
  EXPECT_TRUE(jobs_->Submit(spec, "bob", 2).ok());
  EXPECT_TRUE(jobs_->Submit(spec, "alice").ok());  // no limit given: none applies
  ASSERT_TRUE(jobs_->Cancel(first->job_id(), "room").ok());
  // Unfinished now: the second and the one submitted without a limit.
  EXPECT_EQ(jobs_->Submit(spec, "alice", 2).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(jobs_->Submit(spec, "alice", 3).ok());
}

TEST_F(JobServiceTest, CheckpointAndTheMemberRpcsRefuseBadRequests) {
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok());
  auto checkpoint = [&](const std::string& id, const std::string& dir) {
    grpc::ClientContext ctx;
    v1::CheckpointJobRequest req;
    req.set_job_id(id);
    req.set_output_dir(dir);
    v1::CheckpointJobResponse resp;
    return FromGrpcStatus(stub_->CheckpointJob(&ctx, req, &resp)).code();
  };
  EXPECT_EQ(checkpoint("nope", dir_), absl::StatusCode::kNotFound);
  EXPECT_EQ(checkpoint(job->job_id(), ""), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(checkpoint(job->job_id(), dir_ + "/out"), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(checkpoint(job->job_id(), "../out"), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(checkpoint(job->job_id(), "out"), absl::StatusCode::kFailedPrecondition);  // no step

  {
    grpc::ClientContext ctx;
    v1::StepWrittenRequest req;  // no job, worker or step
    req.set_step(-1);
    v1::StepWrittenResponse resp;
    EXPECT_EQ(FromGrpcStatus(members_stub_->ReportStepWritten(&ctx, req, &resp)).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    grpc::ClientContext ctx;
    v1::StepWrittenRequest req;
    req.set_job_id(job->job_id());
    req.set_worker_id("worker-9");
    req.set_step(0);
    v1::StepWrittenResponse resp;  // the job is not running
    EXPECT_EQ(FromGrpcStatus(members_stub_->ReportStepWritten(&ctx, req, &resp)).code(),
              absl::StatusCode::kFailedPrecondition);
  }
  {
    grpc::ClientContext ctx;
    v1::GetAssignmentRequest req;
    req.set_worker_id("worker-9");
    v1::Assignment resp;
    EXPECT_EQ(FromGrpcStatus(members_stub_->GetAssignment(&ctx, req, &resp)).code(),
              absl::StatusCode::kNotFound);
  }
  {
    grpc::ClientContext ctx;
    v1::GetPlacementRequest req;
    req.set_job_id(job->job_id());
    v1::PlacementTable resp;
    EXPECT_EQ(FromGrpcStatus(members_stub_->GetPlacement(&ctx, req, &resp)).code(),
              absl::StatusCode::kNotFound);
  }
  {
    grpc::ClientContext ctx;
    v1::WaitStepRequest req;  // no job
    v1::StepStatus resp;
    EXPECT_EQ(FromGrpcStatus(members_stub_->WaitStep(&ctx, req, &resp)).code(),
              absl::StatusCode::kInvalidArgument);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::WaitStepRequest req;
    req.set_job_id("nope");
    req.set_step(1);
    v1::StepStatus resp;
    EXPECT_EQ(FromGrpcStatus(members_stub_->WaitStep(&ctx, req, &resp)).code(),
              absl::StatusCode::kNotFound);
  }
}

// The job API's per-client limits, through a real server: a client past its rate gets
// RESOURCE_EXHAUSTED with the reason; one holding its streams cannot open another.
TEST_F(JobServiceTest, AClientPastItsRateOrStreamsIsRefusedWithTheReason) {
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok());
  JobServiceImpl limited(jobs_.get(), &members_, &heat_, scheduler_.get(), "", "",
                         /*enforce=*/false, nullptr,
                         std::make_shared<security::ClientLimits>(security::ClientLimits::Options{
                             .requests_per_second = 0.01, .burst = 3, .streams = 1}));
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&limited}});
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::JobService::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  grpc::ClientContext watch_ctx;
  v1::WatchJobRequest watch;
  watch.set_job_id(job->job_id());
  auto reader = stub->WatchJob(&watch_ctx, watch);  // request 1, holds the one stream
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  {
    grpc::ClientContext ctx;
    auto second = stub->WatchJob(&ctx, watch);  // request 2
    EXPECT_FALSE(second->Read(&event));
    const grpc::Status s = second->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_NE(s.error_message().find("streams open already"), std::string::npos);
  }
  v1::ListJobsResponse list;
  {
    grpc::ClientContext ctx;
    EXPECT_TRUE(stub->ListJobs(&ctx, v1::ListJobsRequest(), &list).ok());  // request 3
  }
  grpc::ClientContext ctx;
  const grpc::Status over = stub->ListJobs(&ctx, v1::ListJobsRequest(), &list);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(over.error_message().find("ListJobs: ipv4:127.0.0.1 makes more than"),
            std::string::npos)
      << over.error_message();
  watch_ctx.TryCancel();
  (void)reader->Finish();
}

// A download is staged whole on the coordinator's disk: without room for it beside the
// reserve (here a reserve larger than any disk), it is refused before anything is written,
// saying whose disk.
TEST_F(JobServiceTest, ADownloadWithoutRoomOnTheCoordinatorsDiskIsRefused) {
  auto job = Submit(SpecFrom(kSpec));
  ASSERT_TRUE(job.ok()) << job.status();
  service_->set_disk_reserve_bytes(1ull << 60);
  grpc::ClientContext ctx;
  v1::DownloadCheckpointRequest request;
  request.set_job_id(job->job_id());
  auto reader = stub_->DownloadCheckpoint(&ctx, request);
  v1::CheckpointChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(),
              ::testing::HasSubstr("the coordinator cannot stage the checkpoint ("));
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("under its --data_dir: the disk under"));
}

// Downloads checked together count each other's promised bytes: two that each fit the
// disk but not both are not both admitted; the room comes back with the first's promise.
TEST(StagingLedgerTest, PromisesCountAgainstTheRoomUntilTheyGo) {
  const std::string dir = ::testing::TempDir();
  const absl::StatusOr<uint64_t> free = FreeBytes(dir);
  ASSERT_TRUE(free.ok()) << free.status();
  const uint64_t share = *free / 5 * 3;  // 60%: one fits, two do not
  StagingLedger ledger;
  std::optional<StagingLedger::Promise> first;
  {
    absl::StatusOr<StagingLedger::Promise> p = ledger.Take(dir, 0, share);
    ASSERT_TRUE(p.ok()) << p.status();
    first.emplace(std::move(*p));
  }
  const absl::StatusOr<StagingLedger::Promise> second = ledger.Take(dir, 0, share);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(
      std::string(second.status().message()),
      ::testing::HasSubstr(absl::StrCat(share, " bytes of that write promised to downloads")));
  first.reset();
  EXPECT_TRUE(ledger.Take(dir, 0, share).ok());
}

// A download is the file's bytes in order, and the caller is asked about before every
// chunk: a token revoked mid-stream ends it with that refusal, a client gone with CANCELLED.
TEST(StreamFileTest, SendsTheBytesAndStopsAtTheFirstRefusal) {
  const std::string path = ::testing::TempDir() + "/stream_" + std::to_string(getpid());
  std::string bytes(2500, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7);
  {
    std::ofstream out(path, std::ios::binary);
    out << bytes;
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  std::string got;
  int asked = 0;
  auto send = [&](absl::string_view chunk) {
    EXPECT_LE(chunk.size(), 1000u);
    got.append(chunk.data(), chunk.size());
    return true;
  };
  auto allowed = [&] {
    ++asked;
    return absl::OkStatus();
  };
  ASSERT_TRUE(StreamFile(fd, path, bytes.size(), 1000, allowed, send).ok());
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(asked, 3);

  got.clear();
  asked = 0;
  auto revoked_after_one = [&] {
    return ++asked > 1 ? absl::UnauthenticatedError("the bearer token is not valid")
                       : absl::OkStatus();
  };
  const absl::Status revoked = StreamFile(fd, path, bytes.size(), 1000, revoked_after_one, send);
  EXPECT_EQ(revoked.code(), absl::StatusCode::kUnauthenticated) << revoked;
  EXPECT_EQ(got, bytes.substr(0, 1000));

  const absl::Status gone =
      StreamFile(fd, path, bytes.size(), 1000, allowed, [](absl::string_view) { return false; });
  EXPECT_EQ(gone.code(), absl::StatusCode::kCancelled) << gone;
  // A file shorter than its export said is an error, not a short download.
  const absl::Status short_file = StreamFile(fd, path, bytes.size() + 1, 1000, allowed, send);
  EXPECT_FALSE(short_file.ok());
  ::close(fd);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace pith::coordinator
