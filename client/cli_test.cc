#include "client/cli.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "common/file.h"
#include "common/grpc_util.h"
#include "common/job_spec.h"
#include "common/param_layout.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pith/v1/job.grpc.pb.h"

namespace pith {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

struct Result {
  int code;
  std::string out, err;
};

Result RunPith(std::vector<std::string> args) {
  std::ostringstream out, err;
  int code = RunCli(args, out, err);
  return {code, out.str(), err.str()};
}

std::string WriteTemp(const std::string& name, const std::string& content) {
  const std::string path = testing::TempDir() + "/" + name;
  EXPECT_TRUE(WriteFileAtomically(path, [&](int fd) {
                return WriteAll(
                    fd, {reinterpret_cast<const uint8_t*>(content.data()), content.size()}, path);
              }).ok());
  return path;
}

// One line, ending in a newline, starting with "pith: ".
void ExpectOneErrorLine(const Result& r) {
  EXPECT_THAT(r.err, StartsWith("pith: "));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

constexpr char kSpec[] = R"({"name": "demo",
  "model": {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4,
            "n_expert": 16, "top_k": 2, "d_ff": 256},
  "train": {"data_path": "tokens.bin", "batch": 16, "steps": 300, "lr": 0.003}})";

TEST(CliTest, SpecCheckPrintsTheSpecWithDefaults) {
  Result r = RunPith({"spec", "check", WriteTemp("ok.json", kSpec)});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("\"min_lr_ratio\": 0.1"));
  EXPECT_TRUE(r.err.empty());
}

TEST(CliTest, InvalidSpecIsOneLineNamingTheField) {
  std::string bad = kSpec;
  bad.replace(bad.find("\"n_head\": 4"), 11, "\"n_head\": 3");
  const std::string path = WriteTemp("bad.json", bad);
  Result r = RunPith({"spec", "check", path});
  EXPECT_EQ(r.code, 1);
  ExpectOneErrorLine(r);
  EXPECT_THAT(r.err, HasSubstr(path + ": JobSpec model.n_head: must divide model.d_model 128"));
}

TEST(CliTest, MalformedSafetensorsIsOneLine) {
  std::string file(8, '\0');
  file[0] = static_cast<char>(200);  // header length 200, but nothing follows
  Result r = RunPith({"safetensors", "inspect", WriteTemp("bad.safetensors", file)});
  EXPECT_EQ(r.code, 1);
  ExpectOneErrorLine(r);
  EXPECT_THAT(r.err, HasSubstr("header length (its first 8 bytes) exceeds"));
}

TEST(CliTest, SafetensorsInspectListsTensors) {
  Tensor t = *Tensor::Zeros(DType::kF32, {2, 3});
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("wte", t.view()).ok());
  writer.SetMetadata("step", "5");
  const std::string path = testing::TempDir() + "/ok.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());
  Result r = RunPith({"safetensors", "inspect", path});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("wte"));
  EXPECT_THAT(r.out, HasSubstr("[2, 3]"));
  EXPECT_THAT(r.out, HasSubstr("metadata step = 5"));
  EXPECT_THAT(r.out, HasSubstr("1 tensors, 24 bytes"));
}

TEST(CliTest, DataPrepareWritesByteTokens) {
  const std::string text = WriteTemp("corpus.txt", "abcabc");
  const std::string out = testing::TempDir() + "/corpus.bin";
  Result r = RunPith({"data", "prepare", "--out", out, text});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("wrote 6 tokens"));
  r = RunPith({"data", "prepare", "--out", out, "--vocab", "1000", text});
  EXPECT_EQ(r.code, 1);
  ExpectOneErrorLine(r);
  r = RunPith({"data", "prepare", text});
  EXPECT_EQ(r.code, 2);  // used wrongly
  EXPECT_THAT(r.err, HasSubstr("--out"));
}

