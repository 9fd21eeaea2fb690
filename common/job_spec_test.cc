#include "common/job_spec.h"

#include <cmath>
#include <string>

#include "absl/strings/str_replace.h"
#include "common/job_spec_testing.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace pith {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr const char* kDesignExample = pith::testing::kDesignExampleSpecJson;

TEST(JobSpecTest, ParsesTheDesignExample) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(kDesignExample);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name(), "demo");
  EXPECT_EQ(spec->model().n_expert(), 16);
  EXPECT_DOUBLE_EQ(spec->model().capacity_factor(), 1.25);
  EXPECT_TRUE(spec->model().renormalize_topk());
  EXPECT_EQ(spec->train().seed(), 1337u);
  EXPECT_DOUBLE_EQ(spec->train().min_lr_ratio(), 0.1);
  EXPECT_EQ(spec->cluster().workers(), 2);
  EXPECT_EQ(spec->cluster().store_replicas(), 2);
}

TEST(JobSpecTest, FillsDefaults) {
  std::string json = absl::StrReplaceAll(
      kDesignExample, {{"\"min_lr_ratio\": 0.1, ", ""}, {", \"store_replicas\": 2", ""}});
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(json);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_DOUBLE_EQ(spec->train().min_lr_ratio(), 0.1);
  EXPECT_DOUBLE_EQ(spec->train().beta1(), 0.9);
  EXPECT_DOUBLE_EQ(spec->train().beta2(), 0.95);
  EXPECT_DOUBLE_EQ(spec->train().eps(), 1e-8);
  EXPECT_EQ(spec->cluster().store_replicas(), 1);
  EXPECT_EQ(spec->cluster().replication().max_compute_replicas(), 1);
  EXPECT_EQ(spec->cluster().replication().max_store_replicas(), 1);
  EXPECT_DOUBLE_EQ(spec->cluster().replication().heat_decay(), 0.9);

  // An explicit min_lr_ratio of 0 is kept, not replaced by the default.
  json = absl::StrReplaceAll(kDesignExample, {{"\"min_lr_ratio\": 0.1", "\"min_lr_ratio\": 0"}});
  spec = ParseJobSpec(json);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->train().min_lr_ratio(), 0.0);
}

TEST(JobSpecTest, JsonRoundTrip) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(kDesignExample);
  ASSERT_TRUE(spec.ok());
  const std::string json = JobSpecToJson(*spec);
  EXPECT_THAT(json, HasSubstr("\"d_model\": 128"));
  absl::StatusOr<v1::JobSpec> again = ParseJobSpec(json);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*spec, *again));
}

TEST(JobSpecTest, NegativeZeroRoundTripsAsZero) {
  // Found by the fuzzer: -0 used to print and re-parse as a different spec.
  std::string json =
      absl::StrReplaceAll(kDesignExample, {{"\"aux_loss_coef\": 0.01", "\"aux_loss_coef\": -0.0"}});
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(json);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FALSE(std::signbit(spec->model().aux_loss_coef()));
  absl::StatusOr<v1::JobSpec> again = ParseJobSpec(JobSpecToJson(*spec));
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*spec, *again));
}

// Replaces `from` in the design example by `to` and returns the parse error.
std::string ErrorFor(const std::string& from, const std::string& to) {
  const std::string json = absl::StrReplaceAll(kDesignExample, {{from, to}});
  EXPECT_NE(json, kDesignExample) << "test edit did not apply: " << from;
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(json);
  EXPECT_FALSE(spec.ok()) << from << " -> " << to;
  if (spec.ok()) return "";
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(spec.status().message());
}

