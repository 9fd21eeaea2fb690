// MoeGpt: the moe-gpt model of DESIGN §3 — parameters, activations, forward and backward —
// written against compute::Backend. Every buffer is allocated once in Create(); a step
// allocates nothing.
//
// Thread safety: one thread at a time (the training loop).
#ifndef PITH_WORKER_MODEL_MOE_GPT_H_
#define PITH_WORKER_MODEL_MOE_GPT_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "common/param_layout.h"
#include "worker/compute/backend.h"

namespace pith::model {

// The loss of one step and its parts (DESIGN §3): loss = ce + aux_coef * aux + z_coef * z,
// with aux and z summed over layers.
struct StepLoss {
  double loss = 0;
  double ce = 0;
  double aux = 0;
  double z = 0;
};

// Expert parallelism: where the experts of a MoE layer run, and how a step's statistics
// are summed across the workers of a job. Unset (the default), everything runs here,
// which is training alone.
class ExpertParallel {
 public:
  virtual ~ExpertParallel() = default;
  // y rows of every expert bucket of `layer` (bucket e: rows offsets[e]..offsets[e+1] of
  // xperm [A, C]); hpre and h [A, F] hold the activations of the rows computed here.
  // bucket_token[i]: the token (row of this worker's batch) whose copy xperm row i is
  // (host memory on the CPU backend).
  virtual absl::Status Forward(int layer, float* y, float* hpre, float* h, const float* xperm,
                               const int64_t* offsets, const int32_t* bucket_token) = 0;
  // dxperm rows from dy; the gradients of the experts computed here accumulate into the
  // model's gradient arena. dh is scratch [A, F].
  virtual absl::Status Backward(int layer, float* dxperm, float* dh, const float* dy,
                                const float* xperm, const float* hpre, const float* h,
                                const int64_t* offsets) = 0;
  // Sums `values` over the job's workers; every worker gets the same bits.
  virtual absl::Status AllReduce(double* values, size_t n) = 0;
  // Whether this worker computes (layer, expert): only those experts' gradients are
  // written here, and zeroed before a step's backward.
  virtual bool Computes(int layer, int expert) const { return true; }
  // Called after the forward, before any expert gradient is zeroed or written: the
  // previous step's optimizer update may still be reading them (it overlaps the forward).
  virtual absl::Status BeforeBackward() { return absl::OkStatus(); }
  // Called once the step's global routing is known (ExpertUsed answers for this step),
  // before the backward.
  virtual void RoutingKnown() {}
};

// Where a model's expert parameters live. kLocal: in its own arenas, beside the dense
// ones (training alone, inference). kExternal: elsewhere (a cluster worker's cache slots
// and gradient pool): the model holds the dense tensors only, and an ExpertParallel
// computes every expert.
enum class Experts { kLocal, kExternal };

class MoeGpt {
 public:
  // A model for `batch` rows of `shape.seq` tokens per step.
  static absl::StatusOr<std::unique_ptr<MoeGpt>> Create(compute::Backend* backend,
                                                        const ModelShape& shape, int batch,
                                                        Experts experts = Experts::kLocal);

  const ParamLayout& layout() const { return layout_; }
  const ModelShape& shape() const { return layout_.shape(); }
  int batch() const { return batch_; }
  compute::Backend* backend() const { return backend_; }

  // The parameter and gradient arenas (device memory, ParamLayout offsets): every tensor
  // with local experts, the dense ones (the first dense_floats) with external experts.
  float* params() const { return params_.f32(); }
  float* grads() const { return grads_.f32(); }
  bool local_experts() const { return experts_ == Experts::kLocal; }
  // Floats in each of the two arenas.
  int64_t arena_floats() const;
  // Bytes of activations and backward scratch (what a step needs besides the arenas).
  int64_t activation_bytes() const;

  // Seeded init of DESIGN §3 (ParamInit) of the tensors held here.
  absl::Status InitWeights(uint64_t seed);

