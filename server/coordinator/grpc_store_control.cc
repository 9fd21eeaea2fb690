#include "server/coordinator/grpc_store_control.h"

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_util.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/store.grpc.pb.h"
#include "server/store/store_client.h"

namespace pith::coordinator {
namespace {

class GrpcStoreControl final : public StoreControl {
 public:
  GrpcStoreControl(absl::Duration timeout, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : timeout_(timeout), credentials_(std::move(credentials)) {}

  absl::Status Fetch(const v1::MemberInfo& store, std::vector<Read>& reads) override {
    std::vector<store::StoreClient::FetchItem> items(reads.size());
    for (size_t i = 0; i < reads.size(); ++i) {
      items[i].key = reads[i].key;
      items[i].version = reads[i].version;
      items[i].buffer = reads[i].buffer;
      items[i].capacity = reads[i].capacity;
    }
    {
      absl::MutexLock lock(&mu_);
      if (client_ == nullptr) {
        ASSIGN_OR_RETURN(client_, store::StoreClient::Create());
      }
    }
    ASSIGN_OR_RETURN(int peer, client_->Connect(store.ucx_address()));
    absl::Status s = client_->Fetch(peer, absl::MakeSpan(items), timeout_ + absl::Minutes(1));
    for (size_t i = 0; i < reads.size(); ++i) reads[i].info = items[i].info;
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("store ", store.member_id(), ": ", s.message()));
    }
    return s;
  }

  absl::StatusOr<uint64_t> PrepareStep(const v1::MemberInfo& store, const std::string& job_id,
                                       int64_t step, int64_t attempt) override {
    v1::PrepareStepRequest request;
    request.set_job_id(job_id);
    request.set_step(step);
    request.set_attempt(attempt);
    v1::PrepareStepResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    RETURN_IF_ERROR(Annotate(Stub(store)->PrepareStep(&ctx, request, &reply), store));
    return reply.blobs_prepared();
  }

  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::MemberInfo& store,
                                                    const std::string& job_id, int64_t step,
                                                    int64_t attempt) override {
    v1::CommitStepRequest request;
    request.set_job_id(job_id);
    request.set_step(step);
    request.set_previous_step(step - 1);
    request.set_attempt(attempt);
    v1::CommitStepResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    RETURN_IF_ERROR(Annotate(Stub(store)->CommitStep(&ctx, request, &reply), store));
    return reply;
  }

  absl::Status AbortStep(const v1::MemberInfo& store, const std::string& job_id, int64_t step,
                         int64_t successor) override {
    v1::AbortStepRequest request;
    request.set_job_id(job_id);
    request.set_step(step);
    request.set_successor(successor);
    v1::AbortStepResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    return Annotate(Stub(store)->AbortStep(&ctx, request, &reply), store);
  }

  absl::StatusOr<std::vector<v1::BlobInfo>> ListGroup(const v1::MemberInfo& store,
                                                      const std::string& job_id, int layer,
                                                      int expert) override {
    std::vector<v1::BlobInfo> out;
    v1::ListBlobsRequest request;
    request.set_job_id(job_id);
    request.set_layer(layer);
    request.set_page_size(10000);
    do {
      v1::ListBlobsResponse reply;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
      RETURN_IF_ERROR(Annotate(Stub(store)->ListBlobs(&ctx, request, &reply), store));
      for (v1::BlobInfo& b : *reply.mutable_blobs()) {
        if (layer < 0 || b.key().expert() == expert) out.push_back(std::move(b));
      }
      request.set_page_token(reply.next_page_token());
    } while (!request.page_token().empty());
    return out;
  }

  absl::StatusOr<std::vector<v1::BlobInfo>> Pull(const v1::MemberInfo& target,
                                                 const v1::MemberInfo& source,
                                                 const std::vector<v1::BlobKey>& keys,
                                                 uint64_t max_bytes_per_second) override {
    v1::PullBlobsRequest request;
    request.set_source_store_id(source.member_id());
    request.set_source_ucx_address(source.ucx_address());
    for (const v1::BlobKey& k : keys) *request.add_keys() = k;
    request.set_max_bytes_per_second(max_bytes_per_second);
    v1::PullBlobsResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    RETURN_IF_ERROR(Annotate(Stub(target)->PullBlobs(&ctx, request, &reply), target));
    return std::vector<v1::BlobInfo>(reply.pulled().begin(), reply.pulled().end());
  }

  absl::StatusOr<std::vector<v1::StoreJob>> ListJobs(const v1::MemberInfo& store) override {
    v1::ListStoreJobsResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    RETURN_IF_ERROR(
        Annotate(Stub(store)->ListStoreJobs(&ctx, v1::ListStoreJobsRequest(), &reply), store));
    return std::vector<v1::StoreJob>(reply.jobs().begin(), reply.jobs().end());
  }

  absl::Status DeleteJob(const v1::MemberInfo& store,
                         const v1::DeleteJobRequest& request) override {
    v1::DeleteJobResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    return Annotate(Stub(store)->DeleteJob(&ctx, request, &reply), store);
  }

 private:
  std::unique_ptr<v1::StoreService::Stub> Stub(const v1::MemberInfo& store) {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<grpc::Channel>& channel = channels_[store.grpc_address()];
    if (channel == nullptr) {
      channel = NewChannel(store.grpc_address(), credentials_);
    }
    return v1::StoreService::NewStub(channel);
  }

  static absl::Status Annotate(const grpc::Status& s, const v1::MemberInfo& store) {
    absl::Status status = FromGrpcStatus(s);
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat("store ", store.member_id(), " (",
                                                    store.grpc_address(), "): ", status.message()));
  }

  const absl::Duration timeout_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<store::StoreClient> client_;  // set once under mu_, thread-safe after
};

}  // namespace

std::unique_ptr<StoreControl> NewGrpcStoreControl(
    absl::Duration timeout, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  return std::make_unique<GrpcStoreControl>(timeout, std::move(credentials));
}

}  // namespace pith::coordinator
