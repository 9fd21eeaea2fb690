// `pith up` and `pith down`: a local cluster of Pith processes on this machine, started
// detached with their logs and data under one folder, and recorded there (local_record.h)
// so that `pith up` again starts the members that died, and `pith down` stops only its own.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/cli_commands.h"
#include "client/local_record.h"
#include "client/prometheus_rules.h"
#include "common/file.h"
#include "common/member_identity.h"
#include "common/status.h"
#include "security/certs.h"

namespace pith::cli {
namespace {

// A Pith binary: next to this one in the build tree, or on PATH.
std::string FindBinary(const std::string& name, const std::string& build_subdir) {
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const std::filesystem::path candidate = self.parent_path().parent_path() / build_subdir / name;
    if (std::filesystem::exists(candidate, ec)) return candidate.string();
    const std::filesystem::path sibling = self.parent_path() / name;
    if (std::filesystem::exists(sibling, ec)) return sibling.string();
  }
  return name;  // execvp searches PATH
}

// The NVIDIA GPUs this process may use: those $CUDA_VISIBLE_DEVICES lists when it is set,
// else those the driver shows (a folder each under /proc/driver/nvidia/gpus); 0 without
// the driver.
int NvidiaGpus() {
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
    const std::vector<std::string> ids = absl::StrSplit(visible, ',', absl::SkipWhitespace());
    return static_cast<int>(ids.size());
  }
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec), end;
       !ec && it != end; it.increment(ec)) {
    ++n;
  }
  return n;
}

// Starts `argv` detached (its own session), output to `log`, with the signal mask
// `mask`; returns its pid.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log,
                            const sigset_t& mask) {
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    ::sigprocmask(SIG_SETMASK, &mask, nullptr);
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

// ": WHY" from the last line of `log` that says why a process ended (the one-line error
// every Pith binary prints, "pith-store: ..."), or "" when there is none.
std::string LastError(const std::string& log) {
  std::string why;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    if (absl::StartsWith(line, "pith-") && absl::StrContains(line, ": ") &&
        !absl::StrContains(line, "ready:")) {
      why = std::string(line.substr(line.find(": ") + 2));
    }
  }
  return why.empty() ? "" : ": " + why;
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
      return absl::InternalError(
          absl::StrCat(name, " exited at start", LastError(s), "; see ", log));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return absl::DeadlineExceededError(absl::StrCat(name, " did not start within 20 s; see ", log));
}

// A store of `dir` that was drained, then stopped: its folder says so (pith-store writes
// DRAINED there when it leaves drained, and refuses to start on it). Such a store is
// retired: `pith up` starts it no more and drops it from the record, saying so on `out`.
bool Retired(const std::string& dir, const std::string& name, std::ostream& out) {
  const std::string marker = DrainedMarker(absl::StrCat(dir, "/", name));  // its --data_dir
  std::error_code ec;
  if (!absl::StartsWith(name, "store") || !std::filesystem::exists(marker, ec)) return false;
  out << name << " was drained and stopped: not started again (remove " << marker
      << " to start it anyway)\n";
  return true;
}

// The local cluster's CA and certificates in DIR/tls (kept across `pith up`s): one per
// process, and the admin's the CLI uses.
absl::Status LocalCerts(const std::string& tls, const std::vector<std::string>& members) {
  RETURN_IF_ERROR(security::EnsureCa(tls).status());
  std::vector<security::Identity> ids = {{security::Role::kAdmin, "admin"}};
  for (const std::string& name : members) {
    ids.push_back(
        {name == "coordinator" ? security::Role::kCoordinator : security::Role::kMember, name});
  }
  for (const security::Identity& id : ids) {
    absl::Status s = security::Issue(tls, id);
    if (!s.ok() && !absl::IsAlreadyExists(s)) return s;
  }
  return absl::OkStatus();
}

// A process's /metrics, for Prometheus' file service discovery.
struct MetricsTarget {
  std::string name;  // "store0"
  int port;
};

