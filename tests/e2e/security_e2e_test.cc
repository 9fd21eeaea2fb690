// Mutual TLS and roles on real processes (a coordinator and a store, each with its own
// certificate): every call a stranger or the wrong role could make to take a cluster over
// is refused with one line, and changes nothing.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/time/clock.h"
#include "child_process.h"
#include "common/job_spec_testing.h"
#include "common/ucx_auth.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "pith/v1/job.grpc.pb.h"
#include "pith/v1/store.grpc.pb.h"
#include "security/tokens.h"
#include "server/store/store_client.h"
#include "test_tls.h"

namespace pith {
namespace {

using pith::security::Role;
using pith::testing::ChildProcess;
using pith::testing::TestTls;

class SecurityE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/security_e2e_" + std::to_string(getpid());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    tls_ = std::make_unique<TestTls>(dir_ + "/tls");
    coordinator_ = std::make_unique<ChildProcess>(
        PITH_COORDINATOR_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir_ + "/coordinator", tls_->CoordinatorFlag(),
                                 "--tokens_file=" + dir_ + "/tokens", "--max_jobs_per_user=2"},
        dir_ + "/coordinator.log");
    ASSERT_TRUE(coordinator_->WaitReady()) << coordinator_->Log();
    address_ = "127.0.0.1:" + std::to_string(coordinator_->grpc_port);
    store_ = std::make_unique<ChildProcess>(
        PITH_STORE_BINARY,
        std::vector<std::string>{"--listen=127.0.0.1:0", "--metrics_port=-1",
                                 "--data_dir=" + dir_ + "/store", "--coordinator=" + address_,
                                 "--export_root=" + dir_ + "/exports", tls_->MemberFlag("store0")},
        dir_ + "/store.log");
    ASSERT_TRUE(store_->WaitReady()) << store_->Log();
    store_address_ = "127.0.0.1:" + std::to_string(store_->grpc_port);
    ASSERT_TRUE(tls_->ok());
    const v1::MemberInfo store = Store();
    ASSERT_EQ(store.state(), v1::MEMBER_STATE_ALIVE);
    store_id_ = store.member_id();
  }

  // `name`'s credentials for the coordinator; ToStore: for the store.
  std::shared_ptr<grpc::ChannelCredentials> As(Role role, const std::string& name) {
    return tls_->Credentials(role, name);
  }
  std::shared_ptr<grpc::ChannelCredentials> ToStore(Role role, const std::string& name) {
    return tls_->Credentials(role, name, Role::kMember);
  }
  // TLS that checks the server but presents no certificate.
  std::shared_ptr<grpc::ChannelCredentials> Anonymous() {
    std::ifstream ca(dir_ + "/tls/ca.pem");
    grpc::SslCredentialsOptions options;
    options.pem_root_certs.assign(std::istreambuf_iterator<char>(ca), {});
    return grpc::SslCredentials(options);
  }
  std::unique_ptr<v1::JobService::Stub> Jobs(std::shared_ptr<grpc::ChannelCredentials> c) {
    return v1::JobService::NewStub(NewChannel(address_, std::move(c)));
  }
  std::unique_ptr<v1::CoordinatorService::Stub> Members(
      std::shared_ptr<grpc::ChannelCredentials> c) {
    return v1::CoordinatorService::NewStub(NewChannel(address_, std::move(c)));
  }
  std::unique_ptr<v1::StoreService::Stub> StoreStub(std::shared_ptr<grpc::ChannelCredentials> c) {
    return v1::StoreService::NewStub(NewChannel(store_address_, std::move(c)));
  }
  // A submit of DESIGN's example spec.
  static v1::SubmitJobRequest DesignSubmit() {
    v1::SubmitJobRequest submit;
    EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(pith::testing::kDesignExampleSpecJson,
                                                            submit.mutable_spec())
                    .ok());
    return submit;
  }
  // The store as the coordinator sees it (asked as an admin).
  v1::MemberInfo Store() {
    grpc::ClientContext ctx;
    v1::ClusterStatusResponse c;
    EXPECT_TRUE(
        Jobs(As(Role::kAdmin, "admin"))->ClusterStatus(&ctx, v1::ClusterStatusRequest(), &c).ok());
    return c.stores_size() == 1 ? c.stores(0) : v1::MemberInfo();
  }

  std::string dir_, address_, store_address_, store_id_;
  std::unique_ptr<TestTls> tls_;
  std::unique_ptr<ChildProcess> coordinator_, store_;
};

