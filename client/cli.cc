// The `pith` CLI's entry point: global flags, the command table, and the commands that
// need no cluster (spec check, safetensors inspect, data prepare, eval, sample, version).
// The job commands are in cli_jobs.cc, `pith up`/`down` in cli_local.cc; eval and sample
// run the model through worker/model/inference.h.
#include "client/cli.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli_commands.h"
#include "common/job_spec.h"
#include "common/param_layout.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "common/version.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "worker/data/token_dataset.h"
#include "worker/model/inference.h"

namespace pith {
namespace cli {
namespace {

constexpr char kUsage[] =
    "usage: pith <command> [args]\n"
    "\n"
    "commands:\n"
    "  spec check SPEC.json        validate a job spec; print it with defaults filled in\n"
    "  safetensors inspect FILE    validate a safetensors file; list its tensors\n"
    "  data prepare --out FILE [--vocab 256] TEXT...\n"
    "                              turn text files into a token file (byte-level: --vocab\n"
    "                              is 256, the only vocabulary it makes)\n"
    "  eval --checkpoint FILE --tokens FILE [--batches N] [--spec SPEC.json]\n"
    "                              mean loss of a checkpoint on token data (held-out\n"
    "                              data: rows as DESIGN §3 orders them, batch s = 0..N-1;\n"
    "                              N defaults to 4)\n"
    "  sample --checkpoint FILE --prompt TEXT [--tokens N] [--temperature T] [--seed S]\n"
    "         [--spec SPEC.json]   generate text from a checkpoint (byte-level vocab;\n"
    "                              defaults: 200 tokens, temperature 0.8, seed 1)\n"
    "                              (--spec: for files that do not record their job's spec;\n"
    "                              with one that does, its model must be the same)\n"
    "  version                     print the Pith version\n"
    "\n"
    "  certs --dir DIR [--name NAME[,NAME...] --role ROLE] [--hosts HOST[,HOST...]]\n"
    "                              make DIR's cluster CA (once), and a certificate for\n"
    "                              each NAME in DIR/NAME (ROLE: member, coordinator,\n"
    "                              admin, user; --hosts: the names and addresses its\n"
    "                              servers are reached at, default this machine's; none\n"
    "                              for admins and users, whose certificates only dial)\n"
    "  token --file FILE --name NAME [--role user|admin] [--expires_in 90d|12h|30m]\n"
    "        [--revoke]            a bearer token (printed once; its hash written to FILE,\n"
    "                              the coordinator's --tokens_file, in place of NAME's\n"
    "                              earlier one; default: no expiry); --revoke: remove\n"
    "                              NAME's token\n"
    "\n"
    "job commands (coordinator from --coordinator HOST:PORT, else $PITH_COORDINATOR, else\n"
    "the local cluster's (pith up), else 127.0.0.1:7000; mutual TLS with --tls_dir DIR,\n"
    "else $PITH_TLS_DIR, else the local cluster's admin certificate; --token T or\n"
    "$PITH_TOKEN (not over a --tls_dir certificate): a bearer token instead of the\n"
    "certificate, with DIR's ca.pem; --insecure:\n"
    "plaintext to a loopback coordinator started --insecure; --output json for\n"
    "machine-readable output):\n"
    "  submit SPEC.json            submit a job; prints its id\n"
    "  status [JOB]                one job's state and figures, or every job\n"
    "  watch JOB                   follow a job: step, loss, tokens/s, cache hit rate, ETA\n"
    "  cancel JOB                  cancel a job\n"
    "  remove JOB...               forget ended jobs: records, heat and stored weights\n"
    "                              (export first); ids are not reused; one it cannot\n"
    "                              remove is named and the rest still go\n"
    "  checkpoint JOB --out FILE [--force]\n"
    "                              export the job's last committed weights (safetensors);\n"
    "                              an existing FILE is replaced only with --force\n"
    "  cluster                     members, their leases and tiers, moves in flight,\n"
    "                              replica deficit, drains\n"
    "  cluster drain STORE [--no-wait] [--timeout SECONDS]\n"
    "                              move every blob off a store while jobs run; waits\n"
    "                              (showing progress, --timeout default 600) until the\n"
    "                              store can be stopped\n"
    "  experts JOB [--svg FILE]    per-layer expert heat; --svg draws a layer x expert\n"
    "                              heat map with replica counts (an ended job's: fetches)\n"
    "\n"
    "local cluster (processes on this machine, data and logs under DIR, default\n"
    "$PITH_HOME or ~/.pith/local; the job commands then find it without flags):\n"
    "  up [--stores N] [--workers N] [--memory_bytes B] [--cache_bytes B] [--ram_bytes B]\n"
    "     [--backend cpu|cuda] [--data_root DIR,...] [--dir DIR]\n"
    "                              (defaults: 2 stores of a 256 MiB RAM tier each, 2 cpu\n"
    "                              workers, no memory bound, every owned expert cached,\n"
    "                              jobs read any file you may; --data_root: only under those,\n"
    "                              --data_root any: again any)\n"
    "                              start one; where one is recorded, start again those of\n"
    "                              its processes that no longer run (after a kill, a crash\n"
    "                              or a reboot), at the coordinator's old address\n"
    "  down [--dir DIR]            stop it (data, logs and the coordinator's port kept)\n";

using Command = std::function<absl::Status(const CliContext&, const Args&, std::ostream&)>;

constexpr char kUsagePayload[] = "pith/usage";

}  // namespace

absl::Status UsageError(const std::string& what) {
  absl::Status s = absl::InvalidArgumentError(what);
  s.SetPayload(kUsagePayload, absl::Cord("1"));
  return s;
}

bool IsUsageError(const absl::Status& status) {
  return status.GetPayload(kUsagePayload).has_value();
}

std::string DefaultDir() {
  if (const char* home = std::getenv("PITH_HOME"); home != nullptr && *home != '\0') return home;
  const char* user_home = std::getenv("HOME");
  return std::string(user_home != nullptr ? user_home : "/tmp") + "/.pith/local";
}

std::string LocalCoordinator(const std::string& dir) {
  std::ifstream in(dir + "/coordinator.address");
  std::string address;
  std::getline(in, address);
  return address;
}

absl::StatusOr<std::unique_ptr<Client>> Connect(const CliContext& ctx) {
  std::string address = ctx.coordinator;
  if (address.empty()) {
    const char* env = std::getenv("PITH_COORDINATOR");
    if (env != nullptr && *env != '\0') address = env;
  }
  if (address.empty()) address = LocalCoordinator(DefaultDir());
  const bool fallback = address.empty();
  if (fallback) address = "127.0.0.1:7000";
  std::string tls_dir = ctx.tls_dir;
  if (ctx.insecure && (!tls_dir.empty() || !ctx.token.empty())) {
    return UsageError("--insecure is plaintext: it takes neither --tls_dir nor --token");
  }
  if (tls_dir.empty() && !ctx.insecure) {
    const char* env = std::getenv("PITH_TLS_DIR");
    if (env != nullptr && *env != '\0') tls_dir = env;
  }
  std::error_code ec;
  if (const std::string local = LocalTlsDir(DefaultDir()) + "/admin";
      tls_dir.empty() && !ctx.insecure && std::filesystem::exists(local + "/cert.pem", ec)) {
    tls_dir = local;
  }
  absl::StatusOr<security::TransportSecurity> security =
      tls_dir.empty() ? security::TransportSecurity::Insecure()
                      : security::TransportSecurity::Tls(tls_dir);
  if (!security.ok()) return Annotate(security.status(), "--tls_dir");
  std::string token = ctx.token;
  // $PITH_TOKEN stands in for the certificates the environment or `pith up` name, not for
  // the one a --tls_dir on the command line names.
  const bool certificate_flag = !ctx.tls_dir.empty() && security->identity().has_value();
  if (const char* env = std::getenv("PITH_TOKEN");
      token.empty() && env != nullptr && !ctx.insecure && !certificate_flag) {
    token = env;
  }
  if (!token.empty()) {
    constexpr size_t kMostTokenBytes = 4096;  // pith token makes 69-byte ones
    if (token.size() > kMostTokenBytes) {
      return UsageError(absl::StrCat("the bearer token is ", token.size(),
                                     " bytes; a token of pith token is 69 (is it the token?)"));
    }
    if (!security->tls()) {
      return UsageError("a bearer token needs --tls_dir DIR with the cluster's ca.pem");
    }
    security = security->WithToken(token);
  }
  absl::StatusOr<std::unique_ptr<Client>> client =
      Client::Connect(address, *security, absl::Seconds(5));
  if (!client.ok() && fallback) {
    return absl::Status(client.status().code(),
                        absl::StrCat(client.status().message(), "; no cluster is up in ",
                                     DefaultDir(), " (pith up starts one) and no --coordinator ",
                                     "or $PITH_COORDINATOR names another"));
  }
  return client;
}

std::string LocalTlsDir(const std::string& dir) { return dir + "/tls"; }

OnStopSignals::OnStopSignals(void (*handler)(int), int flags) {
  struct sigaction action {};
  action.sa_handler = handler;
  action.sa_flags = flags;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kSignals); ++i) {
    ::sigaction(kSignals[i], nullptr, &old_[i]);
    if (old_[i].sa_handler != SIG_IGN) ::sigaction(kSignals[i], &action, nullptr);
  }
}

