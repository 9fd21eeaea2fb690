#include "worker/model/checkpoint.h"

#include <cstring>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_names.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "pith/v1/spec.pb.h"

namespace pith::model {
namespace {

absl::StatusOr<std::vector<float>> ToHost(compute::Backend& backend, const ParamLayout& layout,
                                          const float* arena) {
  std::vector<float> host(layout.total_floats());
  RETURN_IF_ERROR(backend.CopyToHost(host.data(), arena, host.size() * sizeof(float)));
  return host;
}

// The optimizer file's tensor prefixes, the AdamW moments' names in every export.
std::string MomentM() { return std::string(KindPrefix(v1::BLOB_KIND_ADAM_M)); }
std::string MomentV() { return std::string(KindPrefix(v1::BLOB_KIND_ADAM_V)); }

TensorView ViewOf(const float* host, const ParamTensor& t) {
  return TensorView{DType::kF32,
                    t.shape,
                    {reinterpret_cast<const uint8_t*>(host + t.offset),
                     static_cast<size_t>(t.numel) * sizeof(float)}};
}
TensorView ViewOf(const std::vector<float>& host, const ParamTensor& t) {
  return ViewOf(host.data(), t);
}

// Copies the tensors named prefix + <layout name> from `file` into a host arena.
absl::Status ReadTensors(const ParamLayout& layout, const SafetensorsFile& file,
                         const std::string& prefix, float* host) {
  for (const ParamTensor& t : layout.tensors()) {
    const std::string name = prefix + t.name;
    absl::StatusOr<TensorView> v = file.Get(name);
    if (!v.ok()) return absl::InvalidArgumentError(absl::StrCat("missing tensor \"", name, "\""));
    if (v->dtype != DType::kF32 || v->shape != t.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", name, "\" is ", DTypeName(v->dtype), " ", ShapeString(v->shape),
                       ", the model needs F32 ", ShapeString(t.shape)));
    }
    std::memcpy(host + t.offset, v->bytes.data(), v->bytes.size());
  }
  return absl::OkStatus();
}