// Outputs go to new or regular files only: a symlink, a FIFO or a directory at the name is
// refused, never replaced (as root, --out /dev/null would have replaced the device).
TEST(CliTest, OutputsNeverReplaceALinkOrADevice) {
  const std::string text = WriteTemp("corpus2.txt", "abcabc");
  const std::string target = WriteTemp("kept.txt", "kept");
  const std::string link = testing::TempDir() + "/link.bin";
  std::filesystem::remove(link);
  std::filesystem::create_symlink(target, link);
  const std::string fifo = testing::TempDir() + "/fifo.bin";
  std::filesystem::remove(fifo);
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& out : {link, testing::TempDir(), fifo}) {
    const Result r = RunPith({"data", "prepare", "--out", out, text});
    EXPECT_EQ(r.code, 1) << out;
    EXPECT_THAT(r.err, HasSubstr("is not a regular file")) << out;
    ExpectOneErrorLine(r);
  }
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_TRUE(std::filesystem::is_fifo(fifo));
  // Empty names are usage errors (checkpoint's used to abort on an exception).
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"checkpoint", "job", "--out", ""}, {"experts", "job", "--svg", ""}}) {
    const Result r = RunPith(args);
    EXPECT_EQ(r.code, 2) << args[0];
    EXPECT_THAT(r.err, HasSubstr("needs a file name")) << args[0];
    ExpectOneErrorLine(r);
  }
}

// --flag=value works for a command's flags as for the global ones; empty values and a NaN
// temperature are refused.
TEST(CliTest, FlagsTakeEqualsAndRefuseEmptyValues) {
  const std::string text = WriteTemp("corpus3.txt", "abcabc");
  const std::string out = testing::TempDir() + "/corpus3.bin";
  Result r = RunPith({"data", "prepare", "--out=" + out, text});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(std::filesystem::exists(out));
  EXPECT_THAT(RunPith({"--version"}).out, StartsWith("Pith "));
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"--coordinator", "", "status"},
           {"down", "--dir", ""},
           {"up", "--dir", ""},
           {"sample", "--checkpoint", "m.safetensors", "--prompt", "a", "--temperature", "nan"},
           {"sample", "--checkpoint", "m.safetensors", "--prompt", "a", "--temperature=inf"}}) {
    r = RunPith(args);
    EXPECT_EQ(r.code, 2) << absl::StrJoin(args, " ") << ": " << r.err;
    ExpectOneErrorLine(r);
  }
}

TEST(CliTest, UsageErrors) {
  EXPECT_EQ(RunPith({}).code, 2);
  Result r = RunPith({"frobnicate"});
  EXPECT_EQ(r.code, 2);
  ExpectOneErrorLine(r);
  r = RunPith({"spec", "check"});
  EXPECT_EQ(r.code, 2);  // used wrongly
  ExpectOneErrorLine(r);
  r = RunPith({"spec", "check", "/nonexistent.json"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("/nonexistent.json"));
  EXPECT_EQ(RunPith({"help"}).code, 0);
  EXPECT_THAT(RunPith({"version"}).out, StartsWith("Pith "));
  r = RunPith({"--bogus", "status"});  // a flag before the command is not a command
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "pith: unknown flag --bogus (try pith help)\n");
  // Names and hosts that no certificate or token can take: usage errors, nothing made.
  const std::string dir = ::testing::TempDir() + "/cli_usage_certs";
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"certs", "--dir", dir, "--role", "user", "--name", "../evil"},
           {"certs", "--dir", dir, "--role", "admin", "--name", "ops", "--hosts", "node1"},
           {"certs", "--dir", dir, "--hosts", "node1"},
           {"token", "--file", dir + "/tokens", "--name", "eve admin"}}) {
    r = RunPith(args);
    EXPECT_EQ(r.code, 2) << absl::StrJoin(args, " ") << ": " << r.err;
    ExpectOneErrorLine(r);
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(CliTest, ATokenLifetimeIsADurationOfAMinuteAtLeast) {
  for (const char* lifetime : {"soon", "30s", "0d", "-5m", "1.5d"}) {
    const Result r = RunPith({"token", "--file", ::testing::TempDir() + "/cli_test_tokens",
                              "--name", "carol", "--expires_in", lifetime});
    EXPECT_EQ(r.code, 2) << lifetime;
    EXPECT_THAT(r.err, HasSubstr("want a lifetime such as 90d, 12h or 30m")) << lifetime;
    ExpectOneErrorLine(r);
  }
}

TEST(CliTest, AMistypedFlagIsAUsageErrorNotAJobId) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"status", "--bogus"},
                                             {"watch", "--dir", "x"},
                                             {"cancel", "-x"},
                                             {"remove", "job", "--all"},
                                             {"checkpoint", "job", "--out", "f", "--forse"},
                                             {"experts", "job", "--png", "f"}}) {
    const Result r = RunPith(args);
    EXPECT_EQ(r.code, 2) << args[0];
    EXPECT_THAT(r.err, HasSubstr(args[0] + ": unknown flag -"));
    ExpectOneErrorLine(r);
  }
}

