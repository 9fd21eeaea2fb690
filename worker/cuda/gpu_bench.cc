// gpu_bench: the CUDA backend's expert FFN and MoE layer, each against an anchor measured in
// the same run on the same device.
//
//   gpu_bench [--tokens=16384] [--iters=5] [--device=0]
//
// Shapes: Qwen3-30B-A3B (d 2048, f 768, E 128, top-8) and DeepSeek-V2-Lite (d 2048,
// f 1408, E 64, top-6). Each measurement runs for both shapes before the next, the grouped
// kernels' last (the wgmma ones after mma.sync's): a fault there ends the process's use of
// the device, with every other figure in. Per shape, one line each:
//   expert_ffn      fp32 grouped FFN fwd+bwd (ExpertForward/Backward: the products, bias and
//                   gelu) against a dense fp32 cuBLAS GEMM of the same FLOPs;
//   expert_gemm_bf16 the FFN's six products per bucket (2 forward, 4 backward) in bf16 with
//                   fp32 accumulation (weight gradients into fp32), fanned out over side
//                   streams (FanOutGemmBf16), against a dense bf16 cuBLAS GEMM of the same
//                   FLOPs and the H200's ~790 TFLOP/s; its detail line has each phase and
//                   the same products as cuBLAS grouped calls;
//   expert_gemm_bf16_batched the same products as cuBLAS batched calls of row chunks
//                   (BatchedGemmBf16), against the same dense GEMM;
//   expert_gemm_bf16_kernel the same products through Pith's grouped kernels
//                   (KernelGemmBf16: one launch a phase), one line per tile shape (the
//                   mma.sync ones, then the wgmma ones where they run), against the same
//                   dense GEMM;
//   expert_fetch    uploads of a bf16 expert blob into DeviceSlots from registered pinned
//                   staging, against a plain pinned cudaMemcpy of the same bytes;
//   moe_layer       the whole MoE layer fwd+bwd through the backend (router GEMM in fp32,
//                   Route with its device layout, permute, experts, combine, every backward)
//                   in ms, in the fp32 and in the bf16 compute dtype (bf16_batched: its
//                   products as batched calls; bf16_kernel: through the mma.sync kernel;
//                   bf16_wgmma_128x128 and bf16_wgmma_128x256: through the wgmma one, each
//                   with a detail line of kernel launches, or an error where the expert
//                   phases went to the fan-out), for tests/gpu/run.sh to set against
//                   PyTorch's (torch_moe_bench.py).
// Tokens in the GEMM benches spread over the experts with a skew (the first expert gets
// twice the mean, the last half); the layer routes random tokens through a random router.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/types/span.h"
#include "common/bf16.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/cuda/device_slots.h"

namespace pith::cuda {
namespace {

struct Shape {
  const char* name;
  int channels, hidden, experts, top_k;
};

int64_t Flag(int argc, char** argv, const char* name, int64_t fallback) {
  const std::string prefix = std::string("--") + name + "=";
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], prefix.c_str(), prefix.size()) == 0) {
      return std::atoll(argv[i] + prefix.size());
    }
  }
  return fallback;
}

// Fills `n` device floats with N(0, scale) values (a 4M-float host pattern, repeated).
bool Fill(CudaBackend& b, float* dev, int64_t n, float scale) {
  static std::vector<float> pattern = [] {
    std::mt19937 rng(1);
    std::normal_distribution<float> d(0.0f, 1.0f);
    std::vector<float> v(1 << 22);
    for (float& x : v) x = d(rng);
    return v;
  }();
  std::vector<float> scaled(pattern.size());
  for (size_t i = 0; i < pattern.size(); ++i) scaled[i] = pattern[i] * scale;
  for (int64_t at = 0; at < n; at += static_cast<int64_t>(scaled.size())) {
    const int64_t count = std::min<int64_t>(scaled.size(), n - at);
    if (!b.CopyToDevice(dev + at, scaled.data(), sizeof(float) * count).ok()) return false;
  }
  return true;
}

template <typename F>
double SecondsPerIter(CudaBackend& b, int iters, F&& body) {
  body();  // warm-up
  if (!b.Synchronize().ok()) return -1;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) body();
  if (!b.Synchronize().ok()) return -1;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
}

// Bucket offsets for A assignments over E experts: a linear skew from 2x the mean
// (expert 0) to 0.5x (the last); the rounding remainder goes to the last.
std::vector<int64_t> SkewedOffsets(int E, int64_t A) {
  std::vector<int64_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    const double share = (2.0 - 1.5 * e / std::max(1, E - 1)) / (1.25 * E);
    offsets[e + 1] = std::min<int64_t>(A, offsets[e] + static_cast<int64_t>(share * A));
  }
  offsets[E] = A;
  return offsets;
}

// Each expert's views into contiguous fp32 blobs [w1 C*F | b1 F | w2 F*C | b2 C].
void ExpertViews(const float* w, float* g, int E, int C, int F,
                 std::vector<compute::ExpertWeights>& ws, std::vector<compute::ExpertGrads>& gs) {
  const int64_t cf = int64_t{C} * F, blob = 2 * cf + F + C;
  for (int e = 0; e < E; ++e) {
    const float* p = w + e * blob;
    float* q = g + e * blob;
    ws.push_back({p, p + cf, p + cf + F, p + 2 * cf + F});
    gs.push_back({q, q + cf, q + cf + F, q + 2 * cf + F});
  }
}