// After ReadTensors found every expected tensor: fails on the first one the model lacks.
absl::Status CheckNoExtraTensors(const ParamLayout& layout,
                                 const std::vector<SafetensorsEntry>& entries,
                                 const std::vector<std::string>& prefixes) {
  if (entries.size() == layout.tensors().size() * prefixes.size()) return absl::OkStatus();
  absl::flat_hash_set<std::string> known;
  for (const std::string& prefix : prefixes) {
    for (const ParamTensor& t : layout.tensors()) known.insert(prefix + t.name);
  }
  for (const SafetensorsEntry& e : entries) {
    if (!known.contains(e.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", e.name, "\" is not part of this model"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveWeights(compute::Backend& backend, const ParamLayout& layout, const float* arena,
                         const std::string& path) {
  ASSIGN_OR_RETURN(std::vector<float> host, ToHost(backend, layout, arena));
  return SaveHostWeights(layout, host.data(), path);
}

absl::Status LoadWeights(compute::Backend& backend, const ParamLayout& layout,
                         const SafetensorsFile& file, float* arena) {
  std::vector<float> host(layout.total_floats());
  RETURN_IF_ERROR(ReadTensors(layout, file, "", host.data()));
  RETURN_IF_ERROR(CheckNoExtraTensors(layout, file.entries(), {""}));
  return backend.CopyToDevice(arena, host.data(), host.size() * sizeof(float));
}

absl::Status LoadDenseWeights(compute::Backend& backend, const ParamLayout& layout,
                              const SafetensorsReader& file, float* arena) {
  // Every tensor must be there, as the model shapes it (the experts' are read later, one
  // expert at a time).
  for (const ParamTensor& t : layout.tensors()) {
    absl::StatusOr<const SafetensorsEntry*> e = file.Find(t.name);
    if (!e.ok()) return absl::InvalidArgumentError(absl::StrCat("missing tensor \"", t.name, "\""));
    if ((*e)->dtype != DType::kF32 || (*e)->shape != t.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor \"", t.name, "\" is ", DTypeName((*e)->dtype), " ",
                       ShapeString((*e)->shape), ", the model needs F32 ", ShapeString(t.shape)));
    }
  }
  RETURN_IF_ERROR(CheckNoExtraTensors(layout, file.entries(), {""}));
  std::vector<float> host(layout.dense_floats());
  for (const ParamTensor& t : layout.tensors()) {
    if (t.layer >= 0) continue;
    RETURN_IF_ERROR(file.Read(t.name, {reinterpret_cast<uint8_t*>(host.data() + t.offset),
                                       static_cast<size_t>(t.numel) * sizeof(float)}));
  }
  return backend.CopyToDevice(arena, host.data(), host.size() * sizeof(float));
}

absl::Status ReadExpertWeights(const ParamLayout& layout, const SafetensorsReader& file, int layer,
                               int expert, float* out) {
  const int64_t base = layout.ExpertOffset(layer, expert);
  const int first = layout.ExpertTensorIndex(layer, expert);
  for (int i = first; i < first + 4; ++i) {
    const ParamTensor& t = layout.tensors()[i];
    RETURN_IF_ERROR(file.Read(t.name, {reinterpret_cast<uint8_t*>(out + (t.offset - base)),
                                       static_cast<size_t>(t.numel) * sizeof(float)}));
  }
  return absl::OkStatus();
}

absl::Status SaveOptimizer(compute::Backend& backend, const ParamLayout& layout,
                           const AdamWOptimizer& optimizer, int64_t step, const std::string& path) {
  ASSIGN_OR_RETURN(std::vector<float> m, ToHost(backend, layout, optimizer.m()));
  ASSIGN_OR_RETURN(std::vector<float> v, ToHost(backend, layout, optimizer.v()));
  SafetensorsWriter writer;
  const std::vector<ParamTensor>& tensors = layout.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    RETURN_IF_ERROR(writer.Add(MomentM() + tensors[i].name, ViewOf(m, tensors[i])));
    RETURN_IF_ERROR(writer.Add(MomentV() + tensors[i].name, ViewOf(v, tensors[i])));
    writer.SetMetadata("count." + tensors[i].name, absl::StrCat(optimizer.update_counts()[i]));
  }
  writer.SetMetadata(std::string(kSafetensorsStepKey), absl::StrCat(step));
  return writer.Write(path);
}

absl::StatusOr<int64_t> LoadOptimizer(compute::Backend& backend, const ParamLayout& layout,
                                      const SafetensorsFile& file, AdamWOptimizer& optimizer) {
  std::vector<float> m(layout.total_floats()), v(layout.total_floats());
  RETURN_IF_ERROR(ReadTensors(layout, file, MomentM(), m.data()));
  RETURN_IF_ERROR(ReadTensors(layout, file, MomentV(), v.data()));
  RETURN_IF_ERROR(CheckNoExtraTensors(layout, file.entries(), {MomentM(), MomentV()}));
  auto step_it = file.metadata().find(std::string(kSafetensorsStepKey));
  int64_t step = 0;
  if (step_it == file.metadata().end() || !absl::SimpleAtoi(step_it->second, &step) || step < 0) {
    return absl::InvalidArgumentError("optimizer file has no valid \"step\" in __metadata__");
  }
  std::vector<int64_t> counts(layout.tensors().size(), 0);
  for (size_t i = 0; i < counts.size(); ++i) {
    auto it = file.metadata().find("count." + layout.tensors()[i].name);
    if (it == file.metadata().end() || !absl::SimpleAtoi(it->second, &counts[i]) || counts[i] < 0 ||
        counts[i] > step) {
      return absl::InvalidArgumentError(
          absl::StrCat("optimizer file has no valid count for \"", layout.tensors()[i].name, "\""));
    }
  }
  RETURN_IF_ERROR(backend.CopyToDevice(optimizer.m(), m.data(), m.size() * sizeof(float)));
  RETURN_IF_ERROR(backend.CopyToDevice(optimizer.v(), v.data(), v.size() * sizeof(float)));
  optimizer.update_counts() = std::move(counts);
  return step;
}

absl::Status CheckInitModel(const std::map<std::string, std::string>& metadata,
                            const v1::ModelConfig& model) {
  auto it = metadata.find(kSpecMetadataKey);
  if (it == metadata.end()) return absl::OkStatus();
  v1::JobSpec recorded;
  google::protobuf::util::JsonParseOptions lenient;
  lenient.ignore_unknown_fields = true;  // a newer Pith's fields
  if (!google::protobuf::util::JsonStringToMessage(it->second, &recorded, lenient).ok() ||
      recorded.model().n_head() <= 0) {
    return absl::OkStatus();
  }
  if (recorded.model().n_head() == model.n_head()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the file was trained with model.n_head=", recorded.model().n_head(),
                   " and this job has ", model.n_head(),
                   ": the same weights split into other heads are another model; give the "
                   "job the file's n_head"));
}

}  // namespace pith::model