// One refusal: `code`, and a message that contains `says`.
#define EXPECT_REFUSED(call, code, says)                                                     \
  do {                                                                                       \
    grpc::ClientContext ctx;                                                                 \
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));           \
    const grpc::Status s = (call);                                                           \
    EXPECT_EQ(s.error_code(), grpc::StatusCode::code) << #call << ": " << s.error_message(); \
    EXPECT_NE(s.error_message().find(says), std::string::npos)                               \
        << #call << ": " << s.error_message();                                               \
  } while (0)

TEST_F(SecurityE2eTest, StrangersAndWrongRolesGetNothingAndChangeNothing) {
  v1::SubmitJobRequest submit;
  submit.mutable_spec()->set_name("intruder");
  v1::SubmitJobResponse submitted;
  v1::DrainStoreRequest drain;
  drain.set_store_id(store_id_);
  v1::DrainStoreResponse drained;
  v1::RegisterRequest as_store;
  as_store.mutable_member()->set_member_id(store_id_);
  as_store.mutable_member()->set_role(v1::MEMBER_ROLE_STORE);
  as_store.mutable_member()->set_grpc_address("127.0.0.1:1");
  v1::RegisterResponse registered;
  v1::CommitStepRequest commit;
  commit.set_job_id("any");
  commit.set_step(1ll << 62);
  v1::CommitStepResponse committed;
  v1::DeleteJobRequest del;
  del.set_job_id("any");
  v1::DeleteJobResponse deleted;
  v1::CheckpointRequest checkpoint;
  checkpoint.set_checkpoint_dir(dir_ + "/exports/x");
  v1::CheckpointResponse checkpointed;
  v1::ListJobsResponse jobs;

  // No certificate at all: UNAUTHENTICATED, on every service.
  EXPECT_REFUSED(Jobs(Anonymous())->ListJobs(&ctx, v1::ListJobsRequest(), &jobs), UNAUTHENTICATED,
                 "ListJobs: no client certificate");
  EXPECT_REFUSED(Members(Anonymous())->Register(&ctx, as_store, &registered), UNAUTHENTICATED,
                 "Register: no client certificate");
  EXPECT_REFUSED(StoreStub(Anonymous())->CommitStep(&ctx, commit, &committed), UNAUTHENTICATED,
                 "CommitStep: no client certificate");
  // Plaintext to a TLS port, the coordinator's or the store's: no connection.
  EXPECT_REFUSED(Jobs(grpc::InsecureChannelCredentials())->ListJobs(&ctx, {}, &jobs), UNAVAILABLE,
                 "");
  EXPECT_REFUSED(
      StoreStub(grpc::InsecureChannelCredentials())->CommitStep(&ctx, commit, &committed),
      UNAVAILABLE, "");

  // A worker's certificate cannot submit or drain.
  const auto worker = As(Role::kMember, "worker0");
  EXPECT_REFUSED(Jobs(worker)->SubmitJob(&ctx, submit, &submitted), PERMISSION_DENIED,
                 "SubmitJob needs the admin or user role; the caller is worker0 (member)");
  EXPECT_REFUSED(Members(worker)->DrainStore(&ctx, drain, &drained), PERMISSION_DENIED,
                 "DrainStore needs the admin role; the caller is worker0 (member)");
  // A user's cannot register or control a store.
  const auto user = As(Role::kUser, "alice");
  EXPECT_REFUSED(Members(user)->Register(&ctx, as_store, &registered), PERMISSION_DENIED,
                 "Register needs the member role; the caller is alice (user)");
  EXPECT_REFUSED(StoreStub(ToStore(Role::kUser, "alice"))->CommitStep(&ctx, commit, &committed),
                 PERMISSION_DENIED, "CommitStep needs the coordinator role");
  EXPECT_REFUSED(StoreStub(ToStore(Role::kUser, "alice"))->DeleteJob(&ctx, del, &deleted),
                 PERMISSION_DENIED, "DeleteJob needs the coordinator role");
  EXPECT_REFUSED(
      StoreStub(ToStore(Role::kUser, "alice"))->Checkpoint(&ctx, checkpoint, &checkpointed),
      PERMISSION_DENIED, "Checkpoint needs the coordinator role");
  // Nor may an admin commit: store control is the coordinator's alone.
  EXPECT_REFUSED(StoreStub(ToStore(Role::kAdmin, "admin"))->CommitStep(&ctx, commit, &committed),
                 PERMISSION_DENIED, "CommitStep needs the coordinator role");
  // A member cannot take another's id: register as it, heartbeat or deregister it.
  const auto intruder = As(Role::kMember, "intruder");
  EXPECT_REFUSED(Members(intruder)->Register(&ctx, as_store, &registered), PERMISSION_DENIED,
                 store_id_ + " is another member's id; the caller is intruder (member)");
  v1::HeartbeatRequest beat;
  beat.set_member_id(store_id_);
  v1::HeartbeatResponse beaten;
  EXPECT_REFUSED(Members(intruder)->Heartbeat(&ctx, beat, &beaten), PERMISSION_DENIED,
                 "another member's id");
  v1::DeregisterRequest leave;
  leave.set_member_id(store_id_);
  v1::DeregisterResponse left;
  EXPECT_REFUSED(Members(intruder)->Deregister(&ctx, leave, &left), PERMISSION_DENIED,
                 "another member's id");

  // Nothing changed: no job, the store alive, undrained, at its own address; no export.
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(Jobs(user)->ListJobs(&ctx, v1::ListJobsRequest(), &jobs).ok());  // a user reads
    EXPECT_EQ(jobs.jobs_size(), 0);
  }
  const v1::MemberInfo store = Store();
  EXPECT_EQ(store.member_id(), store_id_);
  EXPECT_EQ(store.state(), v1::MEMBER_STATE_ALIVE);
  EXPECT_EQ(store.grpc_address(), store_address_);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/exports/x"));
  {
    grpc::ClientContext ctx;
    v1::ListStoreJobsResponse held;
    ASSERT_TRUE(StoreStub(ToStore(Role::kAdmin, "admin"))
                    ->ListStoreJobs(&ctx, v1::ListStoreJobsRequest(), &held)
                    .ok());
    EXPECT_EQ(held.jobs_size(), 0);
  }
  EXPECT_EQ(store_->Terminate(), 0) << store_->Log();
  EXPECT_EQ(coordinator_->Terminate(), 0) << coordinator_->Log();
}

