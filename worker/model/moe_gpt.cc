#include "worker/model/moe_gpt.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/model/param_init.h"

namespace pith::model {
namespace {

using compute::Backend;

// Hands out aligned pieces of one allocation: first every Take() records a size, then
// Bind() points every requested pointer into the buffer.
class Carver {
 public:
  template <typename T>
  void Take(T** ptr, int64_t count) {
    requests_.push_back({reinterpret_cast<void**>(ptr), Round(count * int64_t{sizeof(T)})});
    total_ += requests_.back().bytes;
  }
  int64_t total() const { return total_; }
  void Bind(void* base) {
    char* p = static_cast<char*>(base);
    for (const Request& r : requests_) {
      *r.ptr = p;
      p += r.bytes;
    }
  }

 private:
  static int64_t Round(int64_t bytes) { return (bytes + 63) / 64 * 64; }
  struct Request {
    void** ptr;
    int64_t bytes;
  };
  std::vector<Request> requests_;
  int64_t total_ = 0;
};

}  // namespace

MoeGpt::MoeGpt(Backend* backend, const ModelShape& shape, int batch, Experts experts)
    : backend_(backend), layout_(shape), batch_(batch), experts_(experts) {
  router_.top_k = shape.top_k;
  router_.capacity_factor = shape.capacity_factor;
  router_.renormalize = shape.renormalize_topk;
}

absl::StatusOr<std::unique_ptr<MoeGpt>> MoeGpt::Create(Backend* backend, const ModelShape& shape,
                                                       int batch, Experts experts) {
  if (batch < 1) return absl::InvalidArgumentError("model batch must be >= 1");
  RETURN_IF_ERROR(backend->SetComputeDtype(shape.compute_dtype));
  std::unique_ptr<MoeGpt> model(new MoeGpt(backend, shape, batch, experts));
  RETURN_IF_ERROR(model->AllocateBuffers());
  return model;
}

absl::Status MoeGpt::AllocateBuffers() {
  const ModelShape& s = shape();
  const int64_t N = int64_t{batch_} * s.seq, C = s.channels, E = s.experts, k = s.top_k;
  const int64_t F = s.hidden, V = s.vocab, A = N * k;
  const int64_t param_bytes = arena_floats() * int64_t{sizeof(float)};
  ASSIGN_OR_RETURN(params_, backend_->Allocate(param_bytes));
  ASSIGN_OR_RETURN(grads_, backend_->Allocate(param_bytes));

  Carver acts;
  residual_.resize(s.layers + 1);
  for (float*& r : residual_) acts.Take(&r, N * C);
  layer_.resize(s.layers);
  for (LayerActs& a : layer_) {
    acts.Take(&a.ln1, N * C);
    acts.Take(&a.ln1_mean, N);
    acts.Take(&a.ln1_rstd, N);
    acts.Take(&a.qkv, 3 * N * C);
    acts.Take(&a.atty, N * C);
    acts.Take(&a.att, int64_t{batch_} * s.heads * s.seq * s.seq);
    acts.Take(&a.mid, N * C);
    acts.Take(&a.ln2, N * C);
    acts.Take(&a.ln2_mean, N);
    acts.Take(&a.ln2_rstd, N);
    acts.Take(&a.router_logits, N * E);
    acts.Take(&a.probs, N * E);
    acts.Take(&a.lse, N);
    acts.Take(&a.gate, A);
    acts.Take(&a.xperm, A * C);
    acts.Take(&a.hpre, A * F);
    acts.Take(&a.h, A * F);
    acts.Take(&a.y, A * C);
    acts.Take(&a.expert, A);
    acts.Take(&a.row, A);
    acts.Take(&a.bucket_token, A);
  }
  acts.Take(&lnf_, N * C);
  acts.Take(&lnf_mean_, N);
  acts.Take(&lnf_rstd_, N);
  acts.Take(&logits_, N * V);
  acts.Take(&losses_, N);
  ASSIGN_OR_RETURN(acts_, backend_->Allocate(acts.total()));
  acts.Bind(acts_.data());

  Carver scratch;
  scratch.Take(&dres_, N * C);
  scratch.Take(&dln_, N * C);
  scratch.Take(&dtmp_, N * C);
  scratch.Take(&dqkv_, 3 * N * C);
  scratch.Take(&dgate_, A);
  scratch.Take(&drouter_, N * E);
  scratch.Take(&dy_, A * C);
  scratch.Take(&dh_, A * F);
  scratch.Take(&dxperm_, A * C);
  ASSIGN_OR_RETURN(scratch_, backend_->Allocate(scratch.total()));
  scratch.Bind(scratch_.data());

  Carver tokens;
  tokens.Take(&inputs_dev_, N);
  tokens.Take(&targets_dev_, N);
  ASSIGN_OR_RETURN(tokens_, backend_->Allocate(tokens.total()));
  tokens.Bind(tokens_.data());

  host_.resize(s.layers);
  for (LayerHost& h : host_) {
    h.offsets.assign(E + 1, 0);
    h.routed.assign(E, 0);
    h.prob_sum.assign(E, 0);
    h.global_f.assign(E, 0);
    h.lse.assign(N, 0);
  }
  host_losses_.assign(N, 0);

  if (!local_experts()) return absl::OkStatus();
  for (int l = 0; l < s.layers; ++l) {
    for (int e = 0; e < s.experts; ++e) {
      const int64_t o = layout_.ExpertOffset(l, e);
      const float* p = params() + o;
      float* g = grads() + o;
      expert_weights_.push_back({p, p + C * F, p + C * F + F, p + 2 * C * F + F});
      expert_grads_.push_back({g, g + C * F, g + C * F + F, g + 2 * C * F + F});
    }
  }
  return absl::OkStatus();
}

int64_t MoeGpt::arena_floats() const {
  return local_experts() ? layout_.total_floats() : layout_.dense_floats();
}

int64_t MoeGpt::activation_bytes() const {
  return static_cast<int64_t>(acts_.bytes() + scratch_.bytes() + tokens_.bytes());
}

absl::Status MoeGpt::InitWeights(uint64_t seed) {
  std::vector<float> host(arena_floats(), 0.0f);
  ParamInit init(layout_, seed);
  const std::vector<ParamTensor>& tensors = layout_.tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].offset >= arena_floats()) break;  // experts held elsewhere
    init.Fill(static_cast<int>(i), host.data() + tensors[i].offset);
  }
  return backend_->CopyToDevice(params(), host.data(), host.size() * sizeof(float));
}

