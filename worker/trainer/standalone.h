// The standalone single-process trainer: one process trains a whole job from its spec.
// It is the reference the distributed path is compared against (same math, same data
// order) and a debugging tool (`pith-worker --standalone`).
//
// Thread safety: RunStandalone runs on the calling thread.
#ifndef PITH_WORKER_TRAINER_STANDALONE_H_
#define PITH_WORKER_TRAINER_STANDALONE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "pith/v1/spec.pb.h"
#include "worker/compute/backend.h"

namespace pith::trainer {

struct StandaloneOptions {
  v1::JobSpec spec;                 // validated, defaults filled in
  std::string init_path;            // start from these weights (overrides spec.train.init_path)
  std::string export_init_path;     // write the starting weights here
  int64_t steps = -1;               // when >= 0: replaces spec.train.steps (schedule too)
  std::string loss_log_path;        // one line per step: "<step> <loss> <ce>", step from 1
  std::string save_path;            // final weights
  std::string save_optimizer_path;  // final optimizer state
};

struct StandaloneResult {
  int64_t steps = 0;
  double final_loss = 0;
  double tokens_per_second = 0;
};

// Trains on `backend`. Errors (missing data, bad init file, ...) name what failed.
absl::StatusOr<StandaloneResult> RunStandalone(const StandaloneOptions& options,
                                               compute::Backend& backend);

}  // namespace pith::trainer

#endif  // PITH_WORKER_TRAINER_STANDALONE_H_