// `dir`/targets.json (file_sd: every process of the cluster, labelled with its name as
// `member`), and beside it a scrape config that reads it and Pith's alert rules.
absl::Status WritePrometheusFiles(const std::string& dir,
                                  const std::vector<MetricsTarget>& targets) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  std::string json = "[\n";
  for (size_t i = 0; i < targets.size(); ++i) {
    absl::StrAppend(&json, "  {\"targets\": [\"127.0.0.1:", targets[i].port,
                    "\"], \"labels\": {\"member\": \"", targets[i].name, "\"}}",
                    i + 1 < targets.size() ? ",\n" : "\n");
  }
  json += "]\n";
  const std::string config = R"(# Written by pith up: prometheus --config.file=THIS_FILE
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - pith-rules.yml
scrape_configs:
  - job_name: pith
    honor_labels: true
    file_sd_configs:
      - files: ['targets.json']
        refresh_interval: 5s
)";
  for (const auto& [file, text] : {std::pair<std::string, std::string>{"targets.json", json},
                                   {"prometheus.yml", config},
                                   {"pith-rules.yml", kPrometheusRules}}) {
    // Written whole, then renamed: Prometheus never reads half a file.
    const std::string path = dir + "/" + file;
    {
      std::ofstream f(path + ".tmp", std::ios::trunc);
      f << text;
      if (!f.flush()) return absl::InternalError(absl::StrCat("cannot write ", path));
    }
    std::filesystem::rename(path + ".tmp", path, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot write ", path, ": ", ec.message()));
  }
  return absl::OkStatus();
}

// `pith up`'s flags, checked.
struct UpFlags {
  int stores = 0, workers = 0;
  uint64_t cache_bytes = 0, memory_bytes = 0, ram_bytes = 0;
  std::string backend;
  std::string data_root;  // the workers' --data_root, or "any": any file the user may read
};

// The flags `pith up` takes besides --dir, with their defaults.
std::map<std::string, std::string> UpDefaults() {
  return {{"--stores", "2"},       {"--workers", "2"},   {"--cache_bytes", "0"},
          {"--memory_bytes", "0"}, {"--backend", "cpu"}, {"--ram_bytes", "268435456"},
          {"--data_root", "any"}};
}

// `over` laid over the defaults.
std::map<std::string, std::string> OverDefaults(const std::map<std::string, std::string>& over) {
  std::map<std::string, std::string> flags = UpDefaults();
  for (const auto& [flag, value] : over) flags[flag] = value;
  return flags;
}

absl::StatusOr<UpFlags> CheckUpFlags(std::map<std::string, std::string> flags) {
  UpFlags f;
  f.backend = flags["--backend"];
  f.data_root = flags["--data_root"];
  for (absl::string_view root : absl::StrSplit(f.data_root, ',')) {
    std::error_code ec;
    if (f.data_root != "any" &&
        (!absl::StartsWith(root, "/") || !std::filesystem::is_directory(std::string(root), ec))) {
      return UsageError(
          absl::StrCat("up: --data_root wants absolute directories (or any), got \"", root, "\""));
    }
  }
  if (f.backend != "cpu" && f.backend != "cuda") {
    return UsageError(absl::StrCat("up: --backend wants cpu or cuda, got \"", f.backend, "\""));
  }
  // Each count: a whole number of at least `least` (processes, or bytes).
  auto count = [&](const char* flag, auto& into, int least) -> absl::Status {
    if (absl::SimpleAtoi(flags[flag], &into) && into >= static_cast<decltype(+into)>(least)) {
      return absl::OkStatus();
    }
    return UsageError(absl::StrCat("up: ", flag, " wants a whole number >= ", least, ", got \"",
                                   flags[flag], "\""));
  };
  RETURN_IF_ERROR(count("--stores", f.stores, 1));
  RETURN_IF_ERROR(count("--workers", f.workers, 1));
  RETURN_IF_ERROR(count("--cache_bytes", f.cache_bytes, 0));
  RETURN_IF_ERROR(count("--memory_bytes", f.memory_bytes, 0));
  RETURN_IF_ERROR(count("--ram_bytes", f.ram_bytes, 1));
  // One machine's processes: past this, use a real deployment (deploy/).
  constexpr int kMost = 64;
  if (f.stores > kMost || f.workers > kMost) {
    return UsageError(absl::StrCat("up: a local cluster takes at most ", kMost, " stores and ",
                                   kMost, " workers, got --stores ", f.stores, " --workers ",
                                   f.workers));
  }
  // Each store's RAM tier is held from its start: they must fit the machine together.
  const uint64_t machine = PhysicalMemoryBytes();
  if (machine > 0 && f.ram_bytes > machine / 2 / static_cast<uint64_t>(f.stores)) {
    return UsageError(absl::StrCat("up: --stores ", f.stores, " x --ram_bytes ", f.ram_bytes,
                                   " is more than half of this machine's ", machine,
                                   " bytes of memory"));
  }
  // A worker holds what --memory_bytes grants it (each checks only its own plan): the
  // workers and the stores share the machine.
  const uint64_t stores_hold = f.ram_bytes * static_cast<uint64_t>(f.stores);
  if (machine > 0 && f.memory_bytes > (machine - stores_hold) / static_cast<uint64_t>(f.workers)) {
    return UsageError(absl::StrCat("up: --workers ", f.workers, " x --memory_bytes ",
                                   f.memory_bytes, " and --stores ", f.stores, " x --ram_bytes ",
                                   f.ram_bytes, " are more than this machine's ", machine,
                                   " bytes of memory"));
  }
  return f;
}

