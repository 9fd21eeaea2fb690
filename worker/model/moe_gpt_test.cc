// moe-gpt end to end on the CPU backend: whole-model gradients against finite
// differences (dropless, with capacity drops, k = E), no heap allocation after the first
// step, bit-exact safetensors round trips, and experts without tokens left untouched.
#include "worker/model/moe_gpt.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <vector>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "pith/v1/spec.pb.h"
#include "worker/compute/cpu_backend.h"
#include "worker/model/checkpoint.h"
#include "worker/model/optimizer.h"

// Counts operator new calls, to prove a step allocates nothing. The replacement pair is
// malloc/free, which GCC flags once it inlines them into new/delete expressions.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
static std::atomic<int64_t> g_allocations{0};
void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace pith::model {
namespace {

ModelShape TinyShape(double capacity_factor, int top_k) {
  ModelShape s;
  s.vocab = 11;
  s.seq = 5;
  s.channels = 8;
  s.layers = 2;
  s.heads = 2;
  s.experts = 4;
  s.top_k = top_k;
  s.hidden = 6;
  s.capacity_factor = capacity_factor;
  s.aux_loss_coef = 0.1;
  s.z_loss_coef = 0.05;
  s.renormalize_topk = true;
  return s;
}

struct Batch {
  std::vector<int32_t> in, tgt;
};

Batch RandomBatch(const ModelShape& s, int batch, uint32_t seed) {
  std::mt19937 rng(seed);
  Batch b;
  for (int i = 0; i < batch * s.seq; ++i) {
    b.in.push_back(static_cast<int32_t>(rng() % s.vocab));
    b.tgt.push_back(static_cast<int32_t>(rng() % s.vocab));
  }
  return b;
}

// Routing of every layer, to tell when a perturbation flipped a decision.
std::vector<std::vector<int64_t>> RoutingOf(const MoeGpt& m) {
  std::vector<std::vector<int64_t>> out;
  for (int l = 0; l < m.shape().layers; ++l) {
    out.push_back(m.routed(l));
    out.push_back(m.bucket_offsets(l));
  }
  return out;
}

void CheckModelGradients(double capacity_factor, int top_k) {
  compute::CpuBackend backend(1);
  const ModelShape shape = TinyShape(capacity_factor, top_k);
  const int batch = 3;
  auto model = MoeGpt::Create(&backend, shape, batch);
  ASSERT_TRUE(model.ok());
  MoeGpt& m = **model;
  ASSERT_TRUE(m.InitWeights(5).ok());
  // Larger weights than the 0.02 init, so that every path carries a visible gradient.
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (const ParamTensor& t : m.layout().tensors()) {
    if (t.shape.size() == 2) {
      for (int64_t i = 0; i < t.numel; ++i) m.params()[t.offset + i] = nd(rng);
    }
  }
  const Batch b = RandomBatch(shape, batch, 3);
  auto step = m.ForwardBackward(b.in.data(), b.tgt.data(), batch);
  ASSERT_TRUE(step.ok());
  const std::vector<float> grads(m.grads(), m.grads() + m.layout().total_floats());
  const auto routing = RoutingOf(m);

  int checked = 0, skipped = 0;
  for (const ParamTensor& t : m.layout().tensors()) {
    for (int sample = 0; sample < 3; ++sample) {
      const int64_t i = t.offset + static_cast<int64_t>(rng() % t.numel);
      float& p = m.params()[i];
      const float saved = p, eps = 2e-3f;
      p = saved + eps;
      const double up = m.ForwardBackward(b.in.data(), b.tgt.data(), batch)->loss;
      const bool up_same = RoutingOf(m) == routing;
      p = saved - eps;
      const double down = m.ForwardBackward(b.in.data(), b.tgt.data(), batch)->loss;
      const bool down_same = RoutingOf(m) == routing;
      p = saved;
      if (!up_same || !down_same) {
        ++skipped;
        continue;
      }
      const double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(grads[i], numeric, 2e-3 + 3e-2 * std::fabs(numeric))
          << t.name << " @" << i - t.offset;
      ++checked;
    }
  }
  EXPECT_GT(checked, 4 * skipped) << "too many routing flips to check gradients";
}

TEST(MoeGptTest, GradientsMatchFiniteDifferencesDropless) { CheckModelGradients(0.0, 2); }
TEST(MoeGptTest, GradientsMatchFiniteDifferencesWithDrops) { CheckModelGradients(0.8, 2); }
TEST(MoeGptTest, GradientsMatchFiniteDifferencesTopKIsE) { CheckModelGradients(0.0, 4); }

TEST(MoeGptTest, TrainingStepAllocatesNothingAfterTheFirst) {
  compute::CpuBackend backend(2);
  ModelShape shape = TinyShape(1.25, 2);
  shape.seq = 16;
  shape.channels = 32;
  auto model = MoeGpt::Create(&backend, shape, 4);
  ASSERT_TRUE(model.ok());
  MoeGpt& m = **model;
  ASSERT_TRUE(m.InitWeights(1).ok());
  OptimizerConfig config;
  config.lr = 1e-3;
  config.steps = 10;
  config.grad_clip = 1.0;
  config.weight_decay = 0.1;
  auto opt = AdamWOptimizer::Create(&backend, m.layout(), config);
  ASSERT_TRUE(opt.ok());
  const HasGrad has_grad = [&](const ParamTensor& t) {
    return t.layer < 0 || m.ExpertUsed(t.layer, t.expert);
  };
  {  // The counter sees the allocations this test is about.
    const int64_t before = g_allocations.load();
    std::vector<int> probe(3);
    ASSERT_GE(g_allocations.load() - before, 1);
  }
  std::vector<Batch> batches;
  for (uint32_t s = 0; s < 4; ++s) batches.push_back(RandomBatch(shape, 4, s));
  for (int s = 0; s < 4; ++s) {
    const int64_t before = g_allocations.load();
    auto loss = m.ForwardBackward(batches[s].in.data(), batches[s].tgt.data(), 4);
    (*opt)->Step(m.params(), m.grads(), s, has_grad);
    const int64_t allocations = g_allocations.load() - before;
    ASSERT_TRUE(loss.ok());
    if (s > 0) {
      EXPECT_EQ(allocations, 0) << "step " << s;
    }
  }
}

TEST(MoeGptTest, TrainedWeightsRoundTripBitExactly) {
  compute::CpuBackend backend(2);
  const ModelShape shape = TinyShape(1.0, 2);
  auto a = MoeGpt::Create(&backend, shape, 2);
  auto b = MoeGpt::Create(&backend, shape, 2);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE((*a)->InitWeights(2).ok());
  OptimizerConfig config;
  config.lr = 1e-2;
  config.steps = 5;
  auto opt_a = AdamWOptimizer::Create(&backend, (*a)->layout(), config);
  auto opt_b = AdamWOptimizer::Create(&backend, (*b)->layout(), config);
  ASSERT_TRUE(opt_a.ok() && opt_b.ok());
  auto has_grad = [](MoeGpt& m) {
    return [&m](const ParamTensor& t) { return t.layer < 0 || m.ExpertUsed(t.layer, t.expert); };
  };
  for (int s = 0; s < 3; ++s) {
    Batch batch = RandomBatch(shape, 2, s);
    ASSERT_TRUE((*a)->ForwardBackward(batch.in.data(), batch.tgt.data(), 2).ok());
    (*opt_a)->Step((*a)->params(), (*a)->grads(), s, has_grad(**a));
  }
  const std::string dir = testing::TempDir();
  ASSERT_TRUE(SaveWeights(backend, (*a)->layout(), (*a)->params(), dir + "/w.safetensors").ok());
  ASSERT_TRUE(SaveOptimizer(backend, (*a)->layout(), **opt_a, 3, dir + "/o.safetensors").ok());
  auto wf = SafetensorsFile::Read(dir + "/w.safetensors");
  auto of = SafetensorsFile::Read(dir + "/o.safetensors");
  ASSERT_TRUE(wf.ok() && of.ok());
  ASSERT_TRUE(LoadWeights(backend, (*b)->layout(), *wf, (*b)->params()).ok());
  auto step = LoadOptimizer(backend, (*b)->layout(), *of, **opt_b);
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(*step, 3);
  const size_t bytes = (*a)->layout().total_floats() * sizeof(float);
  EXPECT_EQ(std::memcmp((*a)->params(), (*b)->params(), bytes), 0);
  EXPECT_EQ(std::memcmp((*opt_a)->m(), (*opt_b)->m(), bytes), 0);
  EXPECT_EQ(std::memcmp((*opt_a)->v(), (*opt_b)->v(), bytes), 0);
  EXPECT_EQ((*opt_a)->update_counts(), (*opt_b)->update_counts());
  // Both continue identically.
  Batch batch = RandomBatch(shape, 2, 99);
  auto la = (*a)->ForwardBackward(batch.in.data(), batch.tgt.data(), 2);
  auto lb = (*b)->ForwardBackward(batch.in.data(), batch.tgt.data(), 2);
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(la->loss, lb->loss);

  // A file of another model is refused with the tensor named.
  auto c = MoeGpt::Create(&backend, TinyShape(1.0, 1), 2);  // same tensors: loads
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(LoadWeights(backend, (*c)->layout(), *wf, (*c)->params()).ok());
  ModelShape wider = shape;
  wider.hidden = 7;
  auto d = MoeGpt::Create(&backend, wider, 2);
  ASSERT_TRUE(d.ok());
  absl::Status bad = LoadWeights(backend, (*d)->layout(), *wf, (*d)->params());
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("h.0.moe.e0.w1"), absl::string_view::npos) << bad;
}

// A file that records its spec starts a job only of its own n_head (the shapes cannot
// tell); other training choices may change, and a file without a spec passes.
TEST(MoeGptTest, AnInitFileOfOtherHeadsIsRefused) {
  v1::ModelConfig job;
  job.set_n_head(4);
  job.set_top_k(2);
  const std::string recorded = R"({"model": {"n_head": 4, "top_k": 1, "future_field": 3}})";
  EXPECT_TRUE(CheckInitModel({{kSpecMetadataKey, recorded}}, job).ok());
  EXPECT_TRUE(CheckInitModel({}, job).ok());
  EXPECT_TRUE(CheckInitModel({{kSpecMetadataKey, "not json"}}, job).ok());
  job.set_n_head(2);
  const absl::Status other = CheckInitModel({{kSpecMetadataKey, recorded}}, job);
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("trained with model.n_head=4 and this job has 2"),
            std::string::npos)
      << other;
}

