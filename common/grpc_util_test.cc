// A gRPC round trip through a generated pith.v1 stub, on an ephemeral loopback port, and
// the Status mapping at the RPC boundary.
#include "common/grpc_util.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "pith/v1/store.grpc.pb.h"

namespace pith {
namespace {

class FakeStoreService final : public v1::StoreService::Service {
 public:
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetStatsRequest*,
                        v1::StoreStats* reply) override {
    reply->set_store_id("store-1");
    reply->set_ram_bytes(4096);
    reply->set_blobs(3);
    return grpc::Status::OK;
  }
  grpc::Status StatBlob(grpc::ServerContext*, const v1::StatBlobRequest* request,
                        v1::BlobInfo* reply) override {
    if (request->key().job_id().empty()) {
      return ToGrpcStatus(absl::InvalidArgumentError("key.job_id is required"));
    }
    return ToGrpcStatus(absl::NotFoundError("no blob " + request->key().job_id()));
  }
};

TEST(GrpcUtilTest, RoundTripThroughAGeneratedStub) {
  FakeStoreService service;
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);

  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string((*server)->port()),
                                     grpc::InsecureChannelCredentials());
  auto stub = v1::StoreService::NewStub(channel);

  grpc::ClientContext ctx;
  v1::StoreStats stats;
  grpc::Status status = stub->GetStats(&ctx, v1::GetStatsRequest(), &stats);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(stats.store_id(), "store-1");
  EXPECT_EQ(stats.ram_bytes(), 4096u);
  EXPECT_EQ(stats.blobs(), 3u);

  // Errors keep their code and message across the wire.
  grpc::ClientContext ctx2;
  v1::StatBlobRequest request;
  request.mutable_key()->set_job_id("job-9");
  v1::BlobInfo info;
  absl::Status err = FromGrpcStatus(stub->StatBlob(&ctx2, request, &info));
  EXPECT_EQ(err.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(err.message(), "no blob job-9");

  grpc::ClientContext ctx3;
  err = FromGrpcStatus(stub->StatBlob(&ctx3, v1::StatBlobRequest(), &info));
  EXPECT_EQ(err.code(), absl::StatusCode::kInvalidArgument);

  // An RPC the service does not implement is UNIMPLEMENTED, not a hang.
  grpc::ClientContext ctx4;
  v1::CommitStepResponse commit;
  err = FromGrpcStatus(stub->CommitStep(&ctx4, v1::CommitStepRequest(), &commit));
  EXPECT_EQ(err.code(), absl::StatusCode::kUnimplemented);

  (*server)->Shutdown();
}

TEST(GrpcUtilTest, StatusCodesMapOneToOne) {
  for (int code = 0; code <= 16; ++code) {
    absl::Status s(static_cast<absl::StatusCode>(code), code == 0 ? "" : "msg");
    EXPECT_EQ(FromGrpcStatus(ToGrpcStatus(s)), s) << code;
  }
}

TEST(GrpcUtilTest, UnbindableAddressIsUnavailable) {
  FakeStoreService service;
  auto first = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
  ASSERT_TRUE(first.ok()) << first.status();
  FakeStoreService service2;
  auto second = GrpcServer::Start(
      {.listen_address = "127.0.0.1:" + std::to_string((*first)->port()), .services = {&service2}});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(GrpcServer::Start({.listen_address = "not an address", .services = {&service2}})
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(GrpcServer::Start({.listen_address = "127.0.0.1:0"}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pith
