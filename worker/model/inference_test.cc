// Inference from a weights file: eval takes the rows training takes and computes the same
// loss as the training forward; sample is greedy at temperature 0 and reproducible per
// seed; bad inputs are errors that say what is wrong.
#include "worker/model/inference.h"

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/param_layout.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/data/token_dataset.h"
#include "worker/model/checkpoint.h"
#include "worker/model/moe_gpt.h"

namespace pith::model {
namespace {

using ::testing::HasSubstr;

v1::JobSpec TinySpec(int vocab = 256) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(absl::StrCat(R"({"name": "tiny",
    "model": {"vocab_size": )",
                                                               vocab, R"(, "seq_len": 8,
              "d_model": 16, "n_layer": 1, "n_head": 2, "n_expert": 4, "top_k": 2, "d_ff": 32},
    "train": {"data_path": "tokens.bin", "batch": 2, "steps": 1, "lr": 0.003}})"));
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

std::string TempPath(const std::string& name) { return testing::TempDir() + "/" + name; }

// A token file of `n` bytes cycling through the lowercase letters.
std::string WriteTokens(const std::string& name, int n) {
  std::string text;
  for (int i = 0; i < n; ++i) text.push_back(static_cast<char>('a' + (i * 7) % 26));
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// Every tensor zero: every logit is equal, so the cross-entropy is ln V.
SafetensorsFile ZeroWeights(const v1::JobSpec& spec) {
  const ParamLayout layout(ModelShape::FromSpec(spec.model()));
  std::vector<float> zeros(layout.total_floats(), 0.0f);
  const std::string path = TempPath("zero.safetensors");
  EXPECT_TRUE(SaveHostWeights(layout, zeros.data(), path).ok());
  return *SafetensorsFile::Read(path);
}

// The seeded init of DESIGN §3, saved as a weights file.
SafetensorsFile SeededWeights(const v1::JobSpec& spec, uint64_t seed) {
  compute::CpuBackend backend(1);
  auto m = MoeGpt::Create(&backend, ModelShape::FromSpec(spec.model()), 1);
  EXPECT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE((*m)->InitWeights(seed).ok());
  const std::string path = TempPath("seeded.safetensors");
  EXPECT_TRUE(SaveWeights(backend, (*m)->layout(), (*m)->params(), path).ok());
  return *SafetensorsFile::Read(path);
}

TEST(InferenceTest, EvalOfZeroWeightsIsLnVocab) {
  const v1::JobSpec spec = TinySpec();
  auto r = Evaluate(ZeroWeights(spec), spec, WriteTokens("zero_tokens.bin", 500), 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->rows, 4);
  EXPECT_EQ(r->tokens, 32);
  EXPECT_NEAR(r->ce, std::log(256.0), 1e-6);
}

// A job trained in bf16 (on the CUDA backend) is evaluated and sampled in fp32 on the
// CPU: its weights file holds the fp32 master weights.
TEST(InferenceTest, ABf16JobIsEvaluatedAndSampledInFp32) {
  v1::JobSpec spec = TinySpec();
  spec.mutable_model()->set_compute_dtype("bf16");
  auto r = Evaluate(ZeroWeights(spec), spec, WriteTokens("bf16_tokens.bin", 500), 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NEAR(r->ce, std::log(256.0), 1e-6);
  SampleOptions options;
  options.tokens = 4;
  options.temperature = 0;
  auto text = Sample(ZeroWeights(spec), spec, "ab", options);
  ASSERT_TRUE(text.ok()) << text.status();
}

TEST(InferenceTest, EvalIsTheTrainingForwardOnTheSameRows) {
  const v1::JobSpec spec = TinySpec();
  const SafetensorsFile weights = SeededWeights(spec, 7);
  const std::string tokens_path = WriteTokens("train_tokens.bin", 1000);
  auto r = Evaluate(weights, spec, tokens_path, 3);
  ASSERT_TRUE(r.ok()) << r.status();

  // The same three global batches through a model loaded by hand.
  const ModelShape shape = ModelShape::FromSpec(spec.model());
  const int B = spec.train().batch(), T = shape.seq;
  compute::CpuBackend backend(0);
  auto m = MoeGpt::Create(&backend, shape, B);
  ASSERT_TRUE(m.ok());
  ASSERT_TRUE(LoadWeights(backend, (*m)->layout(), weights, (*m)->params()).ok());
  auto tokens = data::TokenDataset::Open(tokens_path, shape.vocab);
  ASSERT_TRUE(tokens.ok());
  std::vector<int32_t> inputs(B * T), targets(B * T);
  double ce = 0, loss = 0;
  for (int s = 0; s < 3; ++s) {
    for (int i = 0; i < B; ++i) tokens->Row(s * B + i, T, &inputs[i * T], &targets[i * T]);
    auto l = (*m)->ForwardBackward(inputs.data(), targets.data(), B);
    ASSERT_TRUE(l.ok());
    ce += l->ce;
    loss += l->loss;
  }
  EXPECT_EQ(r->ce, ce / 3);
  EXPECT_EQ(r->loss, loss / 3);
  EXPECT_GT(std::abs(r->ce - std::log(256.0)), 1e-6);  // not the uniform answer
}

TEST(InferenceTest, GreedySampleOfZeroWeightsPicksByteZero) {
  const v1::JobSpec spec = TinySpec();
  auto text = Sample(ZeroWeights(spec), spec, "abc", {.tokens = 5, .temperature = 0});
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text, std::string("abc") + std::string(5, '\0'));
}

TEST(InferenceTest, SampleIsReproducibleForASeed) {
  const v1::JobSpec spec = TinySpec();
  const SafetensorsFile weights = SeededWeights(spec, 3);
  // A prompt longer than seq_len: the window slides.
  const std::string prompt = "the quick brown fox";
  auto a = Sample(weights, spec, prompt, {.tokens = 40, .temperature = 1.0, .seed = 11});
  auto b = Sample(weights, spec, prompt, {.tokens = 40, .temperature = 1.0, .seed = 11});
  auto c = Sample(weights, spec, prompt, {.tokens = 40, .temperature = 1.0, .seed = 12});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->size(), prompt.size() + 40);
  EXPECT_EQ(a->substr(0, prompt.size()), prompt);
  EXPECT_EQ(*a, *b);
  EXPECT_NE(*a, *c);
}

TEST(InferenceTest, SampleShowsTheTextAsItGrows) {
  const v1::JobSpec spec = TinySpec();
  const SafetensorsFile weights = SeededWeights(spec, 3);
  std::vector<std::string> pieces;
  SampleOptions options{.tokens = 6, .temperature = 1.0, .seed = 5};
  options.on_text = [&pieces](absl::string_view more) { pieces.emplace_back(more); };
  auto text = Sample(weights, spec, "abc", options);
  ASSERT_TRUE(text.ok()) << text.status();
  ASSERT_EQ(pieces.size(), 7u);  // the prompt, then one piece per byte
  EXPECT_EQ(pieces[0], "abc");
  EXPECT_EQ(absl::StrJoin(pieces, ""), *text);
}

TEST(InferenceTest, BadInputsAreErrors) {
  const v1::JobSpec spec = TinySpec();
  const SafetensorsFile zero = ZeroWeights(spec);
  // Weights of another model: the first tensor whose shape differs is named.
  v1::JobSpec wider = spec;
  wider.mutable_model()->set_d_model(32);
  auto r = Evaluate(zero, wider, WriteTokens("bad_tokens.bin", 500), 1);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("wte"));
  // A missing token file.
  EXPECT_FALSE(Evaluate(zero, spec, TempPath("no_such_tokens.bin"), 1).ok());
  // Sampling wants bytes.
  const v1::JobSpec words = TinySpec(512);
  auto s = Sample(ZeroWeights(words), words, "abc", {});
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(s.status().message(), HasSubstr("vocab_size 256"));
  EXPECT_FALSE(Sample(zero, spec, "", {}).ok());
}

}  // namespace
}  // namespace pith::model
