#include "client/cli.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/client.h"
#include "common/job_spec.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/version.h"
#include "google/protobuf/util/json_util.h"
#include "worker/compute/cpu_backend.h"
#include "worker/data/token_dataset.h"
#include "worker/model/checkpoint.h"
#include "worker/model/moe_gpt.h"

namespace pith {
namespace {

constexpr char kUsage[] =
    "usage: pith <command> [args]\n"
    "\n"
    "commands:\n"
    "  spec check SPEC.json        validate a job spec; print it with defaults filled in\n"
    "  safetensors inspect FILE    validate a safetensors file; list its tensors\n"
    "  data prepare --out FILE [--vocab 256] TEXT...\n"
    "                              turn text files into a token file (byte-level)\n"
    "  eval --spec SPEC.json --checkpoint FILE --tokens FILE [--batches N]\n"
    "                              mean loss of a checkpoint on token data (held-out\n"
    "                              data: rows as DESIGN §3 orders them, batch s = 0..N-1)\n"
    "  sample --checkpoint FILE --spec SPEC.json --prompt TEXT [--tokens N]\n"
    "         [--temperature T] [--seed S]\n"
    "                              generate text from a checkpoint (byte-level vocab)\n"
    "  version                     print the Pith version\n"
    "\n"
    "job commands (coordinator from --coordinator HOST:PORT, else $PITH_COORDINATOR, else\n"
    "127.0.0.1:7000; --output json for machine-readable output):\n"
    "  submit SPEC.json            submit a job; prints its id\n"
    "  status [JOB]                one job's state and figures, or every job\n"
    "  watch JOB                   follow a job: step, loss, tokens/s, cache hit rate, ETA\n"
    "  cancel JOB                  cancel a job\n"
    "  checkpoint JOB --out FILE   export the job's last committed weights (safetensors)\n"
    "  cluster                     members, their leases and tiers, moves in flight\n";

using Args = std::vector<std::string>;
using Command = std::function<absl::Status(const Args&, std::ostream&)>;

absl::Status UsageError(const std::string& what) { return absl::InvalidArgumentError(what); }

// Flags every job command understands, taken out of the arguments by RunCli.
struct Globals {
  std::string coordinator;
  bool json = false;
};
Globals g_globals;

absl::StatusOr<std::unique_ptr<Client>> Connect() {
  std::string address = g_globals.coordinator;
  if (address.empty()) {
    const char* env = std::getenv("PITH_COORDINATOR");
    address = env != nullptr && *env != '\0' ? env : "127.0.0.1:7000";
  }
  return Client::Connect(address, absl::Seconds(5));
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

std::string StateName(v1::JobState s) {
  std::string name = v1::JobState_Name(s);
  return absl::AsciiStrToLower(absl::StripPrefix(name, "JOB_STATE_"));
}

absl::Status Submit(const Args& args, std::ostream& out) {
  if (args.size() != 1) return UsageError("submit takes one spec file: pith submit SPEC.json");
  ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpec(args[0]));
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  ASSIGN_OR_RETURN(v1::Job job, client->Submit(spec));
  if (g_globals.json) {
    out << "{\"job_id\": \"" << job.job_id() << "\"}\n";
  } else {
    out << job.job_id() << "\n";
  }
  return absl::OkStatus();
}

std::string JobLine(const v1::Job& j) {
  return absl::StrFormat("%-24s %-10s step %d/%d  loss %.4f  %.0f tokens/s  cache hit %.2f%s",
                         j.job_id(), StateName(j.state()), std::max<int64_t>(0, j.committed_step()),
                         j.spec().train().steps(), j.last_loss(), j.tokens_per_second(),
                         j.cache_hit_rate(),
                         j.failure_reason().empty() ? "" : "  (" + j.failure_reason() + ")");
}

absl::Status Status(const Args& args, std::ostream& out) {
  if (args.size() > 1) return UsageError("status takes at most one job id");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  if (args.size() == 1) {
    ASSIGN_OR_RETURN(v1::Job job, client->Get(args[0]));
    out << (g_globals.json ? Json(job) : JobLine(job)) << "\n";
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<v1::Job> jobs, client->List());
  if (g_globals.json) {
    v1::ListJobsResponse all;
    for (v1::Job& j : jobs) *all.add_jobs() = std::move(j);
    out << Json(all) << "\n";
    return absl::OkStatus();
  }
  if (jobs.empty()) out << "no jobs\n";
  for (const v1::Job& j : jobs) out << JobLine(j) << "\n";
  return absl::OkStatus();
}

absl::Status Watch(const Args& args, std::ostream& out) {
  if (args.size() != 1) return UsageError("watch takes one job id: pith watch JOB");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  ASSIGN_OR_RETURN(v1::Job job, client->Get(args[0]));
  const int64_t steps = job.spec().train().steps();
  double first_loss = -1, last_loss = 0, tokens_per_second = 0, hit_rate = 0;
  int64_t last_step = -2;
  v1::JobEvent last;
  RETURN_IF_ERROR(client->Watch(args[0], [&](const v1::JobEvent& e) {
    last = e;
    if (e.step() == last_step && e.state() == v1::JOB_STATE_RUNNING) return true;
    last_step = e.step();
    if (e.step() >= 1) {
      if (first_loss < 0) first_loss = e.loss();
      last_loss = e.loss();
      tokens_per_second = e.tokens_per_second();
      hit_rate = e.cache_hit_rate();
    }
    if (g_globals.json) {
      out << Json(e) << "\n";
    } else if (e.step() >= 1) {
      const double eta = e.step_seconds() * static_cast<double>(steps - e.step());
      const int width = 30,
                filled = static_cast<int>(width * e.step() / std::max<int64_t>(1, steps));
      out << absl::StrFormat(
          "[%s%s] step %d/%d  loss %.4f  %.0f tokens/s  cache hit %.2f  ETA %.0fs\n",
          std::string(filled, '#'), std::string(width - filled, '.'), e.step(), steps, e.loss(),
          e.tokens_per_second(), e.cache_hit_rate(), eta);
    } else {
      out << "job " << e.job_id() << ": " << StateName(e.state())
          << (e.step() == 0 ? " (initial weights written)" : " (waiting for workers)") << "\n";
    }
    out.flush();
    return true;
  }));
  if (!g_globals.json) {
    out << absl::StrFormat(
        "job %s %s at step %d: loss %.4f -> %.4f, %.0f tokens/s, cache hit %.2f%s\n", last.job_id(),
        StateName(last.state()), last.step(), first_loss, last_loss, tokens_per_second, hit_rate,
        last.message().empty() ? "" : " (" + last.message() + ")");
  }
  if (last.state() != v1::JOB_STATE_SUCCEEDED) {
    return absl::AbortedError(absl::StrCat("job ", args[0], " ended ", StateName(last.state()),
                                           last.message().empty() ? "" : ": " + last.message()));
  }
  return absl::OkStatus();
}

absl::Status Cancel(const Args& args, std::ostream& out) {
  if (args.size() != 1) return UsageError("cancel takes one job id: pith cancel JOB");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  ASSIGN_OR_RETURN(v1::Job job, client->Cancel(args[0], "cancelled with pith cancel"));
  out << (g_globals.json ? Json(job) : JobLine(job)) << "\n";
  return absl::OkStatus();
}

absl::Status Checkpoint(const Args& args, std::ostream& out) {
  if (args.size() != 3 || args[1] != "--out") {
    return UsageError("checkpoint takes a job and a file: pith checkpoint JOB --out FILE");
  }
  const std::filesystem::path target = std::filesystem::absolute(args[2]);
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  // The coordinator writes under a folder on its host (this one, for a local cluster);
  // the file is then moved to the name asked for.
  const std::filesystem::path staging =
      target.parent_path() / (".pith-checkpoint-" + std::to_string(::getpid()));
  ASSIGN_OR_RETURN(v1::CheckpointJobResponse r, client->Checkpoint(args[0], staging.string()));
  std::error_code ec;
  std::filesystem::rename(r.weights_path(), target, ec);
  std::filesystem::remove_all(staging);
  if (ec)
    return absl::InternalError(absl::StrCat("cannot write ", target.string(), ": ", ec.message()));
  if (g_globals.json) {
    out << absl::StrFormat("{\"path\": \"%s\", \"step\": %d, \"bytes\": %d}\n", target.string(),
                           r.step(), r.bytes());
  } else {
    out << "wrote " << target.string() << " (step " << r.step() << ", " << r.bytes() << " bytes)\n";
  }
  return absl::OkStatus();
}

absl::Status Cluster(const Args& args, std::ostream& out) {
  if (!args.empty()) return UsageError("cluster takes no arguments");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  ASSIGN_OR_RETURN(v1::ClusterStatusResponse c, client->ClusterStatus());
  if (g_globals.json) {
    out << Json(c) << "\n";
    return absl::OkStatus();
  }
  const int64_t now = absl::ToUnixMillis(absl::Now());
  auto member = [&](const v1::MemberInfo& m) {
    const std::string state =
        absl::AsciiStrToLower(absl::StripPrefix(v1::MemberState_Name(m.state()), "MEMBER_STATE_"));
    out << absl::StrFormat("  %-10s %-6s %-21s lease %5.1fs", m.member_id(), state,
                           m.grpc_address(), (m.lease_expires_unix_ms() - now) / 1e3);
    if (m.role() == v1::MEMBER_ROLE_STORE) {
      out << absl::StrFormat("  ram %.1f MB / %.1f MB  rocksdb %.1f MB", m.ram_bytes() / 1e6,
                             m.capacity_bytes() / 1e6, m.rocksdb_bytes() / 1e6);
    } else if (!m.job_id().empty()) {
      out << "  job " << m.job_id();
    }
    out << "\n";
  };
  out << "stores:\n";
  for (const auto& m : c.stores()) member(m);
  out << "workers:\n";
  for (const auto& m : c.workers()) member(m);
  out << absl::StrFormat("moves in flight %d, blobs moved %d (%.1f MB), replica deficit %d\n",
                         c.moves_size(), c.blobs_moved(), c.bytes_moved() / 1e6,
                         c.replica_deficit());
  return absl::OkStatus();
}

absl::Status SpecCheck(const Args& args, std::ostream& out) {
  if (args.size() != 1) return UsageError("spec check takes one file: pith spec check SPEC.json");
  ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpec(args[0]));
  out << JobSpecToJson(spec) << "\n";
  return absl::OkStatus();
}

absl::Status SafetensorsInspect(const Args& args, std::ostream& out) {
  if (args.size() != 1) {
    return UsageError("safetensors inspect takes one file: pith safetensors inspect FILE");
  }
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(args[0]));
  uint64_t bytes = 0;
  for (const SafetensorsEntry& e : file.entries()) {
    out << absl::StrFormat("%-40s %-8s %-16s %12d bytes\n", e.name, DTypeName(e.dtype),
                           ShapeString(e.shape), e.end - e.begin);
    bytes += e.end - e.begin;
  }
  for (const auto& [k, v] : file.metadata()) out << "metadata " << k << " = " << v << "\n";
  out << file.entries().size() << " tensors, " << bytes << " bytes\n";
  return absl::OkStatus();
}