// The cluster's members in start order: the coordinator, the stores, the workers.
std::vector<std::string> MemberNames(const UpFlags& f, const std::string& dir, std::ostream& out) {
  std::vector<std::string> names = {"coordinator"};
  // A retired store's name is skipped (saying so): the cluster still gets f.stores stores.
  for (int n = 0, stores = 0; stores < f.stores; ++n) {
    const std::string name = absl::StrCat("store", n);
    if (Retired(dir, name, out)) continue;
    names.push_back(name);
    ++stores;
  }
  for (int n = 0; n < f.workers; ++n) names.push_back(absl::StrCat("worker", n));
  return names;
}

// The command line of member `name` of the cluster in `dir`, whose coordinator listens on
// 127.0.0.1:`coordinator_port` (0 at a first start: any free port), serving its metrics
// on `metrics_port` (0: any free port).
std::vector<std::string> MemberCommand(const std::string& name, const UpFlags& f,
                                       const std::string& dir, int coordinator_port,
                                       int metrics_port) {
  const std::string tls = LocalTlsDir(dir) + "/" + name;
  const std::string address = absl::StrCat("127.0.0.1:", coordinator_port);
  const std::string metrics = absl::StrCat("--metrics_port=", metrics_port);
  if (name == "coordinator") {
    return {FindBinary("pith-coordinator", "server/coordinator"),
            "--listen=" + address,
            metrics,
            "--data_dir=" + dir + "/coordinator",
            "--tls_dir=" + tls,
            "--tokens_file=" + LocalTlsDir(dir) + "/tokens"};
  }
  if (absl::StartsWith(name, "store")) {
    return {FindBinary("pith-store", "server/store"),
            "--listen=127.0.0.1:0",
            metrics,
            "--data_dir=" + dir + "/" + name,
            absl::StrCat("--ram_bytes=", f.ram_bytes),
            "--coordinator=" + address,
            "--tls_dir=" + tls};
  }
  // The workers share this host's cores (a worker's compute threads spin while waiting),
  // and its GPUs, round-robin.
  int n = 0;
  (void)absl::SimpleAtoi(name.substr(6), &n);
  const int threads =
      std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / f.workers);
  const int gpus = f.backend == "cuda" ? std::max(1, NvidiaGpus()) : 1;
  return {FindBinary("pith-worker", "worker"),
          "--coordinator=" + address,
          "--listen=127.0.0.1:0",   // UCX and /metrics on loopback, as every member's
          "--data_exclude=" + dir,  // no job reads the cluster's keys, data or logs
          metrics,
          absl::StrCat("--cache_bytes=", f.cache_bytes),
          absl::StrCat("--memory_bytes=", f.memory_bytes),
          "--backend=" + f.backend,
          absl::StrCat("--device=", n % gpus),
          absl::StrCat("--threads=", threads),
          "--data_root=" + (f.data_root == "any" ? "" : f.data_root),
          "--tls_dir=" + tls};
}

