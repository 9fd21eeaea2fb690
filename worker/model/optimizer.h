// AdamW with per-tensor update counts, the DESIGN §3 learning-rate schedule and global
// grad-norm clipping, over a ParamLayout arena on a compute::Backend.
//
// Thread safety: one thread at a time (the training loop).
#ifndef PITH_WORKER_MODEL_OPTIMIZER_H_
#define PITH_WORKER_MODEL_OPTIMIZER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/param_layout.h"
#include "worker/compute/backend.h"

namespace pith::v1 {
class TrainConfig;
}  // namespace pith::v1

namespace pith::model {

struct OptimizerConfig {
  double lr = 0;
  int64_t warmup = 0;
  int64_t steps = 1;
  double min_lr_ratio = 0.1;
  double weight_decay = 0;
  double grad_clip = 0;  // 0 disables clipping
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;

  static OptimizerConfig FromSpec(const v1::TrainConfig& train);
};

// The learning rate of step t (from 0): linear warmup, then cosine decay to
// min_lr_ratio * lr at the last step.
double LearningRate(const OptimizerConfig& config, int64_t step);

// Tells whether a tensor received a gradient this step (experts without tokens did not).
using HasGrad = std::function<bool(const ParamTensor&)>;

struct OptimizerStep {
  double lr = 0;
  double grad_norm = 0;  // before clipping
};

class AdamWOptimizer {
 public:
  // Moments for every tensor of `layout`, or with `dense_only` for the dense ones (the
  // first dense_floats; a cluster worker's experts are updated by its ExpertUpdater, their
  // moments in the stores): expert tensors are then never read, whatever has_grad says.
  static absl::StatusOr<std::unique_ptr<AdamWOptimizer>> Create(compute::Backend* backend,
                                                                const ParamLayout& layout,
                                                                const OptimizerConfig& config,
                                                                bool dense_only = false);

  // Clips the gradients of the tensors with a gradient by their global norm, then applies
  // AdamW to them with the learning rate of `step` (from 0) and advances their counts.
  OptimizerStep Step(float* params, float* grads, int64_t step, const HasGrad& has_grad);

  // The two halves of Step, for training across workers: the squared norm of the
  // gradients of the tensors with a gradient here, and the update of those tensors given
  // the global norm (the square root of the sum of every worker's LocalSumOfSquares).
  double LocalSumOfSquares(const float* grads, const HasGrad& has_grad);
  OptimizerStep Apply(float* params, float* grads, int64_t step, const HasGrad& has_grad,
                      double grad_norm);

  float* m() const { return m_.f32(); }
  float* v() const { return v_.f32(); }
  // Updates applied so far, per tensor of the layout.
  std::vector<int64_t>& update_counts() { return counts_; }
  const std::vector<int64_t>& update_counts() const { return counts_; }
  const OptimizerConfig& config() const { return config_; }

 private:
  AdamWOptimizer(compute::Backend* backend, const ParamLayout& layout,
                 const OptimizerConfig& config, bool dense_only)
      : backend_(backend), layout_(layout), config_(config), dense_only_(dense_only) {}
  // Whether tensor t has a gradient here this step and moments in this optimizer.
  bool Updates(const ParamTensor& t, const HasGrad& has_grad) const {
    return (!dense_only_ || t.layer < 0) && has_grad(t);
  }

  compute::Backend* backend_;
  const ParamLayout& layout_;
  OptimizerConfig config_;
  bool dense_only_;
  compute::DeviceBuffer m_, v_;
  std::vector<int64_t> counts_;
};

}  // namespace pith::model

#endif  // PITH_WORKER_MODEL_OPTIMIZER_H_