compute::RoutingBuffers MoeGpt::Routing(int l) {
  LayerActs& a = layer_[l];
  LayerHost& h = host_[l];
  return {a.probs,          a.lse,           a.expert,         a.gate, a.row, a.bucket_token,
          h.offsets.data(), h.routed.data(), h.prob_sum.data()};
}

absl::Status MoeGpt::Forward(const int32_t* tokens) {
  const ModelShape& s = shape();
  const int N = batch_ * s.seq, C = s.channels, E = s.experts, F = s.hidden;
  if (parallel_ == nullptr && !local_experts()) {
    return absl::FailedPreconditionError("a model with external experts needs an ExpertParallel");
  }
  Backend& b = *backend_;
  const float* p = params();
  b.Embedding(residual_[0], tokens, p + layout_.wte(), p + layout_.wpe(), batch_, s.seq, C);
  for (int l = 0; l < s.layers; ++l) {
    const ParamLayout::Layer& w = layout_.layer(l);
    LayerActs& a = layer_[l];
    const float* x = residual_[l];
    b.LayerNorm(a.ln1, a.ln1_mean, a.ln1_rstd, x, p + w.ln1_w, p + w.ln1_b, N, C);
    b.Gemm(false, false, N, 3 * C, C, 1.0f, a.ln1, C, p + w.qkv_w, 3 * C, 0.0f, a.qkv, 3 * C);
    b.AddBias(a.qkv, p + w.qkv_b, N, 3 * C);
    b.Attention(a.atty, a.att, a.qkv, batch_, s.seq, C, s.heads);
    b.Gemm(false, false, N, C, C, 1.0f, a.atty, C, p + w.o_w, C, 0.0f, dtmp_, C);
    b.AddBias(dtmp_, p + w.o_b, N, C);
    b.Add(a.mid, x, dtmp_, int64_t{N} * C);

    b.LayerNorm(a.ln2, a.ln2_mean, a.ln2_rstd, a.mid, p + w.ln2_w, p + w.ln2_b, N, C);
    b.GemmFp32(false, false, N, E, C, 1.0f, a.ln2, C, p + w.router_w, E, 0.0f, a.router_logits, E);
    b.Route(a.router_logits, N, E, router_, Routing(l));
    const int64_t* offsets = host_[l].offsets.data();
    b.Permute(a.xperm, a.ln2, a.bucket_token, offsets[E], C);
    if (parallel_ != nullptr) {
      RETURN_IF_ERROR(parallel_->Forward(l, a.y, a.hpre, a.h, a.xperm, offsets, a.bucket_token));
    } else {
      b.ExpertForward(a.y, a.hpre, a.h, a.xperm, offsets, expert_weights(l), C, F);
    }
    b.Combine(dtmp_, a.y, a.row, a.gate, N, s.top_k, C);
    b.Add(residual_[l + 1], a.mid, dtmp_, int64_t{N} * C);
  }
  b.LayerNorm(lnf_, lnf_mean_, lnf_rstd_, residual_[s.layers], p + layout_.lnf_w(),
              p + layout_.lnf_b(), N, C);
  b.Gemm(false, true, N, s.vocab, C, 1.0f, lnf_, C, p + layout_.wte(), C, 0.0f, logits_, s.vocab);
  return absl::OkStatus();
}

