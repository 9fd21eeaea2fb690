#include "common/process.h"

#include <signal.h>

#include <cstdio>
#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
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
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);

  FLAGS_logtostderr = true;
  FLAGS_v = absl::GetFlag(FLAGS_log_verbosity);
  FLAGS_minloglevel =
      absl::GetFlag(FLAGS_log_warnings_only) ? google::GLOG_WARNING : google::GLOG_INFO;
  google::InitGoogleLogging(argv[0]);

  return std::vector<std::string>(positional.begin() + 1, positional.end());
}

int ExitStatus(absl::string_view program, const absl::Status& status) {
  if (status.ok()) return EXIT_SUCCESS;
  fprintf(stderr, "%s: %s\n", std::string(program).c_str(), std::string(status.message()).c_str());
  return EXIT_FAILURE;
}

namespace {

sigset_t ShutdownSet() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  return set;
}

}  // namespace

ShutdownSignals::ShutdownSignals() {
  sigset_t set = ShutdownSet();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int ShutdownSignals::Wait() {
  sigset_t set = ShutdownSet();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  return sig;
}

}  // namespace pith