int RunShape(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  const int C = s.channels, F = s.hidden, E = s.experts;
  const int64_t A = tokens * s.top_k;
  const std::vector<int64_t> offsets = SkewedOffsets(E, A);
  const int64_t expert_floats = 2 * int64_t{C} * F + F + C;
  auto alloc = [&](int64_t floats) { return b.Allocate(sizeof(float) * floats); };
  auto x = alloc(A * C), y = alloc(A * C), hpre = alloc(A * F), h = alloc(A * F);
  auto dy = alloc(A * C), dx = alloc(A * C), dh = alloc(A * F);
  auto w = alloc(E * expert_floats), g = alloc(E * expert_floats);
  for (auto* buf : {&x, &y, &hpre, &h, &dy, &dx, &dh, &w, &g}) {
    if (!buf->ok()) {
      std::fprintf(stderr, "%s: %s\n", s.name, buf->status().ToString().c_str());
      return 1;
    }
  }
  if (!Fill(b, x->f32(), A * C, 1.0f) || !Fill(b, w->f32(), E * expert_floats, 0.02f) ||
      !Fill(b, dy->f32(), A * C, 1e-3f)) {
    std::fprintf(stderr, "%s: fill: %s\n", s.name, b.status().ToString().c_str());
    return 1;
  }
  std::vector<compute::ExpertWeights> ws;
  std::vector<compute::ExpertGrads> gs;
  ExpertViews(w->f32(), g->f32(), E, C, F, ws, gs);
  const double grouped = SecondsPerIter(b, iters, [&] {
    b.ExpertForward(y->f32(), hpre->f32(), h->f32(), x->f32(), offsets.data(), ws, C, F);
    b.ExpertBackward(dx->f32(), dh->f32(), gs, dy->f32(), x->f32(), hpre->f32(), h->f32(),
                     offsets.data(), ws, C, F);
  });
  // The same FLOPs as six [A, C] x [C, F] products (2 forward, 4 backward).
  const double dense = SecondsPerIter(b, iters, [&] {
    for (int i = 0; i < 6; ++i) {
      b.Gemm(false, false, static_cast<int>(A), F, C, 1.0f, x->f32(), C, w->f32(), F, 0.0f,
             hpre->f32(), F);
    }
  });
  if (grouped <= 0 || dense <= 0) {
    std::fprintf(stderr, "%s: %s\n", s.name, b.status().ToString().c_str());
    return 1;
  }
  const double flops = 12.0 * static_cast<double>(A) * C * F;
  std::printf(
      "expert_ffn %-16s tokens=%lld A=%lld  grouped fwd+bwd %.2f ms %.1f TFLOP/s  dense %.1f "
      "TFLOP/s  ratio %.3f (target >= 0.8)\n",
      s.name, static_cast<long long>(tokens), static_cast<long long>(A), grouped * 1e3,
      flops / grouped / 1e12, flops / dense / 1e12, dense / grouped);
  return 0;
}

// Reports allocation failures by name; true when every buffer is there.
bool AllOk(const char* name,
           std::initializer_list<const absl::StatusOr<compute::DeviceBuffer>*> bufs) {
  for (const auto* buf : bufs) {
    if (!buf->ok()) {
      std::fprintf(stderr, "%s: %s\n", name, buf->status().ToString().c_str());
      return false;
    }
  }
  return true;
}

using Bf16Call = std::pair<const char*, const std::vector<CudaBackend::Bf16Gemm>*>;

double Flops(const std::vector<CudaBackend::Bf16Gemm>& problems) {
  double f = 0;
  for (const auto& p : problems) f += 2.0 * p.m * p.n * p.k;
  return f;
}

// TFLOP/s of each phase on its own: where the FFN's time goes.
// `run` issues one phase (the fan-out by default).
using Bf16Run = std::function<void(const std::vector<CudaBackend::Bf16Gemm>&, const char*)>;
std::string Bf16Breakdown(CudaBackend& b, const std::vector<Bf16Call>& calls, int iters,
                          const Bf16Run& run = nullptr) {
  std::string out;
  for (const Bf16Call& call : calls) {
    const auto& [name, problems] = call;
    const double t = SecondsPerIter(b, iters, [&] {
      if (run) {  // call's members: clang 14 cannot capture structured bindings
        run(*call.second, call.first);
      } else {
        b.FanOutGemmBf16(*call.second, call.first);
      }
    });
    char part[64];
    std::snprintf(part, sizeof(part), " %s %.0f", name, Flops(*problems) / t / 1e12);
    out += part;
  }
  return out;
}

// TFLOP/s of `fan_out` with other side-stream and launch-thread counts, for the detail
// line; the backend's own setting again afterwards.
std::string OtherFanOuts(CudaBackend& b, int iters, double flops,
                         const std::function<void()>& fan_out) {
  const int streams = b.side_streams(), threads = b.launch_threads();
  std::string out;
  for (auto [n, t] : {std::pair{2, 1}, std::pair{8, 1}, std::pair{4, 4}, std::pair{8, 8}}) {
    b.set_side_streams(n);
    b.set_launch_threads(t);
    char part[64];
    std::snprintf(part, sizeof(part), " %d streams/%d threads %.0f", n, t,
                  flops / SecondsPerIter(b, iters, fan_out) / 1e12);
    out += part;
  }
  b.set_side_streams(streams);
  b.set_launch_threads(threads);
  return out;
}

