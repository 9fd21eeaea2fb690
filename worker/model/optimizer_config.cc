// OptimizerConfig from a job spec: the optimizer's one use of the protos.
#include "pith/v1/spec.pb.h"
#include "worker/model/optimizer.h"

namespace pith::model {

OptimizerConfig OptimizerConfig::FromSpec(const v1::TrainConfig& t) {
  OptimizerConfig c;
  c.lr = t.lr();
  c.warmup = t.warmup();
  c.steps = t.steps();
  c.min_lr_ratio = t.min_lr_ratio();
  c.weight_decay = t.weight_decay();
  c.grad_clip = t.grad_clip();
  c.beta1 = t.beta1();
  c.beta2 = t.beta2();
  c.eps = t.eps();
  return c;
}

}  // namespace pith::model
