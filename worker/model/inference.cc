#include "worker/model/inference.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/param_layout.h"
#include "common/status.h"
#include "worker/compute/cpu_backend.h"
#include "worker/data/token_dataset.h"
#include "worker/model/checkpoint.h"
#include "worker/model/moe_gpt.h"

namespace pith::model {

namespace {

// Evaluation and sampling run on the CPU backend in fp32, whatever precision the job
// trained in: its checkpoint holds the fp32 master weights.
ModelShape InferenceShape(const v1::JobSpec& spec) {
  ModelShape shape = ModelShape::FromSpec(spec.model());
  shape.compute_dtype = ComputeDtype::kFp32;
  return shape;
}

}  // namespace

absl::StatusOr<EvalResult> Evaluate(const SafetensorsFile& weights, const v1::JobSpec& spec,
                                    const std::string& tokens_path, int batches) {
  const ModelShape shape = InferenceShape(spec);
  const int B = spec.train().batch(), T = shape.seq;
  compute::CpuBackend backend(0);
  ASSIGN_OR_RETURN(std::unique_ptr<MoeGpt> m, MoeGpt::Create(&backend, shape, B));
  RETURN_IF_ERROR(LoadWeights(backend, m->layout(), weights, m->params()));
  ASSIGN_OR_RETURN(data::TokenDataset tokens, data::TokenDataset::Open(tokens_path, shape.vocab));
  // Rows wrap around the file (the training order does): past one pass, an evaluation
  // would score the same text again. A row reads T + 1 tokens (its inputs and targets).
  const int64_t one_pass = (tokens.size() - 1) / (int64_t{B} * T);
  if (one_pass < 1) {
    return absl::InvalidArgumentError(absl::StrCat(tokens_path, " holds ", tokens.size(),
                                                   " tokens: one batch of ", B, " rows of ", T,
                                                   " needs ", int64_t{B} * T + 1));
  }
  if (batches > one_pass) {
    return absl::InvalidArgumentError(
        absl::StrCat("--batches ", batches, " reads past the end of ", tokens_path, ": its ",
                     tokens.size(), " tokens hold ", one_pass, " batches of ", B, " rows of ", T,
                     " tokens; ask for at most ", one_pass));
  }
  std::vector<int32_t> inputs(int64_t{B} * T), targets(int64_t{B} * T);
  EvalResult result;
  for (int s = 0; s < batches; ++s) {
    for (int i = 0; i < B; ++i) {
      tokens.Row(int64_t{s} * B + i, T, inputs.data() + int64_t{i} * T,
                 targets.data() + int64_t{i} * T);
    }
    ASSIGN_OR_RETURN(StepLoss l, m->ForwardBackward(inputs.data(), targets.data(), B));
    result.ce += l.ce;
    result.loss += l.loss;
  }
  result.rows = int64_t{batches} * B;
  result.tokens = result.rows * T;
  result.ce /= batches;
  result.loss /= batches;
  return result;
}

absl::StatusOr<std::string> Sample(const SafetensorsFile& weights, const v1::JobSpec& spec,
                                   const std::string& prompt, const SampleOptions& options) {
  const ModelShape shape = InferenceShape(spec);
  if (shape.vocab != 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("sample: generates bytes, which needs model.vocab_size 256; this model's is ",
                     shape.vocab));
  }
  if (prompt.empty()) return absl::InvalidArgumentError("sample: the prompt is empty");
  compute::CpuBackend backend(0);
  ASSIGN_OR_RETURN(std::unique_ptr<MoeGpt> m, MoeGpt::Create(&backend, shape, 1));
  RETURN_IF_ERROR(LoadWeights(backend, m->layout(), weights, m->params()));
  const int T = shape.seq, V = shape.vocab;
  std::string text = prompt;
  std::vector<int32_t> window(T, ' ');
  std::vector<float> logits(int64_t{T} * V);
  std::mt19937_64 rng(options.seed);
  if (options.on_text) options.on_text(text);
  for (int n = 0; n < options.tokens; ++n) {
    // The last T bytes at the start of the window; later positions cannot affect them.
    const size_t from = text.size() > static_cast<size_t>(T) ? text.size() - T : 0;
    const int used = static_cast<int>(text.size() - from);
    for (int i = 0; i < T; ++i) {
      window[i] = i < used ? static_cast<uint8_t>(text[from + i]) : ' ';
    }
    RETURN_IF_ERROR(m->Logits(window.data(), logits.data()));
    const float* row = logits.data() + int64_t{used - 1} * V;
    int next = static_cast<int>(std::max_element(row, row + V) - row);
    if (options.temperature > 0) {
      std::vector<double> p(V);
      const double top = row[next];
      for (int v = 0; v < V; ++v) p[v] = std::exp((row[v] - top) / options.temperature);
      next = std::discrete_distribution<int>(p.begin(), p.end())(rng);
    }
    text.push_back(static_cast<char>(next));
    if (options.on_text) options.on_text(absl::string_view(&text.back(), 1));
  }
  return text;
}

}  // namespace pith::model