// Jobs belong to who submitted them: another user can neither read, watch, cancel, remove,
// export nor download one, nor see it listed; an admin reaches every job.
TEST_F(SecurityE2eTest, AUserReachesOnlyTheJobsItSubmitted) {
  const auto alice = As(Role::kUser, "alice"), bob = As(Role::kUser, "bob");
  const auto admin = As(Role::kAdmin, "admin");
  const v1::SubmitJobRequest submit = DesignSubmit();
  v1::SubmitJobResponse submitted;
  {
    grpc::ClientContext ctx;
    const grpc::Status s = Jobs(alice)->SubmitJob(&ctx, submit, &submitted);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const std::string id = submitted.job().job_id();
  EXPECT_EQ(submitted.job().owner(), "alice");
  const std::string says = "job " + id + " was not submitted by the caller, bob (user)";

  v1::GetJobRequest get;
  get.set_job_id(id);
  v1::Job job;
  EXPECT_REFUSED(Jobs(bob)->GetJob(&ctx, get, &job), PERMISSION_DENIED, "GetJob: " + says);
  v1::CancelJobRequest cancel;
  cancel.set_job_id(id);
  EXPECT_REFUSED(Jobs(bob)->CancelJob(&ctx, cancel, &job), PERMISSION_DENIED, "CancelJob: " + says);
  v1::RemoveJobRequest remove;
  remove.set_job_id(id);
  EXPECT_REFUSED(Jobs(bob)->RemoveJob(&ctx, remove, &job), PERMISSION_DENIED, "RemoveJob: " + says);
  v1::CheckpointJobRequest checkpoint;
  checkpoint.set_job_id(id);
  checkpoint.set_output_dir("stolen");
  v1::CheckpointJobResponse exported;
  EXPECT_REFUSED(Jobs(bob)->CheckpointJob(&ctx, checkpoint, &exported), PERMISSION_DENIED,
                 "CheckpointJob: " + says);
  v1::ExpertHeatRequest heat;
  heat.set_job_id(id);
  v1::ExpertHeatResponse heated;
  EXPECT_REFUSED(Jobs(bob)->ExpertHeat(&ctx, heat, &heated), PERMISSION_DENIED,
                 "ExpertHeat: " + says);
  // A stream refused: nothing read, then the refusal naming `method`.
  auto refused_stream = [&](auto open, auto item, const std::string& method) {
    grpc::ClientContext ctx;
    auto reader = open(&ctx);
    EXPECT_FALSE(reader->Read(&item));
    const grpc::Status s = reader->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
    EXPECT_NE(s.error_message().find(method + ": " + says), std::string::npos) << s.error_message();
  };
  v1::WatchJobRequest watch;
  watch.set_job_id(id);
  refused_stream([&](grpc::ClientContext* c) { return Jobs(bob)->WatchJob(c, watch); },
                 v1::JobEvent(), "WatchJob");
  v1::DownloadCheckpointRequest download;
  download.set_job_id(id);
  refused_stream([&](grpc::ClientContext* c) { return Jobs(bob)->DownloadCheckpoint(c, download); },
                 v1::CheckpointChunk(), "DownloadCheckpoint");
  get.set_job_id("no-such-job");  // an unknown job is unknown to everyone
  EXPECT_REFUSED(Jobs(bob)->GetJob(&ctx, get, &job), NOT_FOUND, "no-such-job");
  get.set_job_id(id);

  // Listed for its owner and an admin only; still pending: bob's cancel changed nothing.
  auto listed = [&](std::shared_ptr<grpc::ChannelCredentials> who) {
    grpc::ClientContext ctx;
    v1::ListJobsResponse jobs;
    EXPECT_TRUE(Jobs(std::move(who))->ListJobs(&ctx, v1::ListJobsRequest(), &jobs).ok());
    return jobs.jobs_size();
  };
  EXPECT_EQ(listed(bob), 0);
  EXPECT_EQ(listed(alice), 1);
  EXPECT_EQ(listed(admin), 1);
  for (const auto& who : {alice, admin}) {
    grpc::ClientContext ctx;
    ASSERT_TRUE(Jobs(who)->GetJob(&ctx, get, &job).ok());
    EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING);
  }
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(Jobs(alice)->CancelJob(&ctx, cancel, &job).ok());
    EXPECT_EQ(job.state(), v1::JOB_STATE_CANCELLED);
  }
  // Ended, it is still alice's alone to remove.
  EXPECT_REFUSED(Jobs(bob)->RemoveJob(&ctx, remove, &job), PERMISSION_DENIED, "RemoveJob: " + says);
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(Jobs(alice)->RemoveJob(&ctx, remove, &job).ok());
  }
  EXPECT_EQ(listed(alice), 0);
  // Removed, it is still not bob's to learn about (not even that it was removed).
  EXPECT_REFUSED(Jobs(bob)->GetJob(&ctx, get, &job), PERMISSION_DENIED, "GetJob: " + says);
  EXPECT_REFUSED(Jobs(alice)->GetJob(&ctx, get, &job), NOT_FOUND, "was removed (cancelled)");
  EXPECT_EQ(store_->Terminate(), 0) << store_->Log();
  EXPECT_EQ(coordinator_->Terminate(), 0) << coordinator_->Log();
}

