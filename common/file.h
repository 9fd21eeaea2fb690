// Whole-file reads and atomic, durable writes with RAII file descriptors.
//
// Thread safety: free functions on independent files; safe from any thread.
#ifndef PITH_COMMON_FILE_H_
#define PITH_COMMON_FILE_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/buffer.h"

namespace pith {

// An open file descriptor, closed on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept;
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes now, reporting the error close(2) returns (for written files it matters).
  absl::Status Close();

 private:
  int fd_ = -1;
};

// The whole file in an aligned buffer. NOT_FOUND when it does not exist.
absl::StatusOr<Buffer> ReadFile(const std::string& path);

// Writes all of `bytes` to `fd`, retrying short writes.
absl::Status WriteAll(int fd, absl::Span<const uint8_t> bytes, const std::string& path_for_errors);
// Appends `text` to the file at `path` (created 0644 when missing).
absl::Status AppendToFile(const std::string& path, absl::string_view text);

// Writes all of `bytes` at `offset` of `fd` / reads `bytes.size()` bytes from there
// (DATA_LOSS at the end of the file), retrying short transfers.
absl::Status PwriteAll(int fd, absl::Span<const uint8_t> bytes, uint64_t offset,
                       const std::string& path_for_errors);
absl::Status PreadAll(int fd, absl::Span<uint8_t> bytes, uint64_t offset,
                      const std::string& path_for_errors);

// The machine's physical memory in bytes; 0 when the system does not say.
uint64_t PhysicalMemoryBytes();
// Bytes an unprivileged writer may still write to the file system holding `path`.
absl::StatusOr<uint64_t> FreeBytes(const std::string& path);
// OK when the file system holding `dir` keeps `reserve` bytes free after `incoming` more;
// otherwise RESOURCE_EXHAUSTED saying how full it is and what the reserve is for.
absl::Status CheckDiskRoom(const std::string& dir, uint64_t reserve, uint64_t incoming);
// The least --disk_reserve_bytes a process with a RocksDB takes (Debian's RocksDB aborts
// when it recovers onto a full disk); CheckDiskReserve: INVALID_ARGUMENT under it.
inline constexpr uint64_t kMinDiskReserveBytes = 4ull << 20;
absl::Status CheckDiskReserve(uint64_t reserve);

// Creates `path` atomically: `fill` writes the content to a temporary file beside it
// (created new, never through a symlink), which is fsynced and renamed over `path`; with
// `replace` false an existing `path` is left alone (ALREADY_EXISTS, renameat2's
// RENAME_NOREPLACE). FAILED_PRECONDITION when `path` is there and not a regular file (a
// directory, a symlink, a device: renaming would replace it). On any error `path` is left
// as it was.
absl::Status WriteFileAtomically(const std::string& path,
                                 const std::function<absl::Status(int fd)>& fill,
                                 bool replace = true);

}  // namespace pith

#endif  // PITH_COMMON_FILE_H_
