// A real pith-coordinator process: jobs submitted over gRPC survive kill -9 and a restart.
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "child_process.h"
#include "common/grpc_util.h"
#include "gtest/gtest.h"
#include "pith/v1/job.grpc.pb.h"

namespace pith::coordinator {
namespace {

std::unique_ptr<pith::testing::ChildProcess> StartCoordinator(
    const std::string& dir, int n, const std::string& listen = "127.0.0.1:0") {
  auto p = std::make_unique<pith::testing::ChildProcess>(
      PITH_COORDINATOR_BINARY,
      std::vector<std::string>{"--listen=" + listen, "--metrics_port=-1", "--lease_ms=1000",
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

v1::ClusterStatusResponse Cluster(v1::JobService::Stub& stub) {
  grpc::ClientContext ctx;
  v1::ClusterStatusResponse resp;
  EXPECT_TRUE(stub.ClusterStatus(&ctx, v1::ClusterStatusRequest(), &resp).ok());
  return resp;
}

// Polls ClusterStatus (10 s at most) until `pred` holds.
template <typename Pred>
bool WaitFor(v1::JobService::Stub& stub, Pred pred) {
  for (int i = 0; i < 100; ++i) {
    if (pred(Cluster(stub))) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

TEST(CoordinatorE2eTest, StoresRegisterHeartbeatDieAndComeBack) {
  const std::string dir = ::testing::TempDir() + "/members_e2e_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto coordinator = StartCoordinator(dir, 1);
  const std::string address = "127.0.0.1:" + std::to_string(coordinator->grpc_port);
  auto stub = Stub(coordinator->grpc_port);
  auto start_store = [&](int n) {
    auto p = std::make_unique<pith::testing::ChildProcess>(
        PITH_STORE_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir + "/store" + std::to_string(n),
                                 "--ram_bytes=67108864", "--max_blob_bytes=1048576",
                                 "--coordinator=" + address},
        dir + "/store" + std::to_string(n) + ".log");
    EXPECT_TRUE(p->WaitReady()) << p->Log();
    return p;
  };
  auto store0 = start_store(0);
  auto store1 = start_store(1);
  ASSERT_TRUE(WaitFor(*stub, [](const v1::ClusterStatusResponse& c) {
    return c.stores_size() == 2 && c.stores(0).state() == v1::MEMBER_STATE_ALIVE &&
           c.stores(1).state() == v1::MEMBER_STATE_ALIVE;
  }));
  const auto alive = Cluster(*stub);
  EXPECT_EQ(alive.stores(0).capacity_bytes(), 67108864u);
  EXPECT_FALSE(alive.stores(0).ucx_address().empty());

  // kill -9: the lease runs out and the store is dead; the other stays alive.
  store1->Kill();
  ASSERT_TRUE(WaitFor(*stub, [](const v1::ClusterStatusResponse& c) {
    int dead = 0, live = 0;
    for (const auto& s : c.stores()) {
      dead += s.state() == v1::MEMBER_STATE_DEAD;
      live += s.state() == v1::MEMBER_STATE_ALIVE;
    }
    return dead == 1 && live == 1;
  }));

  // A coordinator restart forgets members; the live store registers again by itself.
  coordinator->Kill();
  coordinator = StartCoordinator(dir, 2, address);
  stub = Stub(coordinator->grpc_port);
  ASSERT_TRUE(WaitFor(*stub, [](const v1::ClusterStatusResponse& c) {
    return c.stores_size() == 1 && c.stores(0).state() == v1::MEMBER_STATE_ALIVE;
  })) << store0->Log();
  EXPECT_EQ(store0->Terminate(), 0);
}

TEST(CoordinatorE2eTest, UnreachableCoordinatorIsOneClearLine) {
  const std::string dir = ::testing::TempDir() + "/unreachable_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  pith::testing::ChildProcess store(PITH_STORE_BINARY,
                                    {"--listen=127.0.0.1:0", "--metrics_port=-1",
                                     "--data_dir=" + dir, "--coordinator=127.0.0.1:1"},
                                    dir + ".log");
  EXPECT_FALSE(store.WaitReady(30));
  EXPECT_NE(store.Log().find("pith-store: coordinator: cannot reach 127.0.0.1:1"),
            std::string::npos)
      << store.Log();
}

}  // namespace
}  // namespace pith::coordinator