// A user may have --max_jobs_per_user unfinished jobs at once: one more is refused with
// the count until one ends; other users and admins are not held by it.
TEST_F(SecurityE2eTest, AUserHasABoundedNumberOfUnfinishedJobs) {
  const v1::SubmitJobRequest submit = DesignSubmit();
  auto submit_as = [&](std::shared_ptr<grpc::ChannelCredentials> who, v1::Job* job) {
    grpc::ClientContext ctx;
    v1::SubmitJobResponse reply;
    const grpc::Status s = Jobs(std::move(who))->SubmitJob(&ctx, submit, &reply);
    *job = reply.job();
    return s;
  };
  const auto alice = As(Role::kUser, "alice");
  v1::Job first, job;
  ASSERT_TRUE(submit_as(alice, &first).ok());
  ASSERT_TRUE(submit_as(alice, &job).ok());
  EXPECT_REFUSED(submit_as(alice, &job), RESOURCE_EXHAUSTED,
                 "alice has 2 unfinished job(s), the most this coordinator allows a user "
                 "(--max_jobs_per_user=2)");
  ASSERT_TRUE(submit_as(As(Role::kUser, "bob"), &job).ok());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(submit_as(As(Role::kAdmin, "admin"), &job).ok());
  {
    grpc::ClientContext ctx;
    v1::CancelJobRequest cancel;
    cancel.set_job_id(first.job_id());
    ASSERT_TRUE(Jobs(alice)->CancelJob(&ctx, cancel, &job).ok());
  }
  EXPECT_TRUE(submit_as(alice, &job).ok());  // one ended: room for one more
}

