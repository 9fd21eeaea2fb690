// 20 training steps of moe-gpt (AdamW, capacity drops, router losses) on the CUDA backend
// and on the CPU backend from the same initial weights and batches: every step's loss
// within 1e-4 relative, the final weights close; in the bf16 compute dtype within 2e-2.
// Skipped without a CUDA device.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/cuda/cuda_backend.h"
#include "worker/model/moe_gpt.h"
#include "worker/model/optimizer.h"

namespace pith::cuda {
namespace {

using model::ModelShape;

ModelShape Shape(ComputeDtype dtype = ComputeDtype::kFp32) {
  ModelShape s;
  s.compute_dtype = dtype;
  s.vocab = 96;
  s.seq = 32;
  s.channels = 64;
  s.layers = 2;
  s.heads = 4;
  s.experts = 8;
  s.top_k = 2;
  s.hidden = 96;
  s.capacity_factor = 1.25;
  s.aux_loss_coef = 0.01;
  s.z_loss_coef = 0.001;
  s.renormalize_topk = true;
  return s;
}

// Trains `steps` steps on `backend`; returns each step's loss and the final weights.
struct TrainRun {
  std::vector<double> losses;
  std::vector<float> weights;
};

TrainRun Train(compute::Backend& backend, int steps, ComputeDtype dtype = ComputeDtype::kFp32) {
  const ModelShape shape = Shape(dtype);
  const int batch = 4;
  TrainRun run;
  absl::StatusOr<std::unique_ptr<model::MoeGpt>> moe =
      model::MoeGpt::Create(&backend, shape, batch);
  EXPECT_TRUE(moe.ok()) << moe.status();
  if (!moe.ok()) return run;
  model::OptimizerConfig config;
  config.lr = 3e-3;
  config.warmup = 2;
  config.steps = steps;
  config.weight_decay = 0.1;
  config.grad_clip = 1.0;
  absl::StatusOr<std::unique_ptr<model::AdamWOptimizer>> opt =
      model::AdamWOptimizer::Create(&backend, (*moe)->layout(), config);
  EXPECT_TRUE(opt.ok()) << opt.status();
  if (!opt.ok()) return run;
  EXPECT_TRUE((*moe)->InitWeights(7).ok());
  const model::HasGrad has_grad = [&](const model::ParamTensor& t) {
    return t.layer < 0 || (*moe)->ExpertUsed(t.layer, t.expert);
  };
  std::mt19937 rng(11);
  std::vector<int32_t> in(batch * shape.seq), tgt(batch * shape.seq);
  for (int s = 0; s < steps; ++s) {
    // A learnable stream: each target is the input shifted by a fixed amount.
    for (size_t i = 0; i < in.size(); ++i) {
      in[i] = static_cast<int32_t>(rng() % shape.vocab);
      tgt[i] = (in[i] + 3) % shape.vocab;
    }
    absl::StatusOr<model::StepLoss> loss = (*moe)->ForwardBackward(in.data(), tgt.data(), batch);
    EXPECT_TRUE(loss.ok()) << loss.status();
    if (!loss.ok()) return run;
    (*opt)->Step((*moe)->params(), (*moe)->grads(), s, has_grad);
    run.losses.push_back(loss->loss);
  }
  run.weights.resize((*moe)->layout().total_floats());
  EXPECT_TRUE(backend.Synchronize().ok());
  EXPECT_TRUE(
      backend.CopyToHost(run.weights.data(), (*moe)->params(), run.weights.size() * sizeof(float))
          .ok());
  return run;
}

TEST(CudaTrainingTest, TwentyStepsMatchTheCpuBackend) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> gpu = CudaBackend::Create(0);
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device here: " << gpu.status();
  compute::CpuBackend cpu(2);
  constexpr int kSteps = 20;
  const TrainRun want = Train(cpu, kSteps);
  const TrainRun got = Train(**gpu, kSteps);
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 1e-4 * std::fabs(want.losses[s])) << "step " << s;
  }
  EXPECT_LT(want.losses.back(), want.losses.front());  // it learns
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.weights.size(); ++i) {
    diff += std::pow(double{got.weights[i]} - want.weights[i], 2);
    norm += std::pow(double{want.weights[i]}, 2);
  }
  EXPECT_LT(std::sqrt(diff / norm), 1e-3) << "relative distance of the final weights";
}

// The bf16 compute dtype (bf16 inputs to every product but the router's, fp32
// accumulation, fp32 master weights and optimizer): every step's loss within 2e-2
// relative of the CPU's fp32 run, and it learns.
TEST(CudaTrainingTest, TwentyBf16StepsStayNearTheFp32Run) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> gpu = CudaBackend::Create(0);
  if (!gpu.ok()) GTEST_SKIP() << "no CUDA device here: " << gpu.status();
  compute::CpuBackend cpu(2);
  constexpr int kSteps = 20;
  const TrainRun want = Train(cpu, kSteps);
  const TrainRun got = Train(**gpu, kSteps, ComputeDtype::kBf16);
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  double largest = 0;
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_NEAR(got.losses[s], want.losses[s], 2e-2 * std::fabs(want.losses[s])) << "step " << s;
    largest = std::max(largest, std::fabs(got.losses[s] / want.losses[s] - 1));
  }
  std::printf("bf16 vs fp32 loss: largest relative difference over %d steps %.2e\n", kSteps,
              largest);
  EXPECT_LT(got.losses.back(), got.losses.front());  // it learns
}

// The same bf16 training with the expert products in the grouped kernel (with their
// bias, gelu and gelu derivative passes) and as cuBLAS batched calls of row chunks: each
// step's loss within 5e-3 relative of the fan-out's (the same math summed in another
// order) and within 2e-2 of the CPU's fp32 run, and the kernel's expert phases (those
// with an epilogue: a single dense product goes through the kernel too) or the batched
// calls ran.
TEST(CudaTrainingTest, TwentyBf16StepsThroughTheGroupedKernelAndBatchedCalls) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> fan = CudaBackend::Create(0);
  if (!fan.ok()) GTEST_SKIP() << "no CUDA device here: " << fan.status();
  constexpr int kSteps = 20;
  compute::CpuBackend cpu(2);
  const TrainRun fp32 = Train(cpu, kSteps);
  const TrainRun want = Train(**fan, kSteps, ComputeDtype::kBf16);
  ASSERT_EQ(want.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(fp32.losses.size(), static_cast<size_t>(kSteps));
  for (auto how : {CudaBackend::Bf16Products::kKernel, CudaBackend::Bf16Products::kBatched}) {
    const bool kernel = how == CudaBackend::Bf16Products::kKernel;
    SCOPED_TRACE(kernel ? "grouped kernel" : "batched calls");
    absl::StatusOr<std::unique_ptr<CudaBackend>> gpu = CudaBackend::Create(0);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    (*gpu)->set_bf16_products(how);
    const TrainRun got = Train(**gpu, kSteps, ComputeDtype::kBf16);
    ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps));
    EXPECT_GT(kernel ? (*gpu)->epilogue_launches() : (*gpu)->batched_calls(), 0u);
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_NEAR(got.losses[s], want.losses[s], 5e-3 * std::fabs(want.losses[s])) << "step " << s;
      EXPECT_NEAR(got.losses[s], fp32.losses[s], 2e-2 * std::fabs(fp32.losses[s])) << "step " << s;
    }
  }
}

}  // namespace
}  // namespace pith::cuda