// The FFN's six products in bf16 (fp32 accumulation) over skewed buckets, as problem
// lists per phase, with the device memory they use. Weight gradients go into fp32 with
// beta 1 (bwd_dw), or into bf16 (bwd_dw_bf16) for cuBLAS's grouped call, which then needs
// AccumulateBf16 into `g`.
struct FfnProducts {
  using P = CudaBackend::Bf16Gemm;
  std::vector<P> fwd1, fwd2, bwd_dh, bwd_dw, bwd_dw_bf16, bwd_dx;
  P dense;  // one [A, C] x [C, F] product: 6 of them are the FFN's FLOPs
  std::vector<compute::DeviceBuffer> memory;
  float* g = nullptr;
  void* gb = nullptr;
  int64_t gradient_floats = 0;
  double flops = 0;
};

bool MakeFfnProducts(CudaBackend& b, const Shape& s, int64_t tokens, FfnProducts& out) {
  const int C = s.channels, F = s.hidden, E = s.experts;
  const int64_t A = tokens * s.top_k, per_expert = 2 * int64_t{C} * F;
  const std::vector<int64_t> offsets = SkewedOffsets(E, A);
  auto bf16 = [&](int64_t n) { return b.Allocate(2 * n); };
  auto x = bf16(A * C), hpre = bf16(A * F), h = bf16(A * F), y = bf16(A * C), dy = bf16(A * C);
  auto dx = bf16(A * C), dh = bf16(A * F), w = bf16(E * per_expert);
  auto gb = bf16(E * per_expert), g = b.Allocate(sizeof(float) * E * per_expert);
  auto tmp = b.Allocate(sizeof(float) * std::max(A * std::max(C, F), E * per_expert));
  if (!AllOk(s.name, {&x, &hpre, &h, &y, &dy, &dx, &dh, &w, &gb, &g, &tmp})) return false;
  for (auto [buf, n, scale] :
       {std::tuple{&x, A * C, 1.0f}, std::tuple{&h, A * F, 1.0f}, std::tuple{&dy, A * C, 1e-3f},
        std::tuple{&w, E * per_expert, 0.02f}}) {
    if (!Fill(b, tmp->f32(), n, scale)) return false;
    b.ToBf16((*buf)->data(), tmp->f32(), n);
  }
  auto at = [](const absl::StatusOr<compute::DeviceBuffer>& buf, int64_t elems) {
    return static_cast<uint16_t*>((*buf).data()) + elems;
  };
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = offsets[e];
    const int rows = static_cast<int>(offsets[e + 1] - r0);
    if (rows == 0) continue;
    const uint16_t* w1 = at(w, e * per_expert);
    const uint16_t* w2 = w1 + int64_t{C} * F;
    float* g1 = g->f32() + e * per_expert;
    float* g2 = g1 + int64_t{C} * F;
    uint16_t* gb1 = at(gb, e * per_expert);
    uint16_t* gb2 = gb1 + int64_t{C} * F;
    out.fwd1.push_back({false, false, rows, F, C, at(x, r0 * C), C, w1, F, 0, at(hpre, r0 * F), F});
    out.fwd2.push_back({false, false, rows, C, F, at(h, r0 * F), F, w2, C, 0, at(y, r0 * C), C});
    out.bwd_dh.push_back({false, true, rows, F, C, at(dy, r0 * C), C, w2, C, 0, at(dh, r0 * F), F});
    out.bwd_dw.push_back(
        {true, false, F, C, rows, at(h, r0 * F), F, at(dy, r0 * C), C, 1, g2, C, true});
    out.bwd_dw.push_back(
        {true, false, C, F, rows, at(x, r0 * C), C, at(dh, r0 * F), F, 1, g1, F, true});
    out.bwd_dw_bf16.push_back(
        {true, false, F, C, rows, at(h, r0 * F), F, at(dy, r0 * C), C, 0, gb2, C});
    out.bwd_dw_bf16.push_back(
        {true, false, C, F, rows, at(x, r0 * C), C, at(dh, r0 * F), F, 0, gb1, F});
    out.bwd_dx.push_back({false, true, rows, C, F, at(dh, r0 * F), F, w1, F, 0, at(dx, r0 * C), C});
  }
  out.dense = {false, false, static_cast<int>(A), F, C, at(x, 0), C, at(w, 0),
               F,     0,     at(hpre, 0),         F};
  out.g = g->f32();
  out.gb = gb->data();
  out.gradient_floats = E * per_expert;
  out.flops = 12.0 * static_cast<double>(A) * C * F;
  for (auto* buf : {&x, &hpre, &h, &y, &dy, &dx, &dh, &w, &gb, &g}) {
    out.memory.push_back(std::move(**buf));
  }
  return true;
}