absl::Status MoeGpt::Backward(int64_t global_tokens) {
  const ModelShape& s = shape();
  const int N = batch_ * s.seq, C = s.channels, E = s.experts, F = s.hidden, V = s.vocab;
  Backend& b = *backend_;
  const float* p = params();
  float* g = grads();

  // logits = lnf @ wte^T; logits_ holds dloss/dlogits now.
  b.Gemm(false, false, N, C, V, 1.0f, logits_, V, p + layout_.wte(), C, 0.0f, dln_, C);
  b.Gemm(true, false, V, C, N, 1.0f, logits_, V, lnf_, C, 1.0f, g + layout_.wte(), C);
  b.Zero(dres_, sizeof(float) * N * C);
  b.LayerNormBackward(dres_, g + layout_.lnf_w(), g + layout_.lnf_b(), dln_, residual_[s.layers],
                      p + layout_.lnf_w(), lnf_mean_, lnf_rstd_, N, C);

  for (int l = s.layers - 1; l >= 0; --l) {
    const ParamLayout::Layer& w = layout_.layer(l);
    LayerActs& a = layer_[l];
    LayerHost& h = host_[l];
    const int64_t* offsets = h.offsets.data();

    // MoE sub-block: out = mid + Combine(experts(Permute(ln2))).
    b.CombineBackward(dy_, dgate_, dres_, a.y, a.row, a.gate, N, s.top_k, C);
    if (parallel_ != nullptr) {
      RETURN_IF_ERROR(parallel_->Backward(l, dxperm_, dh_, dy_, a.xperm, a.hpre, a.h, offsets));
    } else {
      b.ExpertBackward(dxperm_, dh_, expert_grads(l), dy_, a.xperm, a.hpre, a.h, offsets,
                       expert_weights(l), C, F);
    }
    b.Zero(dln_, sizeof(float) * N * C);
    b.PermuteBackward(dln_, dxperm_, a.row, N, s.top_k, C);
    compute::RouterLossGrad loss{s.aux_loss_coef, s.z_loss_coef, global_tokens, h.global_f.data()};
    b.RouteBackward(drouter_, dgate_, Routing(l), N, E, router_, loss);
    b.GemmFp32(false, true, N, C, E, 1.0f, drouter_, E, p + w.router_w, E, 1.0f, dln_, C);
    b.GemmFp32(true, false, C, E, N, 1.0f, a.ln2, C, drouter_, E, 1.0f, g + w.router_w, E);
    b.LayerNormBackward(dres_, g + w.ln2_w, g + w.ln2_b, dln_, a.mid, p + w.ln2_w, a.ln2_mean,
                        a.ln2_rstd, N, C);

    // Attention sub-block: mid = x + attn(ln1(x)) @ o_w + o_b.
    b.Gemm(false, true, N, C, C, 1.0f, dres_, C, p + w.o_w, C, 0.0f, dtmp_, C);
    b.Gemm(true, false, C, C, N, 1.0f, a.atty, C, dres_, C, 1.0f, g + w.o_w, C);
    b.BiasGrad(g + w.o_b, dres_, N, C);
    b.AttentionBackward(dqkv_, dtmp_, a.qkv, a.att, batch_, s.seq, C, s.heads);
    b.Gemm(false, true, N, C, 3 * C, 1.0f, dqkv_, 3 * C, p + w.qkv_w, 3 * C, 0.0f, dln_, C);
    b.Gemm(true, false, C, 3 * C, N, 1.0f, a.ln1, C, dqkv_, 3 * C, 1.0f, g + w.qkv_w, 3 * C);
    b.BiasGrad(g + w.qkv_b, dqkv_, N, 3 * C);
    b.LayerNormBackward(dres_, g + w.ln1_w, g + w.ln1_b, dln_, residual_[l], p + w.ln1_w,
                        a.ln1_mean, a.ln1_rstd, N, C);
  }
  b.EmbeddingBackward(g + layout_.wte(), g + layout_.wpe(), dres_, inputs_dev_, batch_, s.seq, C);
  return absl::OkStatus();
}