// The members a Launcher started and nothing records yet, for its signal handler: a pith
// up interrupted (^C, a timeout's SIGTERM) kills them.
constexpr int kMaxStarted = 256;  // members of a local cluster: CheckUpFlags bounds them
volatile pid_t g_started[kMaxStarted];
volatile sig_atomic_t g_started_count = 0;
extern "C" void KillStartedAndExit(int sig) {
  for (int i = g_started_count - 1; i >= 0; --i) ::kill(g_started[i], SIGKILL);
  ::_exit(128 + sig);
}

// Starts members of the cluster in `dir`, each detached with its log at DIR/NAME.log (the
// previous one kept as NAME.log.prev). Until Keep(), those it started die with it: by
// Abandon(), or at SIGINT, SIGTERM or SIGHUP (those not ignored: nohup keeps its word).
class Launcher {
 public:
  explicit Launcher(std::string dir) : dir_(std::move(dir)) {}
  ~Launcher() { Keep(); }  // then stop_ puts the earlier actions back
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;

  // What it started is recorded: a signal kills nothing more.
  void Keep() { g_started_count = 0; }

  absl::StatusOr<LocalMember> Launch(const std::string& name,
                                     const std::vector<std::string>& argv) {
    const std::string log = dir_ + "/" + name + ".log";
    std::error_code ec;
    std::filesystem::rename(log, log + ".prev", ec);  // a crashed member's last words
    std::filesystem::remove(log, ec);
    // No stop signal between the fork and the pid's note: the handler kills what it names.
    sigset_t stops, mask;
    sigemptyset(&stops);
    for (int sig : OnStopSignals::kSignals) sigaddset(&stops, sig);
    ::sigprocmask(SIG_BLOCK, &stops, &mask);
    absl::StatusOr<pid_t> spawned = Spawn(argv, log, mask);
    if (spawned.ok() && g_started_count < kMaxStarted) {
      g_started[g_started_count] = *spawned;
      g_started_count = g_started_count + 1;
    }
    ::sigprocmask(SIG_SETMASK, &mask, nullptr);
    ASSIGN_OR_RETURN(const pid_t pid, spawned);
    started_.push_back(pid);
    ASSIGN_OR_RETURN(const auto ports, WaitReady(name, pid, log));
    const std::optional<uint64_t> start = ProcessStart(pid);
    if (!start.has_value()) {
      return absl::InternalError(absl::StrCat(name, " exited after it started; see ", log));
    }
    LocalMember m{name, pid, *start, ports.first, ports.second};
    if (absl::StartsWith(name, "worker")) m.grpc_port = 0;  // workers serve no gRPC port
    return m;
  }

  void Abandon() {
    for (auto it = started_.rbegin(); it != started_.rend(); ++it) ::kill(*it, SIGKILL);
  }

 private:
  const std::string dir_;
  std::vector<pid_t> started_;
  OnStopSignals stop_{KillStartedAndExit};  // (g_started_count is 0: each Launcher ends so)
};

