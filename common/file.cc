#include "common/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rename_onto.h"
#include "common/status.h"

namespace pith {
namespace {

absl::Status ErrnoError(int err, absl::string_view what, const std::string& path) {
  std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(msg);
    case ENOSPC:
    case EDQUOT:
      return DiskFullError(msg);
    default:
      return absl::InternalError(msg);
  }
}

}  // namespace

UniqueFd::UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status UniqueFd::Close() {
  if (fd_ < 0) return absl::OkStatus();
  int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) return absl::InternalError(absl::StrCat("close: ", std::strerror(errno)));
  return absl::OkStatus();
}

absl::StatusOr<Buffer> ReadFile(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoError(errno, "cannot open", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode))
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  ASSIGN_OR_RETURN(Buffer buffer,
                   Buffer::Allocate(static_cast<size_t>(st.st_size), Buffer::Init::kUninitialized));
  size_t done = 0;
  while (done < buffer.size()) {
    ssize_t n = ::read(fd.get(), buffer.data() + done, buffer.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot read", path);
    }
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, " shrank while being read"));
    }
    done += static_cast<size_t>(n);
  }
  return buffer;
}

absl::Status WriteAll(int fd, absl::Span<const uint8_t> bytes, const std::string& path_for_errors) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot write", path_for_errors);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status AppendToFile(const std::string& path, absl::string_view text) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoError(errno, "cannot open", path);
  return WriteAll(fd.get(), {reinterpret_cast<const uint8_t*>(text.data()), text.size()}, path);
}

absl::Status PwriteAll(int fd, absl::Span<const uint8_t> bytes, uint64_t offset,
                       const std::string& path_for_errors) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n =
        ::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "cannot write", path_for_errors);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PreadAll(int fd, absl::Span<uint8_t> bytes, uint64_t offset,
                      const std::string& path_for_errors) {
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n =
        ::pread(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "cannot read", path_for_errors);
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path_for_errors, ": ends at ", offset + done));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path,
                                 const std::function<absl::Status(int fd)>& fill, bool replace) {
  if (!RegularOrMissing(path.c_str())) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a regular file (a directory, a link or a device): not replaced"));
  }
  // One name per call: two writers of one path in a process must not share a temporary.
  static std::atomic<uint64_t> calls{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid(), ".", ++calls);
  ::unlink(tmp.c_str());  // a dead process's leftover (or a planted link: never followed)
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoError(errno, "cannot write", path);  // named as the caller did
  absl::Status status = fill(fd.get());
  if (status.ok() && ::fsync(fd.get()) != 0) status = ErrnoError(errno, "cannot fsync", tmp);
  if (status.ok()) status = Annotate(fd.Close(), tmp);
  if (status.ok()) {
    const int rc = RenameOnto(tmp.c_str(), path.c_str(), replace);
    if (rc != 0 && errno == EEXIST) {
      status = absl::AlreadyExistsError(
          absl::StrCat(path, " already exists; exports never replace a file"));
    } else if (rc != 0) {
      status = ErrnoError(errno, "cannot rename onto", path);
    }
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  return status;
}

uint64_t PhysicalMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page) : 0;
}

absl::StatusOr<uint64_t> FreeBytes(const std::string& path) {
  struct statvfs st;
  if (::statvfs(path.c_str(), &st) != 0)
    return ErrnoError(errno, "cannot stat the file system of", path);
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

absl::Status CheckDiskRoom(const std::string& dir, uint64_t reserve, uint64_t incoming) {
  ASSIGN_OR_RETURN(const uint64_t free, FreeBytes(dir));
  if (free >= reserve && free - reserve >= incoming) return absl::OkStatus();
  return DiskFullError(absl::StrCat(
      "the disk under ", dir, " is full: ", free, " bytes free",
      incoming > 0 ? absl::StrCat("; a write of ", incoming, " bytes would leave less than")
                   : std::string(", less than"),
      " the reserve of ", reserve,
      " bytes (--disk_reserve_bytes) that keeps its RocksDB writable; free space or move "
      "--data_dir to a larger disk"));
}

absl::Status CheckDiskReserve(uint64_t reserve) {
  if (reserve >= kMinDiskReserveBytes) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--disk_reserve_bytes=", reserve, " is under ", kMinDiskReserveBytes,
      ": RocksDB needs that much free disk to recover after a crash (it aborts without)"));
}

}  // namespace pith
