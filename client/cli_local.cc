// `pith up` and `pith down`: a local cluster of Pith processes on this machine, started
// detached with their logs and data under one folder.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/cli_commands.h"
#include "client/prometheus_rules.h"
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
    if (std::filesystem::exists(candidate)) return candidate.string();
    const std::filesystem::path sibling = self.parent_path() / name;
    if (std::filesystem::exists(sibling)) return sibling.string();
  }
  return name;  // execvp searches PATH
}

// The NVIDIA GPUs the driver shows (a folder each under /proc/driver/nvidia/gpus); 0
// without the driver.
int NvidiaGpus() {
  std::error_code ec;
  int n = 0;
  for (std::filesystem::directory_iterator it("/proc/driver/nvidia/gpus", ec), end;
       !ec && it != end; it.increment(ec)) {
    ++n;
  }
  return n;
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

// The local cluster's CA and certificates in DIR/tls (kept across `pith up`s): one per
// process, and the admin's the CLI uses.
absl::Status LocalCerts(const std::string& tls, int stores, int workers) {
  RETURN_IF_ERROR(security::EnsureCa(tls).status());
  std::vector<security::Identity> ids = {{security::Role::kCoordinator, "coordinator"},
                                         {security::Role::kAdmin, "admin"}};
  for (int n = 0; n < stores; ++n)
    ids.push_back({security::Role::kMember, absl::StrCat("store", n)});
  for (int n = 0; n < workers; ++n) {
    ids.push_back({security::Role::kMember, absl::StrCat("worker", n)});
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
  std::string backend, dir;
};

absl::StatusOr<UpFlags> ParseUpFlags(const Args& args) {
  std::map<std::string, std::string> flags = {
      {"--stores", "2"},       {"--workers", "2"},           {"--cache_bytes", "0"},
      {"--memory_bytes", "0"}, {"--ram_bytes", "268435456"}, {"--dir", DefaultDir()},
      {"--backend", "cpu"}};
  RETURN_IF_ERROR(ParseFlags("up", args, flags));
  UpFlags f;
  f.backend = flags["--backend"];
  f.dir = flags["--dir"];
  if (f.backend != "cpu" && f.backend != "cuda") {
    return UsageError(absl::StrCat("up: --backend wants cpu or cuda, got \"", f.backend, "\""));
  }
  if (!absl::SimpleAtoi(flags["--stores"], &f.stores) || f.stores < 1 ||
      !absl::SimpleAtoi(flags["--workers"], &f.workers) || f.workers < 1 ||
      !absl::SimpleAtoi(flags["--cache_bytes"], &f.cache_bytes) ||
      !absl::SimpleAtoi(flags["--memory_bytes"], &f.memory_bytes) ||
      !absl::SimpleAtoi(flags["--ram_bytes"], &f.ram_bytes) || f.ram_bytes == 0) {
    return UsageError(
        "up: --stores and --workers want numbers >= 1, --cache_bytes, --memory_bytes and "
        "--ram_bytes byte counts");
  }
  return f;
}

}  // namespace

absl::Status Up(const CliContext& ctx, const Args& args, std::ostream& out) {
  ASSIGN_OR_RETURN(const UpFlags f, ParseUpFlags(args));
  const int stores = f.stores, workers = f.workers;
  const uint64_t cache_bytes = f.cache_bytes, memory_bytes = f.memory_bytes;
  const uint64_t ram_bytes = f.ram_bytes;
  const std::string& backend = f.backend;
  const std::string& dir = f.dir;
  if (!LocalCoordinator(dir).empty() && std::filesystem::exists(dir + "/pids")) {
    return absl::AlreadyExistsError(
        absl::StrCat("a cluster is already up in ", dir, " (pith down --dir ", dir, " first)"));
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::PermissionDeniedError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  const std::string tls = LocalTlsDir(dir);
  RETURN_IF_ERROR(Annotate(LocalCerts(tls, stores, workers), "certificates"));
  std::vector<std::pair<std::string, pid_t>> started;
  std::vector<MetricsTarget> targets;
  auto stop_all = [&] {
    for (auto it = started.rbegin(); it != started.rend(); ++it) ::kill(it->second, SIGKILL);
  };
  auto launch = [&](const std::string& name,
                    std::vector<std::string> argv) -> absl::StatusOr<std::pair<int, int>> {
    const std::string log = dir + "/" + name + ".log";
    std::filesystem::remove(log, ec);
    ASSIGN_OR_RETURN(pid_t pid, Spawn(argv, log));
    started.push_back({name, pid});
    ASSIGN_OR_RETURN(auto ports, WaitReady(name, pid, log));
    targets.push_back({name, ports.second});
    return ports;
  };
  std::vector<std::string> lines;
  absl::Status status = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(
        auto c,
        launch("coordinator",
               {FindBinary("pith-coordinator", "server/coordinator"), "--listen=127.0.0.1:0",
                "--metrics_port=0", "--data_dir=" + dir + "/coordinator",
                "--tls_dir=" + tls + "/coordinator", "--tokens_file=" + tls + "/tokens"}));
    const std::string address = absl::StrCat("127.0.0.1:", c.first);
    lines.push_back(absl::StrFormat("  %-12s %-22s http://127.0.0.1:%d/metrics", "coordinator",
                                    address, c.second));
    for (int n = 0; n < stores; ++n) {
      const std::string name = absl::StrCat("store", n);
      ASSIGN_OR_RETURN(
          auto st, launch(name, {FindBinary("pith-store", "server/store"), "--listen=127.0.0.1:0",
                                 "--metrics_port=0", "--data_dir=" + dir + "/" + name,
                                 absl::StrCat("--ram_bytes=", ram_bytes),
                                 "--coordinator=" + address, "--tls_dir=" + tls + "/" + name}));
      lines.push_back(absl::StrFormat("  %-12s 127.0.0.1:%-12d http://127.0.0.1:%d/metrics", name,
                                      st.first, st.second));
    }
    // The workers share this host's cores (a worker's compute threads spin while waiting),
    // and its GPUs, round-robin.
    const int threads =
        std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / workers);
    const int gpus = backend == "cuda" ? std::max(1, NvidiaGpus()) : 1;
    for (int n = 0; n < workers; ++n) {
      const std::string name = absl::StrCat("worker", n);
      ASSIGN_OR_RETURN(
          auto w,
          launch(name, {FindBinary("pith-worker", "worker"), "--coordinator=" + address,
                        "--metrics_port=0", absl::StrCat("--cache_bytes=", cache_bytes),
                        absl::StrCat("--memory_bytes=", memory_bytes), "--backend=" + backend,
                        absl::StrCat("--device=", n % gpus), absl::StrCat("--threads=", threads),
                        "--tls_dir=" + tls + "/" + name}));
      lines.push_back(
          absl::StrFormat("  %-12s %-22s http://127.0.0.1:%d/metrics", name, "-", w.second));
    }
    std::ofstream(dir + "/coordinator.address") << address << "\n";
    std::ofstream pids(dir + "/pids");
    for (const auto& [name, pid] : started) pids << name << " " << pid << "\n";
    return WritePrometheusFiles(dir + "/prometheus", targets);
  }();
  if (!status.ok()) {
    stop_all();
    return status;
  }
  out << "Pith local cluster up in " << dir << ":\n";
  for (const std::string& l : lines) out << l << "\n";
  out << "Mutual TLS on every port (certificates in " << tls << "; the CLI uses admin's).\n";
  for (const auto& t : targets) {
    if (t.name == "coordinator") out << "Dashboard: http://127.0.0.1:" << t.port << "/\n";
  }
  out << "Prometheus (targets and alert rules): prometheus --config.file=" << dir
      << "/prometheus/prometheus.yml\n";
  out << "The job commands find it by themselves; stop it with pith down"
      << (dir == DefaultDir() ? "" : " --dir " + dir) << ".\n";
  return absl::OkStatus();
}

absl::Status Down(const CliContext& ctx, const Args& args, std::ostream& out) {
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
  std::filesystem::remove(dir + "/prometheus/targets.json", ec);  // nothing left to scrape
  out << "Pith local cluster in " << dir << " is down (data and logs kept there).\n";
  if (!clean) return absl::InternalError("some processes had to be killed");
  return absl::OkStatus();
}

}  // namespace pith::cli