OnStopSignals::~OnStopSignals() {
  for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
}

absl::Status ParseFlags(const std::string& command, const Args& args,
                        std::map<std::string, std::string>& flags) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto it = flags.find(args[i]);
    if (it == flags.end()) return UsageError(command + ": unknown argument " + args[i]);
    if (i + 1 == args.size() || args[i + 1].empty()) {
      return UsageError(args[i] + " needs a value");
    }
    it->second = args[++i];
  }
  return absl::OkStatus();
}

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

namespace {

absl::Status SpecCheck(const CliContext& ctx, const Args& args, std::ostream& out) {
  if (args.size() != 1) return UsageError("spec check takes one file: pith spec check SPEC.json");
  ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpec(args[0]));
  out << JobSpecToJson(spec) << "\n";
  return absl::OkStatus();
}

absl::Status SafetensorsInspect(const CliContext& ctx, const Args& args, std::ostream& out) {
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

absl::Status DataPrepare(const CliContext& ctx, const Args& args, std::ostream& out) {
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

// The first field of `model` whose value differs between two specs ("" when none does),
// but compute_dtype: eval and sample compute in fp32 whatever the job trained in.
std::string FirstModelDifference(const v1::ModelConfig& a, const v1::ModelConfig& b) {
  const google::protobuf::Descriptor* d = v1::ModelConfig::descriptor();
  for (int i = 0; i < d->field_count(); ++i) {
    if (d->field(i)->name() == "compute_dtype") continue;
    const std::vector<const google::protobuf::FieldDescriptor*> only = {d->field(i)};
    google::protobuf::util::MessageDifferencer differ;
    if (!differ.CompareWithFields(a, b, only, only)) return d->field(i)->name();
  }
  return "";
}

// The spec of a checkpoint: the one a job export records in the file's metadata, else
// --spec. Where both are there, --spec may change what eval reads (train.batch, seed) but
// not the model: a model field the weights' shapes do not show (n_head, top_k, ...) would
// otherwise run the weights as a model they were never trained as, without a word.
absl::StatusOr<v1::JobSpec> SpecOf(const std::string& spec_flag, const SafetensorsFile& file,
                                   const std::string& path) {
  auto it = file.metadata().find(model::kSpecMetadataKey);
  if (it == file.metadata().end() && spec_flag.empty()) {
    return UsageError(absl::StrCat(path, " records no job spec: give --spec SPEC.json"));
  }
  v1::JobSpec recorded;
  absl::Status readable = absl::OkStatus();
  if (it != file.metadata().end()) {
    if (!google::protobuf::util::JsonStringToMessage(it->second, &recorded).ok()) {
      readable = absl::DataLossError(absl::StrCat(path, ": unreadable job spec in its metadata"));
    } else {
      ApplyJobSpecDefaults(&recorded);
      readable = Annotate(ValidateJobSpec(recorded), absl::StrCat(path, "'s recorded spec"));
    }
    if (spec_flag.empty()) return readable.ok() ? absl::StatusOr<v1::JobSpec>(recorded) : readable;
  }
  ASSIGN_OR_RETURN(v1::JobSpec given, LoadJobSpec(spec_flag));
  // No spec recorded, or one this Pith cannot read (another version's): --spec decides.
  if (it == file.metadata().end() || !readable.ok()) return given;
  if (const std::string field = FirstModelDifference(given.model(), recorded.model());
      !field.empty()) {
    return UsageError(absl::StrCat("--spec ", spec_flag, " has another model.", field, " than ",
                                   path, " was trained with; leave out --spec to use the ",
                                   "spec the file records"));
  }
  return given;
}

// Evaluates a weights file: the mean cross-entropy (and total loss) over `batches` global
// batches of the token file, computed by the same model code training uses.
absl::Status Eval(const CliContext& ctx, const Args& args, std::ostream& out) {
  std::map<std::string, std::string> flags = {
      {"--spec", ""}, {"--checkpoint", ""}, {"--tokens", ""}, {"--batches", "4"}};
  RETURN_IF_ERROR(ParseFlags("eval", args, flags));
  for (const char* required : {"--checkpoint", "--tokens"}) {
    if (flags[required].empty()) return UsageError(absl::StrCat("eval needs ", required));
  }
  int batches = 0;
  if (!absl::SimpleAtoi(flags["--batches"], &batches) || batches < 1) {
    return UsageError("--batches wants a number >= 1, got " + flags["--batches"]);
  }
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(flags["--checkpoint"]));
  ASSIGN_OR_RETURN(v1::JobSpec spec, SpecOf(flags["--spec"], file, flags["--checkpoint"]));
  ASSIGN_OR_RETURN(model::EvalResult r, model::Evaluate(file, spec, flags["--tokens"], batches));
  out << absl::StrFormat("eval rows=%d tokens=%d ce=%.9g loss=%.9g\n", r.rows, r.tokens, r.ce,
                         r.loss);
  return absl::OkStatus();
}

// Generates text from a checkpoint, byte by byte: the prompt, then up to --tokens bytes
// sampled at --temperature (0: the most likely byte), the context the last seq_len bytes.
absl::Status Sample(const CliContext& ctx, const Args& args, std::ostream& out) {
  std::map<std::string, std::string> flags = {{"--spec", ""},           {"--checkpoint", ""},
                                              {"--prompt", ""},         {"--tokens", "200"},
                                              {"--temperature", "0.8"}, {"--seed", "1"}};
  RETURN_IF_ERROR(ParseFlags("sample", args, flags));
  for (const char* required : {"--checkpoint", "--prompt"}) {
    if (flags[required].empty()) {
      return UsageError(absl::StrCat("sample needs ", required, " (not empty)"));
    }
  }
  model::SampleOptions options;
  if (!absl::SimpleAtoi(flags["--tokens"], &options.tokens) || options.tokens < 0 ||
      options.tokens > 100000) {
    return UsageError("--tokens wants a number in [0, 100000], got " + flags["--tokens"]);
  }
  if (!absl::SimpleAtod(flags["--temperature"], &options.temperature) ||
      !(options.temperature >= 0) || std::isinf(options.temperature)) {
    return UsageError("--temperature wants a number >= 0, got " + flags["--temperature"]);
  }
  if (!absl::SimpleAtoi(flags["--seed"], &options.seed)) {
    return UsageError("--seed wants a number, got " + flags["--seed"]);
  }
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(flags["--checkpoint"]));
  ASSIGN_OR_RETURN(v1::JobSpec spec, SpecOf(flags["--spec"], file, flags["--checkpoint"]));
  bool shown = false;  // the text shows as it grows
  options.on_text = [&out, &shown](absl::string_view more) {
    out << more << std::flush;
    shown = true;
  };
  const absl::Status status = model::Sample(file, spec, flags["--prompt"], options).status();
  if (shown) out << "\n";  // ends the text, also before an error line
  return status;
}

