#include "server/coordinator/checkpoint_export.h"

#include <filesystem>
#include <map>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_names.h"
#include "common/file.h"
#include "common/param_layout.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {
namespace {

// A weights blob's key in the checkpoint: (layer, expert, dense tensor name).
using WeightsKey = std::tuple<int, int, std::string>;

// The live store holding the newest committed copy of a weights blob.
struct Best {
  int64_t version = -1;
  std::string store;
};

// The blob a checkpoint reads for an expert (or a dense tensor): its weights, but a bf16
// job's fp32 master for its experts (their weights blob is the bf16 form).
v1::BlobKind ExportKind(const v1::Job& job, bool expert) {
  return expert && job.spec().model().compute_dtype() == "bf16" ? v1::BLOB_KIND_MASTER
                                                                : v1::BLOB_KIND_WEIGHTS;
}

// Which live store holds the newest committed copy (at most `step`) of each weights blob.
std::map<WeightsKey, Best> NewestCopies(StoreControl& stores, const Alive& alive,
                                        const v1::Job& job, int64_t step) {
  std::map<WeightsKey, Best> best;
  for (const auto& [id, store] : alive.stores) {
    absl::StatusOr<std::vector<v1::BlobInfo>> listed =
        stores.ListGroup(store, job.job_id(), /*layer=*/-2, 0);
    if (!listed.ok()) {
      LOG(WARNING) << "checkpoint of " << job.job_id() << ": " << listed.status();
      continue;
    }
    for (const v1::BlobInfo& b : *listed) {
      if (b.key().kind() != ExportKind(job, b.key().layer() >= 0) || b.version() > step) continue;
      const auto key = std::make_tuple(b.key().layer(), b.key().layer() < 0 ? 0 : b.key().expert(),
                                       b.key().layer() < 0 ? b.key().tensor() : std::string());
      Best& slot = best[key];
      if (b.version() > slot.version) slot = {b.version(), id};
    }
  }
  return best;
}

// One weights blob of the checkpoint: where to read it, and the tensors it holds (a
// dense tensor, or an expert's four) at their offsets in it.
struct BlobPlan {
  v1::BlobKey key;
  Best from;
  int64_t floats = 0;
  std::vector<const model::ParamTensor*> tensors;
  int64_t base = 0;  // the layout offset of its first float
};

// Every weights blob of the model, in layout order, with the live store to read it from.
absl::StatusOr<std::vector<BlobPlan>> PlanBlobs(const model::ParamLayout& layout,
                                                const v1::Job& job,
                                                const std::map<WeightsKey, Best>& best) {
  std::vector<BlobPlan> plans;
  for (const model::ParamTensor& t : layout.tensors()) {
    const bool expert = t.layer >= 0;
    if (expert && !plans.empty() && plans.back().key.layer() == t.layer &&
        plans.back().key.expert() == t.expert) {
      plans.back().tensors.push_back(&t);  // one blob per expert
      continue;
    }
    BlobPlan p;
    p.key.set_job_id(job.job_id());
    p.key.set_kind(ExportKind(job, expert));
    p.key.set_layer(expert ? t.layer : -1);
    if (expert) {
      p.key.set_expert(t.expert);
    } else {
      p.key.set_tensor(t.name);
    }
    p.floats = expert ? layout.shape().expert_floats() : t.numel;
    p.base = t.offset;
    p.tensors.push_back(&t);
    auto it = best.find(std::make_tuple(p.key.layer(), p.key.expert(), p.key.tensor()));
    if (it == best.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job.job_id(), ": no live store holds the weights of ",
                       expert ? absl::StrCat("layer ", t.layer, " expert ", t.expert) : t.name));
    }
    p.from = it->second;
    plans.push_back(std::move(p));
  }
  return plans;
}

// Runs the reads, each batch from its store; every blob must be the version and size
// planned.
absl::Status FetchReads(StoreControl& stores, const Alive& alive,
                        std::map<std::string, std::vector<StoreControl::Read>>& reads) {
  for (auto& [store, batch] : reads) {
    RETURN_IF_ERROR(stores.Fetch(alive.stores.at(store), batch));
    for (const StoreControl::Read& r : batch) {
      if (r.info.version() != r.version) {
        return absl::AbortedError(
            absl::StrCat("a blob of layer ", r.key.layer(),
                         " changed version during the checkpoint; try again"));
      }
      if (r.info.size_bytes() != r.capacity) {
        return absl::DataLossError(absl::StrCat("blob of layer ", r.key.layer(), " (",
                                                r.key.tensor(), ") has ", r.info.size_bytes(),
                                                " bytes, the model wants ", r.capacity));
      }
    }
  }
  return absl::OkStatus();
}

