#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/internal/parse.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/version.h"
#include "glog/logging.h"

ABSL_FLAG(int, log_verbosity, 0, "glog verbose level: VLOG(n) lines with n <= this are shown");
ABSL_FLAG(bool, log_warnings_only, false, "Log only warnings and errors");

namespace pith {

std::vector<std::string> InitProcess(int argc, char** argv, absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return std::string("Pith ") + kPithVersion + "\n"; };
  // --help lists Pith's own flags (Abseil's default shows only flags defined in a file
  // named after the binary).
  usage_config.contains_help_flags = [](absl::string_view file) {
    return file.find("absl/") == absl::string_view::npos;
  };
  absl::SetFlagsUsageConfig(usage_config);
  // absl::ParseCommandLine, but --help and --version exit 0: asked for, they are no
  // failure (Abseil exits 1 after help). Bad flags still exit 1 with Abseil's message.
  // ParseCommandLineImpl is Abseil's internal API as of Debian 12's 20220623 (newer
  // releases offer absl::ParseAbseilFlagsOnly for this).
  std::vector<char*> positional = absl::flags_internal::ParseCommandLineImpl(
      argc, argv, absl::flags_internal::ArgvListAction::kRemoveParsedArgs,
      absl::flags_internal::UsageFlagsAction::kIgnoreUsage,
      absl::flags_internal::OnUndefinedFlag::kAbortIfUndefined);
  if (absl::flags_internal::HandleUsageFlags(std::cout, absl::ProgramUsageMessage()) >= 0) {
    std::cout.flush();
    std::exit(EXIT_SUCCESS);
  }

  FLAGS_logtostderr = true;
  FLAGS_v = absl::GetFlag(FLAGS_log_verbosity);
  FLAGS_minloglevel =
      absl::GetFlag(FLAGS_log_warnings_only) ? google::GLOG_WARNING : google::GLOG_INFO;
  google::InitGoogleLogging(argv[0]);
  // Debian's Abseil is built without NDEBUG, so every Mutex lock would otherwise feed a
  // global lock-order graph (its deadlock check): ~1% of a worker's CPU, on every thread.
  // The tests keep it (they do not call InitProcess).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);

  return std::vector<std::string>(positional.begin() + 1, positional.end());
}

int ExitStatus(absl::string_view program, const absl::Status& status) {
  if (status.ok()) return EXIT_SUCCESS;
  fprintf(stderr, "%s: %s\n", std::string(program).c_str(), std::string(status.message()).c_str());
  // A wait that a SIGTERM or SIGINT ended was stopped as asked: no failure (systemd).
  return absl::IsCancelled(status) && ShutdownRequested() ? EXIT_SUCCESS : EXIT_FAILURE;
}

absl::Status CheckFdHeadroom(int want) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return absl::OkStatus();
  }
  std::error_code ec;
  uint64_t open = 0;
  for (std::filesystem::directory_iterator it("/proc/self/fd", ec), end; !ec && it != end;
       it.increment(ec)) {
    ++open;
  }
  if (ec == std::errc::too_many_files_open) {  // not even the listing's own descriptor
    return absl::ResourceExhaustedError(
        absl::StrCat("no file descriptor free (RLIMIT_NOFILE ", limit.rlim_cur,
                     "): raise its open-file limit (ulimit -n, or LimitNOFILE= under systemd)"));
  }
  if (ec == std::errc::too_many_files_open_in_system) {
    return absl::ResourceExhaustedError(
        "the machine has no file descriptor free (ENFILE): raise fs.file-max, or stop what "
        "holds them");
  }
  if (ec) return absl::OkStatus();  // no /proc to count in: nothing known against it
  if (open + want <= limit.rlim_cur) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      "fewer than ", want, " file descriptors free (", open, " open of RLIMIT_NOFILE ",
      limit.rlim_cur, "): raise its open-file limit (ulimit -n, or LimitNOFILE= under systemd)"));
}

namespace {

// The write end of the shutdown pipe; the handler only writes the signal number to it.
int g_shutdown_pipe[2] = {-1, -1};

ABSL_CONST_INIT absl::Mutex g_reload_mu(absl::kConstInit);
std::function<void()>* g_reload ABSL_GUARDED_BY(g_reload_mu) = nullptr;  // never freed

// Lock-free, so the handler may set it; other threads read it.
std::atomic<bool> g_shutdown_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);

void OnShutdownSignal(int sig) {
  if (sig != SIGHUP) g_shutdown_requested.store(true, std::memory_order_relaxed);
  const unsigned char byte = static_cast<unsigned char>(sig);
  (void)!::write(g_shutdown_pipe[1], &byte, 1);
}

}  // namespace

void OnReloadSignal(std::function<void()> reload) {
  absl::MutexLock lock(&g_reload_mu);
  if (g_reload == nullptr) g_reload = new std::function<void()>();
  *g_reload = std::move(reload);
}

ShutdownSignals::ShutdownSignals() {
  if (g_shutdown_pipe[0] < 0 && ::pipe2(g_shutdown_pipe, O_CLOEXEC) != 0) {
    PLOG(FATAL) << "shutdown pipe";
  }
  // A handler rather than sigwait: libraries start threads of their own (OpenBLAS at load
  // time) whose signal masks this process does not control, and a handler works whichever
  // thread the signal lands on.
  struct sigaction action = {};
  action.sa_handler = OnShutdownSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGHUP, &action, nullptr);
}

bool ShutdownRequested() { return g_shutdown_requested.load(std::memory_order_relaxed); }

int ShutdownSignals::Wait() {
  unsigned char byte = 0;
  while (true) {
    const ssize_t n = ::read(g_shutdown_pipe[0], &byte, 1);
    if (n == 1 && byte == SIGHUP) {
      std::function<void()> reload;
      {
        absl::MutexLock lock(&g_reload_mu);
        if (g_reload != nullptr) reload = *g_reload;
      }
      if (reload) {
        reload();
      } else {
        LOG(INFO) << "SIGHUP: nothing to reload (no --tls_dir)";
      }
      continue;
    }
    if (n == 1) return byte;
    if (n < 0 && errno == EINTR) continue;
    PLOG(FATAL) << "shutdown pipe";
  }
}

}  // namespace pith