TEST(JobSpecTest, NamesTheBadField) {
  struct Case {
    std::string from, to, want;
  };
  const Case cases[] = {
      {"\"name\": \"demo\"", "\"name\": \"\"", "JobSpec name: "},
      {"\"name\": \"demo\"", "\"name\": \"a b\"", "JobSpec name: "},
      {"\"vocab_size\": 256", "\"vocab_size\": 1", "JobSpec model.vocab_size: "},
      {"\"vocab_size\": 256", "\"vocab_size\": 70000", "JobSpec model.vocab_size: "},
      {"\"seq_len\": 64", "\"seq_len\": 0", "JobSpec model.seq_len: "},
      {"\"d_model\": 128", "\"d_model\": -1", "JobSpec model.d_model: "},
      {"\"n_head\": 4", "\"n_head\": 3", "JobSpec model.n_head: must divide model.d_model 128"},
      {"\"n_layer\": 4", "\"n_layer\": 0", "JobSpec model.n_layer: "},
      {"\"n_expert\": 16", "\"n_expert\": 0", "JobSpec model.n_expert: "},
      {"\"n_expert\": 16", "\"n_expert\": 65536",
       "JobSpec model.n_expert: n_layer x n_expert is 262144 experts, more than the limit of "
       "131072"},
      {"\"top_k\": 2", "\"top_k\": 17", "JobSpec model.top_k: must be in [1, 16], got 17"},
      {"\"d_ff\": 256", "\"d_ff\": 0", "JobSpec model.d_ff: "},
      {"\"aux_loss_coef\": 0.01", "\"aux_loss_coef\": -1", "JobSpec model.aux_loss_coef: "},
      {"\"z_loss_coef\": 0.001", "\"z_loss_coef\": \"NaN\"", "JobSpec model.z_loss_coef: "},
      {"\"d_model\": 128", "\"d_model\": 1048576", "JobSpec model: has "},
      {"\"top_k\": 2", "\"top_k\": 2, \"compute_dtype\": \"fp16\"",
       "JobSpec model.compute_dtype: must be fp32 or bf16, got \"fp16\""},
      {"\"data_path\": \"tokens.bin\"", "\"data_path\": \"\"", "JobSpec train.data_path: "},
      {"\"batch\": 16", "\"batch\": 0", "JobSpec train.batch: "},
      {"\"steps\": 300", "\"steps\": 0", "JobSpec train.steps: "},
      {"\"lr\": 0.003", "\"lr\": 0", "JobSpec train.lr: "},
      {"\"warmup\": 20", "\"warmup\": -5", "JobSpec train.warmup: "},
      {"\"min_lr_ratio\": 0.1", "\"min_lr_ratio\": 1.5", "JobSpec train.min_lr_ratio: "},
      {"\"weight_decay\": 0.1", "\"weight_decay\": -0.1", "JobSpec train.weight_decay: "},
      {"\"grad_clip\": 1.0", "\"grad_clip\": -1", "JobSpec train.grad_clip: "},
      {"\"grad_clip\": 1.0", "\"grad_clip\": 1.0, \"beta2\": 1.0", "JobSpec train.beta2: "},
      {"\"workers\": 2", "\"workers\": -1", "JobSpec cluster.workers: "},
      {"\"batch\": 16", "\"batch\": 1",
       "JobSpec train.batch: must be at least cluster.workers (2): each worker trains rows of its "
       "own, got 1"},
      {"\"store_replicas\": 2", "\"store_replicas\": 17", "JobSpec cluster.store_replicas: "},
      {"\"cache_bytes\": 0", "\"cache_bytes\": -1", "JobSpec cluster.cache_bytes: "},
      {"\"cache_bytes\": 0", "\"cache_bytes\": 0, \"replication\": {\"max_compute_replicas\": 3}",
       "JobSpec cluster.replication.max_compute_replicas: must be in [1, 2], got 3"},
      {"\"cache_bytes\": 0", "\"cache_bytes\": 0, \"replication\": {\"heat_decay\": 1.5}",
       "JobSpec cluster.replication.heat_decay: "},
  };
  for (const Case& c : cases) {
    EXPECT_THAT(ErrorFor(c.from, c.to), StartsWith(c.want)) << c.from << " -> " << c.to;
  }
}

TEST(JobSpecTest, MalformedJsonIsOneClearError) {
  EXPECT_THAT(ErrorFor("\"d_model\": 128", "\"d_model\": \"wide\""), StartsWith("JobSpec JSON: "));
  EXPECT_THAT(ErrorFor("\"d_model\": 128", "\"d_modle\": 128"), HasSubstr("d_modle"));
  EXPECT_THAT(ErrorFor("\"cluster\"", "\"clusters\""), HasSubstr("clusters"));
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec("{\"name\": ");
  EXPECT_THAT(std::string(spec.status().message()), StartsWith("JobSpec JSON: "));
  // A file cut short: one line, with the text the parser stopped at quoted.
  spec = ParseJobSpec("{\"model\": {\"n_layer\": 2");
  EXPECT_THAT(std::string(spec.status().message()), StartsWith("JobSpec JSON: "));
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("(at: 2)"));
  EXPECT_EQ(std::string(spec.status().message()).find('\n'), std::string::npos) << spec.status();
  // Cut short in a file of many lines: still one line, the lines around it quoted.
  spec = ParseJobSpec("{\n  \"model\": {\n    \"n_layer\": 2,\n    \"d_model\": 1");
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("(at: "));
  EXPECT_EQ(std::string(spec.status().message()).find('\n'), std::string::npos) << spec.status();
  spec = ParseJobSpec("");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(JobSpecTest, AKeyGivenTwiceIsRefused) {
  // JSON parsers keep one of the two silently; a spec edited by adding a line would train
  // with whichever came last.
  EXPECT_THAT(ErrorFor("\"steps\": 300", "\"steps\": 7, \"steps\": 300"),
              StartsWith("JobSpec train.steps: given twice"));
  // protobuf maps the lowerCamelCase name to the same field.
  EXPECT_THAT(ErrorFor("\"n_layer\": 4", "\"n_layer\": 4, \"nLayer\": 3"),
              StartsWith("JobSpec model.nLayer: given twice"));
  EXPECT_THAT(ErrorFor("\"name\": \"demo\"", "\"name\": \"a\", \"name\": \"b\""),
              StartsWith("JobSpec name: given twice"));
  // An escaped name is the same name to protobuf.
  EXPECT_THAT(ErrorFor("\"steps\": 300", "\"steps\": 7, \"\\u0073teps\": 300"),
              StartsWith("JobSpec train.steps: given twice"));
  EXPECT_THAT(ErrorFor("\"cluster\": {", "\"cluster\": {}, \"cluster\": {"),
              StartsWith("JobSpec cluster: given twice"));
  // The same name in two different objects is no duplicate; strings holding braces, quotes
  // and key-like text are not keys.
  const std::string tricky =
      absl::StrReplaceAll(kDesignExample, {{"\"tokens.bin\"", "\"{\\\"data_path\\\": 1, }.bin\""}});
  ASSERT_NE(tricky, kDesignExample);
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpec(tricky);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->train().data_path(), "{\"data_path\": 1, }.bin");
}

TEST(JobSpecTest, LoadNamesTheFile) {
  absl::StatusOr<v1::JobSpec> spec = LoadJobSpec("/nonexistent/spec.json");
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(spec.status().message()), HasSubstr("/nonexistent/spec.json"));
}

}  // namespace
}  // namespace pith