// Reads `plans` a window of at most kExportWindowBytes at a time and writes each tensor at
// its offset in the file: the coordinator holds one window of the model, however large.
absl::Status StreamBlobs(StoreControl& stores, const Alive& alive,
                         const std::vector<BlobPlan>& plans, int fd,
                         const std::map<std::string, uint64_t>& offsets, const std::string& path) {
  constexpr int64_t kExportWindowBytes = 64 << 20;
  std::vector<float> window;
  for (size_t begin = 0; begin < plans.size();) {
    size_t end = begin;
    int64_t floats = 0;
    while (end < plans.size() &&
           (end == begin ||
            (floats + plans[end].floats) * int64_t{sizeof(float)} <= kExportWindowBytes)) {
      floats += plans[end++].floats;
    }
    window.resize(floats);
    std::map<std::string, std::vector<StoreControl::Read>> reads;  // by store
    int64_t at = 0;
    for (size_t i = begin; i < end; ++i) {
      StoreControl::Read read;
      read.key = plans[i].key;
      read.version = plans[i].from.version;
      read.buffer = window.data() + at;
      read.capacity = static_cast<size_t>(plans[i].floats) * sizeof(float);
      reads[plans[i].from.store].push_back(std::move(read));
      at += plans[i].floats;
    }
    RETURN_IF_ERROR(FetchReads(stores, alive, reads));
    at = 0;
    for (size_t i = begin; i < end; ++i) {
      for (const model::ParamTensor* t : plans[i].tensors) {
        const float* data = window.data() + at + (t->offset - plans[i].base);
        RETURN_IF_ERROR(PwriteAll(
            fd, {reinterpret_cast<const uint8_t*>(data), static_cast<size_t>(t->numel) * 4},
            offsets.at(t->name), path));
      }
      at += plans[i].floats;
    }
    begin = end;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::CheckpointJobResponse> ExportCheckpoint(StoreControl& stores, const Alive& alive,
                                                           const v1::Job& job,
                                                           const std::string& output_dir) {
  const int64_t step = job.committed_step();
  if (step < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.job_id(), " has no committed step yet"));
  }
  const model::ParamLayout layout(model::ModelShape::FromSpec(job.spec().model()));
  ASSIGN_OR_RETURN(const std::vector<BlobPlan> plans,
                   PlanBlobs(layout, job, NewestCopies(stores, alive, job, step)));
  std::error_code ec;
  std::filesystem::create_directories(output_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", output_dir, ": ", ec.message()));
  }
  const std::string path =
      absl::StrCat(output_dir, "/", model::CheckpointFileName(job.job_id(), step));
  std::string spec_json;
  google::protobuf::util::JsonPrintOptions json_options;
  json_options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(job.spec(), &spec_json, json_options);
  SafetensorsWriter writer;
  writer.SetMetadata(model::kSpecMetadataKey, spec_json);
  for (const model::ParamTensor& t : layout.tensors()) {
    // The bytes come later (WriteWith): a span of their size.
    RETURN_IF_ERROR(writer.Add(
        t.name, TensorView{DType::kF32, t.shape, {nullptr, static_cast<size_t>(t.numel) * 4}}));
  }
  RETURN_IF_ERROR(writer.WriteWith(
      path,
      [&](int fd, const std::map<std::string, uint64_t>& at) {
        return StreamBlobs(stores, alive, plans, fd, at, path);
      },
      /*replace=*/false));
  v1::CheckpointJobResponse response;
  response.set_step(step);
  response.set_weights_path(path);
  response.set_bytes(std::filesystem::file_size(path, ec));
  return response;
}

absl::StatusOr<v1::CheckpointJobResponse> Scheduler::Checkpoint(
    const v1::CheckpointJobRequest& request) {
  if (request.output_dir().empty()) return absl::InvalidArgumentError("output_dir is required");
  if (request.include_optimizer()) {
    return absl::UnimplementedError(
        "include_optimizer: exporting the optimizer state is not supported yet; export the "
        "weights only");
  }
  {
    absl::MutexLock lock(&mu_);  // no Remove from here on: its blobs stay while read
    ++exporting_[request.job_id()];
  }
  absl::Cleanup exported = [this, &request] {
    absl::MutexLock lock(&mu_);
    if (--exporting_[request.job_id()] == 0) exporting_.erase(request.job_id());
  };
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(request.job_id()));
  // Hold the job's commits (after any in progress) so every blob read is of one step.
  const bool held = HoldCommits(job.job_id());
  absl::StatusOr<v1::CheckpointJobResponse> out =
      [&]() -> absl::StatusOr<v1::CheckpointJobResponse> {
    ASSIGN_OR_RETURN(job, jobs_->Get(request.job_id()));
    return ExportCheckpoint(*stores_, Snapshot(*members_), job, request.output_dir());
  }();
  if (held) ReleaseCommits(job.job_id());
  return out;
}

}  // namespace pith::coordinator