absl::Status Version(const CliContext& ctx, const Args& args, std::ostream& out) {
  out << "Pith " << kPithVersion << "\n";
  return absl::OkStatus();
}

}  // namespace
}  // namespace cli

namespace cli {
namespace {

// A job commands' flag (--coordinator, --output, --tls_dir, --token) into `ctx`.
absl::Status SetJobFlag(CliContext& ctx, const std::string& flag, const std::string& value) {
  if (value.empty()) return UsageError(flag + " needs a value, not an empty one");
  if (flag == "--coordinator") {
    ctx.coordinator = value;
  } else if (flag == "--tls_dir") {
    ctx.tls_dir = value;
  } else if (flag == "--token") {
    ctx.token = value;
  } else if (value == "json" || value == "text") {
    ctx.json = value == "json";
  } else {
    return UsageError("--output is json or text, not " + value);
  }
  return absl::OkStatus();
}

// The command line as a command and its arguments: the job commands' flags, anywhere,
// go to `ctx`; a command's --flag=value becomes --flag value (as the servers' flags are
// written); what follows a command's flag that takes a value is that value as written,
// whatever it looks like (`--prompt "--token=x"`, `--prompt --help`): `values` gets the
// indices of those.
absl::StatusOr<std::vector<std::string>> CommandLine(const std::vector<std::string>& raw,
                                                     CliContext& ctx, std::set<size_t>& values) {
  static const std::set<std::string> kSwitches = {"--force", "--no-wait", "--revoke", "--help"};
  std::vector<std::string> args;
  bool value_next = false;
  for (size_t i = 0; i < raw.size(); ++i) {
    const std::string& a = raw[i];
    if (value_next) {
      values.insert(args.size());
      args.push_back(a);
      value_next = false;
      continue;
    }
    const size_t eq = a.find('=');
    const std::string name = a.substr(0, eq);
    if (a == "--insecure") {
      ctx.insecure = true;
    } else if (name == "--coordinator" || name == "--output" || name == "--tls_dir" ||
               name == "--token") {
      if (eq == std::string::npos && i + 1 == raw.size())
        return UsageError(name + " needs a value");
      RETURN_IF_ERROR(SetJobFlag(ctx, name, eq == std::string::npos ? raw[++i] : a.substr(eq + 1)));
    } else if (absl::StartsWith(a, "--") && eq != std::string::npos) {
      args.push_back(name);
      values.insert(args.size());
      args.push_back(a.substr(eq + 1));
    } else {
      value_next = absl::StartsWith(a, "--") && a != "--version" && !kSwitches.count(a);
      args.push_back(a == "--version" ? "version" : a);
    }
  }
  return args;
}

}  // namespace
}  // namespace cli

