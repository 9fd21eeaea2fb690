#include "server/store/store_service.h"

#include <chrono>
#include <filesystem>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_names.h"
#include "common/export_path.h"
#include "common/grpc_util.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/ucx.h"
#include "server/store/blob_key.h"

namespace pith::store {
security::Policy StoreServiceImpl::StorePolicy(bool enforce) {
  using security::Role;
  std::map<std::string, std::set<Role>> rules;
  for (const char* method : {"PrepareStep", "CommitStep", "AbortStep", "DeleteBlob", "DeleteJob",
                             "Checkpoint", "PullBlobs"}) {
    rules[method] = {Role::kCoordinator};
  }
  for (const char* method :
       {"GetUcxAddress", "StatBlob", "ListBlobs", "ListStoreJobs", "GetStats"}) {
    rules[method] = {Role::kCoordinator, Role::kAdmin};
  }
  return security::Policy(enforce, std::move(rules));
}

grpc::Status StoreServiceImpl::GetUcxAddress(grpc::ServerContext* context,
                                             const v1::GetUcxAddressRequest*,
                                             v1::UcxAddress* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "GetUcxAddress"); !denied.ok()) return denied;
  reply->set_worker_address(ucx_address_);
  reply->set_transports(ucx::Transports());
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::StatBlob(grpc::ServerContext* context,
                                        const v1::StatBlobRequest* request, v1::BlobInfo* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "StatBlob"); !denied.ok()) return denied;
  absl::StatusOr<v1::BlobInfo> info = store_->Stat(request->key(), request->version());
  if (!info.ok()) return ToGrpcStatus(info.status());
  *reply = *info;
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::ListBlobs(grpc::ServerContext* context,
                                         const v1::ListBlobsRequest* request,
                                         v1::ListBlobsResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "ListBlobs"); !denied.ok()) return denied;
  std::string after;
  if (!request->page_token().empty() &&
      !absl::WebSafeBase64Unescape(request->page_token(), &after)) {
    return ToGrpcStatus(absl::InvalidArgumentError("malformed page_token"));
  }
  if (request->layer() < -2) return ToGrpcStatus(absl::InvalidArgumentError("layer must be >= -2"));
  const int limit = request->page_size() > 0 ? std::min(request->page_size(), 10000) : 1000;
  std::string next;
  absl::StatusOr<std::vector<v1::BlobInfo>> blobs =
      store_->List(request->job_id(), request->layer(), after, limit, &next);
  if (!blobs.ok()) return ToGrpcStatus(blobs.status());
  for (v1::BlobInfo& b : *blobs) *reply->add_blobs() = std::move(b);
  if (!next.empty()) reply->set_next_page_token(absl::WebSafeBase64Escape(next));
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::PrepareStep(grpc::ServerContext* context,
                                           const v1::PrepareStepRequest* request,
                                           v1::PrepareStepResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "PrepareStep"); !denied.ok()) return denied;
  absl::StatusOr<uint64_t> n =
      store_->PrepareStep(request->job_id(), request->step(), request->attempt());
  if (!n.ok()) return ToGrpcStatus(n.status());
  reply->set_blobs_prepared(*n);
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::CommitStep(grpc::ServerContext* context,
                                          const v1::CommitStepRequest* request,
                                          v1::CommitStepResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "CommitStep"); !denied.ok()) return denied;
  absl::StatusOr<BlobStore::CommitResult> r = store_->CommitStep(
      request->job_id(), request->step(),
      request->has_previous_step() ? std::optional<int64_t>(request->previous_step())
                                   : std::nullopt,
      request->has_attempt() ? std::optional<int64_t>(request->attempt()) : std::nullopt);
  if (!r.ok()) return ToGrpcStatus(r.status());
  reply->set_committed_step(r->committed_step);
  reply->set_blobs_committed(r->blobs_committed);
  reply->set_already_committed(r->already);
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::AbortStep(grpc::ServerContext* context,
                                         const v1::AbortStepRequest* request,
                                         v1::AbortStepResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "AbortStep"); !denied.ok()) return denied;
  absl::StatusOr<uint64_t> n =
      store_->AbortStep(request->job_id(), request->step(), request->successor());
  if (!n.ok()) return ToGrpcStatus(n.status());
  reply->set_blobs_discarded(*n);
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::DeleteBlob(grpc::ServerContext* context,
                                          const v1::DeleteBlobRequest* request,
                                          v1::DeleteBlobResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "DeleteBlob"); !denied.ok()) return denied;
  absl::StatusOr<uint64_t> bytes = store_->DeleteBlob(request->key());
  if (!bytes.ok()) return ToGrpcStatus(bytes.status());
  reply->set_bytes_freed(*bytes);
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::DeleteJob(grpc::ServerContext* context,
                                         const v1::DeleteJobRequest* request,
                                         v1::DeleteJobResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "DeleteJob"); !denied.ok()) return denied;
  BlobStore::DeleteScope scope;
  scope.keep_weights = request->keep_weights();
  if (request->has_layer()) scope.group = {request->layer(), request->expert()};
  auto r = store_->DeleteJob(request->job_id(), scope);
  if (!r.ok()) return ToGrpcStatus(r.status());
  reply->set_blobs_deleted(r->first);
  reply->set_bytes_freed(r->second);
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::ListStoreJobs(grpc::ServerContext* context,
                                             const v1::ListStoreJobsRequest*,
                                             v1::ListStoreJobsResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "ListStoreJobs"); !denied.ok()) return denied;
  for (v1::StoreJob& job : store_->Jobs()) *reply->add_jobs() = std::move(job);
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::GetStats(grpc::ServerContext* context, const v1::GetStatsRequest*,
                                        v1::StoreStats* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "GetStats"); !denied.ok()) return denied;
  *reply = store_->Stats();
  return grpc::Status::OK;
}

