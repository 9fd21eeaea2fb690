// The record `pith up` keeps of a local cluster in its folder, so that `pith up` can bring
// back the members that died (a kill, a crash, a reboot) and `pith down` stops only the
// processes it started:
//   DIR/pids              one line per member: name pid start grpc_port metrics_port
//                         (start: the process's start time in clock ticks since boot, from
//                         /proc/PID/stat, which tells a reused pid from the member)
//   DIR/up.flags          the `pith up` flags the cluster was started with, one per line
//                         (kept by `pith down`: the next `pith up` starts with them)
//   DIR/coordinator.port  the coordinator's port, kept across `pith down`: a cluster
//                         started again in DIR answers at the same address when it can
// Older records without the last three columns read with start 0 (not checked).
//
// Thread safety: plain functions on files; callers serialize on the folder with LockFolder.
#ifndef PITH_CLIENT_LOCAL_RECORD_H_
#define PITH_CLIENT_LOCAL_RECORD_H_

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/file.h"

namespace pith::cli {

struct LocalMember {
  std::string name;  // "coordinator", "store0", "worker1"
  pid_t pid = 0;
  uint64_t start = 0;  // 0: unknown
  int grpc_port = 0;   // 0 for a worker (it serves no gRPC port)
  int metrics_port = 0;
};

// `pid`'s start time (clock ticks since boot); nullopt when no such process runs (or it is
// a zombie).
std::optional<uint64_t> ProcessStart(pid_t pid);

// Whether `m` still runs: its pid exists, with its start time when the record has one, and
// (unless `mark` is empty) with `mark` as one of its arguments (a member's --tls_dir=...),
// so that neither a pid reused since nor an older record without start times is trusted.
bool Alive(const LocalMember& m, const std::string& mark);

// DIR/pids; NOT_FOUND when no cluster is recorded in `dir`.
absl::StatusOr<std::vector<LocalMember>> ReadMembers(const std::string& dir);
// Writes DIR/pids whole (through a temporary file and a rename).
absl::Status WriteMembers(const std::string& dir, const std::vector<LocalMember>& members);

// DIR/up.flags as flag -> value; an empty map when there is none.
std::map<std::string, std::string> ReadUpFlags(const std::string& dir);
absl::Status WriteUpFlags(const std::string& dir, const std::map<std::string, std::string>& flags);

// DIR/coordinator.port; 0 when none is recorded.
int ReadCoordinatorPort(const std::string& dir);
absl::Status WriteCoordinatorPort(const std::string& dir, int port);

// An exclusive lock on the folder's record (flock on DIR/.lock, waiting for it), held by
// `pith up` and `pith down` while they read and change it; released with the returned fd.
absl::StatusOr<UniqueFd> LockFolder(const std::string& dir);

// Whether a listener could bind 127.0.0.1:`port` now (nothing listens there).
bool LoopbackPortFree(int port);

}  // namespace pith::cli

#endif  // PITH_CLIENT_LOCAL_RECORD_H_