// `dir` absolute and normal: the members' flags name paths under it, which must read the
// same from wherever `pith up` or `pith down` runs next.
std::string FolderPath(const std::string& dir) {
  std::error_code ec;
  std::string path = std::filesystem::absolute(dir, ec).lexically_normal().string();
  if (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

// Whether member `m` of the cluster in `dir` still runs (see Alive: its pid, start time
// and its own --tls_dir among its arguments).
bool Runs(const std::string& dir, const LocalMember& m) {
  return Alive(m, "--tls_dir=" + LocalTlsDir(dir) + "/" + m.name);
}

// Records the members (`pids`, last) and their Prometheus targets in `dir`.
absl::Status RecordMembers(const std::string& dir, const std::vector<LocalMember>& members) {
  std::vector<MetricsTarget> targets;
  for (const LocalMember& m : members) targets.push_back({m.name, m.metrics_port});
  RETURN_IF_ERROR(WritePrometheusFiles(dir + "/prometheus", targets));
  return WriteMembers(dir, members);
}

// Records the cluster in `dir` (see local_record.h) and its Prometheus targets; `pids` last,
// so that a record that could not be written whole names no member.
absl::Status Record(const std::string& dir, const std::vector<LocalMember>& members,
                    const std::map<std::string, std::string>& flags) {
  RETURN_IF_ERROR(WriteUpFlags(dir, flags));
  RETURN_IF_ERROR(WriteCoordinatorPort(dir, members.front().grpc_port));
  std::ofstream(dir + "/coordinator.address") << "127.0.0.1:" << members.front().grpc_port << "\n";
  return RecordMembers(dir, members);
}

void PrintCluster(const std::string& dir, const std::vector<LocalMember>& members,
                  std::ostream& out) {
  for (const LocalMember& m : members) {
    const std::string address = m.grpc_port > 0 ? absl::StrCat("127.0.0.1:", m.grpc_port) : "-";
    out << absl::StrFormat("  %-12s %-22s http://127.0.0.1:%d/metrics\n", m.name, address,
                           m.metrics_port);
  }
  const std::string tls = LocalTlsDir(dir);
  out << "Mutual TLS on every port (certificates in " << tls << "; the CLI uses admin's).\n";
  out << "Dashboard: http://127.0.0.1:" << members.front().metrics_port << "/\n";
  out << "Prometheus (targets and alert rules): prometheus --config.file=" << dir
      << "/prometheus/prometheus.yml\n";
  if (dir == FolderPath(DefaultDir())) {
    out << "The job commands find it by themselves; stop it with pith down.\n";
  } else {
    out << "The job commands find it with PITH_HOME=" << dir
        << " in their environment (export it); stop it with pith down --dir " << dir << ".\n";
  }
}

// A first start in `dir` (nothing recorded there) with `flags` (checked: `f`): every
// member, the coordinator on the port it had last time in `dir` when that port is free.
absl::Status StartFresh(const std::string& dir, const std::map<std::string, std::string>& flags,
                        const UpFlags& f, std::ostream& out) {
  const std::vector<std::string> names = MemberNames(f, dir, out);
  RETURN_IF_ERROR(Annotate(LocalCerts(LocalTlsDir(dir), names), "certificates"));
  const int recorded = ReadCoordinatorPort(dir);
  const bool moved = recorded != 0 && !LoopbackPortFree(recorded);
  int port = moved ? 0 : recorded;
  Launcher launcher(dir);
  std::vector<LocalMember> members;
  absl::Status status = [&]() -> absl::Status {
    for (const std::string& name : names) {
      ASSIGN_OR_RETURN(LocalMember m, launcher.Launch(name, MemberCommand(name, f, dir, port, 0)));
      if (name == "coordinator") port = m.grpc_port;
      members.push_back(m);
    }
    return Record(dir, members, flags);
  }();
  if (!status.ok()) {
    launcher.Abandon();
    return status;
  }
  launcher.Keep();
  out << "Pith local cluster up in " << dir << ":\n";
  std::vector<std::string> own;  // its flags other than the defaults
  for (const auto& [flag, value] : flags) {
    if (UpDefaults()[flag] != value) own.push_back(absl::StrCat(flag, " ", value));
  }
  if (!own.empty()) out << "(with " << absl::StrJoin(own, " ") << ")\n";
  if (moved) {
    out << "(its coordinator's port before, " << recorded << ", is taken: it listens on "
        << members.front().grpc_port << " now)\n";
  }
  PrintCluster(dir, members, out);
  return absl::OkStatus();
}

// A cluster recorded in `dir`: starts again, from the record, the members that no longer
// run (killed, crashed, or all of them after a reboot), at the coordinator's old address.
absl::Status Restart(const std::string& dir, const std::map<std::string, std::string>& given,
                     std::vector<LocalMember> members, std::ostream& out) {
  std::vector<std::string> dead, running;
  std::vector<bool> runs;  // members[i] still runs, looked at once
  bool retired = false;
  for (auto m = members.begin(); m != members.end();) {
    const bool alive = Runs(dir, *m);
    if (!alive && Retired(dir, m->name, out)) {
      m = members.erase(m);
      retired = true;
      continue;
    }
    runs.push_back(alive);
    (alive ? running : dead).push_back(m->name);
    ++m;
  }
  if (retired) RETURN_IF_ERROR(RecordMembers(dir, members));
  const std::map<std::string, std::string> recorded = ReadUpFlags(dir);
  if (dead.empty()) {  // up is idempotent: nothing to start, unless asked for other flags
    const std::map<std::string, std::string> flags = OverDefaults(recorded);
    for (const auto& [flag, value] : given) {
      auto it = flags.find(flag);
      if (!recorded.empty() && (it == flags.end() || it->second != value)) {
        return absl::FailedPreconditionError(
            absl::StrCat("the cluster in ", dir, " is already up with ", flag, " ",
                         it == flags.end() ? "unset" : it->second, "; pith down --dir ", dir,
                         " first to start it with ", flag, " ", value));
      }
    }
    out << "the cluster in " << dir << " is already up: every process runs, nothing to start\n";
    PrintCluster(dir, members, out);
    return absl::OkStatus();
  }
  std::map<std::string, std::string> flags = OverDefaults(recorded);
  if (recorded.empty() || members.front().name != "coordinator" || members.front().grpc_port <= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("the cluster in ", dir,
                     " was started by an older pith and cannot be restarted from "
                     "its record: pith down --dir ",
                     dir, ", then pith up"));
  }
  for (const auto& [flag, value] : given) {
    if (flags[flag] != value) {
      return absl::FailedPreconditionError(
          absl::StrCat("the cluster in ", dir, " was started with ", flag, " ", flags[flag],
                       "; pith down --dir ", dir, " first to start it with ", flag, " ", value));
    }
  }
  absl::StatusOr<UpFlags> f = CheckUpFlags(flags);
  if (!f.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(dir, "/up.flags: ", f.status().message()));
  }
  const int port = members.front().grpc_port;
  if (!runs.front() && !LoopbackPortFree(port)) {
    return absl::FailedPreconditionError(
        absl::StrCat("the coordinator of ", dir, " cannot listen on 127.0.0.1:", port,
                     " again: another process holds the port (ss -ltnp 'sport = :", port,
                     "' shows it; or pith down --dir ", dir, ", then pith up)"));
  }
  Launcher launcher(dir);
  absl::Status status = [&]() -> absl::Status {
    for (size_t i = 0; i < members.size(); ++i) {
      if (runs[i]) continue;
      LocalMember& m = members[i];
      // Its metrics port again where it is free: the dashboard's address stays too.
      const int metrics =
          m.metrics_port > 0 && LoopbackPortFree(m.metrics_port) ? m.metrics_port : 0;
      ASSIGN_OR_RETURN(m, launcher.Launch(m.name, MemberCommand(m.name, *f, dir, port, metrics)));
    }
    return Record(dir, members, flags);
  }();
  if (!status.ok()) {
    launcher.Abandon();
    return status;
  }
  launcher.Keep();
  out << "Pith local cluster in " << dir << ": restarted " << absl::StrJoin(dead, ", ");
  if (!running.empty()) out << " (" << absl::StrJoin(running, ", ") << " kept running)";
  out << ":\n";
  PrintCluster(dir, members, out);
  return absl::OkStatus();
}

