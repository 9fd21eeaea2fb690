#include "server/coordinator/checkpoint_export.h"

#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_names.h"
#include "common/param_layout.h"
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
      if (b.key().kind() != v1::BLOB_KIND_WEIGHTS || b.version() > step) continue;
      const auto key = std::make_tuple(b.key().layer(), b.key().layer() < 0 ? 0 : b.key().expert(),
                                       b.key().layer() < 0 ? b.key().tensor() : std::string());
      Best& slot = best[key];
      if (b.version() > slot.version) slot = {b.version(), id};
    }
  }
  return best;
}

// One read per weights blob into its place in `host`, batched by the store to read from.
absl::StatusOr<std::map<std::string, std::vector<StoreControl::Read>>> PlanReads(
    const model::ParamLayout& layout, const v1::Job& job, const std::map<WeightsKey, Best>& best,
    std::vector<float>& host) {
  std::map<std::string, std::vector<StoreControl::Read>> reads;  // by store
  std::set<std::pair<int, int>> experts;
  for (const model::ParamTensor& t : layout.tensors()) {
    v1::BlobKey key;
    key.set_job_id(job.job_id());
    key.set_kind(v1::BLOB_KIND_WEIGHTS);
    int64_t offset = t.offset, floats = t.numel;
    if (t.layer < 0) {
      key.set_layer(-1);
      key.set_tensor(t.name);
    } else {
      if (!experts.insert({t.layer, t.expert}).second) continue;  // one blob per expert
      key.set_layer(t.layer);
      key.set_expert(t.expert);
      floats = layout.shape().expert_floats();
    }
    auto it = best.find(std::make_tuple(key.layer(), key.expert(), key.tensor()));
    if (it == best.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job.job_id(), ": no live store holds the weights of ",
          t.layer < 0 ? t.name : absl::StrCat("layer ", t.layer, " expert ", t.expert)));
    }
    StoreControl::Read read;
    read.key = key;
    read.version = it->second.version;
    read.buffer = host.data() + offset;
    read.capacity = static_cast<size_t>(floats) * sizeof(float);
    reads[it->second.store].push_back(std::move(read));
  }
  return reads;
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

// Writes `host` (step `step` of `job`) as the safetensors file, the spec in its metadata.
absl::StatusOr<v1::CheckpointJobResponse> WriteWeights(const model::ParamLayout& layout,
                                                       const std::vector<float>& host,
                                                       const v1::Job& job, int64_t step,
                                                       const std::string& output_dir) {
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
  RETURN_IF_ERROR(
      model::SaveHostWeights(layout, host.data(), path, {{model::kSpecMetadataKey, spec_json}}));
  v1::CheckpointJobResponse response;
  response.set_step(step);
  response.set_weights_path(path);
  response.set_bytes(std::filesystem::file_size(path, ec));
  return response;
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
  const std::map<WeightsKey, Best> best = NewestCopies(stores, alive, job, step);
  std::vector<float> host(layout.total_floats());
  ASSIGN_OR_RETURN(auto reads, PlanReads(layout, job, best, host));
  RETURN_IF_ERROR(FetchReads(stores, alive, reads));
  return WriteWeights(layout, host, job, step, output_dir);
}

absl::StatusOr<v1::CheckpointJobResponse> Scheduler::Checkpoint(
    const v1::CheckpointJobRequest& request) {
  if (request.output_dir().empty()) return absl::InvalidArgumentError("output_dir is required");
  if (request.include_optimizer()) {
    return absl::UnimplementedError(
        "include_optimizer: exporting the optimizer state is not supported yet; export the "
        "weights only");
  }
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
