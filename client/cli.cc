#include "client/cli.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/file.h"
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
    "  eval --checkpoint FILE --tokens FILE [--batches N] [--spec SPEC.json]\n"
    "                              mean loss of a checkpoint on token data (held-out\n"
    "                              data: rows as DESIGN §3 orders them, batch s = 0..N-1)\n"
    "  sample --checkpoint FILE --prompt TEXT [--tokens N] [--temperature T] [--seed S]\n"
    "         [--spec SPEC.json]   generate text from a checkpoint (byte-level vocab)\n"
    "                              (--spec: for files that do not record their job's spec)\n"
    "  version                     print the Pith version\n"
    "\n"
    "job commands (coordinator from --coordinator HOST:PORT, else $PITH_COORDINATOR, else\n"
    "127.0.0.1:7000; --output json for machine-readable output):\n"
    "  submit SPEC.json            submit a job; prints its id\n"
    "  status [JOB]                one job's state and figures, or every job\n"
    "  watch JOB                   follow a job: step, loss, tokens/s, cache hit rate, ETA\n"
    "  cancel JOB                  cancel a job\n"
    "  checkpoint JOB --out FILE   export the job's last committed weights (safetensors)\n"
    "  cluster                     members, their leases and tiers, moves in flight,\n"
    "                              replica deficit, drains\n"
    "  cluster drain STORE [--no-wait] [--timeout SECONDS]\n"
    "                              move every blob off a store while jobs run; waits\n"
    "                              (showing progress) until the store can be stopped\n"
    "  experts JOB [--svg FILE]    per-layer expert heat; --svg draws a layer x expert\n"
    "                              heat map with replica counts\n"
    "\n"
    "local cluster (processes on this machine, data and logs under DIR, default\n"
    "$PITH_HOME or ~/.pith/local; the job commands then find it without flags):\n"
    "  up [--stores N] [--workers N] [--cache_bytes B] [--ram_bytes B] [--dir DIR]\n"
    "  down [--dir DIR]\n";

using Args = std::vector<std::string>;
using Command = std::function<absl::Status(const Args&, std::ostream&)>;

// A command used wrongly (exit 2), as opposed to one that failed (exit 1).
constexpr char kUsagePayload[] = "pith/usage";
absl::Status UsageError(const std::string& what) {
  absl::Status s = absl::InvalidArgumentError(what);
  s.SetPayload(kUsagePayload, absl::Cord("1"));
  return s;
}

// Flags every job command understands, taken out of the arguments by RunCli.
struct Globals {
  std::string coordinator;
  bool json = false;
};
Globals g_globals;

std::string DefaultDir() {
  if (const char* home = std::getenv("PITH_HOME"); home != nullptr && *home != '\0') return home;
  const char* user_home = std::getenv("HOME");
  return std::string(user_home != nullptr ? user_home : "/tmp") + "/.pith/local";
}

// The coordinator of a cluster started by `pith up` in `dir`, if one is recorded there.
std::string LocalCoordinator(const std::string& dir) {
  std::ifstream in(dir + "/coordinator.address");
  std::string address;
  std::getline(in, address);
  return address;
}

absl::StatusOr<std::unique_ptr<Client>> Connect() {
  std::string address = g_globals.coordinator;
  if (address.empty()) {
    const char* env = std::getenv("PITH_COORDINATOR");
    if (env != nullptr && *env != '\0') address = env;
  }
  if (address.empty()) address = LocalCoordinator(DefaultDir());
  if (address.empty()) address = "127.0.0.1:7000";
  return Client::Connect(address, absl::Seconds(5));
}

// A Pith binary: next to this one in the build tree, or on PATH.
std::string FindBinary(const std::string& name, const std::string& build_subdir) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path candidate = self.parent_path().parent_path() / build_subdir / name;
    if (std::filesystem::exists(candidate)) return candidate.string();
    const std::filesystem::path sibling = self.parent_path() / name;
    if (std::filesystem::exists(sibling)) return sibling.string();
  }
  return name;  // execvp searches PATH
}

// Starts `argv` detached (its own session), output to `log`; returns its pid.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::setsid();
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    std::vector<char*> args;
    for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  return pid;
}

