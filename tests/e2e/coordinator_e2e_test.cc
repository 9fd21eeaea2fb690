// A real pith-coordinator process: jobs submitted over gRPC survive kill -9 and a restart;
// stores register and die; the step-commit protocol runs against real pith-store processes
// with workers speaking the member protocol (a worker dying mid-step, a coordinator
// killed mid-step).
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "child_process.h"
#include "common/grpc_util.h"
#include "common/ucx_auth.h"
#include "gtest/gtest.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "pith/v1/job.grpc.pb.h"
#include "pith/v1/store.grpc.pb.h"
#include "scratch_dir.h"
#include "server/store/store_client.h"
#include "test_tls.h"

namespace pith::coordinator {
namespace {

// The certificates of every process and call of this test (mutual TLS, as users run it).
pith::testing::TestTls& Tls() {
  static auto* tls = new pith::testing::TestTls(::testing::TempDir() + "/coordinator_e2e_tls_" +
                                                std::to_string(getpid()));
  return *tls;
}

std::unique_ptr<pith::testing::ChildProcess> StartCoordinator(
    const std::string& dir, int n, const std::string& listen = "127.0.0.1:0") {
  auto p = std::make_unique<pith::testing::ChildProcess>(
      PITH_COORDINATOR_BINARY,
      std::vector<std::string>{"--listen=" + listen, "--metrics_port=-1", "--lease_ms=1000",
                               "--data_dir=" + dir + "/data", Tls().CoordinatorFlag()},
      dir + "/coordinator." + std::to_string(n) + ".log");
  EXPECT_TRUE(p->WaitReady()) << p->Log();
  return p;
}

std::unique_ptr<v1::JobService::Stub> Stub(int port) {
  return v1::JobService::NewStub(Tls().AdminChannel("127.0.0.1:" + std::to_string(port)));
}

TEST(CoordinatorE2eTest, JobsSurviveKillDashNine) {
  const pith::testing::ScratchDir scratch(::testing::TempDir() + "/coordinator_e2e_" +
                                          std::to_string(getpid()));
  const std::string& dir = scratch.dir;
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
  const pith::testing::ScratchDir scratch(::testing::TempDir() + "/members_e2e_" +
                                          std::to_string(getpid()));
  const std::string& dir = scratch.dir;
  auto coordinator = StartCoordinator(dir, 1);
  const std::string address = "127.0.0.1:" + std::to_string(coordinator->grpc_port);
  auto stub = Stub(coordinator->grpc_port);
  auto start_store = [&](int n) {
    auto p = std::make_unique<pith::testing::ChildProcess>(
        PITH_STORE_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir + "/store" + std::to_string(n),
                                 "--ram_bytes=67108864", "--max_blob_bytes=1048576",
                                 "--coordinator=" + address,
                                 Tls().MemberFlag("store" + std::to_string(n))},
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
  const pith::testing::ScratchDir scratch(::testing::TempDir() + "/unreachable_" +
                                          std::to_string(getpid()));
  const std::string& dir = scratch.dir;
  pith::testing::ChildProcess store(
      PITH_STORE_BINARY,
      {"--listen=127.0.0.1:0", "--metrics_port=-1", "--data_dir=" + dir,
       "--coordinator=127.0.0.1:1", Tls().MemberFlag("store0")},
      dir + ".log");
  EXPECT_FALSE(store.WaitReady(30));
  EXPECT_NE(store.Log().find("pith-store: coordinator: cannot reach 127.0.0.1:1"),
            std::string::npos)
      << store.Log();
}

// A worker as the coordinator sees one: it registers, heartbeats (registering again, with
// its id, when the coordinator asks), and writes blobs to stores over UCX. Stop() is a
// worker dying: it falls silent.
using store::StoreClient;

class MemberWorker {
 public:
  explicit MemberWorker(const std::string& coordinator)
      : coordinator_(coordinator),
        credentials_(
            Tls().Credentials(security::Role::kMember, "fake-worker" + std::to_string(next_++))) {
    Register();
    beat_ = std::thread([this] {
      while (!stop_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        v1::HeartbeatRequest req;
        req.set_member_id(id_);
        v1::HeartbeatResponse resp;
        if (Stub()->Heartbeat(&ctx, req, &resp).ok() && resp.reregister()) Register();
      }
    });
  }
  ~MemberWorker() { Stop(); }
  void Stop() {
    stop_ = true;
    if (beat_.joinable()) beat_.join();
  }
  const std::string& id() const { return id_; }

  std::unique_ptr<v1::CoordinatorService::Stub> Stub() {
    return v1::CoordinatorService::NewStub(NewChannel(coordinator_, credentials_));
  }

  absl::StatusOr<v1::Assignment> Assignment() {
    grpc::ClientContext ctx;
    v1::GetAssignmentRequest req;
    req.set_worker_id(id_);
    v1::Assignment a;
    absl::Status s = FromGrpcStatus(Stub()->GetAssignment(&ctx, req, &a));
    if (!s.ok()) return s;
    return a;
  }

  // Writes version `step` of every expert this worker owns first (and, rank 0, the dense
  // group) to each of its stores: 4 KiB per blob, filled with `step`.
  absl::Status WriteStep(const v1::Assignment& a, int64_t step) {
    if (client_ == nullptr) {
      auto c = StoreClient::Create();
      if (!c.ok()) return c.status();
      client_ = std::move(*c);
    }
    std::map<std::string, std::string> ucx;
    for (const v1::MemberInfo& m : a.stores()) ucx[m.member_id()] = m.ucx_address();
    auto buf = client_->AllocateBuffer(4096);
    if (!buf.ok()) return buf.status();
    std::memset((*buf)->data(), static_cast<int>(step), 4096);
    for (const v1::ExpertPlacement& e : a.placement().experts()) {
      const bool mine =
          e.layer() < 0 ? a.rank() == 0 : e.owners_size() > 0 && e.owners(0).worker_id() == id_;
      if (!mine) continue;
      for (const std::string& store : e.store_ids()) {
        if (!ucx.count(store)) {
          return absl::NotFoundError(
              absl::StrCat("store ", store, " is not in the assignment: ", a.ShortDebugString()));
        }
        auto peer = client_->Connect(ucx[store]);
        if (!peer.ok()) return peer.status();
        v1::BlobKey key;
        key.set_job_id(a.job_id());
        key.set_layer(e.layer());
        key.set_expert(e.expert());
        key.set_kind(v1::BLOB_KIND_WEIGHTS);
        if (e.layer() < 0) key.set_tensor("wte");
        auto info = client_->Put(*peer, key, step, (*buf)->data(), 4096, (*buf)->handle());
        if (!info.ok()) return info.status();
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<v1::StepStatus> Report(const v1::Assignment& a, int64_t step) {
    grpc::ClientContext ctx;
    v1::StepWrittenRequest req;
    req.set_job_id(a.job_id());
    req.set_worker_id(id_);
    req.set_step(step);
    req.set_ok(true);
    req.set_loss(1.0 / (step + 1));
    req.set_assignment_version(a.assignment_version());
    v1::StepWrittenResponse resp;
    absl::Status s = FromGrpcStatus(Stub()->ReportStepWritten(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.status();
  }

 private:
  void Register() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::RegisterRequest req;
    req.mutable_member()->set_member_id(id_);
    req.mutable_member()->set_role(v1::MEMBER_ROLE_WORKER);
    req.mutable_member()->set_grpc_address("127.0.0.1:1");
    v1::RegisterResponse resp;
    if (Stub()->Register(&ctx, req, &resp).ok()) {
      id_ = resp.member_id();
      ucx::SetDataPlaneKey(resp.data_plane_key());  // as a member's agent does
    }
  }

  const std::string coordinator_;
  static inline int next_ = 0;  // fake workers made so far: each has its own certificate
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  std::string id_;
  std::atomic<bool> stop_{false};
  std::thread beat_;
  std::unique_ptr<StoreClient> client_;
};

// Polls `fn` every 50 ms for up to `seconds` until it returns true.
template <typename Fn>
bool Eventually(Fn fn, double seconds = 15) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (fn()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The job of the steps test: a small MoE model, 2 workers, 2 store copies, 3 steps.
v1::SubmitJobRequest StepsJob() {
  v1::SubmitJobRequest submit;
  v1::JobSpec* spec = submit.mutable_spec();
  spec->set_name("steps");
  auto* m = spec->mutable_model();
  m->set_vocab_size(256);
  m->set_seq_len(32);
  m->set_d_model(64);
  m->set_n_layer(2);
  m->set_n_head(4);
  m->set_n_expert(4);
  m->set_top_k(2);
  m->set_d_ff(128);
  spec->mutable_train()->set_data_path("tokens.bin");
  spec->mutable_train()->set_batch(8);
  spec->mutable_train()->set_steps(3);
  spec->mutable_train()->set_lr(0.003);
  spec->mutable_cluster()->set_workers(2);
  spec->mutable_cluster()->set_store_replicas(2);
  return submit;
}

// A store's view of one weights blob of `job_id`: its committed version, or -1.
int64_t CommittedVersion(v1::StoreService::Stub& store, const std::string& job_id, int layer,
                         int expert) {
  grpc::ClientContext ctx;
  v1::StatBlobRequest req;
  req.mutable_key()->set_job_id(job_id);
  req.mutable_key()->set_layer(layer);
  req.mutable_key()->set_expert(expert);
  req.mutable_key()->set_kind(v1::BLOB_KIND_WEIGHTS);
  if (layer < 0) req.mutable_key()->set_tensor("wte");
  req.set_version(-1);
  v1::BlobInfo info;
  return store.StatBlob(&ctx, req, &info).ok() ? info.version() : -1;
}

// The worker's assignment to a job, once its version is above `newer_than`.
v1::Assignment AssignmentOf(MemberWorker& w, int64_t newer_than = 0) {
  absl::StatusOr<v1::Assignment> got;
  EXPECT_TRUE(Eventually([&] {
    got = w.Assignment();
    return got.ok() && !got->job_id().empty() && got->assignment_version() > newer_than;
  })) << (got.ok() ? got->DebugString() : got.status().ToString());
  return *got;
}

// Starts `n` stores in `dir` that register with the coordinator at `address`, and a stub
// to each.
void StartStores(const std::string& dir, const std::string& address, int n,
                 std::vector<std::unique_ptr<pith::testing::ChildProcess>>* stores,
                 std::vector<std::unique_ptr<v1::StoreService::Stub>>* stubs) {
  for (int i = 0; i < n; ++i) {
    stores->push_back(std::make_unique<pith::testing::ChildProcess>(
        PITH_STORE_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir + "/store" + std::to_string(i),
                                 "--ram_bytes=67108864", "--max_blob_bytes=1048576",
                                 "--coordinator=" + address,
                                 Tls().MemberFlag("store" + std::to_string(i))},
        dir + "/store" + std::to_string(i) + ".log"));
    ASSERT_TRUE(stores->back()->WaitReady()) << stores->back()->Log();
    stubs->push_back(v1::StoreService::NewStub(
        Tls().CoordinatorChannel("127.0.0.1:" + std::to_string(stores->back()->grpc_port))));
  }
}

void Submit(v1::JobService::Stub& stub, const v1::SubmitJobRequest& submit, std::string* job_id) {
  grpc::ClientContext ctx;
  v1::SubmitJobResponse resp;
  ASSERT_TRUE(stub.SubmitJob(&ctx, submit, &resp).ok());
  *job_id = resp.job().job_id();
}

TEST(CoordinatorE2eTest, StepsCommitOnRealStoresThroughWorkerDeathAndCoordinatorKill) {
  const pith::testing::ScratchDir scratch(::testing::TempDir() + "/steps_e2e_" +
                                          std::to_string(getpid()));
  const std::string& dir = scratch.dir;
  auto coordinator = StartCoordinator(dir, 1);
  const std::string address = "127.0.0.1:" + std::to_string(coordinator->grpc_port);
  std::vector<std::unique_ptr<pith::testing::ChildProcess>> stores;
  std::vector<std::unique_ptr<v1::StoreService::Stub>> store_stubs;
  ASSERT_NO_FATAL_FAILURE(StartStores(dir, address, 2, &stores, &store_stubs));
  auto stub = Stub(coordinator->grpc_port);
  ASSERT_TRUE(
      WaitFor(*stub, [](const v1::ClusterStatusResponse& c) { return c.stores_size() == 2; }));
  auto a = std::make_unique<MemberWorker>(address);
  auto b = std::make_unique<MemberWorker>(address);

  std::string job_id;
  ASSERT_NO_FATAL_FAILURE(Submit(*stub, StepsJob(), &job_id));
  auto job = [&] {
    grpc::ClientContext ctx;
    v1::GetJobRequest get;
    get.set_job_id(job_id);
    v1::Job j;
    EXPECT_TRUE(stub->GetJob(&ctx, get, &j).ok());
    return j;
  };
  auto committed_version = [&](int store, int layer, int expert) {
    return CommittedVersion(*store_stubs[store], job_id, layer, expert);
  };
  auto run_step = [&](std::vector<std::pair<MemberWorker*, v1::Assignment>> ws, int64_t step) {
    for (auto& [w, as] : ws) {
      absl::Status written = w->WriteStep(as, step);
      ASSERT_TRUE(written.ok()) << written;
    }
    for (auto& [w, as] : ws) {
      auto st = w->Report(as, step);
      ASSERT_TRUE(st.ok()) << st.status();
    }
    // The commit may land in a scheduler pass (Tick finishes pending commits), not the report.
    ASSERT_TRUE(Eventually([&] { return job().committed_step() >= step; }, 5));
    ASSERT_EQ(job().committed_step(), step);
  };

  // Step 0, the initial weights: both workers write, the stores commit.
  ASSERT_TRUE(Eventually([&] { return job().state() == v1::JOB_STATE_RUNNING; }));
  v1::Assignment aa = AssignmentOf(*a), ab = AssignmentOf(*b);
  EXPECT_EQ(aa.world(), 2);
  run_step({{a.get(), aa}, {b.get(), ab}}, 0);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(committed_version(s, -1, 0), 0);
    for (int e = 0; e < 4; ++e) EXPECT_EQ(committed_version(s, 1, e), 0);
  }

  // Step 1: a writes and reports, b dies before reporting. The lease runs out, the step
  // is aborted on the stores (a's pending versions are gone), a spare worker takes b's
  // place and the step is redone.
  auto spare = std::make_unique<MemberWorker>(address);
  ASSERT_TRUE(a->WriteStep(aa, 1).ok());
  ASSERT_TRUE(a->Report(aa, 1).ok());
  ASSERT_TRUE(b->WriteStep(ab, 1).ok());
  b->Stop();
  v1::Assignment as = AssignmentOf(*spare);
  aa = AssignmentOf(*a, aa.assignment_version());
  EXPECT_EQ(as.committed_step(), 0);
  EXPECT_EQ(aa.placement().epoch(), 2);
  EXPECT_EQ(b->Report(ab, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(a->Report(ab, 1).status().code(), absl::StatusCode::kAborted);  // the void attempt
  for (int s = 0; s < 2; ++s) {
    for (int e = 0; e < 4; ++e) EXPECT_EQ(committed_version(s, 1, e), 0);
  }
  run_step({{a.get(), aa}, {spare.get(), as}}, 1);
  for (int s = 0; s < 2; ++s) {
    for (int e = 0; e < 4; ++e) EXPECT_EQ(committed_version(s, 1, e), 1) << s << " " << e;
  }

  // Step 2: the coordinator is killed after a's report. Restarted on the same address,
  // it gets its members back and voids the attempt; the redone step commits.
  ASSERT_TRUE(a->WriteStep(aa, 2).ok());
  ASSERT_TRUE(a->Report(aa, 2).ok());
  coordinator->Kill();
  coordinator = StartCoordinator(dir, 2, address);
  stub = Stub(coordinator->grpc_port);
  const int64_t before = aa.assignment_version();
  aa = AssignmentOf(*a, before);
  as = AssignmentOf(*spare, before);
  EXPECT_EQ(aa.committed_step(), 1);
  run_step({{a.get(), aa}, {spare.get(), as}}, 2);

  // Step 3 is the last: the job succeeds and its workers are released.
  run_step({{a.get(), aa}, {spare.get(), as}}, 3);
  EXPECT_EQ(job().state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_DOUBLE_EQ(job().last_loss(), 0.25);
  EXPECT_TRUE(Eventually([&] {
    auto got = a->Assignment();
    return got.ok() && got->job_id().empty();
  }));
  a->Stop();
  spare->Stop();
  for (auto& store : stores) EXPECT_EQ(store->Terminate(), 0) << store->Log();
  EXPECT_EQ(coordinator->Terminate(), 0) << coordinator->Log();
}

}  // namespace
}  // namespace pith::coordinator
