// The names a checkpoint export uses (DESIGN §3), decided here once for every side that
// writes or reads one: the file a job export writes (coordinator, read back by `pith
// checkpoint`), the name each blob or tensor takes inside it (the store's export, the
// worker's optimizer file, the parameter layout).
//
// Thread safety: pure functions.
#ifndef PITH_COMMON_CHECKPOINT_NAMES_H_
#define PITH_COMMON_CHECKPOINT_NAMES_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "common/param_layout.h"  // ExpertTensorPrefix
#include "pith/v1/common.pb.h"

namespace pith::model {

// "<job>.step<N>.safetensors": the weights file a job export of committed step N writes.
std::string CheckpointFileName(absl::string_view job_id, int64_t step);

// What the tensors of a blob kind are prefixed with in a safetensors file: "" for
// weights, "master.", "m." and "v." (AdamW moments), "state.".
absl::string_view KindPrefix(v1::BlobKind kind);

// The name a blob takes in a safetensors export: its kind's prefix, then the DESIGN tensor
// name of a dense blob or ExpertTensorPrefix of an expert's blob.
std::string ExportTensorName(const v1::BlobKey& key);

}  // namespace pith::model

#endif  // PITH_COMMON_CHECKPOINT_NAMES_H_
