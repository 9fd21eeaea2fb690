// The `pith` CLI's parts, shared by cli.cc (dispatch, offline commands), cli_jobs.cc (the
// job commands, over the SDK in client.h) and cli_local.cc (`pith up` / `pith down`).
// Internal to the CLI: SDK users include client/client.h.
//
// Thread safety: every command gets its own CliContext and shares no state, so RunCli
// calls may run concurrently.
#ifndef PITH_CLIENT_CLI_COMMANDS_H_
#define PITH_CLIENT_CLI_COMMANDS_H_

#include <signal.h>

#include <iterator>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "google/protobuf/message.h"

namespace pith::cli {

using Args = std::vector<std::string>;

// Flags every job command understands, taken out of the arguments by RunCli.
struct CliContext {
  std::string coordinator;
  std::string tls_dir;  // --tls_dir; see Connect
  std::string token;    // --token (else $PITH_TOKEN): a bearer token instead of a certificate
  bool json = false;
  bool insecure = false;  // --insecure: plaintext to a loopback coordinator
};

// While it lives, SIGINT, SIGTERM and SIGHUP run `handler` (async-signal-safe) with
// sigaction's `flags`, except those ignored (nohup keeps its word); the earlier actions
// come back after. How a command that leaves something behind cleans up when stopped.
class OnStopSignals {
 public:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};

  explicit OnStopSignals(void (*handler)(int), int flags = 0);
  ~OnStopSignals();
  OnStopSignals(const OnStopSignals&) = delete;
  OnStopSignals& operator=(const OnStopSignals&) = delete;

 private:
  struct sigaction old_[std::size(kSignals)]{};
};

// A command used wrongly (exit 2), as opposed to one that failed (exit 1).
absl::Status UsageError(const std::string& what);
bool IsUsageError(const absl::Status& status);

// Takes "--flag value" pairs into `flags`, whose keys are the command's flags (with their
// defaults); a usage error names an unknown flag or one without a value.
absl::Status ParseFlags(const std::string& command, const Args& args,
                        std::map<std::string, std::string>& flags);

// The local cluster's folder: $PITH_HOME, else ~/.pith/local.
std::string DefaultDir();
// The coordinator of a cluster started by `pith up` in `dir`, if one is recorded there.
std::string LocalCoordinator(const std::string& dir);
// The coordinator from --coordinator, else $PITH_COORDINATOR, else the local cluster's,
// else 127.0.0.1:7000; over mutual TLS with the certificate of --tls_dir, else
// $PITH_TLS_DIR, else the local cluster's admin certificate (DIR/tls/admin) when there is
// one, else plaintext (loopback only).
absl::StatusOr<std::unique_ptr<Client>> Connect(const CliContext& ctx);
// Where `pith up` keeps the local cluster's certificates.
std::string LocalTlsDir(const std::string& dir);
// `m` as JSON with the proto field names.
std::string Json(const google::protobuf::Message& m);

// Job commands (cli_jobs.cc).
absl::Status Submit(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Status(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Watch(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Cancel(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Remove(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Checkpoint(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Experts(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Cluster(const CliContext& ctx, const Args& args, std::ostream& out);

// Certificates (cli_certs.cc).
absl::Status Certs(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Token(const CliContext& ctx, const Args& args, std::ostream& out);

// The local cluster (cli_local.cc).
absl::Status Up(const CliContext& ctx, const Args& args, std::ostream& out);
absl::Status Down(const CliContext& ctx, const Args& args, std::ostream& out);

}  // namespace pith::cli

#endif  // PITH_CLIENT_CLI_COMMANDS_H_