grpc::Status StoreServiceImpl::Checkpoint(grpc::ServerContext* context,
                                          const v1::CheckpointRequest* request,
                                          v1::CheckpointResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "Checkpoint"); !denied.ok()) return denied;
  if (request->checkpoint_dir().empty() && request->export_job_id().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("give checkpoint_dir, export_job_id, or both"));
  }
  if (!request->checkpoint_dir().empty()) {
    absl::StatusOr<ExportPath> dir = ExportPath::NewEntry(export_root_, request->checkpoint_dir());
    if (!dir.ok()) return ToGrpcStatus(dir.status());
    absl::Status s = store_->cold().Checkpoint(dir->path());
    if (!s.ok()) return ToGrpcStatus(s);
    reply->set_checkpoint_dir(dir->shown());
  }
  if (!request->export_job_id().empty()) {
    if (request->export_path().empty()) {
      return ToGrpcStatus(absl::InvalidArgumentError("export_path is required with export_job_id"));
    }
    absl::StatusOr<ExportPath> file = ExportPath::NewEntry(export_root_, request->export_path());
    if (!file.ok()) return ToGrpcStatus(file.status());
    // Pin every committed blob of the job, then write them in one safetensors file.
    std::vector<BlobRef> refs;
    SafetensorsWriter writer;
    std::string after, next;
    uint64_t bytes = 0;
    do {
      auto page = store_->List(request->export_job_id(), -2, after, 1000, &next);
      if (!page.ok()) return ToGrpcStatus(page.status());
      for (const v1::BlobInfo& info : *page) {
        absl::StatusOr<BlobRef> ref = store_->Get(info.key(), info.version());
        if (!ref.ok()) return ToGrpcStatus(ref.status());
        const bool f32 = ref->size() % 4 == 0;
        TensorView view{f32 ? DType::kF32 : DType::kU8,
                        {static_cast<int64_t>(ref->size() / (f32 ? 4 : 1))},
                        {ref->data(), ref->size()}};
        absl::Status s = writer.Add(model::ExportTensorName(info.key()), view);
        if (!s.ok()) return ToGrpcStatus(s);
        bytes += ref->size();
        refs.push_back(*std::move(ref));
      }
      after = next;
    } while (!next.empty());
    const int64_t step = store_->CommittedStep(request->export_job_id());
    writer.SetMetadata(std::string(kSafetensorsStepKey), absl::StrCat(step));
    absl::Status s = writer.Write(file->path(), /*replace=*/false);
    if (!s.ok()) return ToGrpcStatus(s);
    reply->set_export_path(file->shown());
    reply->set_step(step);
    reply->set_bytes(bytes);
  }
  return grpc::Status::OK;
}

absl::StatusOr<StoreClient*> StoreServiceImpl::PeerClient() {
  absl::MutexLock lock(&mu_);
  if (!peers_) {
    ASSIGN_OR_RETURN(peers_, StoreClient::Create());
  }
  return peers_.get();
}

grpc::Status StoreServiceImpl::PullBlobs(grpc::ServerContext* context,
                                         const v1::PullBlobsRequest* request,
                                         v1::PullBlobsResponse* reply) {
  if (grpc::Status denied = policy_.Admit(*context, "PullBlobs"); !denied.ok()) return denied;
  if (request->source_ucx_address().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("source_ucx_address is required"));
  }
  absl::StatusOr<StoreClient*> client = PeerClient();
  if (!client.ok()) return ToGrpcStatus(client.status());
  absl::StatusOr<int> peer = (*client)->Connect(request->source_ucx_address());
  if (!peer.ok()) return ToGrpcStatus(peer.status());
  absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> buffer =
      // Room for the largest blob, of which a pull mostly touches far less.
      (*client)->AllocateBuffer(store_->options().max_blob_bytes, /*fault_in=*/false);
  if (!buffer.ok()) return ToGrpcStatus(buffer.status());
  const auto start = std::chrono::steady_clock::now();
  uint64_t moved = 0;
  for (const v1::BlobKey& key : request->keys()) {
    if (context->IsCancelled()) return ToGrpcStatus(absl::CancelledError("pull cancelled"));
    StoreClient::FetchItem item;
    item.key = key;
    item.buffer = (*buffer)->data();
    item.capacity = (*buffer)->size();
    item.memh = (*buffer)->handle();
    absl::Status s = (*client)->Fetch(*peer, absl::MakeSpan(&item, 1));
    if (!s.ok()) return ToGrpcStatus(Annotate(s, BlobKeyDebugString(key)));
    absl::StatusOr<v1::BlobInfo> info = store_->InstallCommitted(
        key, item.info.version(), {(*buffer)->data(), item.info.size_bytes()});
    // A newer version committed here meanwhile (this store is joining the blob's group and
    // receives its writes): nothing to copy.
    if (absl::IsFailedPrecondition(info.status())) continue;
    if (!info.ok()) return ToGrpcStatus(info.status());
    if (info->crc32c() != item.info.crc32c()) {
      return ToGrpcStatus(absl::DataLossError(
          absl::StrCat(BlobKeyDebugString(key), ": checksum changed in transit")));
    }
    *reply->add_pulled() = *info;
    moved += item.info.size_bytes();
    // Throttle so that training fetches keep priority.
    if (request->max_bytes_per_second() > 0) {
      const auto due = start + std::chrono::duration<double>(static_cast<double>(moved) /
                                                             request->max_bytes_per_second());
      std::this_thread::sleep_until(due);
    }
  }
  return grpc::Status::OK;
}

}  // namespace pith::store
