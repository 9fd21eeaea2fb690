// libFuzzer target: the store's gRPC handlers (StoreServiceImpl), called as the server
// calls them, on a fresh store per input (4 MiB RAM tier over an in-memory cold tier).
// An input is a sequence of up to 32 operations: a handler with a request of the fuzzer's
// bytes merged over a valid one, or a blob written as the data plane writes them. Every
// answer is OK or a named error (rpc_fuzz.h), and what a commit answers holds after it:
// the job is at that step, a prepared step is past the job's, the RAM tier never holds
// more than its budget, and a restart (the store opened again over its tier) keeps the
// committed step and brings back exactly the prepared versions.
//
// Not here: PullBlobs (it dials the source's UCX address; its address check is
// ucx_address_fuzz's), and the mutual-TLS policy (security/authorize_test).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "glog/logging.h"
#include "rpc_fuzz.h"
#include "server/store/blob_store.h"
#include "server/store/cold_tier.h"
#include "server/store/store_service.h"

namespace {

using pith::fuzz::CheckAnswer;
using pith::fuzz::Request;
using pith::fuzz::Require;
namespace v1 = pith::v1;

constexpr uint64_t kRamBytes = 4 << 20;

// Removed at exit (the string is never destroyed: the exit handler reads it).
const std::string& ExportRoot() {
  static const std::string* const path = [] {
    auto* p = new std::string("/tmp/pith_store_fuzz." + std::to_string(getpid()));
    std::atexit([] { std::filesystem::remove_all(ExportRoot()); });
    return p;
  }();
  return *path;
}

// Valid requests the fuzzer's bytes are merged over: job "j", expert (0, 1).
v1::BlobKey BaseKey() {
  v1::BlobKey key;
  key.set_job_id("j");
  key.set_layer(0);
  key.set_expert(1);
  key.set_kind(v1::BLOB_KIND_WEIGHTS);
  return key;
}

struct World {
  std::unique_ptr<uint8_t, decltype(&std::free)> arena{
      static_cast<uint8_t*>(std::aligned_alloc(4096, kRamBytes)), &std::free};
  pith::store::MemoryColdTier tier;  // outlives the store: a restart opens it again
  std::unique_ptr<pith::store::BlobStore> store;
  std::unique_ptr<pith::store::StoreServiceImpl> service;
};

// (Re)opens the store over the world's tier, as a restart after a process crash would.
void OpenStore(World& w) {
  w.service.reset();
  w.store.reset();
  pith::store::BlobStoreOptions options;
  options.ram_bytes = kRamBytes;
  options.max_blob_bytes = 1 << 20;
  auto store =
      pith::store::BlobStore::Open(options, pith::store::ForwardTo(&w.tier), w.arena.get());
  Require(store.ok(), "a store opens over what its tier holds");
  w.store = *std::move(store);
  w.service = std::make_unique<pith::store::StoreServiceImpl>(w.store.get(), "not-a-ucx-address",
                                                              ExportRoot());
}

// The store dies and starts again: the job keeps its committed step, and exactly the
// prepared versions come back pending.
void Restart(World& w) {
  const int64_t step = w.store->CommittedStep("j");
  OpenStore(w);
  Require(w.store->CommittedStep("j") == step, "a restart keeps the committed step");
  auto contents = w.tier.Load();
  Require(contents.ok(), "the tier loads");
  Require(w.store->Stats().pending_blobs() == contents->pending.size(),
          "a restart keeps the prepared versions pending, and no other");
}

// The step calls of RunOne: commit, abort and prepare (op 3, 4, 10).
void StepCall(World& w, FuzzedDataProvider& in, int op) {
  grpc::ServerContext ctx;
  pith::store::StoreServiceImpl& s = *w.service;
  switch (op) {
    case 3: {
      v1::CommitStepRequest base;
      base.set_job_id("j");
      base.set_step(in.ConsumeIntegralInRange<int64_t>(0, 8));
      v1::CommitStepRequest req = Request(base, in);
      v1::CommitStepResponse reply;
      grpc::Status st = s.CommitStep(&ctx, &req, &reply);
      CheckAnswer("CommitStep", st);
      if (st.ok()) {
        Require(reply.committed_step() == req.step(), "a commit answers the step asked");
        Require(w.store->CommittedStep(req.job_id()) == req.step(),
                "a job is at the step its commit answered");
      }
      return;
    }
    case 4: {
      v1::AbortStepRequest base;
      base.set_job_id("j");
      base.set_step(in.ConsumeIntegralInRange<int64_t>(0, 8));
      v1::AbortStepRequest req = Request(base, in);
      v1::AbortStepResponse reply;
      CheckAnswer("AbortStep", s.AbortStep(&ctx, &req, &reply));
      return;
    }
    case 10: {
      v1::PrepareStepRequest base;
      base.set_job_id("j");
      base.set_step(in.ConsumeIntegralInRange<int64_t>(0, 8));
      v1::PrepareStepRequest req = Request(base, in);
      v1::PrepareStepResponse reply;
      grpc::Status st = s.PrepareStep(&ctx, &req, &reply);
      CheckAnswer("PrepareStep", st);
      if (st.ok()) {
        Require(w.store->CommittedStep(req.job_id()) < req.step(),
                "a prepared step is one the job has not committed");
      }
      return;
    }
    default:
      return;
  }
}

// One operation of the input on `w`.
void RunOne(World& w, FuzzedDataProvider& in) {
  grpc::ServerContext ctx;
  pith::store::StoreServiceImpl& s = *w.service;
  const int op = in.ConsumeIntegralInRange(0, 12);
  switch (op) {
    case 0: {  // a write, as the data plane makes it (its own parser: data_plane_fuzz)
      v1::BlobKey key = Request(BaseKey(), in);
      const int64_t version = in.ConsumeIntegralInRange<int64_t>(-2, 8);
      const std::string bytes = in.ConsumeRandomLengthString(4096);
      (void)w.store->Put(key, version,
                         {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()});
      return;
    }
    case 1: {
      v1::StatBlobRequest req;
      *req.mutable_key() = Request(BaseKey(), in);
      req.set_version(in.ConsumeIntegralInRange<int64_t>(-3, 8));
      v1::BlobInfo reply;
      CheckAnswer("StatBlob", s.StatBlob(&ctx, &req, &reply));
      return;
    }
    case 2: {
      v1::ListBlobsRequest base;
      base.set_job_id("j");
      base.set_layer(-2);
      v1::ListBlobsRequest req = Request(base, in);
      v1::ListBlobsResponse reply;
      CheckAnswer("ListBlobs", s.ListBlobs(&ctx, &req, &reply));
      return;
    }
    case 3:
    case 4:
    case 10:
      return StepCall(w, in, op);
    case 5: {
      v1::DeleteBlobRequest req;
      *req.mutable_key() = Request(BaseKey(), in);
      v1::DeleteBlobResponse reply;
      CheckAnswer("DeleteBlob", s.DeleteBlob(&ctx, &req, &reply));
      return;
    }
    case 6: {
      v1::DeleteJobRequest base;
      base.set_job_id("j");
      v1::DeleteJobRequest req = Request(base, in);
      v1::DeleteJobResponse reply;
      CheckAnswer("DeleteJob", s.DeleteJob(&ctx, &req, &reply));
      return;
    }
    case 7: {
      v1::ListStoreJobsRequest req;
      v1::ListStoreJobsResponse reply;
      CheckAnswer("ListStoreJobs", s.ListStoreJobs(&ctx, &req, &reply));
      return;
    }
    case 8: {
      v1::GetStatsRequest req;
      v1::StoreStats reply;
      CheckAnswer("GetStats", s.GetStats(&ctx, &req, &reply));
      Require(reply.ram_bytes() <= reply.ram_capacity_bytes(), "the RAM tier keeps its budget");
      return;
    }
    case 9: {
      v1::CheckpointRequest base;
      base.set_export_job_id("j");
      base.set_export_path("j.safetensors");
      v1::CheckpointRequest req = Request(base, in);
      v1::CheckpointResponse reply;
      grpc::Status st = s.Checkpoint(&ctx, &req, &reply);
      // The in-memory tier has no RocksDB checkpoint to make: UNIMPLEMENTED, by design.
      if (st.error_code() != grpc::StatusCode::UNIMPLEMENTED) CheckAnswer("Checkpoint", st);
      return;
    }
    case 11:
      return Restart(w);
    default: {
      v1::GetUcxAddressRequest req;
      v1::UcxAddress reply;
      CheckAnswer("GetUcxAddress", s.GetUcxAddress(&ctx, &req, &reply));
      return;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pith::fuzz::QuietProtobuf();
  FLAGS_minloglevel = 3;  // the store logs what it refuses; the checks here judge it
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::filesystem::remove_all(ExportRoot());
  std::filesystem::create_directories(ExportRoot());
  FuzzedDataProvider in(data, size);
  auto world = std::make_unique<World>();
  OpenStore(*world);
  for (int op = 0; op < 32 && in.remaining_bytes() > 0; ++op) RunOne(*world, in);
  return 0;
}