// Waits (20 s at most) for the "ready: grpc_port=G metrics_port=M" line in `log`.
absl::StatusOr<std::pair<int, int>> WaitReady(const std::string& name, pid_t pid,
                                              const std::string& log) {
  const std::regex ready("ready: grpc_port=([0-9]+) metrics_port=(-?[0-9]+)");
  for (int i = 0; i < 200; ++i) {
    std::ifstream in(log);
    std::stringstream text;
    text << in.rdbuf();
    const std::string s = text.str();
    std::smatch m;
    if (std::regex_search(s, m, ready)) return std::make_pair(std::stoi(m[1]), std::stoi(m[2]));
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return absl::InternalError(absl::StrCat(name, " exited at start; see ", log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat(name, " did not start within 20 s; see ", log));
}

// Takes "--flag value" pairs into `flags`, whose keys are the command's flags (with their
// defaults); a usage error names an unknown flag or one without a value.
absl::Status ParseFlags(const std::string& command, const Args& args,
                        std::map<std::string, std::string>& flags) {
  for (size_t i = 0; i < args.size(); ++i) {
    auto it = flags.find(args[i]);
    if (it == flags.end()) return UsageError(command + ": unknown argument " + args[i]);
    if (i + 1 == args.size()) return UsageError(args[i] + " needs a value");
    it->second = args[++i];
  }
  return absl::OkStatus();
}

absl::Status Up(const Args& args, std::ostream& out) {
  std::map<std::string, std::string> flags = {{"--stores", "2"},
                                              {"--workers", "2"},
                                              {"--cache_bytes", "0"},
                                              {"--ram_bytes", "268435456"},
                                              {"--dir", DefaultDir()}};
  RETURN_IF_ERROR(ParseFlags("up", args, flags));
  int stores = 0, workers = 0;
  uint64_t cache_bytes = 0, ram_bytes = 0;
  if (!absl::SimpleAtoi(flags["--stores"], &stores) || stores < 1 ||
      !absl::SimpleAtoi(flags["--workers"], &workers) || workers < 1 ||
      !absl::SimpleAtoi(flags["--cache_bytes"], &cache_bytes) ||
      !absl::SimpleAtoi(flags["--ram_bytes"], &ram_bytes) || ram_bytes == 0) {
    return UsageError(
        "up: --stores and --workers want numbers >= 1, --cache_bytes and "
        "--ram_bytes byte counts");
  }
  const std::string dir = flags["--dir"];
  if (!LocalCoordinator(dir).empty() && std::filesystem::exists(dir + "/pids")) {
    return absl::AlreadyExistsError(
        absl::StrCat("a cluster is already up in ", dir, " (pith down --dir ", dir, " first)"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  std::vector<std::pair<std::string, pid_t>> started;
  auto stop_all = [&] {
    for (auto it = started.rbegin(); it != started.rend(); ++it) ::kill(it->second, SIGKILL);
  };
  auto launch = [&](const std::string& name,
                    std::vector<std::string> argv) -> absl::StatusOr<std::pair<int, int>> {
    const std::string log = dir + "/" + name + ".log";
    std::filesystem::remove(log, ec);
    ASSIGN_OR_RETURN(pid_t pid, Spawn(argv, log));
    started.push_back({name, pid});
    return WaitReady(name, pid, log);
  };
  std::vector<std::string> lines;
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(auto c,
                     launch("coordinator", {FindBinary("pith-coordinator", "server/coordinator"),
                                            "--listen=127.0.0.1:0", "--metrics_port=0",
                                            "--data_dir=" + dir + "/coordinator"}));
    const std::string address = absl::StrCat("127.0.0.1:", c.first);
    lines.push_back(absl::StrFormat("  %-12s %-22s http://127.0.0.1:%d/metrics", "coordinator",
                                    address, c.second));
    for (int n = 0; n < stores; ++n) {
      const std::string name = absl::StrCat("store", n);
      ASSIGN_OR_RETURN(
          auto st,
          launch(name, {FindBinary("pith-store", "server/store"), "--listen=127.0.0.1:0",
                        "--metrics_port=0", "--data_dir=" + dir + "/" + name,
                        absl::StrCat("--ram_bytes=", ram_bytes), "--coordinator=" + address}));
      lines.push_back(absl::StrFormat("  %-12s 127.0.0.1:%-12d http://127.0.0.1:%d/metrics", name,
                                      st.first, st.second));
    }
    // The workers share this host's cores (a worker's compute threads spin while waiting).
    const int threads =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / workers);
    for (int n = 0; n < workers; ++n) {
      const std::string name = absl::StrCat("worker", n);
      ASSIGN_OR_RETURN(
          auto w, launch(name, {FindBinary("pith-worker", "worker"), "--coordinator=" + address,
                                "--metrics_port=0", absl::StrCat("--cache_bytes=", cache_bytes),
                                absl::StrCat("--threads=", threads)}));
      lines.push_back(
          absl::StrFormat("  %-12s %-22s http://127.0.0.1:%d/metrics", name, "-", w.second));
    }
    std::ofstream(dir + "/coordinator.address") << address << "\n";
    std::ofstream pids(dir + "/pids");
    for (const auto& [name, pid] : started) pids << name << " " << pid << "\n";
    return absl::OkStatus();
  }();
  if (!status.ok()) {
    stop_all();
    return status;
  }
  out << "Pith local cluster up in " << dir << ":\n";
  for (const std::string& l : lines) out << l << "\n";
  out << "The job commands find it by themselves; stop it with pith down"
      << (flags["--dir"] == DefaultDir() ? "" : " --dir " + dir) << ".\n";
  return absl::OkStatus();
}

absl::Status Down(const Args& args, std::ostream& out) {
  std::string dir = DefaultDir();
  if (args.size() == 2 && args[0] == "--dir") {
    dir = args[1];
  } else if (!args.empty()) {
    return UsageError("down takes --dir DIR at most");
  }
  std::ifstream in(dir + "/pids");
  if (!in) return absl::NotFoundError(absl::StrCat("no cluster is up in ", dir));
  std::vector<std::pair<std::string, pid_t>> procs;
  std::string name;
  pid_t pid;
  while (in >> name >> pid) procs.push_back({name, pid});
  // Workers first, then stores, then the coordinator: the reverse of the start order.
  bool clean = true;
  for (auto it = procs.rbegin(); it != procs.rend(); ++it) {
    if (::kill(it->second, SIGTERM) != 0) {
      out << "  " << it->first << " was not running\n";
      continue;
    }
    bool gone = false;
    for (int i = 0; i < 150 && !gone; ++i) {
      gone = ::kill(it->second, 0) != 0;
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!gone) {
      ::kill(it->second, SIGKILL);
      clean = false;
    }
    out << "  " << it->first << (gone ? " stopped" : " killed (did not stop within 15 s)") << "\n";
  }
  std::error_code ec;
  std::filesystem::remove(dir + "/pids", ec);
  std::filesystem::remove(dir + "/coordinator.address", ec);
  out << "Pith local cluster in " << dir << " is down (data and logs kept there).\n";
  if (!clean) return absl::InternalError("some processes had to be killed");
  return absl::OkStatus();
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

absl::Status Experts(const Args& args, std::ostream& out) {
  std::string svg;
  if (args.size() == 3 && args[1] == "--svg") {
    svg = args[2];
  } else if (args.size() != 1) {
    return UsageError(
        "experts takes a job and optionally --svg FILE: pith experts JOB [--svg FILE]");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  ASSIGN_OR_RETURN(v1::ExpertHeatResponse heat, client->ExpertHeat(args[0]));
  if (g_globals.json) {
    out << Json(heat) << "\n";
  } else {
    int layers = 0, experts = 0;
    for (const auto& e : heat.experts()) {
      layers = std::max(layers, e.expert().layer() + 1);
      experts = std::max(experts, e.expert().expert() + 1);
    }
    out << absl::StrFormat("job %s, heat after step %d, placement epoch %d\n", heat.job_id(),
                           heat.step(), heat.placement_epoch());
    for (int l = 0; l < layers; ++l) {
      double total = 0, top = 0;
      int hottest = -1;
      std::string row;
      for (const auto& e : heat.experts()) {
        if (e.expert().layer() != l) continue;
        total += e.heat();
        if (e.heat() > top) top = e.heat(), hottest = e.expert().expert();
        row += absl::StrFormat(" %6.0f", e.heat());
      }
      out << absl::StrFormat("layer %2d: hottest expert %d (%.0f%% of the layer's heat)\n        ",
                             l, hottest, total > 0 ? 100 * top / total : 0.0)
          << row << "\n";
    }
    for (const auto& p : heat.pairs()) {
      out << absl::StrFormat("co-activated: layer %d experts %d+%d (%.0f)\n", p.layer(),
                             p.expert_a(), p.expert_b(), p.weight());
    }
  }
  if (!svg.empty()) {
    // A layer x expert grid, darker = hotter (per layer), each cell labelled with its
    // compute and store replica counts.
    int layers = 0, experts = 0;
    for (const auto& e : heat.experts()) {
      layers = std::max(layers, e.expert().layer() + 1);
      experts = std::max(experts, e.expert().expert() + 1);
    }
    std::vector<double> layer_max(layers, 0);
    for (const auto& e : heat.experts()) {
      layer_max[e.expert().layer()] = std::max(layer_max[e.expert().layer()], e.heat());
    }
    const int cell = 36, left = 70, top = 40;
    std::ostringstream doc;
    doc << absl::StrFormat(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
        "font-family=\"sans-serif\" font-size=\"10\">\n",
        left + experts * cell + 10, top + layers * cell + 30);
    doc << absl::StrFormat(
        "<text x=\"%d\" y=\"20\" font-size=\"13\">%s: expert heat after step "
        "%d (label: compute/store replicas)</text>\n",
        left, heat.job_id(), heat.step());
    for (int l = 0; l < layers; ++l) {
      doc << absl::StrFormat("<text x=\"5\" y=\"%d\">layer %d</text>\n", top + l * cell + 22, l);
    }
    for (int x = 0; x < experts; ++x) {
      doc << absl::StrFormat("<text x=\"%d\" y=\"%d\">e%d</text>\n", left + x * cell + 10,
                             top + layers * cell + 15, x);
    }
    for (const auto& e : heat.experts()) {
      const int l = e.expert().layer(), x = e.expert().expert();
      const double t = layer_max[l] > 0 ? e.heat() / layer_max[l] : 0;
      const int shade = static_cast<int>(255 - 200 * t);
      doc << absl::StrFormat(
          "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"rgb(255,%d,%d)\" "
          "stroke=\"#888\"><title>layer %d expert %d: heat %.1f</title></rect>\n",
          left + x * cell, top + l * cell, cell, cell, shade, shade, l, x, e.heat());
      doc << absl::StrFormat("<text x=\"%d\" y=\"%d\">%d/%d</text>\n", left + x * cell + 8,
                             top + l * cell + 22, e.compute_replicas(), e.store_replicas());
    }
    doc << "</svg>\n";
    const std::string text = doc.str();
    RETURN_IF_ERROR(WriteFileAtomically(svg, [&](int fd) {
      return WriteAll(fd, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, svg);
    }));
    if (!g_globals.json) out << "wrote " << svg << "\n";
  }
  return absl::OkStatus();
}

absl::Status ClusterDrain(const Args& args, std::ostream& out) {
  std::string store;
  bool wait = true;
  double timeout_s = 600;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--no-wait") {
      wait = false;
    } else if (args[i] == "--timeout") {
      if (i + 1 == args.size() || !absl::SimpleAtod(args[i + 1], &timeout_s) || timeout_s <= 0) {
        return UsageError("--timeout wants a number of seconds > 0");
      }
      ++i;
    } else if (absl::StartsWith(args[i], "--")) {
      return UsageError("cluster drain: unknown flag " + args[i]);
    } else if (store.empty()) {
      store = args[i];
    } else {
      return UsageError("cluster drain takes one store: pith cluster drain STORE");
    }
  }
  if (store.empty()) return UsageError("cluster drain takes one store: pith cluster drain STORE");
  ASSIGN_OR_RETURN(std::unique_ptr<Client> client, Connect());
  ASSIGN_OR_RETURN(v1::DrainStoreResponse started, client->DrainStore(store));
  if (!g_globals.json) {
    out << absl::StrFormat("draining %s: %d expert groups, %d blobs (%.1f MB) to move\n", store,
                           started.groups_to_move(), started.blobs_to_move(),
                           started.bytes_to_move() / 1e6);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(timeout_s);
  std::string last;
  while (true) {
    ASSIGN_OR_RETURN(v1::ClusterStatusResponse c, client->ClusterStatus());
    const v1::StoreDrain* drain = nullptr;
    for (const v1::StoreDrain& d : c.drains()) {
      if (d.store_id() == store) drain = &d;
    }
    if (drain == nullptr) {
      return absl::UnavailableError(absl::StrCat(
          "store ", store, " left the cluster while draining; blobs it held are re-replicated ",
          "from their other copies (see pith cluster)"));
    }
    if (!wait || drain->can_stop()) {
      if (g_globals.json) {
        out << Json(*drain) << "\n";
      } else if (drain->can_stop()) {
        out << store << " is drained: nothing is placed on it any more; its process can be "
            << "stopped now\n";
      } else {
        out << "the drain goes on; pith cluster shows its progress and when " << store
            << " can be stopped\n";
      }
      return absl::OkStatus();
    }
    int moving = 0;
    for (const v1::BlobMove& m : c.moves()) {
      moving += m.from_store_id() == store || m.to_store_id() == store;
    }
    const std::string line =
        absl::StrFormat("  %s: %d of %d groups still placed on it, %d copies in flight", store,
                        drain->groups_left(), drain->groups_total(), moving);
    if (line != last && !g_globals.json) out << line << "\n" << std::flush;
    last = line;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("store ", store, " is still draining after ", timeout_s, " s (",
                       drain->groups_left(), " groups left; pith cluster shows the progress)"));
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
}

absl::Status Cluster(const Args& args, std::ostream& out) {
  if (!args.empty() && args[0] == "drain")
    return ClusterDrain(Args(args.begin() + 1, args.end()), out);
  if (!args.empty()) return UsageError("cluster takes no arguments (or: cluster drain STORE)");
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
  for (const v1::BlobMove& m : c.moves()) {
    const std::string group =
        m.key().layer() < 0 ? std::string("dense")
                            : absl::StrCat("layer ", m.key().layer(), " expert ", m.key().expert());
    out << absl::StrFormat("  move %s %s: %s -> %s (%s)\n", m.key().job_id(), group,
                           m.from_store_id(), m.to_store_id(), m.reason());
  }
  for (const v1::StoreDrain& d : c.drains()) {
    out << absl::StrFormat("drain %s: %d of %d groups left%s\n", d.store_id(), d.groups_left(),
                           d.groups_total(), d.can_stop() ? ", drained: it can be stopped" : "");
  }
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

// The spec of a checkpoint: --spec when given, else the one a job export records in the
// file's metadata.
absl::StatusOr<v1::JobSpec> SpecOf(const std::string& spec_flag, const SafetensorsFile& file,
                                   const std::string& path) {
  if (!spec_flag.empty()) return LoadJobSpec(spec_flag);
  auto it = file.metadata().find(model::kSpecMetadataKey);
  if (it == file.metadata().end()) {
    return UsageError(absl::StrCat(path, " records no job spec: give --spec SPEC.json"));
  }
  v1::JobSpec spec;
  if (!google::protobuf::util::JsonStringToMessage(it->second, &spec).ok()) {
    return absl::DataLossError(absl::StrCat(path, ": unreadable job spec in its metadata"));
  }
  ApplyJobSpecDefaults(&spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  return spec;
}

// Evaluates a weights file: the mean cross-entropy (and total loss) over `batches` global
// batches of the token file, computed by the same model code training uses.
absl::Status Eval(const Args& args, std::ostream& out) {
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
  const model::ModelShape shape = model::ModelShape::FromSpec(spec.model());
  const int B = spec.train().batch(), T = shape.seq;
  compute::CpuBackend backend(0);
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeGpt> m, model::MoeGpt::Create(&backend, shape, B));
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
  RETURN_IF_ERROR(ParseFlags("sample", args, flags));
  for (const char* required : {"--checkpoint", "--prompt"}) {
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
  ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(flags["--checkpoint"]));
  ASSIGN_OR_RETURN(v1::JobSpec spec, SpecOf(flags["--spec"], file, flags["--checkpoint"]));
  const model::ModelShape shape = model::ModelShape::FromSpec(spec.model());
  if (shape.vocab != 256) {
    return absl::InvalidArgumentError(
        "sample: the model's vocabulary is not bytes (vocab_size 256)");
  }
  compute::CpuBackend backend(0);
  ASSIGN_OR_RETURN(std::unique_ptr<model::MoeGpt> m, model::MoeGpt::Create(&backend, shape, 1));
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
      {"up", Up},
      {"experts", Experts},
      {"down", Down},
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
    return status.GetPayload(kUsagePayload).has_value() ? 2 : 1;
  }
  err << "pith: unknown command \"" << absl::StrJoin(args, " ") << "\" (try pith help)\n";
  return 2;
}

}  // namespace pith
