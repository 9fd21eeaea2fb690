#include "worker/compute/opaque_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status.h"

namespace pith::compute {

OpaqueBackend::~OpaqueBackend() {
  for (const auto& [ptr, bytes] : mappings_) ::munmap(ptr, bytes);
}

void OpaqueBackend::Protect(bool closed) {
  for (const auto& [ptr, bytes] : mappings_) {
    if (::mprotect(ptr, bytes, closed ? PROT_NONE : PROT_READ | PROT_WRITE) != 0) {
      std::fprintf(stderr, "opaque backend: mprotect: %s\n", std::strerror(errno));
      std::abort();
    }
  }
}

bool OpaqueBackend::Inside(const void* p, size_t bytes) const {
  auto it = mappings_.upper_bound(const_cast<void*>(p));
  if (it == mappings_.begin()) return false;
  --it;
  const auto* begin = static_cast<const char*>(it->first);
  const auto* at = static_cast<const char*>(p);
  return at >= begin && at + bytes <= begin + it->second;
}

void OpaqueBackend::Expect(const char* op, std::initializer_list<const void*> device,
                           const void* host) const {
  for (const void* p : device) {
    if (p != nullptr && !Inside(p, 1)) {
      std::fprintf(stderr, "opaque backend: %s: a host pointer where device memory belongs\n", op);
      std::abort();
    }
  }
  if (host != nullptr && Inside(host, 1)) {
    std::fprintf(stderr, "opaque backend: %s: device memory where a host pointer belongs\n", op);
    std::abort();
  }
}

absl::StatusOr<DeviceBuffer> OpaqueBackend::Allocate(size_t bytes) {
  if (bytes == 0) return DeviceBuffer(this, nullptr, 0);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t mapped = (bytes + page - 1) / page * page;
  void* p = ::mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("opaque backend: cannot map ", bytes));
  }
  mappings_[p] = mapped;  // zero-filled, as Allocate promises
  held_ += mapped;
  return DeviceBuffer(this, p, bytes);
}

void OpaqueBackend::Free(void* ptr, size_t) {
  auto it = mappings_.find(ptr);
  if (it == mappings_.end()) return;
  ::munmap(it->first, it->second);
  held_ -= it->second;
  mappings_.erase(it);
}