  // Zeroes the gradients, runs forward and backward over inputs/targets [batch, T] (host
  // arrays of token ids) and returns the loss. The mean is over `global_rows` * T targets
  // (the rows of the whole global batch; `batch` when training alone). INVALID_ARGUMENT
  // for a token id outside the vocabulary.
  absl::StatusOr<StepLoss> ForwardBackward(const int32_t* inputs, const int32_t* targets,
                                           int64_t global_rows);

  // Forward only, for inference: `inputs` [batch, T] token ids; copies the logits of
  // every position to `logits` [batch, T, V] (host). INVALID_ARGUMENT for a bad token id.
  absl::Status Logits(const int32_t* inputs, float* logits);

  // Whether the expert kept at least one token in the last ForwardBackward, on any worker
  // (an expert that did not gets no gradient and no update that step).
  bool ExpertUsed(int layer, int expert) const;

  // Runs the experts through `parallel` (not owned; null: here) from the next step on.
  void SetExpertParallel(ExpertParallel* parallel) { parallel_ = parallel; }

  // Expert weights and gradients of one layer, for an ExpertParallel that computes here
  // (local experts only: empty spans otherwise).
  absl::Span<const compute::ExpertWeights> expert_weights(int layer) const {
    if (expert_weights_.empty()) return {};
    return {expert_weights_.data() + int64_t{layer} * shape().experts,
            static_cast<size_t>(shape().experts)};
  }
  absl::Span<const compute::ExpertGrads> expert_grads(int layer) const {
    if (expert_grads_.empty()) return {};
    return {expert_grads_.data() + int64_t{layer} * shape().experts,
            static_cast<size_t>(shape().experts)};
  }

  // Host copies of the last step's activations, for tests and debugging: the router
  // probabilities of a layer [N, E] and d loss / d logits [N, V].
  absl::Status CopyRouterProbs(int layer, float* out) const;
  absl::Status CopyLogitGrads(float* out) const;
  // The experts each token chose at `layer` in the last step, [N, top_k] (kept or not).
  absl::Status CopyChosenExperts(int layer, int32_t* out) const;

  // Host copies of the last step's routing of one layer, for heat reports and tests.
  const std::vector<int64_t>& routed(int layer) const { return host_[layer].routed; }
  const std::vector<int64_t>& bucket_offsets(int layer) const { return host_[layer].offsets; }

 private:
  struct LayerActs {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *mid, *ln2, *ln2_mean, *ln2_rstd;
    float *router_logits, *probs, *lse, *gate, *xperm, *hpre, *h, *y;
    int32_t *expert, *row, *bucket_token;
  };
  struct LayerHost {
    std::vector<int64_t> offsets, routed;
    std::vector<double> prob_sum, global_f;
    std::vector<float> lse;
  };

  MoeGpt(compute::Backend* backend, const ModelShape& shape, int batch, Experts experts);
  absl::Status AllocateBuffers();
  compute::RoutingBuffers Routing(int l);
  absl::Status Forward(const int32_t* tokens);
  absl::Status Backward(int64_t global_tokens);

  compute::Backend* backend_;
  ParamLayout layout_;
  int batch_;
  Experts experts_;
  compute::RouterConfig router_;

  compute::DeviceBuffer params_, grads_, acts_, scratch_, tokens_;
  std::vector<float*> residual_;  // L + 1 entries of [N, C]
  std::vector<LayerActs> layer_;
  std::vector<LayerHost> host_;
  float *lnf_, *lnf_mean_, *lnf_rstd_, *logits_, *losses_;
  float *dres_, *dln_, *dtmp_, *dqkv_, *dgate_, *drouter_, *dy_, *dh_, *dxperm_;
  int32_t *inputs_dev_, *targets_dev_;
  std::vector<float> host_losses_;
  std::vector<compute::ExpertWeights> expert_weights_;  // per layer, E entries each
  std::vector<compute::ExpertGrads> expert_grads_;
  ExpertParallel* parallel_ = nullptr;
  std::vector<double> global_stats_;  // routed, prob_sum, kept: L x E each, summed
};

}  // namespace pith::model

#endif  // PITH_WORKER_MODEL_MOE_GPT_H_
