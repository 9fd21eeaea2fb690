// Inference from a weights file, for `pith eval` and `pith sample`: the same model code
// training runs (MoeGpt on the CPU backend), loaded from a checkpoint and its job spec.
// The CLI parses flags and prints; these functions own the model.
//
// Thread safety: free functions; each builds and owns its model, so calls may run
// concurrently.
#ifndef PITH_WORKER_MODEL_INFERENCE_H_
#define PITH_WORKER_MODEL_INFERENCE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "pith/v1/spec.pb.h"

namespace pith::model {

// Mean losses over `batches` global batches of held-out tokens.
struct EvalResult {
  int64_t rows = 0;    // batches * batch
  int64_t tokens = 0;  // rows * seq_len
  double ce = 0;       // mean cross-entropy per batch
  double loss = 0;     // mean total loss (ce + aux + z terms, DESIGN §3)
};

// Evaluates the weights in `weights` (a model of `spec`) on the token file at
// `tokens_path`: batch s = 0..batches-1 takes global rows s*B..s*B+B-1 in the DESIGN §3
// order. Errors name the missing or mis-shaped tensor, or the bad token file; batches past
// one pass over the file (rows would wrap around to text already scored) are refused.
absl::StatusOr<EvalResult> Evaluate(const SafetensorsFile& weights, const v1::JobSpec& spec,
                                    const std::string& tokens_path, int batches);

struct SampleOptions {
  int tokens = 200;          // bytes to generate after the prompt
  double temperature = 0.8;  // 0: always the most likely byte
  uint64_t seed = 1;
};

// The prompt followed by up to `options.tokens` bytes generated one at a time, each from
// the logits of the last seq_len bytes. INVALID_ARGUMENT for a model whose vocabulary is
// not bytes (vocab_size 256).
absl::StatusOr<std::string> Sample(const SafetensorsFile& weights, const v1::JobSpec& spec,
                                   const std::string& prompt, const SampleOptions& options);

}  // namespace pith::model

#endif  // PITH_WORKER_MODEL_INFERENCE_H_