absl::Status OpaqueBackend::CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) Expect("CopyToDevice", {dst}, src);
  Open open(this);
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status OpaqueBackend::CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) Expect("CopyToHost", {src}, dst);
  Open open(this);
  if (bytes > 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

namespace {

// The experts with every bf16 weight matrix widened to fp32 (and, with `round`, every fp32
// one rounded through bf16, as the bf16 compute dtype's products see it), in buffers of
// its own; the biases as they are. What the CPU's fp32 expert ops then compute on.
class HostFp32Experts {
 public:
  HostFp32Experts(absl::Span<const ExpertWeights> experts, int channels, int hidden, bool round) {
    const size_t cf = static_cast<size_t>(channels) * hidden;
    for (const ExpertWeights& w : experts) {
      if (!w.bf16() && !round) {
        weights_.push_back(w);
        continue;
      }
      std::vector<float>& f = floats_.emplace_back(2 * cf);
      for (size_t i = 0; i < cf; ++i) {
        f[i] = w.bf16() ? Bf16ToFloat(w.w1_bf16[i]) : Bf16ToFloat(RoundToBf16(w.w1[i]));
        f[cf + i] = w.bf16() ? Bf16ToFloat(w.w2_bf16[i]) : Bf16ToFloat(RoundToBf16(w.w2[i]));
      }
      weights_.push_back({f.data(), w.b1, f.data() + cf, w.b2});
    }
  }
  absl::Span<const ExpertWeights> get() const { return weights_; }

 private:
  std::vector<std::vector<float>> floats_;
  std::vector<ExpertWeights> weights_;
};

class OpaqueSlotMirror final : public SlotMirror {
 public:
  OpaqueSlotMirror(OpaqueBackend* backend, DeviceBuffer arena, size_t slot_bytes, int slots,
                   void* host, size_t host_bytes)
      : backend_(backend),
        arena_(std::move(arena)),
        slot_bytes_(slot_bytes),
        host_(static_cast<uint8_t*>(host)),
        host_bytes_(host_bytes),
        pending_(slots),
        landing_(slots),
        in_use_(slots, false) {}

  // The copy lands at once, but the host bytes are held to the contract: unchanged until
  // WaitCopies, which aborts (naming it) when they changed, as a DMA still reading them
  // would have copied other bytes.
  absl::Status Upload(int i, const void* host, size_t bytes) override {
    auto* p = static_cast<uint8_t*>(const_cast<void*>(host));
    RETURN_IF_ERROR(Check(i, p, bytes, "upload"));
    pending_[i] = {p, std::vector<uint8_t>(p, p + bytes)};
    ++uploads_;
    return backend_->CopyToDevice(Slot(i), p, bytes);
  }
  // The slot's bytes are read at once, but land in `host` only at WaitSlot or WaitCopies;
  // until then `host` holds NaNs (all bits set), as a DMA still writing it would leave
  // something else there.
  absl::Status Download(int i, void* host, size_t bytes) override {
    auto* p = static_cast<uint8_t*>(host);
    RETURN_IF_ERROR(Check(i, p, bytes, "download"));
    if (in_use_[i]) {  // a GPU's copy would not wait for the ops that write it
      return absl::FailedPreconditionError(
          "slot mirror: a download of a slot used since its Release");
    }
    RETURN_IF_ERROR(Land(i));  // the slot's last download, before this one replaces it
    std::vector<uint8_t> bytes_now(bytes);
    RETURN_IF_ERROR(backend_->CopyToHost(bytes_now.data(), Slot(i), bytes));
    std::memset(p, 0xff, bytes);
    landing_[i] = {p, std::move(bytes_now)};
    ++downloads_;
    return absl::OkStatus();
  }
  absl::StatusOr<void*> Use(int i) override {
    if (i < 0 || i >= slots()) return absl::InvalidArgumentError("slot mirror: no such slot");
    in_use_[i] = true;
    return static_cast<void*>(Slot(i));
  }
  absl::Status Release(int i) override {
    if (i < 0 || i >= slots()) return absl::InvalidArgumentError("slot mirror: no such slot");
    in_use_[i] = false;
    return absl::OkStatus();
  }
  absl::Status WaitSlot(int i) override {
    if (i < 0 || i >= slots()) return absl::InvalidArgumentError("slot mirror: no such slot");
    return Land(i);
  }
  absl::Status WaitCopies() override {
    for (int i = 0; i < slots(); ++i) RETURN_IF_ERROR(Land(i));
    return absl::OkStatus();
  }
  uint64_t uploads() const override { return uploads_; }
  uint64_t downloads() const override { return downloads_; }
  int slots() const override { return static_cast<int>(pending_.size()); }

 private:
  uint8_t* Slot(int i) const { return static_cast<uint8_t*>(arena_.data()) + slot_bytes_ * i; }
  absl::Status Check(int i, const uint8_t* p, size_t bytes, const char* what) const {
    if (i < 0 || i >= slots() || bytes > slot_bytes_ || p < host_ ||
        p + bytes > host_ + host_bytes_) {
      return absl::InvalidArgumentError(
          absl::StrCat("slot mirror: ", what, " outside its slots or its host memory"));
    }
    return absl::OkStatus();
  }
  // Slot i's last copy done: an upload's host bytes checked, a download's landed.
  absl::Status Land(int i) {
    auto& [from, bytes] = pending_[i];
    if (from != nullptr && !std::equal(bytes.begin(), bytes.end(), from)) {
      std::fprintf(stderr,
                   "opaque backend: a slot's host bytes changed before its upload was "
                   "waited for\n");
      std::abort();
    }
    from = nullptr;
    auto& [to, landed] = landing_[i];
    if (to != nullptr) std::memcpy(to, landed.data(), landed.size());
    to = nullptr;
    return absl::OkStatus();
  }

  OpaqueBackend* backend_;
  DeviceBuffer arena_;
  size_t slot_bytes_;
  uint8_t* host_;
  size_t host_bytes_;
  // [slot]: an upload not waited for, and the bytes it copied; a download not waited for,
  // and the bytes it read.
  std::vector<std::pair<const uint8_t*, std::vector<uint8_t>>> pending_;
  std::vector<std::pair<uint8_t*, std::vector<uint8_t>>> landing_;
  std::vector<bool> in_use_;  // [slot]: Use since its last Release
  uint64_t uploads_ = 0, downloads_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<SlotMirror>> OpaqueBackend::MakeSlotMirror(size_t slot_bytes,
                                                                          int slots, void* host,
                                                                          size_t host_bytes) {
  if (slots <= 0 || slot_bytes == 0) {
    return absl::InvalidArgumentError("slot mirror: no slots");
  }
  ASSIGN_OR_RETURN(DeviceBuffer arena, Allocate(slot_bytes * slots));
  return std::unique_ptr<SlotMirror>(
      new OpaqueSlotMirror(this, std::move(arena), slot_bytes, slots, host, host_bytes));
}

void OpaqueBackend::Zero(void* dst, size_t bytes) {
  Open open(this);
  if (bytes > 0) std::memset(dst, 0, bytes);
}

void OpaqueBackend::Gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                         const float* a, int lda, const float* b, int ldb, float beta, float* c,
                         int ldc) {
  Open open(this);
  cpu_.Gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void OpaqueBackend::AddBias(float* out, const float* bias, int m, int n) {
  Open open(this);
  cpu_.AddBias(out, bias, m, n);
}

void OpaqueBackend::BiasGrad(float* dbias, const float* dout, int m, int n) {
  Open open(this);
  cpu_.BiasGrad(dbias, dout, m, n);
}

void OpaqueBackend::Add(float* out, const float* a, const float* b, int64_t n) {
  Open open(this);
  cpu_.Add(out, a, b, n);
}

void OpaqueBackend::Embedding(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                              int batch, int seq, int channels) {
  Open open(this);
  cpu_.Embedding(out, tokens, wte, wpe, batch, seq, channels);
}

void OpaqueBackend::EmbeddingBackward(float* dwte, float* dwpe, const float* dout,
                                      const int32_t* tokens, int batch, int seq, int channels) {
  Open open(this);
  cpu_.EmbeddingBackward(dwte, dwpe, dout, tokens, batch, seq, channels);
}

void OpaqueBackend::LayerNorm(float* out, float* mean, float* rstd, const float* x, const float* w,
                              const float* b, int n, int channels) {
  Open open(this);
  cpu_.LayerNorm(out, mean, rstd, x, w, b, n, channels);
}

void OpaqueBackend::LayerNormBackward(float* dx, float* dw, float* db, const float* dout,
                                      const float* x, const float* w, const float* mean,
                                      const float* rstd, int n, int channels) {
  Open open(this);
  cpu_.LayerNormBackward(dx, dw, db, dout, x, w, mean, rstd, n, channels);
}

void OpaqueBackend::Attention(float* out, float* att, const float* qkv, int batch, int seq,
                              int channels, int heads) {
  Open open(this);
  cpu_.Attention(out, att, qkv, batch, seq, channels, heads);
}

void OpaqueBackend::AttentionBackward(float* dqkv, const float* dout, const float* qkv,
                                      const float* att, int batch, int seq, int channels,
                                      int heads) {
  Open open(this);
  cpu_.AttentionBackward(dqkv, dout, qkv, att, batch, seq, channels, heads);
}

void OpaqueBackend::Gelu(float* out, const float* x, int64_t n) {
  Open open(this);
  cpu_.Gelu(out, x, n);
}

void OpaqueBackend::GeluBackward(float* dx, const float* x, const float* dout, int64_t n) {
  Open open(this);
  cpu_.GeluBackward(dx, x, dout, n);
}

void OpaqueBackend::CrossEntropyForwardBackward(float* logits, float* losses,
                                                const int32_t* targets, int n, int vocab,
                                                float scale) {
  Open open(this);
  cpu_.CrossEntropyForwardBackward(logits, losses, targets, n, vocab, scale);
}

double OpaqueBackend::SumOfSquares(const float* x, int64_t n) {
  Open open(this);
  return cpu_.SumOfSquares(x, n);
}

void OpaqueBackend::Scale(float* x, float s, int64_t n) {
  Open open(this);
  cpu_.Scale(x, s, n);
}

void OpaqueBackend::AdamW(float* param, const float* grad, float* m, float* v, int64_t n, float lr,
                          float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  Open open(this);
  cpu_.AdamW(param, grad, m, v, n, lr, beta1, beta2, eps, weight_decay, step);
}

void OpaqueBackend::Route(const float* logits, int n, int experts, const RouterConfig& config,
                          const RoutingBuffers& out) {
  Open open(this);
  cpu_.Route(logits, n, experts, config, out);
}

void OpaqueBackend::Permute(float* bucket, const float* x, const int32_t* bucket_token,
                            int64_t rows, int channels) {
  Open open(this);
  cpu_.Permute(bucket, x, bucket_token, rows, channels);
}

void OpaqueBackend::ScatterRows(float* dst, const float* src, const int32_t* dst_row, int64_t rows,
                                int channels) {
  Open open(this);
  cpu_.ScatterRows(dst, src, dst_row, rows, channels);
}

void OpaqueBackend::PermuteBackward(float* dx, const float* dbucket, const int32_t* row, int n,
                                    int top_k, int channels) {
  Open open(this);
  cpu_.PermuteBackward(dx, dbucket, row, n, top_k, channels);
}

void OpaqueBackend::Combine(float* out, const float* y, const int32_t* row, const float* gate,
                            int n, int top_k, int channels) {
  Open open(this);
  cpu_.Combine(out, y, row, gate, n, top_k, channels);
}

void OpaqueBackend::CombineBackward(float* dy, float* dgate, const float* dout, const float* y,
                                    const int32_t* row, const float* gate, int n, int top_k,
                                    int channels) {
  Open open(this);
  cpu_.CombineBackward(dy, dgate, dout, y, row, gate, n, top_k, channels);
}

void OpaqueBackend::ExpertForward(float* y, float* hpre, float* h, const float* x,
                                  const int64_t* offsets, absl::Span<const ExpertWeights> experts,
                                  int channels, int hidden) {
  for (const ExpertWeights& w : experts)
    Expect("ExpertForward (weights)", {w.w1, w.b1, w.w2, w.b2, w.w1_bf16, w.w2_bf16});
  Expect("ExpertForward", {y, hpre, h, x}, offsets);
  Open open(this);
  const HostFp32Experts wide(experts, channels, hidden, dtype_ == ComputeDtype::kBf16);
  cpu_.ExpertForward(y, hpre, h, x, offsets, wide.get(), channels, hidden);
}

void OpaqueBackend::ExpertBackward(float* dx, float* dh, absl::Span<const ExpertGrads> grads,
                                   const float* dy, const float* x, const float* hpre,
                                   const float* h, const int64_t* offsets,
                                   absl::Span<const ExpertWeights> experts, int channels,
                                   int hidden) {
  for (const ExpertWeights& w : experts)
    Expect("ExpertBackward (weights)", {w.w1, w.b1, w.w2, w.b2, w.w1_bf16, w.w2_bf16});
  for (const ExpertGrads& g : grads) Expect("ExpertBackward (grads)", {g.w1, g.b1, g.w2, g.b2});
  Expect("ExpertBackward", {dx, dh, dy, x, hpre, h}, offsets);
  Open open(this);
  const HostFp32Experts wide(experts, channels, hidden, dtype_ == ComputeDtype::kBf16);
  cpu_.ExpertBackward(dx, dh, grads, dy, x, hpre, h, offsets, wide.get(), channels, hidden);
}

void OpaqueBackend::RouteBackward(float* dlogits, const float* dgate, const RoutingBuffers& routing,
                                  int n, int experts, const RouterConfig& config,
                                  const RouterLossGrad& loss) {
  Open open(this);
  cpu_.RouteBackward(dlogits, dgate, routing, n, experts, config, loss);
}

}  // namespace pith::compute
