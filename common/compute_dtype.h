// The precision a job's products run in (the job spec's model.compute_dtype).
// fp32: every op in fp32 (every backend). bf16: the matrix products take bf16 inputs and
// accumulate in fp32 (the CUDA backend); the router's product, softmax, top-k, gates,
// LayerNorm statistics, losses and AdamW stay fp32, and so do master weights and moments.
#ifndef PITH_COMMON_COMPUTE_DTYPE_H_
#define PITH_COMMON_COMPUTE_DTYPE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace pith {

enum class ComputeDtype { kFp32, kBf16 };

inline absl::string_view ComputeDtypeName(ComputeDtype d) {
  return d == ComputeDtype::kBf16 ? "bf16" : "fp32";
}

// "" (the default) and "fp32" are fp32; "bf16" is bf16.
inline absl::StatusOr<ComputeDtype> ParseComputeDtype(absl::string_view name) {
  if (name.empty() || name == "fp32") return ComputeDtype::kFp32;
  if (name == "bf16") return ComputeDtype::kBf16;
  return absl::InvalidArgumentError(
      absl::StrCat("compute dtype: expected fp32 or bf16, got \"", name, "\""));
}

}  // namespace pith

#endif  // PITH_COMMON_COMPUTE_DTYPE_H_
