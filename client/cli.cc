#include "client/cli.h"

#include <functional>
#include <map>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/job_spec.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/version.h"
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
    "  version                     print the Pith version\n";

using Args = std::vector<std::string>;
using Command = std::function<absl::Status(const Args&, std::ostream&)>;

absl::Status UsageError(const std::string& what) { return absl::InvalidArgumentError(what); }

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

absl::Status Version(const Args& args, std::ostream& out) {
  out << "Pith " << kPithVersion << "\n";
  return absl::OkStatus();
}

}  // namespace

int RunCli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  // Commands are named by one or two words ("version", "spec check").
  static const std::map<std::string, Command> kCommands = {
      {"spec check", SpecCheck},     {"safetensors inspect", SafetensorsInspect},
      {"data prepare", DataPrepare}, {"eval", Eval},
      {"version", Version},
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
