// StoreServiceImpl: the gRPC adapter of the store's control plane. It converts between
// protos and BlobStore calls and Status codes; the logic lives in BlobStore.
//
// Thread safety: handlers run concurrently on gRPC threads; BlobStore is thread-safe and
// the peer client (for PullBlobs) is too.
#ifndef PITH_SERVER_STORE_STORE_SERVICE_H_
#define PITH_SERVER_STORE_STORE_SERVICE_H_

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "pith/v1/store.grpc.pb.h"
#include "security/authorize.h"
#include "server/store/blob_store.h"
#include "server/store/store_client.h"

namespace pith::store {

class StoreServiceImpl final : public v1::StoreService::Service {
 public:
  // `export_root`: where Checkpoint may write (ExportPath); empty: nowhere. `enforce`: the
  // server runs mutual TLS, and StorePolicy decides who may call.
  StoreServiceImpl(BlobStore* store, std::string ucx_address, std::string export_root = "",
                   bool enforce = false)
      : store_(store),
        ucx_address_(std::move(ucx_address)),
        export_root_(std::move(export_root)),
        policy_(StorePolicy(enforce)) {}

  // Only the coordinator changes what a store holds (commit, abort, delete, pull,
  // checkpoint); admins may also read (addresses, blobs, jobs, stats).
  static security::Policy StorePolicy(bool enforce);

  grpc::Status GetUcxAddress(grpc::ServerContext* context, const v1::GetUcxAddressRequest*,
                             v1::UcxAddress* reply) override;
  grpc::Status StatBlob(grpc::ServerContext* context, const v1::StatBlobRequest* request,
                        v1::BlobInfo* reply) override;
  grpc::Status ListBlobs(grpc::ServerContext* context, const v1::ListBlobsRequest* request,
                         v1::ListBlobsResponse* reply) override;
  grpc::Status PrepareStep(grpc::ServerContext* context, const v1::PrepareStepRequest* request,
                           v1::PrepareStepResponse* reply) override;
  grpc::Status CommitStep(grpc::ServerContext* context, const v1::CommitStepRequest* request,
                          v1::CommitStepResponse* reply) override;
  grpc::Status AbortStep(grpc::ServerContext* context, const v1::AbortStepRequest* request,
                         v1::AbortStepResponse* reply) override;
  grpc::Status DeleteBlob(grpc::ServerContext* context, const v1::DeleteBlobRequest* request,
                          v1::DeleteBlobResponse* reply) override;
  grpc::Status DeleteJob(grpc::ServerContext* context, const v1::DeleteJobRequest* request,
                         v1::DeleteJobResponse* reply) override;
  grpc::Status ListStoreJobs(grpc::ServerContext* context, const v1::ListStoreJobsRequest* request,
                             v1::ListStoreJobsResponse* reply) override;
  grpc::Status GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                        v1::StoreStats* reply) override;
  grpc::Status Checkpoint(grpc::ServerContext* context, const v1::CheckpointRequest* request,
                          v1::CheckpointResponse* reply) override;
  grpc::Status PullBlobs(grpc::ServerContext* context, const v1::PullBlobsRequest* request,
                         v1::PullBlobsResponse* reply) override;

 private:
  absl::StatusOr<StoreClient*> PeerClient();

  BlobStore* store_;
  std::string ucx_address_;
  const std::string export_root_;
  const security::Policy policy_;
  absl::Mutex mu_;
  std::unique_ptr<StoreClient> peers_ ABSL_GUARDED_BY(mu_);  // created on first pull
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_STORE_SERVICE_H_