// The same products as cuBLAS batched calls of row chunks (BatchedGemmBf16), against the
// same dense products.
int RunBf16Batched(CudaBackend& b, const Shape& s, const FfnProducts& f,
                   const std::vector<Bf16Call>& calls, double dense_s, int iters) {
  const uint64_t before = b.batched_calls();
  const double batched = SecondsPerIter(b, iters, [&] {
    for (const Bf16Call& call : calls) b.BatchedGemmBf16(*call.second, call.first);
  });
  const uint64_t calls_per_run = b.batched_calls() - before;  // a warm-up and `iters`
  if (batched <= 0) {
    std::fprintf(stderr, "%s bf16 batched: %s\n", s.name, b.status().ToString().c_str());
    return 1;
  }
  const std::string phases = Bf16Breakdown(
      b, calls, iters, [&](const std::vector<CudaBackend::Bf16Gemm>& p, const char* op) {
        b.BatchedGemmBf16(p, op);
      });
  std::printf(
      "expert_gemm_bf16_batched %-16s A=%lld  fwd+bwd %.2f ms %.1f TFLOP/s (%.0f%% of 790)  "
      "ratio %.3f (target >= 0.8); %.1f batched calls per iteration%s; TFLOP/s per phase:%s\n",
      s.name, static_cast<long long>(f.dense.m), batched * 1e3, f.flops / batched / 1e12,
      100 * f.flops / batched / 790e12, dense_s / batched,
      static_cast<double>(calls_per_run) / (iters + 1),
      calls_per_run == 0 ? " (cuBLAS refused them: this is the fan-out)" : "", phases.c_str());
  return 0;
}