// Stops `members` together: SIGTERM to each that runs, then up to 15 s for them all to
// end, then SIGKILL to any left. Whether every one ended at its SIGTERM.
bool StopMembers(const std::string& dir, const std::vector<LocalMember>& members,
                 std::ostream& out) {
  bool clean = true;
  std::vector<const LocalMember*> signalled;
  for (const LocalMember& m : members) {
    if (!Runs(dir, m)) {
      out << "  " << m.name << " was not running\n";
    } else if (::kill(m.pid, SIGTERM) != 0) {
      out << "  " << m.name << " could not be stopped: " << std::strerror(errno) << "\n";
      clean = false;
    } else {
      signalled.push_back(&m);
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  for (const LocalMember* m : signalled) {
    bool gone = !Runs(dir, *m);
    while (!gone && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      gone = !Runs(dir, *m);
    }
    if (!gone) {
      ::kill(m->pid, SIGKILL);
      clean = false;
    }
    out << "  " << m->name << (gone ? " stopped" : " killed (did not stop within 15 s)") << "\n";
  }
  return clean;
}

}  // namespace

absl::Status Up(const CliContext& ctx, const Args& args, std::ostream& out) {
  // Only the flags given: a restart checks them against the record.
  std::map<std::string, std::string> given = UpDefaults();
  for (auto& [flag, value] : given) value.clear();
  given["--dir"] = "";
  RETURN_IF_ERROR(ParseFlags("up", args, given));
  for (auto it = given.begin(); it != given.end();) {
    it = it->second.empty() ? given.erase(it) : std::next(it);
  }
  std::string dir = DefaultDir();
  if (auto it = given.find("--dir"); it != given.end()) {
    dir = it->second;
    given.erase(it);
  }
  // Bad values are refused before anything is made.
  RETURN_IF_ERROR(CheckUpFlags(OverDefaults(given)).status());
  dir = FolderPath(dir);
  std::error_code ec;
  // The folder is its user's alone (made here, or before by pith certs or mkdir): it
  // gathers the members' logs, data and keys.
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  }
  std::filesystem::permissions(dir, std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, ec);
  if (ec) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot make ", dir, " its owner's alone: ", ec.message()));
  }
  ASSIGN_OR_RETURN(const UniqueFd lock, LockFolder(dir));  // one pith up or down at a time
  absl::StatusOr<std::vector<LocalMember>> recorded = ReadMembers(dir);
  if (recorded.ok() && !recorded->empty()) return Restart(dir, given, *std::move(recorded), out);
  // A folder whose cluster went down (pith down) starts again as it was: the flags given
  // now laid over the ones it last started with (its stores' data is laid out for them).
  std::map<std::string, std::string> last;
  for (const auto& [flag, value] : ReadUpFlags(dir)) {
    if (UpDefaults().count(flag)) last[flag] = value;  // one this pith still takes
  }
  for (const auto& [flag, value] : given) last[flag] = value;
  const std::map<std::string, std::string> flags = OverDefaults(last);
  absl::StatusOr<UpFlags> f = CheckUpFlags(flags);
  if (!f.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        f.status().message(), " (from ", dir, "/up.flags, the flags of the cluster last up ",
        "there; give that flag to pith up to replace it)"));
  }
  return StartFresh(dir, flags, *f, out);
}