// A coordinator that knows one job.
class OneJobService final : public v1::JobService::Service {
 public:
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest*, v1::Job* reply) override {
    *reply = job;
    return grpc::Status::OK;
  }
  v1::Job job;
};

TEST(CliTest, StatusSaysAJobRunsShortOfWorkers) {
  ::setenv("PITH_HOME", (::testing::TempDir() + "/cli_status_home").c_str(), 1);  // no cluster
  OneJobService service;
  service.job.set_job_id("demo-1");
  service.job.set_state(v1::JOB_STATE_RUNNING);
  service.job.set_committed_step(5);
  service.job.mutable_spec()->mutable_train()->set_steps(10);
  service.job.mutable_spec()->mutable_cluster()->set_workers(2);
  service.job.set_workers(1);
  auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", (*server)->port());
  Result r = RunPith({"--coordinator", address, "status", "demo-1"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("step 5/10  loss 0.0000"));
  EXPECT_THAT(r.out, HasSubstr("(1 of 2 workers)")) << r.out;
  service.job.set_workers(2);
  r = RunPith({"--coordinator", address, "status", "demo-1"});
  EXPECT_THAT(r.out, Not(HasSubstr("workers)"))) << r.out;
  // --insecure: plaintext whatever certificates the environment names.
  ::setenv("PITH_TLS_DIR", "/nonexistent-tls", 1);
  EXPECT_EQ(RunPith({"--coordinator", address, "status", "demo-1"}).code, 1);
  r = RunPith({"--insecure", "--coordinator", address, "status", "demo-1"});
  EXPECT_EQ(r.code, 0) << r.err;
  r = RunPith({"--insecure", "--token", "t", "--coordinator", address, "status", "demo-1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--insecure is plaintext"));
  ::unsetenv("PITH_TLS_DIR");
  ::unsetenv("PITH_HOME");
}

// A coordinator that streams one chunk of a checkpoint, then waits until the CLI's
// partial file holds it and sends the process SIGTERM (an operator's kill mid-download).
class KilledMidDownload final : public v1::JobService::Service {
 public:
  explicit KilledMidDownload(std::string partial) : partial_(std::move(partial)) {}
  grpc::Status DownloadCheckpoint(grpc::ServerContext*, const v1::DownloadCheckpointRequest*,
                                  grpc::ServerWriter<v1::CheckpointChunk>* writer) override {
    v1::CheckpointChunk chunk;
    chunk.set_step(3);
    chunk.set_total_bytes(2 << 20);
    chunk.set_data(std::string(1 << 20, 'w'));
    writer->Write(chunk);
    for (int i = 0; i < 1000; ++i) {
      struct stat st;
      if (::stat(partial_.c_str(), &st) == 0 && st.st_size == (1 << 20)) ::raise(SIGTERM);
      absl::SleepFor(absl::Milliseconds(10));
    }
    return grpc::Status(grpc::StatusCode::INTERNAL, "the CLI was not killed");
  }

 private:
  const std::string partial_;
};

// SIGTERM during `pith checkpoint` leaves no FILE.partial-PID behind.
TEST(CliDeathTest, ASignalMidDownloadRemovesThePartialFile) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: no gRPC state forked
  const std::string dir = ::testing::TempDir() + "/cli_killed_download";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/model.safetensors";
  EXPECT_EXIT(
      {
        KilledMidDownload service(Client::PartialPath(path));
        auto server = GrpcServer::Start({.listen_address = "127.0.0.1:0", .services = {&service}});
        if (!server.ok()) ::_exit(1);
        RunPith({"--insecure", "--coordinator", absl::StrCat("127.0.0.1:", (*server)->port()),
                 "checkpoint", "demo-1", "--out", path});
        ::_exit(2);
      },
      ::testing::KilledBySignal(SIGTERM), "");
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "a partial file was left";
  std::filesystem::remove_all(dir);
}