absl::Status DataPrepare(const Args& args, std::ostream& out) {
  std::string output;
  int vocab = 256;
  std::vector<std::string> inputs;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--out" || a == "--vocab") {
      if (i + 1 == args.size()) return UsageError(a + " needs a value");
      const std::string& value = args[++i];
      if (a == "--out") {
        output = value;
      } else if (!absl::SimpleAtoi(value, &vocab)) {
        return UsageError("--vocab wants a number, got " + value);
      }
    } else if (absl::StartsWith(a, "--")) {
      return UsageError("data prepare: unknown flag " + a);
    } else {
      inputs.push_back(a);
    }
  }
  if (output.empty()) return UsageError("data prepare needs --out FILE");
  ASSIGN_OR_RETURN(int64_t tokens, data::PrepareByteTokens(inputs, output, vocab));
  out << "wrote " << tokens << " tokens (vocab " << vocab << ") to " << output << "\n";
  return absl::OkStatus();
}

// Evaluates a weights file: the mean cross-entropy (and total loss) over `batches` global
// batches of the token file, computed by the same model code training uses.
absl::Status Eval(const Args& args, std::ostream& out) {
  std::map<std::string, std::string> flags = {
      {"--spec", ""}, {"--checkpoint", ""}, {"--tokens", ""}, {"--batches", "4"}};
  for (size_t i = 0; i < args.size(); ++i) {
    auto it = flags.find(args[i]);
    if (it == flags.end()) return UsageError("eval: unknown argument " + args[i]);
    if (i + 1 == args.size()) return UsageError(args[i] + " needs a value");
    it->second = args[++i];
  }
  for (const char* required : {"--spec", "--checkpoint", "--tokens"}) {
    if (flags[required].empty()) return UsageError(absl::StrCat("eval needs ", required));
  }
  int batches = 0;
  if (!absl::SimpleAtoi(flags["--batches"], &batches) || batches < 1) {
    return UsageError("--batches wants a number >= 1, got " + flags["--batches"]);
  }
  ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpec(flags["--spec"]));
  const model::ModelShape shape = model::ModelShape::FromSpec(spec.model());
  const int B = spec.train().batch(), T = shape.seq;
  compute::CpuBackend backend(0);
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeGpt> m, model::MoeGpt::Create(&backend, shape, B));
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(flags["--checkpoint"]));
  RETURN_IF_ERROR(model::LoadWeights(backend, m->layout(), file, m->params()));
  ASSIGN_OR_RETURN(data::TokenDataset tokens,
                   data::TokenDataset::Open(flags["--tokens"], shape.vocab));
  std::vector<int32_t> inputs(int64_t{B} * T), targets(int64_t{B} * T);
  double ce = 0, loss = 0;
  for (int s = 0; s < batches; ++s) {
    for (int i = 0; i < B; ++i) {
      tokens.Row(int64_t{s} * B + i, T, inputs.data() + int64_t{i} * T,
                 targets.data() + int64_t{i} * T);
    }
    ASSIGN_OR_RETURN(model::StepLoss l, m->ForwardBackward(inputs.data(), targets.data(), B));
    ce += l.ce;
    loss += l.loss;
  }
  out << absl::StrFormat("eval rows=%d tokens=%d ce=%.9g loss=%.9g\n", batches * B,
                         int64_t{batches} * B * T, ce / batches, loss / batches);
  return absl::OkStatus();
}

