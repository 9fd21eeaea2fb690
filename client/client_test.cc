// pith::Client against an in-process coordinator (job registry, scheduler and JobService
// on an ephemeral port): every call, their errors, the watch stream, and an unreachable
// coordinator reported within the deadline.
#include "client/client.h"

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <thread>

#include "common/grpc_util.h"
#include "common/job_spec_testing.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "pith/v1/store.grpc.pb.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/job_service.h"
#include "server/coordinator/store_control_testing.h"

namespace pith {
namespace {

using ::testing::HasSubstr;

class ClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/client_" + std::to_string(getpid());
    std::filesystem::remove_all(dir_);
    jobs_ = *coordinator::JobRegistry::Open(dir_);
    scheduler_ = std::make_unique<coordinator::Scheduler>(jobs_.get(), &members_, &heat_, &stores_);
    service_ = std::make_unique<coordinator::JobServiceImpl>(jobs_.get(), &members_, &heat_,
                                                             scheduler_.get());
    auto server =
        GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {service_.get()}});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    auto client = Client::Connect("127.0.0.1:" + std::to_string(server_->port()),
                                  security::TransportSecurity::Insecure());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }
  void TearDown() override {
    client_.reset();
    server_.reset();
    service_.reset();
    scheduler_.reset();
    jobs_.reset();
    std::filesystem::remove_all(dir_);
  }
  v1::JobSpec Spec() {
    v1::JobSpec spec;
    EXPECT_TRUE(
        google::protobuf::util::JsonStringToMessage(testing::kDesignExampleSpecJson, &spec).ok());
    return spec;
  }

  std::string dir_;
  coordinator::Membership members_{absl::Seconds(3)};
  coordinator::HeatRegistry heat_;
  coordinator::testing::NoStores stores_;
  std::unique_ptr<coordinator::JobRegistry> jobs_;
  std::unique_ptr<coordinator::Scheduler> scheduler_;
  std::unique_ptr<coordinator::JobServiceImpl> service_;
  std::unique_ptr<GrpcServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientTest, SubmitGetListCancelAndWatch) {
  auto job = client_->Submit(Spec());
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  auto got = client_->Get(job->job_id());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->spec().name(), "demo");
  auto all = client_->List();
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 1u);

  // Watch sees the pending job, then its cancellation, and returns.
  std::vector<v1::JobState> seen;
  std::thread cancel([&] {
    absl::SleepFor(absl::Milliseconds(200));
    EXPECT_TRUE(client_->Cancel(job->job_id(), "enough").ok());
  });
  ASSERT_TRUE(client_
                  ->Watch(job->job_id(),
                          [&](const v1::JobEvent& e) {
                            seen.push_back(e.state());
                            return true;
                          })
                  .ok());
  cancel.join();
  ASSERT_GE(seen.size(), 2u);
  EXPECT_EQ(seen.front(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(seen.back(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(client_->Cancel(job->job_id()).status().code(), absl::StatusCode::kFailedPrecondition);

  auto cluster = client_->ClusterStatus();
  ASSERT_TRUE(cluster.ok());
  EXPECT_EQ(cluster->stores_size(), 0);
}

TEST_F(ClientTest, ErrorsAreTheCoordinatorsNamedAndClear) {
  v1::JobSpec bad = Spec();
  bad.mutable_model()->set_n_head(3);
  auto r = client_->Submit(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("model.n_head"));
  EXPECT_EQ(client_->Get("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->ExpertHeat("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Checkpoint("nope", dir_).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->Watch("nope", [](const v1::JobEvent&) { return true; }).code(),
            absl::StatusCode::kNotFound);
}

TEST(ClientConnectTest, AnUnreachableCoordinatorIsUnavailableWithinTheDeadline) {
  const absl::Time start = absl::Now();
  auto client = Client::Connect("127.0.0.1:1", security::TransportSecurity::Insecure(),
                                absl::Milliseconds(500));
  EXPECT_EQ(client.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("127.0.0.1:1"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
}

// An address that serves gRPC but not the coordinator's API (a store's port, say): every
// call names the address and what it is not, rather than gRPC's empty UNIMPLEMENTED.
TEST(ClientConnectTest, AnotherServiceIsNamedAsNotTheCoordinator) {
  v1::StoreService::Service store;  // every method UNIMPLEMENTED: the API, not a store
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&store}});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "127.0.0.1:" + std::to_string((*server)->port());
  auto client = Client::Connect(address, security::TransportSecurity::Insecure());
  ASSERT_TRUE(client.ok()) << client.status();
  for (const absl::Status& s :
       {(*client)->List().status(), (*client)->Get("demo-1").status(),
        (*client)->Watch("demo-1", [](const v1::JobEvent&) { return true; })}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented);
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(address + " does not serve this call of the coordinator's API"));
  }
}

// A coordinator that streams a 3 MiB checkpoint in 1 MiB chunks.
class ThreeMiBCheckpoint final : public v1::JobService::Service {
 public:
  grpc::Status DownloadCheckpoint(grpc::ServerContext*, const v1::DownloadCheckpointRequest*,
                                  grpc::ServerWriter<v1::CheckpointChunk>* writer) override {
    for (int i = 0; i < 3; ++i) {
      v1::CheckpointChunk chunk;
      if (i == 0) {
        chunk.set_step(7);
        chunk.set_total_bytes(3 << 20);
      }
      chunk.set_data(std::string(1 << 20, static_cast<char>('a' + i)));
      if (!writer->Write(chunk)) return grpc::Status(grpc::StatusCode::CANCELLED, "gone");
    }
    return grpc::Status::OK;
  }
};

// A download onto a disk that fills (here a 1 MiB file-size limit, EFBIG) says which file
// and why, not the CANCELLED of the stream it then ends, and leaves no file behind; with
// room, the file is the stream's bytes.
TEST(ClientDownloadTest, AFullDiskIsNamedAndLeavesNothing) {
  ThreeMiBCheckpoint service;
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = Client::Connect("127.0.0.1:" + std::to_string((*server)->port()),
                                security::TransportSecurity::Insecure());
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string dir = ::testing::TempDir() + "/download_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";

  struct rlimit before;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto previous = ::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = before;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const auto full = (*client)->DownloadCheckpoint("demo-1", path, /*replace=*/false);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &before), 0);
  ::signal(SIGXFSZ, previous);
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
  EXPECT_THAT(std::string(full.status().message()),
              HasSubstr("cannot write " + path + " (3145728 bytes): File too large"));
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "a partial file was left";

  const auto whole = (*client)->DownloadCheckpoint("demo-1", path, /*replace=*/false);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->step(), 7);
  EXPECT_EQ(std::filesystem::file_size(path), 3u << 20);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pith