TEST(CliTest, HelpAfterACommandPrintsTheUsage) {
  for (const char* command : {"up", "checkpoint", "down"}) {
    const Result r = RunPith({command, "--help"});
    EXPECT_EQ(r.code, 0) << command;
    EXPECT_THAT(r.out, HasSubstr("local cluster")) << command;
  }
}

TEST(CliTest, UpNamesTheFlagWhoseValueIsWrong) {
  const std::string dir = ::testing::TempDir() + "/cli_up_flags";
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--stores", "0"}, {"--workers", "-1"}, {"--ram_bytes", "abc"}}) {
    const Result r = RunPith({"up", "--dir", dir, flag, value});
    EXPECT_EQ(r.code, 2) << flag;
    EXPECT_THAT(r.err, HasSubstr("up: " + flag + " wants a whole number >= 1, got \"" + value))
        << r.err;
  }
  for (const char* root : {"data", "/no/such/dir", "/tmp,rel", "/tmp,", ","}) {
    const Result r = RunPith({"up", "--dir", dir, "--data_root", root});
    EXPECT_EQ(r.code, 2) << root;
    EXPECT_THAT(r.err, HasSubstr("up: --data_root wants absolute directories (or any), got"))
        << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(dir));  // refused before anything was made
}

TEST(CliTest, UpRefusesAClusterLargerThanTheMachine) {
  const std::string dir = ::testing::TempDir() + "/cli_up_memory";
  const uint64_t machine = PhysicalMemoryBytes();
  ASSERT_GT(machine, 0u);
  // The stores' RAM tiers alone: at most half of the machine.
  Result r =
      RunPith({"up", "--dir", dir, "--stores", "2", "--ram_bytes", absl::StrCat(machine / 3)});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("is more than half of this machine's")) << r.err;
  ExpectOneErrorLine(r);
  // Workers each granted a third of the machine, beside stores that hold a quarter.
  r = RunPith({"up", "--dir", dir, "--stores", "1", "--ram_bytes", absl::StrCat(machine / 4),
               "--workers", "3", "--memory_bytes", absl::StrCat(machine / 3)});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("up: --workers 3 x --memory_bytes " + absl::StrCat(machine / 3)))
      << r.err;
  ExpectOneErrorLine(r);
  EXPECT_FALSE(std::filesystem::exists(dir));  // refused before anything was made
}

