#include "worker/trainer/standalone.h"

#include <fcntl.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "absl/strings/str_format.h"
#include "common/file.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/data/token_dataset.h"
#include "worker/model/checkpoint.h"
#include "worker/model/moe_gpt.h"
#include "worker/model/optimizer.h"

namespace pith::trainer {

absl::StatusOr<StandaloneResult> RunStandalone(const StandaloneOptions& options,
                                               compute::Backend& backend) {
  const v1::JobSpec& spec = options.spec;
  const model::ModelShape shape = model::ModelShape::FromSpec(spec.model());
  const int batch = spec.train().batch();
  const int64_t steps = options.steps >= 0 ? options.steps : spec.train().steps();

  ASSIGN_OR_RETURN(data::TokenDataset dataset,
                   data::TokenDataset::Open(spec.train().data_path(), shape.vocab));
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeGpt> moe,
                   model::MoeGpt::Create(&backend, shape, batch));
  model::OptimizerConfig opt_config = model::OptimizerConfig::FromSpec(spec.train());
  opt_config.steps = steps;  // --steps overrides train.steps, schedule included
  ASSIGN_OR_RETURN(std::unique_ptr<model::AdamWOptimizer> optimizer,
                   model::AdamWOptimizer::Create(&backend, moe->layout(), opt_config));

  const std::string init =
      !options.init_path.empty() ? options.init_path : spec.train().init_path();
  if (!init.empty()) {
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(init));
    RETURN_IF_ERROR(Annotate(model::CheckInitModel(file.metadata(), spec.model()),
                             absl::StrCat("init ", init)));
    RETURN_IF_ERROR(Annotate(model::LoadWeights(backend, moe->layout(), file, moe->params()),
                             absl::StrCat("init ", init)));
  } else {
    RETURN_IF_ERROR(moe->InitWeights(spec.train().seed()));
  }
  if (!options.export_init_path.empty()) {
    RETURN_IF_ERROR(
        model::SaveWeights(backend, moe->layout(), moe->params(), options.export_init_path));
  }

  UniqueFd loss_log;
  if (!options.loss_log_path.empty()) {
    loss_log = UniqueFd(
        ::open(options.loss_log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!loss_log.valid()) {
      return absl::InvalidArgumentError(
          absl::StrCat("cannot create loss log ", options.loss_log_path));
    }
  }

  const int T = shape.seq;
  std::vector<int32_t> inputs(int64_t{batch} * T), targets(int64_t{batch} * T);
  const model::ParamLayout& layout = moe->layout();
  const model::HasGrad has_grad = [&](const model::ParamTensor& t) {
    return t.layer < 0 || moe->ExpertUsed(t.layer, t.expert);
  };
  StandaloneResult result;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < steps; ++s) {
    for (int i = 0; i < batch; ++i) {
      dataset.Row(s * batch + i, T, inputs.data() + int64_t{i} * T,
                  targets.data() + int64_t{i} * T);
    }
    ASSIGN_OR_RETURN(model::StepLoss loss,
                     moe->ForwardBackward(inputs.data(), targets.data(), batch));
    const model::OptimizerStep step = optimizer->Step(moe->params(), moe->grads(), s, has_grad);
    result.final_loss = loss.loss;
    if (loss_log.valid()) {
      const std::string line = absl::StrFormat("%d %.9g %.9g\n", s + 1, loss.loss, loss.ce);
      RETURN_IF_ERROR(WriteAll(loss_log.get(),
                               {reinterpret_cast<const uint8_t*>(line.data()), line.size()},
                               options.loss_log_path));
    }
    if (s == 0 || (s + 1) % 10 == 0 || s + 1 == steps) {
      LOG(INFO) << absl::StrFormat("step %d/%d loss %.4f ce %.4f aux %.4f z %.4f lr %.3g norm %.3f",
                                   s + 1, steps, loss.loss, loss.ce, loss.aux, loss.z, step.lr,
                                   step.grad_norm);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.steps = steps;
  result.tokens_per_second = seconds > 0 ? steps * batch * T / seconds : 0;
  if (loss_log.valid()) RETURN_IF_ERROR(loss_log.Close());
  if (!options.save_path.empty()) {
    RETURN_IF_ERROR(model::SaveWeights(backend, layout, moe->params(), options.save_path));
  }
  if (!options.save_optimizer_path.empty()) {
    RETURN_IF_ERROR(
        model::SaveOptimizer(backend, layout, *optimizer, steps, options.save_optimizer_path));
  }
  return result;
}

}  // namespace pith::trainer