absl::Status Down(const CliContext& ctx, const Args& args, std::ostream& out) {
  std::string dir = DefaultDir();
  if (args.size() == 2 && args[0] == "--dir" && !args[1].empty()) {
    dir = args[1];
  } else if (!args.empty()) {
    return UsageError("down takes --dir DIR at most");
  }
  dir = FolderPath(dir);
  std::error_code ec;
  if (!std::filesystem::exists(dir + "/pids", ec)) {  // down is idempotent, as up is
    out << "no cluster is up in " << dir << ": nothing to stop\n";
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(const UniqueFd lock, LockFolder(dir));  // one pith up or down at a time
  ASSIGN_OR_RETURN(const std::vector<LocalMember> members, ReadMembers(dir));
  // The coordinator first, so that no member's leaving is taken for a loss (a job whose
  // only copy of a group is on a store that stops would fail); then the workers, then the
  // stores, each kind at once. A recorded pid that now belongs to another process is left
  // be (see Runs).
  bool clean = true;
  std::vector<LocalMember> rest = members;
  for (const char* kind : {"coordinator", "worker", "store", ""}) {  // "": any other
    std::vector<LocalMember> group;
    for (auto it = rest.begin(); it != rest.end();) {
      const bool now = absl::StartsWith(it->name, kind);
      if (now) group.push_back(*it);
      it = now ? rest.erase(it) : std::next(it);
    }
    clean &= StopMembers(dir, group, out);
  }
  std::filesystem::remove(dir + "/pids", ec);
  std::filesystem::remove(dir + "/coordinator.address", ec);
  std::filesystem::remove(dir + "/prometheus/targets.json", ec);  // nothing left to scrape
  out << "Pith local cluster in " << dir << " is down (data and logs kept there).\n";
  if (!clean) return absl::InternalError("some processes had to be killed or could not be stopped");
  return absl::OkStatus();
}

}  // namespace pith::cli
