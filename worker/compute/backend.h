// Backend: the compute interface the moe-gpt model is written against. One
// implementation per device kind (CPU now, CUDA later); the model code never sees which.
//
// Conventions: every tensor is fp32 (int32 for ids; in the bf16 compute dtype only the
// products' inputs are rounded to bf16, inside the backend), row-major, in memory the backend
// allocated ("device" memory; host RAM for the CPU backend). Ops run in order on the
// backend's one stream; Synchronize() waits for all of them. Gradient outputs named
// d<x> accumulate (+=) unless the comment says "written"; callers zero them per step.
// Shapes: N tokens (= B*T), C model width, H heads, E experts, k top-k, F expert width,
// A kept assignments (rows of the expert buckets), V vocabulary.
//
// Thread safety: a Backend is used by one thread at a time (the training loop).
#ifndef PITH_WORKER_COMPUTE_BACKEND_H_
#define PITH_WORKER_COMPUTE_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/compute_dtype.h"

namespace pith::compute {

class Backend;

// Device memory, freed through its backend when destroyed. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Backend* owner, void* ptr, size_t bytes) : owner_(owner), ptr_(ptr), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : owner_(std::exchange(o.owner_, nullptr)),
        ptr_(std::exchange(o.ptr_, nullptr)),
        bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return ptr_; }
  float* f32() const { return static_cast<float*>(ptr_); }
  int32_t* i32() const { return static_cast<int32_t*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  Backend* owner_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Router decisions for the N tokens of one MoE layer. Device arrays are allocated by the
// caller; the host arrays (the bucket layout, which sizes the grouped GEMMs) too.
struct RoutingBuffers {
  float* probs = nullptr;     // [N, E] written: softmax of the router logits
  float* lse = nullptr;       // [N] written: logsumexp of the router logits
  int32_t* expert = nullptr;  // [N, k] written: chosen experts, by descending p (ties: lower id)
  float* gate = nullptr;      // [N, k] written: gate weights (renormalized if asked)
  int32_t* row = nullptr;     // [N, k] written: row of the assignment in the buckets, -1 = dropped
  int32_t* bucket_token = nullptr;  // [N*k] written: token of each bucket row (first A used)
  // Host: bucket e holds rows [offsets[e], offsets[e+1]); offsets[E] = A.
  int64_t* offsets = nullptr;  // [E + 1]
  int64_t* routed = nullptr;   // [E] assignments per expert before capacity drops
  double* prob_sum = nullptr;  // [E] sum over tokens of probs[:, e]
};

struct RouterConfig {
  int top_k = 1;
  // c > 0: each expert keeps at most ceil(c * k * N / E) assignments, slot-major
  // (slot 0 of every token first); c <= 0: dropless.
  double capacity_factor = 0;
  bool renormalize = true;
};

// Gradient scales of the router losses: aux = aux_coef * E * sum_e f_e * P_e with the
// global f_e (a constant) and P_e = global mean of probs[:, e]; z = z_coef * mean lse^2.
struct RouterLossGrad {
  double aux_coef = 0;
  double z_coef = 0;
  int64_t global_tokens = 1;         // tokens of the global batch in this layer
  const double* global_f = nullptr;  // [E] host: global share of assignments per expert
};

// An expert's parameters (one contiguous blob [w1 C*F | b1 F | w2 F*C | b2 C]). From a
// bf16 weights blob (common/bf16.h; the bf16 compute dtype only), w1 and w2 are null and
// w1_bf16 and w2_bf16 point at the bf16 matrices: the values the products would round
// w1 and w2 to.
struct ExpertWeights {
  const float* w1;
  const float* b1;
  const float* w2;
  const float* b2;
  const uint16_t* w1_bf16 = nullptr;
  const uint16_t* w2_bf16 = nullptr;
  bool bf16() const { return w1_bf16 != nullptr; }
};
// The weights of the expert whose blob (fp32 [w1|b1|w2|b2], or the bf16 form) is at `blob`.
ExpertWeights ExpertWeightsAt(const void* blob, bool bf16, int channels, int hidden);
struct ExpertGrads {
  float* w1;
  float* b1;
  float* w2;
  float* b2;
};

// Device slots paired with host memory, on a backend whose memory the host cannot read
// (DESIGN §2): copies of a host expert cache's slots, uploaded when they change and kept
// on the device while they do not, or device buffers whose contents go down to host
// memory (a gradient pool's) while the backend computes on. A copy runs beside the
// backend's ops (on a GPU: on a copy stream of its own), ordered after the ops that
// touched the slot before its Release, and before the ops that Use the slot next.
//
// Thread safety: the backend's thread only.
class SlotMirror {
 public:
  virtual ~SlotMirror() = default;
  // Starts copying `bytes` from `host` (inside the registered range given at creation)
  // into device slot i. `host` must stay unchanged until WaitCopies returns.
  virtual absl::Status Upload(int i, const void* host, size_t bytes) = 0;
  // Starts copying `bytes` of device slot i into `host` (inside the registered range), as
  // the ops issued before Release(i) left them. `host` holds them once WaitSlot(i) or
  // WaitCopies returns; reading it sooner reads garbage.
  virtual absl::Status Download(int i, void* host, size_t bytes) = 0;
  // Device slot i; the backend's later ops see its last upload and may write it once its
  // last download has read it.
  virtual absl::StatusOr<void*> Use(int i) = 0;
  // The backend's ops issued so far are the last to touch slot i before its next copy.
  virtual absl::Status Release(int i) = 0;
  // Waits on the host until slot i's last copy is done.
  virtual absl::Status WaitSlot(int i) = 0;
  // Waits on the host until every copy issued so far is done (uploads' host bytes free,
  // downloads' landed).
  virtual absl::Status WaitCopies() = 0;
  // Uploads and downloads issued since creation.
  virtual uint64_t uploads() const = 0;
  virtual uint64_t downloads() const = 0;
  virtual int slots() const = 0;
};

// One transfer of a DeviceGroup::Exchange: `bytes` of device memory at `data`, to or from
// rank `peer`.
struct DeviceTransfer {
  int peer;
  void* data;
  size_t bytes;
};

// A collective among the devices of a job's workers (NCCL on CUDA), one per placement
// epoch: rank 0 makes its id (Backend::NewGroupId), the job's peer group carries it, and
// every rank joins (Backend::JoinGroup). Never a hang: every call waits with a deadline,
// and an error, a passed deadline or RequestAbort aborts the group, which then refuses
// every later call.
//
// Thread safety: the backend's thread, except RequestAbort (any thread).
class DeviceGroup {
 public:
  virtual ~DeviceGroup() = default;
  // Sums `n` floats of this backend's memory across the group, in place; returns once the
  // sum is there (the backend's earlier ops included).
  virtual absl::Status AllReduceSum(float* data, size_t n, absl::Duration timeout) = 0;
  // One grouped exchange: each send goes to its peer, each receive comes from its peer,
  // in the listed order per pair (as NCCL matches them); empty transfers are skipped, and
  // both sides agree on every non-empty transfer's size. Returns once every receive has
  // landed (the backend's earlier ops included).
  virtual absl::Status Exchange(absl::Span<const DeviceTransfer> sends,
                                absl::Span<const DeviceTransfer> recvs, absl::Duration timeout) = 0;
  // Aborts the call in progress, or the next one.
  virtual void RequestAbort() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual absl::string_view name() const = 0;
  // Whether the host may read and write this backend's memory directly (the CPU's); false
  // for a device's, which only the copies below reach.
  virtual bool host_addressable() const { return true; }
  // Device memory this backend holds now: its buffers, scratch and slot mirrors (0 for a
  // backend computing in host memory). Any thread.
  virtual uint64_t device_bytes() const { return 0; }

  // --- memory and stream ---------------------------------------------------------------
  // Zero-filled device memory. RESOURCE_EXHAUSTED when there is none.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) = 0;
  // Up to `slots` device slots of `slot_bytes` (fewer where the device cannot spare them,
  // at least 2) for the host slots at [host, host + host_bytes) (a non-host-addressable
  // backend's; UNIMPLEMENTED elsewhere).
  virtual absl::StatusOr<std::unique_ptr<SlotMirror>> MakeSlotMirror(size_t slot_bytes, int slots,
                                                                     void* host, size_t host_bytes);
  // A new device group's id (on rank 0), and this rank's join of the group `id` of
  // `world` ranks, waiting at most `timeout` for the others, or until `abandon` is set
  // (from any thread: the attempt was aborted; ABORTED). UNIMPLEMENTED on a backend
  // without one: the job's peer group carries its sums instead.
  virtual absl::StatusOr<std::string> NewGroupId();
  virtual absl::StatusOr<std::unique_ptr<DeviceGroup>> JoinGroup(const std::string& id, int rank,
                                                                 int world, absl::Duration timeout,
                                                                 const std::atomic<bool>& abandon);
  virtual absl::Status CopyToHost(void* dst, const void* src, size_t bytes) = 0;
  virtual void Zero(void* dst, size_t bytes) = 0;
  // Waits for every op issued so far; reports an asynchronous failure.
  virtual absl::Status Synchronize() = 0;

  // The precision of Gemm and of the expert products from now on: fp32 (the default,
  // every backend) or bf16 (inputs rounded to bf16 to nearest even, products accumulated
  // and written in fp32), where the backend has it; INVALID_ARGUMENT where it has not.
  virtual absl::Status SetComputeDtype(ComputeDtype dtype);
  virtual ComputeDtype compute_dtype() const { return ComputeDtype::kFp32; }

  // --- dense ops -----------------------------------------------------------------------
  // c[M,N] = alpha * op(a) @ op(b) + beta * c, op = transpose when asked (BLAS semantics,
  // row-major, leading dimensions in elements). In the compute dtype.
  virtual void Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a,
                    int lda, const float* b, int ldb, float beta, float* c, int ldc) = 0;
  // Gemm in fp32 whatever the compute dtype: the router's products.
  virtual void GemmFp32(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                        const float* a, int lda, const float* b, int ldb, float beta, float* c,
                        int ldc) {
    Gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  // out[M,N] += bias[N] on every row.
  virtual void AddBias(float* out, const float* bias, int m, int n) = 0;
  // dbias[N] += column sums of dout[M,N].
  virtual void BiasGrad(float* dbias, const float* dout, int m, int n) = 0;
  // out = a + b (n elements; out may alias a).
  virtual void Add(float* out, const float* a, const float* b, int64_t n) = 0;

  // out[B*T, C] written = wte[tokens] + wpe[t].
  virtual void Embedding(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                         int batch, int seq, int channels) = 0;
  virtual void EmbeddingBackward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                                 int batch, int seq, int channels) = 0;

  // out, mean[N], rstd[N] written; eps 1e-5.
  virtual void LayerNorm(float* out, float* mean, float* rstd, const float* x, const float* w,
                         const float* b, int n, int channels) = 0;
  virtual void LayerNormBackward(float* dx, float* dw, float* db, const float* dout, const float* x,
                                 const float* w, const float* mean, const float* rstd, int n,
                                 int channels) = 0;

  // Causal multi-head attention. qkv [B*T, 3C] (q|k|v, heads contiguous); out [B*T, C]
  // and att [B, H, T, T] (softmax probabilities) written.
  virtual void Attention(float* out, float* att, const float* qkv, int batch, int seq, int channels,
                         int heads) = 0;
  // dqkv written.
  virtual void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                                 int batch, int seq, int channels, int heads) = 0;

  // gelu with the tanh approximation; out written; dx written.
  virtual void Gelu(float* out, const float* x, int64_t n) = 0;
  virtual void GeluBackward(float* dx, const float* x, const float* dout, int64_t n) = 0;

  // Softmax cross-entropy over logits [N, V] with targets [N]: the per-token losses are
  // written to losses[N] and the logits are overwritten with d(loss_sum * scale)/dlogits.
  virtual void CrossEntropyForwardBackward(float* logits, float* losses, const int32_t* targets,
                                           int n, int vocab, float scale) = 0;

  // --- optimizer ---------------------------------------------------------------------------
  // Sum of x[i]^2, accumulated in double; synchronizes (the result is on the host).
  virtual double SumOfSquares(const float* x, int64_t n) = 0;
  // x *= s.
  virtual void Scale(float* x, float s, int64_t n) = 0;
  // One AdamW step on n elements as PyTorch defines it (DESIGN §3), `step` being the
  // tensor's update count after this update (1 for the first):
  // p -= lr*wd*p; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
  // p -= lr/(1-b1^step) * m / (sqrt(v)/sqrt(1-b2^step) + eps).
  virtual void AdamW(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                     float beta1, float beta2, float eps, float weight_decay, int64_t step) = 0;

  // --- mixture of experts ----------------------------------------------------------------
  // Routes N tokens from router logits [N, E] (fp32). See RoutingBuffers.
  virtual void Route(const float* logits, int n, int experts, const RouterConfig& config,
                     const RoutingBuffers& out) = 0;
  // bucket[A, C] written: row r holds x[bucket_token[r]].
  virtual void Permute(float* bucket, const float* x, const int32_t* bucket_token, int64_t rows,
                       int channels) = 0;
  // dst row dst_row[r] written with src row r, for r < rows (no dst row twice): rows that
  // came back together put in their places.
  virtual void ScatterRows(float* dst, const float* src, const int32_t* dst_row, int64_t rows,
                           int channels) = 0;
  // dx[N, C] += the bucket rows of each token's kept assignments (row [N, k]).
  virtual void PermuteBackward(float* dx, const float* dbucket, const int32_t* row, int n,
                               int top_k, int channels) = 0;
  // out[N, C] written = sum over kept assignments of gate * y[row].
  virtual void Combine(float* out, const float* y, const int32_t* row, const float* gate, int n,
                       int top_k, int channels) = 0;
  // dy[A, C] written = gate * dout[token]; dgate[N, k] written = <dout[token], y[row]>
  // (0 for dropped assignments).
  virtual void CombineBackward(float* dy, float* dgate, const float* dout, const float* y,
                               const int32_t* row, const float* gate, int n, int top_k,
                               int channels) = 0;
  // The expert FFN over every bucket: y = gelu(x @ w1 + b1) @ w2 + b2, with hpre (x @ w1 +
  // b1) and h (its gelu) [A, F] written for the backward pass. offsets as in RoutingBuffers;
  // experts with empty buckets are skipped.
  virtual void ExpertForward(float* y, float* hpre, float* h, const float* x,
                             const int64_t* offsets, absl::Span<const ExpertWeights> experts,
                             int channels, int hidden) = 0;
  // dx [A, C] written; the grads of experts with non-empty buckets accumulate; dh is
  // scratch [A, F].
  virtual void ExpertBackward(float* dx, float* dh, absl::Span<const ExpertGrads> grads,
                              const float* dy, const float* x, const float* hpre, const float* h,
                              const int64_t* offsets, absl::Span<const ExpertWeights> experts,
                              int channels, int hidden) = 0;
  // dlogits [N, E] written: gradient of the gate weights (dgate) and of the aux and z
  // losses through the softmax. Dropped assignments still count in the renormalization.
  virtual void RouteBackward(float* dlogits, const float* dgate, const RoutingBuffers& routing,
                             int n, int experts, const RouterConfig& config,
                             const RouterLossGrad& loss) = 0;

 protected:
  friend class DeviceBuffer;
  // Releases memory from Allocate; called by DeviceBuffer only.
  virtual void Free(void* ptr, size_t bytes) = 0;
};

// `n` elements of `backend`'s memory at `p`, readable on the host: `p` itself where the
// backend's memory is the host's, else a copy made now in `copy`.
template <typename T>
absl::StatusOr<const T*> ReadableOnHost(Backend& backend, const T* p, int64_t n,
                                        std::vector<T>& copy) {
  if (backend.host_addressable() || n == 0) return p;
  copy.resize(n);
  absl::Status st = backend.CopyToHost(copy.data(), p, n * sizeof(T));
  if (!st.ok()) return st;
  return copy.data();
}

}  // namespace pith::compute

#endif  // PITH_WORKER_COMPUTE_BACKEND_H_
