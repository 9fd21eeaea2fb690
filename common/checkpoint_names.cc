#include "common/checkpoint_names.h"

#include "absl/strings/str_cat.h"

namespace pith::model {

std::string CheckpointFileName(absl::string_view job_id, int64_t step) {
  return absl::StrCat(job_id, ".step", step, ".safetensors");
}

absl::string_view KindPrefix(v1::BlobKind kind) {
  switch (kind) {
    case v1::BLOB_KIND_MASTER:
      return "master.";
    case v1::BLOB_KIND_ADAM_M:
      return "m.";
    case v1::BLOB_KIND_ADAM_V:
      return "v.";
    case v1::BLOB_KIND_STATE:
      return "state.";
    default:
      return "";
  }
}

std::string ExportTensorName(const v1::BlobKey& key) {
  return absl::StrCat(KindPrefix(key.kind()), key.layer() == -1
                                                  ? key.tensor()
                                                  : ExpertTensorPrefix(key.layer(), key.expert()));
}

}  // namespace pith::model