TEST(MoeGptTest, ExpertsWithoutTokensAreNotUpdated) {
  compute::CpuBackend backend(1);
  ModelShape shape = TinyShape(0.3, 1);  // k = 1 with a tight capacity: some experts idle
  shape.experts = 8;
  auto model = MoeGpt::Create(&backend, shape, 1);
  ASSERT_TRUE(model.ok());
  MoeGpt& m = **model;
  ASSERT_TRUE(m.InitWeights(4).ok());
  OptimizerConfig config;
  config.lr = 1e-2;
  config.weight_decay = 0.5;
  auto opt = AdamWOptimizer::Create(&backend, m.layout(), config);
  ASSERT_TRUE(opt.ok());
  const std::vector<float> before(m.params(), m.params() + m.layout().total_floats());
  Batch batch = RandomBatch(shape, 1, 1);
  ASSERT_TRUE(m.ForwardBackward(batch.in.data(), batch.tgt.data(), 1).ok());
  (*opt)->Step(m.params(), m.grads(), 0, [&](const ParamTensor& t) {
    return t.layer < 0 || m.ExpertUsed(t.layer, t.expert);
  });
  int idle = 0;
  const auto& tensors = m.layout().tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const ParamTensor& t = tensors[i];
    const bool changed =
        std::memcmp(before.data() + t.offset, m.params() + t.offset, t.numel * sizeof(float)) != 0;
    if (t.layer >= 0 && !m.ExpertUsed(t.layer, t.expert)) {
      ++idle;
      EXPECT_FALSE(changed) << t.name;
      EXPECT_EQ((*opt)->update_counts()[i], 0) << t.name;
    } else {
      EXPECT_EQ((*opt)->update_counts()[i], 1) << t.name;
    }
  }
  EXPECT_GT(idle, 0) << "the test wants at least one idle expert";
}

