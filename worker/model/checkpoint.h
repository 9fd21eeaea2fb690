// moe-gpt checkpoints in safetensors (DESIGN §3): the weights file holds every tensor by
// its DESIGN name, fp32, shaped [in, out]; the optimizer file holds "m.<name>" and
// "v.<name>" and, in __metadata__, the step ("step") and each tensor's AdamW update count
// ("count.<name>").
//
// Thread safety: free functions; callers serialize access to the model.
#ifndef PITH_WORKER_MODEL_CHECKPOINT_H_
#define PITH_WORKER_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/param_layout.h"
#include "common/safetensors.h"
#include "common/safetensors_reader.h"
#include "worker/compute/backend.h"
#include "worker/model/optimizer.h"

namespace pith::model {

// A weights file to start a job from, against the job's model: where the file records the
// spec it was trained with (kSpecMetadataKey, as job exports do), its model.n_head must be
// the job's. The tensors' shapes cannot show it, and other heads would split the attention
// weights into a model they never were (FAILED_PRECONDITION naming both). Training
// choices (top_k, capacity, loss coefficients) may change; a file recording no spec, or
// one this Pith cannot read, passes.
absl::Status CheckInitModel(const std::map<std::string, std::string>& metadata,
                            const v1::ModelConfig& model);

// Writes the parameters in `arena` (device memory) as a weights file.
absl::Status SaveWeights(compute::Backend& backend, const ParamLayout& layout, const float* arena,
                         const std::string& path);

// The same from host memory: SaveHostWeights in common/param_layout.h.

// Loads a weights file into `arena`. Every tensor of the layout must be there with its
// exact shape and dtype F32, and nothing else; errors name the tensor.
absl::Status LoadWeights(compute::Backend& backend, const ParamLayout& layout,
                         const SafetensorsFile& file, float* arena);

// For a model with external experts, from a file read tensor by tensor: checks that it
// holds exactly the layout's tensors and loads the dense ones into `arena` (dense_floats).
absl::Status LoadDenseWeights(compute::Backend& backend, const ParamLayout& layout,
                              const SafetensorsReader& file, float* arena);
// Reads the four tensors of expert (layer, expert) from a weights file LoadDenseWeights
// checked into `out` (expert_floats, host memory, w1 b1 w2 b2).
absl::Status ReadExpertWeights(const ParamLayout& layout, const SafetensorsReader& file, int layer,
                               int expert, float* out);

// Writes the optimizer state after `step` steps.
absl::Status SaveOptimizer(compute::Backend& backend, const ParamLayout& layout,
                           const AdamWOptimizer& optimizer, int64_t step, const std::string& path);

// Loads an optimizer file; returns the step it was saved after.
absl::StatusOr<int64_t> LoadOptimizer(compute::Backend& backend, const ParamLayout& layout,
                                      const SafetensorsFile& file, AdamWOptimizer& optimizer);

}  // namespace pith::model

#endif  // PITH_WORKER_MODEL_CHECKPOINT_H_