// The products fanned out (FanOutGemmBf16, the default) against six dense bf16 products
// of the same FLOPs; the detail line has each phase and cuBLAS's grouped calls.
int RunBf16Gemms(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  FfnProducts f;
  if (!MakeFfnProducts(b, s, tokens, f)) return 1;
  const auto &fwd1 = f.fwd1, &fwd2 = f.fwd2, &bwd_dh = f.bwd_dh, &bwd_dw = f.bwd_dw;
  const auto &bwd_dw_bf16 = f.bwd_dw_bf16, &bwd_dx = f.bwd_dx;
  const double flops = f.flops;
  const int64_t A = tokens * s.top_k;
  auto fan_out = [&] {
    b.FanOutGemmBf16(fwd1, "bf16 x @ w1");
    b.FanOutGemmBf16(fwd2, "bf16 h @ w2");
    b.FanOutGemmBf16(bwd_dh, "bf16 dy @ w2^T");
    b.FanOutGemmBf16(bwd_dw, "bf16 dW1, dW2");
    b.FanOutGemmBf16(bwd_dx, "bf16 dh @ w1^T");
  };
  const double fanout = SecondsPerIter(b, iters, fan_out);
  const double dense_s = SecondsPerIter(b, iters, [&] {
    for (int i = 0; i < 6; ++i) b.GemmBf16(f.dense, "bf16 dense");
  });
  if (fanout <= 0 || dense_s <= 0) {
    std::fprintf(stderr, "%s bf16: %s\n", s.name, b.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "expert_gemm_bf16 %-16s A=%lld  fwd+bwd %.2f ms %.1f TFLOP/s (%.0f%% of 790)  dense %.1f "
      "TFLOP/s  ratio %.3f (target >= 0.8)\n",
      s.name, static_cast<long long>(A), fanout * 1e3, flops / fanout / 1e12,
      100 * flops / fanout / 790e12, flops / dense_s / 1e12, dense_s / fanout);
  const std::vector<Bf16Call> calls = {{"x@w1", &fwd1},
                                       {"h@w2", &fwd2},
                                       {"dy@w2T", &bwd_dh},
                                       {"dW1+dW2", &bwd_dw},
                                       {"dh@w1T", &bwd_dx}};
  // Each line as soon as it is measured; the comparisons beside the default (other stream
  // and thread counts, cuBLAS grouped calls) last, so a failure there loses no line before.
  const std::string phases = Bf16Breakdown(b, calls, iters);
  if (RunBf16Batched(b, s, f, calls, dense_s, iters) != 0) return 1;
  const std::string other_counts = OtherFanOuts(b, iters, flops, fan_out);
  const double grouped = SecondsPerIter(b, iters, [&] {
    b.GroupedGemmBf16(fwd1, "bf16 x @ w1 (grouped)");
    b.GroupedGemmBf16(fwd2, "bf16 h @ w2 (grouped)");
    b.GroupedGemmBf16(bwd_dh, "bf16 dy @ w2^T (grouped)");
    b.GroupedGemmBf16(bwd_dw_bf16, "bf16 dW1, dW2 (grouped)");
    b.AccumulateBf16(f.g, f.gb, f.gradient_floats);
    b.GroupedGemmBf16(bwd_dx, "bf16 dh @ w1^T (grouped)");
  });
  if (grouped <= 0) {
    std::fprintf(stderr, "%s bf16 grouped calls: %s\n", s.name, b.status().ToString().c_str());
  }
  std::printf(
      "expert_gemm_bf16_detail %-16s TFLOP/s per phase:%s; with%s (default %d/%d); cuBLAS "
      "grouped calls (cublasGemmGroupedBatchedEx + bf16->fp32 gradient add) %.1f\n",
      s.name, phases.c_str(), other_counts.c_str(), b.side_streams(), b.launch_threads(),
      grouped > 0 ? flops / grouped / 1e12 : 0.0);
  return grouped > 0 ? 0 : 1;
}

using Tile = CudaBackend::KernelTile;
using NamedTile = std::pair<Tile, const char*>;
constexpr NamedTile kMmaTiles[] = {
    {Tile::k128x128, "128x128"}, {Tile::k128x256, "128x256"}, {Tile::k256x128, "256x128"}};
constexpr NamedTile kWgmmaTiles[] = {{Tile::kWgmma128x128, "wgmma 128x128"},
                                     {Tile::kWgmma128x256, "wgmma 128x256"}};

// Whether `tile` runs here; false with the backend's error said when it is not that the
// tile does not run but that the backend failed (then nothing after it measures).
bool TileRuns(CudaBackend& b, const Shape& s, Tile tile, const char* name, bool* failed) {
  if (b.KernelTileRuns(tile)) return true;
  *failed = !b.status().ok();
  if (*failed) {
    std::fprintf(stderr, "%s tile %s: %s\n", s.name, name, b.status().ToString().c_str());
  }
  return false;
}

// The products through Pith's grouped kernel (KernelGemmBf16: one launch a phase), with
// each of `tiles`, against the same dense products; each phase's TFLOP/s.
int RunBf16Kernel(CudaBackend& b, const Shape& s, int64_t tokens, int iters,
                  absl::Span<const NamedTile> tiles) {
  FfnProducts f;
  if (!MakeFfnProducts(b, s, tokens, f)) return 1;
  const std::vector<Bf16Call> calls = {{"x@w1", &f.fwd1},
                                       {"h@w2", &f.fwd2},
                                       {"dy@w2T", &f.bwd_dh},
                                       {"dW1+dW2", &f.bwd_dw},
                                       {"dh@w1T", &f.bwd_dx}};
  const double dense_s = SecondsPerIter(b, iters, [&] {
    for (int i = 0; i < 6; ++i) b.GemmBf16(f.dense, "bf16 dense");
  });
  for (auto [tile, name] : tiles) {
    bool failed = false;
    if (!TileRuns(b, s, tile, name, &failed)) {
      if (failed) return 1;
      std::printf(
          "expert_gemm_bf16_kernel %-16s tile %s: does not run here (its shared memory, or for "
          "wgmma an sm_90 device and the build's sm_90a code)\n",
          s.name, name);
      continue;
    }
    b.set_kernel_tile(tile);
    bool taken = true;
    const double kernel = SecondsPerIter(b, iters, [&] {
      for (const Bf16Call& call : calls) taken &= b.KernelGemmBf16(*call.second, call.first);
    });
    if (!taken && b.status().ok()) {  // nothing failed: the next tile may take them
      std::printf("expert_gemm_bf16_kernel %-16s tile %s: a problem it does not take\n", s.name,
                  name);
      continue;
    }
    if (kernel <= 0 || dense_s <= 0) {
      std::fprintf(stderr, "%s bf16 kernel %s: %s\n", s.name, name, b.status().ToString().c_str());
      return 1;
    }
    const std::string phases = Bf16Breakdown(
        b, calls, iters, [&](const std::vector<CudaBackend::Bf16Gemm>& p, const char* op) {
          b.KernelGemmBf16(p, op);
        });
    std::printf(
        "expert_gemm_bf16_kernel %-16s tile %s (%d CTAs/SM) A=%lld  fwd+bwd %.2f ms %.1f TFLOP/s "
        "(%.0f%% of 790)  dense %.1f TFLOP/s  ratio %.3f (target >= 0.8); TFLOP/s per phase:%s\n",
        s.name, name, b.KernelBlocksPerSm(tile), static_cast<long long>(tokens * s.top_k),
        kernel * 1e3, f.flops / kernel / 1e12, 100 * f.flops / kernel / 790e12,
        f.flops / dense_s / 1e12, dense_s / kernel, phases.c_str());
  }
  return 0;
}

// Where one iteration's time goes: after each part, waits for the device and notes the
// part's share (off: does nothing, for the timed iterations).
class Marks {
 public:
  Marks(CudaBackend& b, bool on) : b_(b), on_(on) {}
  void operator()(const char* part) {
    if (!on_) return;
    (void)b_.Synchronize();
    const auto now = std::chrono::steady_clock::now();
    char text[48];
    std::snprintf(text, sizeof(text), " %s %.2f", part,
                  std::chrono::duration<double>(now - last_).count() * 1e3);
    parts_ += text;
    last_ = now;
  }
  void Start() {
    (void)b_.Synchronize();
    last_ = std::chrono::steady_clock::now();
  }
  const std::string& parts() const { return parts_; }
  bool on() const { return on_; }

 private:
  CudaBackend& b_;
  bool on_;
  std::chrono::steady_clock::time_point last_;
  std::string parts_;
};

// The bf16 weights blobs of the fp32 experts at `w` (random biases) in `memory`, and `ws`
// pointing at them; false after saying why not.
bool BlobWeights(CudaBackend& b, const Shape& s, const float* w,
                 absl::StatusOr<compute::DeviceBuffer>& memory,
                 std::vector<compute::ExpertWeights>& ws) {
  const int C = s.channels, F = s.hidden, E = s.experts;
  const Bf16ExpertLayout at(C, F);
  const int64_t expert_floats = 2 * int64_t{C} * F + F + C;
  memory = b.Allocate(at.bytes * E);
  if (!AllOk(s.name, {&memory}) || !Fill(b, memory->f32(), at.bytes * E / 4, 0.02f)) return false;
  auto* base = static_cast<uint8_t*>(memory->data());
  for (int e = 0; e < E; ++e) {
    uint8_t* blob = base + at.bytes * e;
    const float* master = w + e * expert_floats;
    b.ToBf16(blob + at.w1, master, int64_t{C} * F);
    b.ToBf16(blob + at.w2, master + int64_t{C} * F + F, int64_t{F} * C);
    ws[e] = compute::ExpertWeightsAt(blob, true, C, F);
  }
  if (!b.Synchronize().ok()) {
    std::fprintf(stderr, "%s blobs: %s\n", s.name, b.status().ToString().c_str());
    return false;
  }
  return true;
}

// The whole MoE layer, forward and backward, through the backend's ops in its compute
// dtype: seconds per iteration, or -1 after saying why not. With `breakdown`, one more
// iteration's parts in ms.
// With `blobs`, the experts' weights are bf16 weights blobs (common/bf16.h: what a bf16
// job's cluster worker computes from) instead of fp32 masters the products round.
double LayerSeconds(CudaBackend& b, const Shape& s, int64_t tokens, int iters,
                    std::string* breakdown = nullptr, bool blobs = false) {
  const int C = s.channels, F = s.hidden, E = s.experts, k = s.top_k;
  const int N = static_cast<int>(tokens);
  const int64_t A = int64_t{N} * k, expert_floats = 2 * int64_t{C} * F + F + C;
  auto f32 = [&](int64_t n) { return b.Allocate(sizeof(float) * n); };
  auto i32 = [&](int64_t n) { return b.Allocate(sizeof(int32_t) * n); };
  auto x = f32(int64_t{N} * C), wr = f32(int64_t{C} * E), logits = f32(int64_t{N} * E);
  auto probs = f32(int64_t{N} * E), lse = f32(N), expert = i32(A), gate = f32(A), row = i32(A);
  auto bucket_token = i32(A), xperm = f32(A * C), hpre = f32(A * F), h = f32(A * F);
  auto y = f32(A * C), out = f32(int64_t{N} * C), dout = f32(int64_t{N} * C), dy = f32(A * C);
  auto dgate = f32(A), dh = f32(A * F), dxperm = f32(A * C), dx = f32(int64_t{N} * C);
  auto dlogits = f32(int64_t{N} * E), dwr = f32(int64_t{C} * E);
  auto w = f32(E * expert_floats), g = f32(E * expert_floats);
  if (!AllOk(s.name, {&x,      &wr,   &logits,  &probs, &lse, &expert, &gate, &row,   &bucket_token,
                      &xperm,  &hpre, &h,       &y,     &out, &dout,   &dy,   &dgate, &dh,
                      &dxperm, &dx,   &dlogits, &dwr,   &w,   &g})) {
    return -1;
  }
  if (!Fill(b, x->f32(), int64_t{N} * C, 1.0f) || !Fill(b, wr->f32(), int64_t{C} * E, 0.02f) ||
      !Fill(b, w->f32(), E * expert_floats, 0.02f) ||
      !Fill(b, dout->f32(), int64_t{N} * C, 1e-3f)) {
    std::fprintf(stderr, "%s layer: fill: %s\n", s.name, b.status().ToString().c_str());
    return -1;
  }
  std::vector<compute::ExpertWeights> ws;
  std::vector<compute::ExpertGrads> gs;
  ExpertViews(w->f32(), g->f32(), E, C, F, ws, gs);
  absl::StatusOr<compute::DeviceBuffer> blob_memory;
  if (blobs && !BlobWeights(b, s, w->f32(), blob_memory, ws)) return -1;
  std::vector<int64_t> offsets(E + 1), routed(E);
  std::vector<double> prob_sum(E), global_f(E);
  const compute::RoutingBuffers rb{probs->f32(),
                                   lse->f32(),
                                   static_cast<int32_t*>(expert->data()),
                                   gate->f32(),
                                   static_cast<int32_t*>(row->data()),
                                   static_cast<int32_t*>(bucket_token->data()),
                                   offsets.data(),
                                   routed.data(),
                                   prob_sum.data()};
  const compute::RouterConfig config{k, 0.0, true};
  auto iteration = [&](Marks& mark) {
    b.GemmFp32(false, false, N, E, C, 1.0f, x->f32(), C, wr->f32(), E, 0.0f, logits->f32(), E);
    mark("router_gemm");
    b.Route(logits->f32(), N, E, config, rb);
    mark("route");
    const int64_t a = offsets[E];
    b.Permute(xperm->f32(), x->f32(), rb.bucket_token, a, C);
    mark("permute");
    b.ExpertForward(y->f32(), hpre->f32(), h->f32(), xperm->f32(), offsets.data(), ws, C, F);
    mark("experts_fwd");
    b.Combine(out->f32(), y->f32(), rb.row, rb.gate, N, k, C);
    b.CombineBackward(dy->f32(), dgate->f32(), dout->f32(), y->f32(), rb.row, rb.gate, N, k, C);
    mark("combine_fwd_bwd");
    b.ExpertBackward(dxperm->f32(), dh->f32(), gs, dy->f32(), xperm->f32(), hpre->f32(), h->f32(),
                     offsets.data(), ws, C, F);
    mark("experts_bwd");
    b.Zero(dx->data(), sizeof(float) * N * C);
    b.PermuteBackward(dx->f32(), dxperm->f32(), rb.row, N, k, C);
    mark("permute_bwd");
    for (int e = 0; e < E; ++e) global_f[e] = static_cast<double>(routed[e]) / (double{1} * A);
    b.RouteBackward(dlogits->f32(), dgate->f32(), rb, N, E, config,
                    {0.01, 0.001, N, global_f.data()});
    b.GemmFp32(true, false, C, E, N, 1.0f, x->f32(), C, dlogits->f32(), E, 0.0f, dwr->f32(), E);
    b.GemmFp32(false, true, N, C, E, 1.0f, dlogits->f32(), E, wr->f32(), E, 1.0f, dx->f32(), C);
    mark("router_bwd");
    if (mark.on() && b.compute_dtype() == ComputeDtype::kBf16) {  // one rounding of [A, C]
      b.ToBf16(dy->data(), xperm->f32(), a * C);
      mark("(round_AxC)");
    }
  };
  Marks off(b, false);
  const double seconds = SecondsPerIter(b, iters, [&] { iteration(off); });
  if (seconds > 0 && breakdown != nullptr) {
    Marks on(b, true);
    on.Start();
    iteration(on);
    *breakdown = on.parts();
  }
  if (seconds <= 0) {
    std::fprintf(stderr, "%s layer: %s\n", s.name, b.status().ToString().c_str());
    return -1;
  }
  return seconds;
}

// The layer in the backend's present settings: its moe_layer line and its detail line,
// under `label` (what tests/gpu/run.sh reads back); the seconds per iteration, or -1.
// `check`, when given, runs after the measurement and before the lines: false prints none.
double LayerLines(CudaBackend& b, const Shape& s, int64_t tokens, int iters, const char* label,
                  bool blobs = false, const std::function<bool()>& check = nullptr) {
  std::string parts;
  const double seconds = LayerSeconds(b, s, tokens, iters, &parts, blobs);
  if (seconds <= 0 || (check && !check())) return -1;
  std::printf("moe_layer %-16s tokens=%lld %s fwd+bwd %.2f ms\n", s.name,
              static_cast<long long>(tokens), label, seconds * 1e3);
  std::printf("moe_layer_detail %-16s %s one iteration, each part waited for (ms):%s\n", s.name,
              label, parts.c_str());
  return seconds;
}

int RunLayer(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  return LayerLines(b, s, tokens, iters, "fp32") > 0 ? 0 : 1;
}

// The layer in bf16 with the backend's defaults, from bf16 weights blobs, with batched
// products, and last with the fan-outs' launches spread over 4 host threads.
int RunLayerBf16(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  if (!b.SetComputeDtype(ComputeDtype::kBf16).ok()) return 1;
  const double seconds = LayerLines(b, s, tokens, iters, "bf16");
  if (seconds <= 0) return 1;
  // As a bf16 job's cluster worker computes: the weights already bf16 (no rounding).
  if (LayerLines(b, s, tokens, iters, "bf16_blobs", /*blobs=*/true) <= 0) return 1;
  const CudaBackend::Bf16Products products = b.bf16_products();
  b.set_bf16_products(CudaBackend::Bf16Products::kBatched);
  const uint64_t before = b.batched_calls();
  if (LayerLines(b, s, tokens, iters, "bf16_batched") <= 0) return 1;
  // LayerSeconds runs a warm-up, `iters` timed iterations and one broken down.
  std::printf("moe_layer_detail %-16s bf16_batched %.1f batched calls per iteration%s\n", s.name,
              static_cast<double>(b.batched_calls() - before) / (iters + 2),
              b.batched_calls() == before ? " (cuBLAS refused them: these are the fan-out's)" : "");
  b.set_bf16_products(products);
  const int threads = b.launch_threads();
  b.set_launch_threads(4);
  const double threaded = LayerSeconds(b, s, tokens, iters);
  b.set_launch_threads(threads);
  if (threaded <= 0) return 1;
  std::printf("moe_layer_detail %-16s bf16 with 4 launch threads %.2f ms (default %d: %.2f)\n",
              s.name, threaded * 1e3, threads, seconds * 1e3);
  return 0;
}

// The bf16 layer with its expert products through the grouped kernel with each of
// `tiles` (labels as run.sh reads them), where the device runs it; a layer whose expert
// phases did not go through the kernel (its epilogues never ran) fails, rather than
// printing the fan-out's time under the kernel's label.
int RunLayerBf16Kernel(CudaBackend& b, const Shape& s, int64_t tokens, int iters,
                       absl::Span<const NamedTile> tiles) {
  if (!b.SetComputeDtype(ComputeDtype::kBf16).ok()) return 1;
  b.set_bf16_products(CudaBackend::Bf16Products::kKernel);
  for (const NamedTile& named : tiles) {
    const char* name = named.second;  // a plain local: lambdas capture it (not a binding)
    bool failed = false;
    if (!TileRuns(b, s, named.first, name, &failed)) {
      if (failed) return 1;
      continue;
    }
    b.set_kernel_tile(named.first);
    const uint64_t launches = b.kernel_launches(), epilogues = b.epilogue_launches();
    // No moe_layer line under the kernel's label for a layer the fan-out ran.
    const auto through_kernel = [&] {
      if (b.epilogue_launches() > epilogues) return true;
      std::fprintf(stderr, "%s %s: the expert phases went to the fan-out\n", s.name, name);
      return false;
    };
    if (LayerLines(b, s, tokens, iters, name, /*blobs=*/false, through_kernel) <= 0) return 1;
    // LayerSeconds runs a warm-up, `iters` timed iterations and one broken down.
    const double per = iters + 2;
    std::printf(
        "moe_layer_detail %-16s %s %.1f kernel launches per iteration, %.1f with an "
        "epilogue\n",
        s.name, name, (b.kernel_launches() - launches) / per,
        (b.epilogue_launches() - epilogues) / per);
  }
  return 0;
}

constexpr NamedTile kMmaLayer[] = {{Tile::k128x128, "bf16_kernel"}};
constexpr NamedTile kWgmmaLayer[] = {{Tile::kWgmma128x128, "bf16_wgmma_128x128"},
                                     {Tile::kWgmma128x256, "bf16_wgmma_128x256"}};
int RunMmaKernel(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  return RunBf16Kernel(b, s, tokens, iters, kMmaTiles);
}
int RunMmaLayer(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  return RunLayerBf16Kernel(b, s, tokens, iters, kMmaLayer);
}
int RunWgmmaKernel(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  return RunBf16Kernel(b, s, tokens, iters, kWgmmaTiles);
}
int RunWgmmaLayer(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  return RunLayerBf16Kernel(b, s, tokens, iters, kWgmmaLayer);
}

// Expert fetches to the device: one round of uploads of a bf16 weights blob into every
// slot of a DeviceSlots from registered pinned staging, against one plain pinned
// cudaMemcpy of the same bytes.
int RunFetch(CudaBackend& b, const Shape& s, int64_t, int iters) {
  const size_t blob = 2 * (2 * size_t{1} * s.channels * s.hidden + s.hidden + s.channels);
  const int count = std::min(64, s.experts);
  const size_t total = blob * count;
  std::unique_ptr<uint8_t, decltype(&std::free)> staging(
      static_cast<uint8_t*>(std::aligned_alloc(4096, (total + 4095) / 4096 * 4096)), &std::free);
  auto plain = b.Allocate(total);
  auto slots = DeviceSlots::Create(b.device(), blob, count);
  if (staging == nullptr || !plain.ok() || !slots.ok() ||
      !(*slots)->RegisterStaging(staging.get(), total).ok()) {
    std::fprintf(stderr, "%s fetch: setup failed\n", s.name);
    return 1;
  }
  std::memset(staging.get(), 1, total);
  // Allocate zeroes on the backend's stream: done before the legacy-stream copies start.
  if (!b.Synchronize().ok()) {
    std::fprintf(stderr, "%s fetch: setup failed\n", s.name);
    return 1;
  }
  auto timed = [&](auto&& round) {
    round();  // warm-up
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) round();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters;
  };
  bool ok = true;
  const double fetch = timed([&] {
    for (int i = 0; i < count; ++i) ok &= (*slots)->Upload(i, staging.get() + blob * i, blob).ok();
    ok &= (*slots)->Wait().ok();
  });
  const double memcpy_s = timed([&] {
    ok &= cudaMemcpy(plain->data(), staging.get(), total, cudaMemcpyHostToDevice) == cudaSuccess;
  });
  if (!ok) {
    std::fprintf(stderr, "%s fetch: a copy failed\n", s.name);
    return 1;
  }
  std::printf(
      "expert_fetch %-16s blob %.1f MB x %d slots  fetch %.1f GB/s  pinned cudaMemcpy %.1f GB/s  "
      "ratio %.3f (target >= 0.9)\n",
      s.name, blob / 1e6, count, total / fetch / 1e9, total / memcpy_s / 1e9, memcpy_s / fetch);
  return 0;
}

}  // namespace
}  // namespace pith::cuda