// Generates text from a checkpoint, byte by byte: the prompt, then up to --tokens bytes
// sampled at --temperature (0: the most likely byte), the context the last seq_len bytes.
absl::Status Sample(const Args& args, std::ostream& out) {
  std::map<std::string, std::string> flags = {{"--spec", ""},           {"--checkpoint", ""},
                                              {"--prompt", ""},         {"--tokens", "200"},
                                              {"--temperature", "0.8"}, {"--seed", "1"}};
  for (size_t i = 0; i < args.size(); ++i) {
    auto it = flags.find(args[i]);
    if (it == flags.end()) return UsageError("sample: unknown argument " + args[i]);
    if (i + 1 == args.size()) return UsageError(args[i] + " needs a value");
    it->second = args[++i];
  }
  for (const char* required : {"--spec", "--checkpoint", "--prompt"}) {
    if (flags[required].empty()) return UsageError(absl::StrCat("sample needs ", required));
  }
  int tokens = 0;
  double temperature = 0;
  uint64_t seed = 0;
  if (!absl::SimpleAtoi(flags["--tokens"], &tokens) || tokens < 0 || tokens > 100000) {
    return UsageError("--tokens wants a number in [0, 100000], got " + flags["--tokens"]);
  }
  if (!absl::SimpleAtod(flags["--temperature"], &temperature) || temperature < 0) {
    return UsageError("--temperature wants a number >= 0, got " + flags["--temperature"]);
  }
  if (!absl::SimpleAtoi(flags["--seed"], &seed)) {
    return UsageError("--seed wants a number, got " + flags["--seed"]);
  }
  ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpec(flags["--spec"]));
  const model::ModelShape shape = model::ModelShape::FromSpec(spec.model());
  if (shape.vocab != 256) {
    return absl::InvalidArgumentError(
        "sample: the model's vocabulary is not bytes (vocab_size 256)");
  }
  compute::CpuBackend backend(0);
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeGpt> m, model::MoeGpt::Create(&backend, shape, 1));
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(flags["--checkpoint"]));
  RETURN_IF_ERROR(model::LoadWeights(backend, m->layout(), file, m->params()));
  const int T = shape.seq, V = shape.vocab;
  std::string text = flags["--prompt"];
  std::vector<int32_t> window(T, ' ');
  std::vector<float> logits(int64_t{T} * V);
  std::mt19937_64 rng(seed);
  for (int n = 0; n < tokens; ++n) {
    // The last T bytes at the start of the window; later positions cannot affect them.
    const size_t from = text.size() > static_cast<size_t>(T) ? text.size() - T : 0;
    const int used = static_cast<int>(text.size() - from);
    for (int i = 0; i < T; ++i) {
      window[i] = i < used ? static_cast<uint8_t>(text[from + i]) : ' ';
    }
    RETURN_IF_ERROR(m->Logits(window.data(), logits.data()));
    const float* row = logits.data() + int64_t{used - 1} * V;
    int next = static_cast<int>(std::max_element(row, row + V) - row);
    if (temperature > 0) {
      std::vector<double> p(V);
      const double top = row[next];
      for (int v = 0; v < V; ++v) p[v] = std::exp((row[v] - top) / temperature);
      next = std::discrete_distribution<int>(p.begin(), p.end())(rng);
    }
    text.push_back(static_cast<char>(next));
  }
  out << text << "\n";
  return absl::OkStatus();
}

