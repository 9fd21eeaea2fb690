// gpu_bench: the CUDA backend's expert FFN (grouped GEMMs, forward + backward) against a
// dense cuBLAS GEMM of the same FLOPs, measured in the same run on the same device.
//
//   gpu_bench [--tokens=16384] [--iters=5]
//
// Shapes: Qwen3-30B-A3B (d 2048, f 768, E 128, top-8) and DeepSeek-V2-Lite (d 2048,
// f 1408, E 64, top-6); tokens spread over the experts with a skew (the first expert gets
// twice the mean, the last half). Prints one line per shape: the grouped TFLOP/s, the dense
// TFLOP/s and their ratio (the target is >= 0.8). fp32 as the backend computes today.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "worker/cuda/cuda_backend.h"

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

int RunShape(CudaBackend& b, const Shape& s, int64_t tokens, int iters) {
  const int C = s.channels, F = s.hidden, E = s.experts;
  const int64_t A = tokens * s.top_k;
  std::vector<int64_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) {
    // Linear skew from 2x the mean (expert 0) to 0.5x (the last); the rest to the last.
    const double share = (2.0 - 1.5 * e / std::max(1, E - 1)) / (1.25 * E);
    offsets[e + 1] = std::min<int64_t>(A, offsets[e] + static_cast<int64_t>(share * A));
  }
  offsets[E] = A;
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
  for (int e = 0; e < E; ++e) {
    const float* p = w->f32() + e * expert_floats;
    float* q = g->f32() + e * expert_floats;
    ws.push_back({p, p + int64_t{C} * F, p + int64_t{C} * F + F, p + 2 * int64_t{C} * F + F});
    gs.push_back({q, q + int64_t{C} * F, q + int64_t{C} * F + F, q + 2 * int64_t{C} * F + F});
  }
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

}  // namespace
}  // namespace pith::cuda

int main(int argc, char** argv) {
  auto backend =
      pith::cuda::CudaBackend::Create(static_cast<int>(pith::cuda::Flag(argc, argv, "device", 0)));
  if (!backend.ok()) {
    std::fprintf(stderr, "gpu_bench: %s\n", backend.status().ToString().c_str());
    return 2;
  }
  std::printf("gpu_bench on %s (fp32, no TF32)\n", (*backend)->description().c_str());
  const int64_t tokens = pith::cuda::Flag(argc, argv, "tokens", 16384);
  const int iters = static_cast<int>(pith::cuda::Flag(argc, argv, "iters", 5));
  int rc = 0;
  for (const pith::cuda::Shape& s : {pith::cuda::Shape{"qwen3-30b-a3b", 2048, 768, 128, 8},
                                     pith::cuda::Shape{"deepseek-v2-lite", 2048, 1408, 64, 6}}) {
    rc |= pith::cuda::RunShape(**backend, s, tokens, iters);
  }
  return rc;
}