int main(int argc, char** argv) {
  using pith::cuda::CudaBackend;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines in order with stderr's
  const int device = static_cast<int>(pith::cuda::Flag(argc, argv, "device", 0));
  const int64_t tokens = pith::cuda::Flag(argc, argv, "tokens", 16384);
  const int iters = static_cast<int>(pith::cuda::Flag(argc, argv, "iters", 5));
  int rc = 0;
  bool first = true;
  // Each measurement for both shapes before the next: the grouped kernel's come last, the
  // wgmma ones (the newest) after mma.sync's, since a fault on the device ends the
  // process's use of it, and the figures before them are then in already.
  namespace pc = pith::cuda;
  for (auto* run : {pc::RunShape, pc::RunBf16Gemms, pc::RunLayer, pc::RunLayerBf16, pc::RunFetch,
                    pc::RunMmaKernel, pc::RunMmaLayer, pc::RunWgmmaKernel, pc::RunWgmmaLayer}) {
    for (const pc::Shape& s : {pc::Shape{"qwen3-30b-a3b", 2048, 768, 128, 8},
                               pc::Shape{"deepseek-v2-lite", 2048, 1408, 64, 6}}) {
      // A backend per measurement: a failed one stays failed, and the others still run.
      auto backend = CudaBackend::Create(device);
      if (!backend.ok()) {
        std::fprintf(stderr, "gpu_bench: %s\n", backend.status().ToString().c_str());
        return 2;
      }
      if (first) {
        std::printf("gpu_bench on %s (fp32 without TF32; bf16 where named)\n",
                    (*backend)->description().c_str());
        first = false;
      }
      rc |= run(**backend, s, tokens, iters);
    }
  }
  return rc;
}