absl::StatusOr<StepLoss> MoeGpt::ForwardBackward(const int32_t* inputs, const int32_t* targets,
                                                 int64_t global_rows) {
  const ModelShape& s = shape();
  const int N = batch_ * s.seq, E = s.experts;
  for (int i = 0; i < N; ++i) {
    if (inputs[i] < 0 || inputs[i] >= s.vocab || targets[i] < 0 || targets[i] >= s.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id out of range [0, ", s.vocab, ") at position ", i));
    }
  }
  Backend& b = *backend_;
  RETURN_IF_ERROR(b.CopyToDevice(inputs_dev_, inputs, sizeof(int32_t) * N));
  RETURN_IF_ERROR(b.CopyToDevice(targets_dev_, targets, sizeof(int32_t) * N));
  // The dense gradients, and after the forward those of the experts computed here (the
  // others stay unread).
  b.Zero(grads(), sizeof(float) * layout_.dense_floats());
  RETURN_IF_ERROR(Forward(inputs_dev_));
  if (parallel_ != nullptr) RETURN_IF_ERROR(parallel_->BeforeBackward());
  for (int l = 0; l < s.layers && local_experts(); ++l) {
    for (int e = 0; e < E; ++e) {
      if (parallel_ == nullptr || parallel_->Computes(l, e)) {
        b.Zero(grads() + layout_.ExpertOffset(l, e), sizeof(float) * s.expert_floats());
      }
    }
  }

  // Routing statistics of the whole global batch (DESIGN §3: f_e and P_e are global):
  // this worker's, summed across the workers when there are several.
  const int64_t global_tokens = global_rows * s.seq;
  const int L = s.layers;
  global_stats_.assign(int64_t{3} * L * E, 0.0);
  double* routed = global_stats_.data();
  double* prob_sum = routed + int64_t{L} * E;
  double* kept = prob_sum + int64_t{L} * E;
  for (int l = 0; l < L; ++l) {
    const LayerHost& h = host_[l];
    for (int e = 0; e < E; ++e) {
      routed[int64_t{l} * E + e] = static_cast<double>(h.routed[e]);
      prob_sum[int64_t{l} * E + e] = h.prob_sum[e];
      kept[int64_t{l} * E + e] = static_cast<double>(h.offsets[e + 1] - h.offsets[e]);
    }
  }
  if (parallel_ != nullptr) {
    RETURN_IF_ERROR(parallel_->AllReduce(global_stats_.data(), global_stats_.size()));
    parallel_->RoutingKnown();
  }
  StepLoss loss;
  double local[2] = {0, 0};  // cross-entropy and z-loss sums of this worker's tokens
  for (int l = 0; l < L; ++l) {
    LayerHost& h = host_[l];
    double aux = 0;
    for (int e = 0; e < E; ++e) {
      h.global_f[e] = routed[int64_t{l} * E + e] / (static_cast<double>(global_tokens) * s.top_k);
      aux += h.global_f[e] * (prob_sum[int64_t{l} * E + e] / static_cast<double>(global_tokens));
    }
    loss.aux += E * aux;
    RETURN_IF_ERROR(b.CopyToHost(h.lse.data(), layer_[l].lse, sizeof(float) * N));
    for (float v : h.lse) local[1] += double{v} * v;
  }
  b.CrossEntropyForwardBackward(logits_, losses_, targets_dev_, N, s.vocab,
                                static_cast<float>(1.0 / static_cast<double>(global_tokens)));
  RETURN_IF_ERROR(b.CopyToHost(host_losses_.data(), losses_, sizeof(float) * N));
  for (float v : host_losses_) local[0] += v;
  if (parallel_ != nullptr) RETURN_IF_ERROR(parallel_->AllReduce(local, 2));
  loss.ce = local[0] / static_cast<double>(global_tokens);
  loss.z = local[1] / static_cast<double>(global_tokens);
  loss.loss = loss.ce + s.aux_loss_coef * loss.aux + s.z_loss_coef * loss.z;

  RETURN_IF_ERROR(Backward(global_tokens));
  RETURN_IF_ERROR(b.Synchronize());
  return loss;
}

