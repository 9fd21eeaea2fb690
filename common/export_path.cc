#include "common/export_path.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "common/status.h"

namespace pith {
namespace {

// `p` without "." and empty components (lexically; ".." is left for the caller to refuse).
std::vector<std::string> Components(const std::string& p) {
  std::vector<std::string> out;
  for (absl::string_view c : absl::StrSplit(p, '/', absl::SkipEmpty())) {
    if (c != ".") out.emplace_back(c);
  }
  return out;
}

}  // namespace

absl::StatusOr<ExportPath> ExportPath::Directory(const std::string& root,
                                                 const std::string& requested) {
  return Open(root, requested, /*new_entry=*/false);
}

absl::StatusOr<ExportPath> ExportPath::NewEntry(const std::string& root,
                                                const std::string& requested) {
  return Open(root, requested, /*new_entry=*/true);
}

absl::StatusOr<ExportPath> ExportPath::Open(const std::string& root_flag,
                                            const std::string& requested, bool new_entry) {
  if (root_flag.empty()) {
    return absl::FailedPreconditionError(
        "server-side exports are off: this server has no --export_root (pith checkpoint --out "
        "downloads to the client instead)");
  }
  if (requested.empty()) return absl::InvalidArgumentError("the export path is empty");
  // A NUL would end the name the kernel sees early ("..\0" passes as a name, opens as "..").
  if (requested.find('\0') != std::string::npos || root_flag.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("the export path holds a NUL byte");
  }
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(root_flag, ec);
  if (ec)
    return absl::InvalidArgumentError(absl::StrCat("export root ", root_flag, ": ", ec.message()));
  const std::vector<std::string> root_parts = Components(absolute.lexically_normal().string());
  const std::string root = absl::StrCat("/", absl::StrJoin(root_parts, "/"));
  std::vector<std::string> parts = Components(requested);
  if (absl::StartsWith(requested, "/")) {  // absolute: must lie under the root
    const bool under = parts.size() >= root_parts.size() + (new_entry ? 1 : 0) &&
                       std::equal(root_parts.begin(), root_parts.end(), parts.begin());
    if (!under) {
      return absl::InvalidArgumentError(
          absl::StrCat("export path ", requested, " is outside the export root ", root));
    }
    parts.erase(parts.begin(), parts.begin() + static_cast<long>(root_parts.size()));
  }
  for (const std::string& c : parts) {
    if (c == "..") {
      return absl::InvalidArgumentError(
          absl::StrCat("export path ", requested, ": '..' may not be used"));
    }
  }
  if (parts.empty()) {
    if (new_entry) {
      return absl::InvalidArgumentError(
          absl::StrCat("export path ", requested, " names the export root itself"));
    }
  }
  ExportPath out;
  out.dir_ = UniqueFd(::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!out.dir_.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat("export root ", root, ": ", std::strerror(errno)));
  }
  const size_t dirs = new_entry ? parts.size() - 1 : parts.size();
  for (size_t i = 0; i < dirs; ++i) {
    if (::mkdirat(out.dir_.get(), parts[i].c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot create ", parts[i], " under ", root, ": ", std::strerror(errno)));
    }
    UniqueFd next(::openat(out.dir_.get(), parts[i].c_str(),
                           O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!next.valid()) {
      const bool link = errno == ELOOP || errno == ENOTDIR;
      return absl::InvalidArgumentError(
          absl::StrCat("export path ", requested, ": ", parts[i],
                       link ? " is a symlink or not a directory; exports do not follow symlinks"
                            : absl::StrCat(" cannot be opened: ", std::strerror(errno))));
    }
    out.dir_ = std::move(next);
  }
  out.path_ = absl::StrCat("/proc/self/fd/", out.dir_.get());
  out.shown_ = parts.empty() ? root : absl::StrCat(root, "/", absl::StrJoin(parts, "/"));
  if (new_entry) {
    struct stat st;
    if (::fstatat(out.dir_.get(), parts.back().c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      return absl::AlreadyExistsError(
          absl::StrCat(out.shown_, " already exists; exports never replace a file"));
    }
    absl::StrAppend(&out.path_, "/", parts.back());
  }
  return out;
}

absl::Status ExportPath::Named(const absl::Status& status) const {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrReplaceAll(status.message(), {{path_, shown_}}));
}

absl::Status ReadPath::CheckRoots(const std::vector<std::string>& roots) {
  for (const std::string& root : roots) {
    struct stat st;
    if (root.empty() || root[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat("--data_root: ", root.empty() ? "an empty entry" : root,
                       " is not an absolute directory path"));
    }
    if (::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--data_root: ", root, " is not a directory this process can reach"));
    }
  }
  return absl::OkStatus();
}

namespace {

// A failed open's errno as ReadPath answers it; `shown` names the file.
absl::Status OpenError(int error, absl::string_view field, const std::string& shown) {
  if (error == ENOENT || error == ENOTDIR) {
    return absl::NotFoundError(absl::StrCat(field, ": no file ", shown));
  }
  if (error == ENAMETOOLONG) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": a name in it is too long"));
  }
  const std::string why = absl::StrCat(field, ": ", shown, ": ", std::strerror(error));
  return error == EACCES || error == EPERM || error == ELOOP ? absl::PermissionDeniedError(why)
                                                             : absl::UnavailableError(why);
}

