// Process start-up shared by every Pith binary: Abseil flags, glog logging to stderr,
// and shutdown on SIGTERM/SIGINT.
#ifndef PITH_COMMON_PROCESS_H_
#define PITH_COMMON_PROCESS_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace pith {

// Sets the --help text, parses the command line (exits with a usage line on an unknown or
// malformed flag, as Abseil does) and starts logging. Returns the positional arguments,
// argv[0] excluded. Call once, first thing in main().
std::vector<std::string> InitProcess(int argc, char** argv, absl::string_view usage);

// The exit status of a binary that ends with `status`: EXIT_SUCCESS for OK; otherwise
// one line "program: message" on stderr (whatever the log settings) and EXIT_FAILURE, or
// EXIT_SUCCESS for a CANCELLED after SIGTERM or SIGINT (ShutdownRequested: a stop asked for).
int ExitStatus(absl::string_view program, const absl::Status& status);

// What SIGHUP (an operator's "reload") does: `reload` runs on the thread in
// ShutdownSignals::Wait each time one arrives (the TLS flags register one: the certificate
// files are checked and put in use at once, security/flags.h). Replaces any earlier one.
void OnReloadSignal(std::function<void()> reload);

// OK when this process may open `want` more file descriptors (its open ones, counted in
// /proc/self/fd, against RLIMIT_NOFILE); otherwise RESOURCE_EXHAUSTED with both figures
// and what to raise. A member that fails it says so in its heartbeat (health): it counts
// as dead until it has room again, instead of failing every job given to it.
absl::Status CheckFdHeadroom(int want);

// Catches SIGTERM and SIGINT (whichever thread they land on) so that Wait() returns them
// instead of the process dying; SIGHUP runs the OnReloadSignal hook (or is logged) and
// Wait() goes on. Construct once, in main(), before anything can take long.
//
// Thread safety: Wait() is called from one thread only.
class ShutdownSignals {
 public:
  ShutdownSignals();
  ShutdownSignals(const ShutdownSignals&) = delete;
  ShutdownSignals& operator=(const ShutdownSignals&) = delete;

  // Blocks until SIGTERM or SIGINT arrives; returns its number.
  int Wait();
};

// Whether SIGTERM or SIGINT arrived since ShutdownSignals was made (false without one):
// a start-up wait that cannot be left to Wait() (a member waiting out its predecessor's
// lease) gives up on it. Any thread.
bool ShutdownRequested();

}  // namespace pith

#endif  // PITH_COMMON_PROCESS_H_