// A watch opened with a bearer token ends when the token is revoked (or expires), not
// when the job does: every new call is refused at once, and so is a stream already open.
TEST_F(SecurityE2eTest, AWatchEndsWhenItsTokenIsRevoked) {
  const std::string tokens = dir_ + "/tokens";
  absl::StatusOr<std::string> token = security::AddToken(tokens, {Role::kUser, "erin"});
  ASSERT_TRUE(token.ok()) << token.status();
  absl::SleepFor(absl::Milliseconds(1100));  // the coordinator looks at the file once a second
  auto bearer = [&](grpc::ClientContext* ctx) {
    ctx->AddMetadata("authorization", "Bearer " + *token);
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  };
  const v1::SubmitJobRequest submit = DesignSubmit();
  v1::SubmitJobResponse submitted;
  {
    grpc::ClientContext ctx;
    bearer(&ctx);
    const grpc::Status s = Jobs(Anonymous())->SubmitJob(&ctx, submit, &submitted);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_EQ(submitted.job().owner(), "erin");
  grpc::ClientContext ctx;
  bearer(&ctx);
  v1::WatchJobRequest watch;
  watch.set_job_id(submitted.job().job_id());
  auto stub = Jobs(Anonymous());
  auto reader = stub->WatchJob(&ctx, watch);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));  // the job as it is: pending (no worker here)
  ASSERT_TRUE(security::RevokeTokens(tokens, "erin").ok());
  const absl::Time revoked = absl::Now();
  while (reader->Read(&event)) {
  }
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << s.error_message();
  EXPECT_NE(s.error_message().find("the bearer token is not valid"), std::string::npos)
      << s.error_message();
  EXPECT_LT(absl::Now() - revoked, absl::Seconds(10));
}