TEST(CliTest, EvalAndSampleUseACheckpointAndRefuseBadInput) {
  const std::string spec_json = R"({"name": "tiny",
    "model": {"vocab_size": 256, "seq_len": 8, "d_model": 16, "n_layer": 1, "n_head": 2,
              "n_expert": 4, "top_k": 2, "d_ff": 32},
    "train": {"data_path": "tokens.bin", "batch": 2, "steps": 1, "lr": 0.003}})";
  const std::string spec = WriteTemp("eval_spec.json", spec_json);
  const std::string tokens = WriteTemp("eval_tokens.bin", std::string(500, 'a'));
  // Weights: every tensor of the model, zero (every logit equal: ce = ln 256).
  const model::ParamLayout layout(model::ModelShape::FromSpec(LoadJobSpec(spec)->model()));
  std::vector<float> zeros(layout.total_floats(), 0.0f);
  const std::string weights = testing::TempDir() + "/eval_zero.safetensors";
  ASSERT_TRUE(model::SaveHostWeights(layout, zeros.data(), weights).ok());
  Result r = RunPith(
      {"eval", "--spec", spec, "--checkpoint", weights, "--tokens", tokens, "--batches", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("eval rows=4 tokens=32 ce=5.5451774"));  // ln 256

  // Sampling from it: equal logits everywhere, so temperature 0 picks byte 0 each time.
  r = RunPith({"sample", "--spec", spec, "--checkpoint", weights, "--prompt", "abc", "--tokens",
               "5", "--temperature", "0"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, std::string("abc") + std::string(5, '\0') + "\n");
  // A flag's value is taken as written, whatever it looks like.
  for (const char* prompt : {"--token=x", "--help", "--coordinator", "--x=y", "--version"}) {
    r = RunPith(
        {"sample", "--spec", spec, "--checkpoint", weights, "--prompt", prompt, "--tokens", "0"});
    EXPECT_EQ(r.code, 0) << prompt << ": " << r.err;
    EXPECT_EQ(r.out, std::string(prompt) + "\n");
  }
  r = RunPith({"sample", "--spec", spec, "--checkpoint", weights, "--prompt", "abc",
               "--temperature", "-1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--temperature"));
  r = RunPith({"sample", "--checkpoint", weights, "--prompt", "abc"});  // no spec anywhere
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("records no job spec"));
  r = RunPith({"sample", "--spec", spec, "--prompt", "abc"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--checkpoint"));

  // A file that records its spec: --spec may change what eval reads, not the model.
  const std::string recorded = testing::TempDir() + "/eval_recorded.safetensors";
  ASSERT_TRUE(model::SaveHostWeights(layout, zeros.data(), recorded,
                                     {{model::kSpecMetadataKey, JobSpecToJson(*LoadJobSpec(spec))}})
                  .ok());
  const std::string wider = WriteTemp(
      "eval_spec_batch.json", absl::StrReplaceAll(spec_json, {{"\"batch\": 2", "\"batch\": 1"}}));
  r = RunPith(
      {"eval", "--spec", wider, "--checkpoint", recorded, "--tokens", tokens, "--batches", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("eval rows=2 tokens=16"));
  // n_head 1 keeps every tensor's shape: before, the weights ran as another model.
  const std::string heads = WriteTemp(
      "eval_spec_heads.json", absl::StrReplaceAll(spec_json, {{"\"n_head\": 2", "\"n_head\": 1"}}));
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"eval", "--tokens", tokens},
        std::vector<std::string>{"sample", "--prompt", "abc"}}) {
    std::vector<std::string> line = args;
    line.insert(line.end(), {"--spec", heads, "--checkpoint", recorded});
    r = RunPith(line);
    EXPECT_EQ(r.code, 2) << args[0];
    EXPECT_THAT(r.err, HasSubstr("has another model.n_head than")) << r.err;
    ExpectOneErrorLine(r);
  }
  // compute_dtype is no other model here (eval and sample compute in fp32).
  const std::string fp32 =
      WriteTemp("eval_spec_fp32.json",
                absl::StrReplaceAll(
                    spec_json, {{"\"d_ff\": 32", "\"d_ff\": 32, \"compute_dtype\": \"fp32\""}}));
  r = RunPith({"eval", "--spec", fp32, "--checkpoint", recorded, "--tokens", tokens});
  EXPECT_EQ(r.code, 0) << r.err;
  // A recorded spec this Pith cannot read (another version's): --spec decides.
  const std::string unreadable = testing::TempDir() + "/eval_unreadable.safetensors";
  ASSERT_TRUE(model::SaveHostWeights(layout, zeros.data(), unreadable,
                                     {{model::kSpecMetadataKey, "{\"model\": {\"future\": 1}}"}})
                  .ok());
  r = RunPith({"eval", "--checkpoint", unreadable, "--tokens", tokens});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("unreadable job spec")) << r.err;
  r = RunPith({"eval", "--spec", spec, "--checkpoint", unreadable, "--tokens", tokens});
  EXPECT_EQ(r.code, 0) << r.err;

  r = RunPith({"eval", "--spec", spec});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--checkpoint"));
  ExpectOneErrorLine(r);
  r = RunPith({"eval", "--spec", spec, "--checkpoint", tokens, "--tokens", tokens});
  EXPECT_EQ(r.code, 1);
  ExpectOneErrorLine(r);
  // 500 tokens hold 31 batches of 2 rows of 8: a 32nd would score text again.
  r = RunPith(
      {"eval", "--spec", spec, "--checkpoint", weights, "--tokens", tokens, "--batches", "32"});
  EXPECT_EQ(r.code, 1);
  EXPECT_THAT(r.err, HasSubstr("hold 31 batches of 2 rows of 8 tokens; ask for at most 31"));
  ExpectOneErrorLine(r);
  r = RunPith(
      {"eval", "--spec", spec, "--checkpoint", weights, "--tokens", tokens, "--batches", "zero"});
  EXPECT_EQ(r.code, 2);
  EXPECT_THAT(r.err, HasSubstr("--batches"));
}

}  // namespace
}  // namespace pith
