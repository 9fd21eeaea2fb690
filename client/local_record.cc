#include "client/local_record.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/file.h"

namespace pith::cli {
namespace {

absl::Status WriteText(const std::string& path, const std::string& text) {
  return WriteFileAtomically(path, [&](int fd) {
    return WriteAll(fd, {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, path);
  });
}

}  // namespace

std::optional<uint64_t> ProcessStart(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat;
  if (!std::getline(in, stat)) return std::nullopt;
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so fields count
  // from the last ')'. The start time is field 22, the 20th after it.
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::vector<std::string> fields =
      absl::StrSplit(stat.substr(paren + 1), ' ', absl::SkipWhitespace());
  uint64_t start = 0;
  if (fields.size() < 20 || fields[0] == "Z" || fields[0] == "X" ||
      !absl::SimpleAtoi(fields[19], &start)) {
    return std::nullopt;
  }
  return start;
}

bool Alive(const LocalMember& m, const std::string& mark) {
  if (m.pid <= 0) return false;
  const std::optional<uint64_t> start = ProcessStart(m.pid);
  if (!start.has_value() || (m.start != 0 && *start != m.start)) return false;
  if (mark.empty()) return true;
  std::ifstream in(absl::StrCat("/proc/", m.pid, "/cmdline"), std::ios::binary);
  std::string arg;
  while (std::getline(in, arg, '\0')) {
    if (arg == mark) return true;
  }
  return false;
}

absl::StatusOr<UniqueFd> LockFolder(const std::string& dir) {
  const std::string path = dir + "/.lock";
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
  if (!fd.valid()) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  while (::flock(fd.get(), LOCK_EX) != 0) {
    if (errno != EINTR) {
      return absl::InternalError(absl::StrCat("cannot lock ", path, ": ", std::strerror(errno)));
    }
  }
  return fd;
}

absl::StatusOr<std::vector<LocalMember>> ReadMembers(const std::string& dir) {
  std::ifstream in(dir + "/pids");
  if (!in) return absl::NotFoundError(absl::StrCat("no cluster is up in ", dir));
  std::vector<LocalMember> members;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    LocalMember m;
    if (!(fields >> m.name >> m.pid)) continue;
    fields >> m.start >> m.grpc_port >> m.metrics_port;  // absent in older records
    members.push_back(m);
  }
  return members;
}

absl::Status WriteMembers(const std::string& dir, const std::vector<LocalMember>& members) {
  std::string text;
  for (const LocalMember& m : members) {
    absl::StrAppend(&text, m.name, " ", m.pid, " ", m.start, " ", m.grpc_port, " ", m.metrics_port,
                    "\n");
  }
  return WriteText(dir + "/pids", text);
}

std::map<std::string, std::string> ReadUpFlags(const std::string& dir) {
  std::ifstream in(dir + "/up.flags");
  std::map<std::string, std::string> flags;
  std::string line;
  while (std::getline(in, line)) {  // "FLAG VALUE": the value may be empty, or hold spaces
    const size_t space = line.find(' ');
    if (space == 0 || line.empty()) continue;
    flags[line.substr(0, space)] = space == std::string::npos ? "" : line.substr(space + 1);
  }
  return flags;
}

absl::Status WriteUpFlags(const std::string& dir, const std::map<std::string, std::string>& flags) {
  std::string text;
  for (const auto& [flag, value] : flags) absl::StrAppend(&text, flag, " ", value, "\n");
  return WriteText(dir + "/up.flags", text);
}

int ReadCoordinatorPort(const std::string& dir) {
  std::ifstream in(dir + "/coordinator.port");
  int port = 0;
  if (!(in >> port) || port <= 0 || port > 65535) return 0;
  return port;
}

absl::Status WriteCoordinatorPort(const std::string& dir, int port) {
  return WriteText(dir + "/coordinator.port", absl::StrCat(port, "\n"));
}

bool LoopbackPortFree(int port) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  // As a gRPC listener binds: past connections in TIME_WAIT do not hold the port.
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return ::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0;
}

}  // namespace pith::cli