int RunCli(const std::vector<std::string>& raw_args, std::ostream& out, std::ostream& err) {
  cli::CliContext ctx;
  std::set<size_t> values;  // the arguments that are a flag's value
  absl::StatusOr<std::vector<std::string>> line = cli::CommandLine(raw_args, ctx, values);
  if (!line.ok()) {
    err << "pith: " << line.status().message() << "\n";
    return 2;
  }
  const std::vector<std::string>& args = *line;
  // Commands are named by one or two words ("version", "spec check").
  static const std::map<std::string, cli::Command> kCommands = {
      {"spec check", cli::SpecCheck},
      {"safetensors inspect", cli::SafetensorsInspect},
      {"data prepare", cli::DataPrepare},
      {"eval", cli::Eval},
      {"version", cli::Version},
      {"submit", cli::Submit},
      {"status", cli::Status},
      {"watch", cli::Watch},
      {"cancel", cli::Cancel},
      {"remove", cli::Remove},
      {"checkpoint", cli::Checkpoint},
      {"cluster", cli::Cluster},
      {"sample", cli::Sample},
      {"up", cli::Up},
      {"experts", cli::Experts},
      {"down", cli::Down},
      {"certs", cli::Certs},
      {"token", cli::Token},
  };
  bool asks_help = false;
  for (size_t i = 0; i < args.size(); ++i) {
    asks_help |= !values.count(i) && (args[i] == "--help" || args[i] == "-h");
  }
  if (args.empty() || args[0] == "help" || asks_help) {
    (args.empty() ? err : out) << cli::kUsage;
    return args.empty() ? 2 : 0;
  }
  for (size_t words = 1; words <= 2 && words <= args.size(); ++words) {
    const std::string name = absl::StrJoin(args.begin(), args.begin() + words, " ");
    auto it = kCommands.find(name);
    if (it == kCommands.end()) continue;
    absl::Status status = it->second(ctx, cli::Args(args.begin() + words, args.end()), out);
    if (status.ok()) return 0;
    err << "pith: " << status.message() << "\n";
    return cli::IsUsageError(status) ? 2 : 1;
  }
  if (absl::StartsWith(args[0], "-")) {  // not a command: a flag pith does not know
    err << "pith: unknown flag " << args[0] << " (try pith help)\n";
    return 2;
  }
  err << "pith: unknown command \"" << absl::StrJoin(args, " ") << "\" (try pith help)\n";
  return 2;
}

}  // namespace pith