// `relative` opened beneath `root` (ReadPath's rules); `shown` names it in errors.
absl::StatusOr<UniqueFd> OpenBeneath(const std::string& root, const std::string& relative,
                                     absl::string_view field, const std::string& shown,
                                     const std::string& allowed) {
  UniqueFd dir(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir.valid()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": --data_root ", root, " cannot be opened: ", std::strerror(errno)));
  }
  struct open_how how {};
  how.flags = O_RDONLY | O_NONBLOCK | O_CLOEXEC;  // a FIFO must not block the open
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  long fd = -1;
  for (int attempt = 0; attempt < 8; ++attempt) {  // EAGAIN: a rename raced the walk
    fd = ::syscall(SYS_openat2, dir.get(), relative.c_str(), &how, sizeof(how));
    if (fd >= 0 || (errno != EAGAIN && errno != EINTR)) break;
  }
  if (fd >= 0) return UniqueFd(static_cast<int>(fd));
  const int error = errno;
  if (error == EXDEV || error == ELOOP) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": ", shown, " leads out of ", allowed,
                     " (through .., or a symlink that is absolute or leaves it)"));
  }
  if (error == ENOSYS) {
    return absl::FailedPreconditionError(
        "--data_root needs openat2 (Linux 5.6 or later), which this kernel lacks");
  }
  return OpenError(error, field, shown);
}

// `requested` opened as given (no roots): the errors OpenBeneath gives.
absl::StatusOr<UniqueFd> OpenAnywhere(const std::string& requested, absl::string_view field) {
  UniqueFd fd(::open(requested.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC));
  if (fd.valid()) return fd;
  return OpenError(errno, field, requested);
}

// PERMISSION_DENIED when the open file `fd` lies in one of `excluded` (by the path the
// kernel resolved it to).
absl::Status NotExcluded(int fd, const std::vector<std::string>& excluded,
                         const std::string& requested, absl::string_view field) {
  if (excluded.empty()) return absl::OkStatus();
  char target[PATH_MAX + 1];
  const std::string link = absl::StrCat("/proc/self/fd/", fd);
  const ssize_t n = ::readlink(link.c_str(), target, PATH_MAX);
  if (n <= 0) return absl::UnavailableError(absl::StrCat(field, ": cannot resolve ", requested));
  const std::string resolved(target, static_cast<size_t>(n));
  for (const std::string& e : excluded) {
    char real[PATH_MAX + 1];
    if (::realpath(e.c_str(), real) == nullptr) continue;  // not there: nothing in it
    const std::string dir = real;
    if (dir == "/" || resolved == dir || absl::StartsWith(resolved, dir + "/")) {
      return absl::PermissionDeniedError(
          absl::StrCat(field, ": ", requested, " lies in ", e,
                       ", which this worker keeps from jobs (--data_exclude, its own --tls_dir)"));
    }
  }
  return absl::OkStatus();
}

// `requested` beneath one of `roots` (ReadPath's rules).
absl::StatusOr<UniqueFd> OpenUnderRoots(const std::string& requested,
                                        const std::vector<std::string>& roots,
                                        absl::string_view field) {
  const std::string allowed =
      absl::StrCat("this worker's --data_root (", absl::StrJoin(roots, ","), ")");
  // (depth, root, the path beneath it): a relative path under the first root; an absolute
  // one under every root it lies under, lexically, the deepest first.
  std::vector<std::tuple<size_t, const std::string*, std::string>> candidates;
  if (requested[0] != '/') {
    candidates.emplace_back(0, &roots[0], requested);
  } else {
    const std::vector<std::string> parts = Components(requested);
    for (const std::string& r : roots) {
      const std::vector<std::string> root_parts = Components(r);
      if (parts.size() > root_parts.size() &&
          std::equal(root_parts.begin(), root_parts.end(), parts.begin())) {
        candidates.emplace_back(
            root_parts.size(), &r,
            absl::StrJoin(parts.begin() + static_cast<long>(root_parts.size()), parts.end(), "/"));
      }
    }
    if (candidates.empty()) {
      return absl::PermissionDeniedError(
          absl::StrCat(field, ": ", requested, " is not beneath ", allowed));
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const auto& a, const auto& b) { return std::get<0>(a) > std::get<0>(b); });
  }
  absl::Status first;
  for (const auto& [depth, root, relative] : candidates) {
    absl::StatusOr<UniqueFd> fd = OpenBeneath(*root, relative, field, requested, allowed);
    if (fd.ok()) return fd;
    if (first.ok()) first = fd.status();
  }
  return first;
}

}  // namespace

absl::StatusOr<ReadPath> ReadPath::Open(const std::string& requested, const ReadRules& rules,
                                        absl::string_view field) {
  ReadPath out;
  out.path_ = out.requested_ = requested;
  if (rules.roots.empty() && rules.excluded.empty()) return out;
  if (requested.empty() || requested.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": not a file name"));
  }
  if (rules.roots.empty()) {
    ASSIGN_OR_RETURN(out.file_, OpenAnywhere(requested, field));
  } else {
    ASSIGN_OR_RETURN(out.file_, OpenUnderRoots(requested, rules.roots, field));
  }
  struct stat st;
  if (::fstat(out.file_.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": ", requested, " is not a regular file"));
  }
  RETURN_IF_ERROR(NotExcluded(out.file_.get(), rules.excluded, requested, field));
  out.path_ = absl::StrCat("/proc/self/fd/", out.file_.get());
  return out;
}

absl::Status ReadPath::Named(const absl::Status& status) const {
  if (status.ok() || path_ == requested_) return status;
  return absl::Status(status.code(), absl::StrReplaceAll(status.message(), {{path_, requested_}}));
}

}  // namespace pith