TEST(MoeGptTest, LearningRateSchedule) {
  OptimizerConfig c;
  c.lr = 1.0;
  c.warmup = 4;
  c.steps = 14;
  c.min_lr_ratio = 0.1;
  EXPECT_DOUBLE_EQ(LearningRate(c, 0), 0.25);
  EXPECT_DOUBLE_EQ(LearningRate(c, 3), 1.0);
  EXPECT_DOUBLE_EQ(LearningRate(c, 4), 1.0);     // q = 0
  EXPECT_NEAR(LearningRate(c, 9), 0.55, 1e-12);  // q = 0.5
  EXPECT_NEAR(LearningRate(c, 14), 0.1, 1e-12);  // q = 1
}

TEST(MoeGptTest, TokenIdsOutsideTheVocabularyAreRejected) {
  compute::CpuBackend backend(1);
  const ModelShape shape = TinyShape(0, 2);
  auto model = MoeGpt::Create(&backend, shape, 1);
  ASSERT_TRUE(model.ok());
  Batch batch = RandomBatch(shape, 1, 1);
  batch.in[2] = shape.vocab;
  EXPECT_EQ((*model)->ForwardBackward(batch.in.data(), batch.tgt.data(), 1).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The CPU backend computes in fp32 only: a bf16 model is refused with the reason.
TEST(MoeGptTest, TheCpuBackendRefusesBf16) {
  compute::CpuBackend backend(1);
  ModelShape shape = TinyShape(0, 2);
  shape.compute_dtype = ComputeDtype::kBf16;
  auto model = MoeGpt::Create(&backend, shape, 1);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(model.status().message(),
            "model.compute_dtype bf16: the cpu backend computes in fp32 only (bf16 needs the "
            "CUDA backend)");
}

}  // namespace
}  // namespace pith::model