TEST_F(SecurityE2eTest, OneCertificateRegistersABoundedNumberOfMembers) {
  v1::RegisterResponse registered;
  const auto flood = As(Role::kMember, "flood");
  int refused = 0;
  for (int i = 0; i < 20; ++i) {
    v1::RegisterRequest join;
    join.mutable_member()->set_role(v1::MEMBER_ROLE_WORKER);
    join.mutable_member()->set_grpc_address("127.0.0.1:1");
    join.mutable_member()->set_identity("fake-" + std::to_string(i));
    grpc::ClientContext ctx;
    const grpc::Status s = Members(flood)->Register(&ctx, join, &registered);
    if (!s.ok()) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      ++refused;
    }
  }
  EXPECT_EQ(refused, 4);  // 16 identities, then no more
  EXPECT_EQ(store_->Terminate(), 0) << store_->Log();
  EXPECT_EQ(coordinator_->Terminate(), 0) << coordinator_->Log();
}

// The UCX data plane: a peer without the cluster's key (handed to members over mutual TLS
// when they register) gets no answer, not even to a put at version 2^62 that would block
// every real write of its key, and the store goes on serving holders of the key.
TEST_F(SecurityE2eTest, TheDataPlaneAnswersOnlyHoldersOfTheClusterKey) {
  v1::UcxAddress address;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(StoreStub(ToStore(Role::kAdmin, "admin"))
                    ->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address)
                    .ok());
  }
  v1::BlobKey key;
  key.set_job_id("victim");
  key.set_layer(0);
  key.set_expert(0);
  key.set_kind(v1::BLOB_KIND_WEIGHTS);
  const std::vector<uint8_t> bytes(4096, 7);
  ASSERT_FALSE(ucx::DataPlaneAuthActive());  // this process holds no key yet
  {
    auto stranger = store::StoreClient::Create();
    ASSERT_TRUE(stranger.ok()) << stranger.status();
    auto peer = (*stranger)->Connect(address.worker_address());
    ASSERT_TRUE(peer.ok()) << peer.status();
    auto put = (*stranger)->Put(*peer, key, int64_t{1} << 62, bytes.data(), bytes.size(), nullptr,
                                absl::Seconds(3));
    EXPECT_EQ(put.status().code(), absl::StatusCode::kDeadlineExceeded) << put.status();
  }
  {
    grpc::ClientContext ctx;
    v1::StatBlobRequest stat;
    *stat.mutable_key() = key;
    stat.set_version(int64_t{1} << 62);
    v1::BlobInfo info;
    EXPECT_EQ(StoreStub(ToStore(Role::kAdmin, "admin"))->StatBlob(&ctx, stat, &info).error_code(),
              grpc::StatusCode::NOT_FOUND)
        << "the stranger's put landed";
  }
  // A member gets the key when it registers; with it the store answers.
  v1::RegisterRequest join;
  join.mutable_member()->set_role(v1::MEMBER_ROLE_WORKER);
  join.mutable_member()->set_grpc_address("127.0.0.1:1");
  v1::RegisterResponse joined;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(Members(As(Role::kMember, "worker7"))->Register(&ctx, join, &joined).ok());
  }
  ASSERT_EQ(joined.data_plane_key().size(), ucx::kDataPlaneKeyBytes);
  ucx::SetDataPlaneKey(joined.data_plane_key());
  auto member = store::StoreClient::Create();
  ASSERT_TRUE(member.ok()) << member.status();
  auto peer = (*member)->Connect(address.worker_address());
  ASSERT_TRUE(peer.ok()) << peer.status();
  auto put = (*member)->Put(*peer, key, 1, bytes.data(), bytes.size(), nullptr, absl::Seconds(10));
  EXPECT_TRUE(put.ok()) << put.status();
  std::vector<uint8_t> back(bytes.size());
  store::StoreClient::FetchItem item;
  item.key = key;
  item.version = 1;
  item.buffer = back.data();
  item.capacity = back.size();
  EXPECT_TRUE((*member)->Fetch(*peer, absl::MakeSpan(&item, 1), absl::Seconds(10)).ok())
      << item.status;
  EXPECT_EQ(back, bytes);
  EXPECT_EQ(store_->Terminate(), 0) << store_->Log();
  EXPECT_EQ(coordinator_->Terminate(), 0) << coordinator_->Log();
}

}  // namespace
}  // namespace pith
