#include "worker/model/optimizer.h"

#include <algorithm>
#include <cmath>

#include "common/status.h"

namespace pith::model {

double LearningRate(const OptimizerConfig& c, int64_t step) {
  if (step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
  const double q = static_cast<double>(step - c.warmup) /
                   static_cast<double>(std::max<int64_t>(1, c.steps - c.warmup));
  const double lr_min = c.min_lr_ratio * c.lr;
  return lr_min + (c.lr - lr_min) * (1.0 + std::cos(M_PI * q)) / 2.0;
}

absl::StatusOr<std::unique_ptr<AdamWOptimizer>> AdamWOptimizer::Create(
    compute::Backend* backend, const ParamLayout& layout, const OptimizerConfig& config,
    bool dense_only) {
  std::unique_ptr<AdamWOptimizer> opt(new AdamWOptimizer(backend, layout, config, dense_only));
  const int64_t floats = dense_only ? layout.dense_floats() : layout.total_floats();
  const int64_t bytes = floats * int64_t{sizeof(float)};
  ASSIGN_OR_RETURN(opt->m_, backend->Allocate(bytes));
  ASSIGN_OR_RETURN(opt->v_, backend->Allocate(bytes));
  opt->counts_.assign(layout.tensors().size(), 0);
  return opt;
}

OptimizerStep AdamWOptimizer::Step(float* params, float* grads, int64_t step,
                                   const HasGrad& has_grad) {
  return Apply(params, grads, step, has_grad, std::sqrt(LocalSumOfSquares(grads, has_grad)));
}

double AdamWOptimizer::LocalSumOfSquares(const float* grads, const HasGrad& has_grad) {
  double sum_sq = 0;
  for (const ParamTensor& t : layout_.tensors()) {
    if (Updates(t, has_grad)) sum_sq += backend_->SumOfSquares(grads + t.offset, t.numel);
  }
  return sum_sq;
}

OptimizerStep AdamWOptimizer::Apply(float* params, float* grads, int64_t step,
                                    const HasGrad& has_grad, double grad_norm) {
  const std::vector<ParamTensor>& tensors = layout_.tensors();
  OptimizerStep out;
  out.lr = LearningRate(config_, step);
  out.grad_norm = grad_norm;
  if (config_.grad_clip > 0) {
    // As torch.nn.utils.clip_grad_norm_.
    const double coef = config_.grad_clip / (out.grad_norm + 1e-6);
    if (coef < 1.0) {
      for (const ParamTensor& t : tensors) {
        if (Updates(t, has_grad)) {
          backend_->Scale(grads + t.offset, static_cast<float>(coef), t.numel);
        }
      }
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ParamTensor& t = tensors[i];
    if (!Updates(t, has_grad)) continue;
    backend_->AdamW(params + t.offset, grads + t.offset, m() + t.offset, v() + t.offset, t.numel,
                    static_cast<float>(out.lr), static_cast<float>(config_.beta1),
                    static_cast<float>(config_.beta2), static_cast<float>(config_.eps),
                    t.decay ? static_cast<float>(config_.weight_decay) : 0.0f, ++counts_[i]);
  }
  return out;
}

}  // namespace pith::model