absl::Status Version(const Args& args, std::ostream& out) {
  out << "Pith " << kPithVersion << "\n";
  return absl::OkStatus();
}

}  // namespace

int RunCli(const std::vector<std::string>& raw_args, std::ostream& out, std::ostream& err) {
  // Flags of every job command, anywhere on the line.
  g_globals = Globals();
  std::vector<std::string> args;
  for (size_t i = 0; i < raw_args.size(); ++i) {
    const std::string& a = raw_args[i];
    std::string value;
    bool has_value = false;
    for (const char* flag : {"--coordinator", "--output"}) {
      if (a == flag || absl::StartsWith(a, std::string(flag) + "=")) {
        if (a == flag) {
          if (i + 1 == raw_args.size()) {
            err << "pith: " << flag << " needs a value\n";
            return 2;
          }
          value = raw_args[++i];
        } else {
          value = a.substr(std::strlen(flag) + 1);
        }
        has_value = true;
        if (std::string(flag) == "--coordinator") {
          g_globals.coordinator = value;
        } else if (value == "json" || value == "text") {
          g_globals.json = value == "json";
        } else {
          err << "pith: --output is json or text, not " << value << "\n";
          return 2;
        }
      }
    }
    if (!has_value) args.push_back(a);
  }
  // Commands are named by one or two words ("version", "spec check").
  static const std::map<std::string, Command> kCommands = {
      {"spec check", SpecCheck},
      {"safetensors inspect", SafetensorsInspect},
      {"data prepare", DataPrepare},
      {"eval", Eval},
      {"version", Version},
      {"submit", Submit},
      {"status", Status},
      {"watch", Watch},
      {"cancel", Cancel},
      {"checkpoint", Checkpoint},
      {"cluster", Cluster},
      {"sample", Sample},
  };
  if (args.empty() || args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    (args.empty() ? err : out) << kUsage;
    return args.empty() ? 2 : 0;
  }
  for (size_t words = 1; words <= 2 && words <= args.size(); ++words) {
    const std::string name = absl::StrJoin(args.begin(), args.begin() + words, " ");
    auto it = kCommands.find(name);
    if (it == kCommands.end()) continue;
    absl::Status status = it->second(Args(args.begin() + words, args.end()), out);
    if (status.ok()) return 0;
    err << "pith: " << status.message() << "\n";
    return 1;
  }
  err << "pith: unknown command \"" << absl::StrJoin(args, " ") << "\" (try pith help)\n";
  return 2;
}

}  // namespace pith