absl::Status MoeGpt::Logits(const int32_t* inputs, float* logits) {
  const ModelShape& s = shape();
  const int N = batch_ * s.seq;
  for (int i = 0; i < N; ++i) {
    if (inputs[i] < 0 || inputs[i] >= s.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id out of range [0, ", s.vocab, ") at position ", i));
    }
  }
  Backend& b = *backend_;
  RETURN_IF_ERROR(b.CopyToDevice(inputs_dev_, inputs, sizeof(int32_t) * N));
  RETURN_IF_ERROR(Forward(inputs_dev_));
  RETURN_IF_ERROR(b.Synchronize());
  return b.CopyToHost(logits, logits_, sizeof(float) * int64_t{N} * s.vocab);
}

absl::Status MoeGpt::CopyRouterProbs(int layer, float* out) const {
  const int64_t n = int64_t{batch_} * shape().seq * shape().experts;
  return backend_->CopyToHost(out, layer_[layer].probs, sizeof(float) * n);
}

absl::Status MoeGpt::CopyLogitGrads(float* out) const {
  const int64_t n = int64_t{batch_} * shape().seq * shape().vocab;
  return backend_->CopyToHost(out, logits_, sizeof(float) * n);
}

absl::Status MoeGpt::CopyChosenExperts(int layer, int32_t* out) const {
  const int64_t n = int64_t{batch_} * shape().seq * shape().top_k;
  return backend_->CopyToHost(out, layer_[layer].expert, sizeof(int32_t) * n);
}

bool MoeGpt::ExpertUsed(int layer, int expert) const {
  const int L = shape().layers, E = shape().experts;
  if (global_stats_.size() == static_cast<size_t>(3) * L * E) {
    return global_stats_[int64_t{2} * L * E + int64_t{layer} * E + expert] > 0;
  }
  const std::vector<int64_t>& o = host_[layer].offsets;
  return o[expert + 1] > o[expert];
}

}  // namespace pith::model
