// A real pith-coordinator process: jobs submitted over gRPC survive kill -9 and a restart.
#include <filesystem>
#include <memory>
#include <string>

#include "child_process.h"
#include "common/grpc_util.h"
#include "gtest/gtest.h"
#include "pith/v1/job.grpc.pb.h"

namespace pith::coordinator {
namespace {

std::unique_ptr<pith::testing::ChildProcess> StartCoordinator(const std::string& dir, int n) {
  auto p = std::make_unique<pith::testing::ChildProcess>(
      PITH_COORDINATOR_BINARY,
      std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                               "--data_dir=" + dir + "/data"},
      dir + "/coordinator." + std::to_string(n) + ".log");
  EXPECT_TRUE(p->WaitReady()) << p->Log();
  return p;
}

std::unique_ptr<v1::JobService::Stub> Stub(int port) {
  return v1::JobService::NewStub(
      grpc::CreateChannel("127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
}

TEST(CoordinatorE2eTest, JobsSurviveKillDashNine) {
  const std::string dir = ::testing::TempDir() + "/coordinator_e2e_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto coordinator = StartCoordinator(dir, 1);
  auto stub = Stub(coordinator->grpc_port);
  v1::SubmitJobRequest submit;
  v1::JobSpec* spec = submit.mutable_spec();
  spec->set_name("survivor");
  auto* m = spec->mutable_model();
  m->set_vocab_size(256);
  m->set_seq_len(32);
  m->set_d_model(64);
  m->set_n_layer(2);
  m->set_n_head(4);
  m->set_n_expert(8);
  m->set_top_k(2);
  m->set_d_ff(128);
  auto* t = spec->mutable_train();
  t->set_data_path("tokens.bin");
  t->set_batch(8);
  t->set_steps(10);
  t->set_lr(0.003);
  std::string ids[2];
  for (std::string& id : ids) {
    grpc::ClientContext ctx;
    v1::SubmitJobResponse resp;
    grpc::Status s = stub->SubmitJob(&ctx, submit, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    id = resp.job().job_id();
  }
  {
    grpc::ClientContext ctx;
    v1::CancelJobRequest cancel;
    cancel.set_job_id(ids[1]);
    v1::Job job;
    ASSERT_TRUE(stub->CancelJob(&ctx, cancel, &job).ok());
  }
  coordinator->Kill();

  coordinator = StartCoordinator(dir, 2);
  stub = Stub(coordinator->grpc_port);
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;
    v1::GetJobRequest get;
    get.set_job_id(ids[i]);
    v1::Job job;
    grpc::Status s = stub->GetJob(&ctx, get, &job);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(job.spec().name(), "survivor");
    EXPECT_EQ(job.state(), i == 0 ? v1::JOB_STATE_PENDING : v1::JOB_STATE_CANCELLED);
  }
  EXPECT_EQ(coordinator->Terminate(), 0) << coordinator->Log();
}

}  // namespace
}  // namespace pith::coordinator
