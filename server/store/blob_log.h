// BlobLog: the append-only files under <store>/blobs that hold the RocksDB cold tier's
// blob bytes (DESIGN §4). It owns the files and their space accounting: appends (bytes
// are reserved under the lock and written without it), the versions each file holds,
// reads (pread, or in place through the file's mapping), punching out the unsynced bytes
// of dropped versions, the log's half of a sync point (fdatasync, the marker of which
// bytes are on disk, deleting emptied files), copy-forward of mostly-dead files, and the
// disposer thread that punches and closes files. It knows nothing of RocksDB: the tier
// keeps the index (which version is where) and writes the marker.
//
// Thread safety: thread-safe. Its mutex guards every file's accounting and is held across
// no I/O but a file's creation (and recovery's, before any other call); it comes after the
// tier's locks in the lock order, and the log never calls out while holding it
// (CopyForward's relocate runs without it). The disposer has its own lock. Once a write to
// the disk fails the log is stopped: it takes no more bytes, and the tier refuses
// everything else (Stopped()).
#ifndef PITH_SERVER_STORE_BLOB_LOG_H_
#define PITH_SERVER_STORE_BLOB_LOG_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "server/store/cold_tier.h"

namespace pith::store {

// Where one version's bytes are: a log file's number, and a range of it.
struct LogSpan {
  uint64_t file = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
};

// What bytes belong to: (encoded blob key, version).
using LogEntry = std::pair<std::string, int64_t>;

struct LogFile;  // one log file; its accounting is guarded by the log's mutex

// A file kept open, and its bytes out of reach of punches, while this lives.
struct LogPin {
  std::shared_ptr<LogFile> file;
  std::shared_ptr<void> hold;
};

// Bytes of a file nothing names any more, not yet on disk.
struct LogPunch {
  std::shared_ptr<LogFile> file;
  uint64_t from = 0, to = 0;
};

// The log's half of a sync point: the files written before it (with how many bytes of
// each it covers), the files emptied before it, whether a file was created.
struct LogSyncPoint {
  std::vector<std::pair<std::shared_ptr<LogFile>, uint64_t>> files;
  std::vector<std::shared_ptr<LogFile>> to_delete;
  bool sync_dir = false;
};

// The status for a failed system call on `path` (errno: ENOSPC is RESOURCE_EXHAUSTED).
absl::Status ErrnoError(absl::string_view what, const std::string& path);
absl::Status FsyncDir(const std::string& dir);

class BlobLog {
 public:
  struct Options {
    std::string dir;
    uint64_t file_bytes = 64ull << 20;  // a new file is started past this size
    // Start writeback every 256 KB of appends (when every commit syncs: otherwise most
    // bytes are dropped, and their files deleted, before a sync point would write them).
    bool writeback = false;
  };
  // Bytes written at the end of the open file; the file counts the writer until EndAppend.
  struct Appended {
    std::shared_ptr<LogFile> file;
    LogSpan span;
    absl::Status written;  // on failure the range is dead space
  };
  // How a span found at recovery stands against the files.
  enum class SpanState { kMissing, kUnsynced, kOnDisk };
  // Called by CopyForward for each live version it copied, without the log's lock: moves
  // the version from `from` to `to` (Unref, Ref) unless it was dropped or rewritten
  // meanwhile.
  using Relocate = std::function<void(const LogEntry&, const LogSpan& from, const LogSpan& to)>;

  explicit BlobLog(Options options);
  // Stops the disposer after it has punched and closed what it was given.
  ~BlobLog();
  BlobLog(const BlobLog&) = delete;
  BlobLog& operator=(const BlobLog&) = delete;

  // Recovery, before any other call: opens every log file in the directory (creating it)
  // and starts the disposer.
  absl::Status OpenFiles() ABSL_LOCKS_EXCLUDED(mu_);
  // Which bytes of each file the last sync point found on disk; without a marker, all.
  absl::Status SetSynced(const std::string* marker) ABSL_LOCKS_EXCLUDED(mu_);
  SpanState Check(const LogSpan& span) ABSL_LOCKS_EXCLUDED(mu_);
  // Deletes the files no version was found in; the others count as written since the
  // last sync point (what a crashed process left in the page cache).
  absl::Status DropUnused() ABSL_LOCKS_EXCLUDED(mu_);

  // Reserves `size` bytes at the end of the open file (a new one once it is full) and
  // writes them; fails with whatever stopped the log.
  absl::StatusOr<Appended> Append(const uint8_t* data, uint64_t size) ABSL_LOCKS_EXCLUDED(mu_);
  // After Append, once its bytes are Ref'd (or not): the file is dirty and may now be empty.
  void EndAppend(const Appended& a) ABSL_LOCKS_EXCLUDED(mu_);

  // Counts `entry` as living at `span` (LinkData: several entries share an offset).
  // NOT_FOUND when the file is gone. `shared` false: the bytes are the entry's alone and
  // never punched (a copy made by CopyForward).
  absl::Status Ref(const LogEntry& entry, const LogSpan& span, bool shared = true)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Takes `entry` out of its file's accounting; with `punches`, queues the unsynced part
  // of bytes no other entry shares and no read is using.
  void Unref(const LogEntry& entry, const LogSpan& span, std::vector<LogPunch>* punches = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Holds the file off punches and closing while the caller reads it.
  absl::StatusOr<LogPin> Pin(uint64_t file) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Read(const LogPin& pin, const LogSpan& span, absl::Span<uint8_t> out);
  // The bytes in place through the file's mapping (the page cache, no copy); the pin keeps
  // the file, and its mapping, after the file is deleted.
  absl::StatusOr<ColdRead> Map(LogPin pin, const LogSpan& span);

  // Copies the live versions of one mostly-dead file, closed for a while, into the open
  // one, calling `relocate` for each; the file goes once nothing is left in it. False when
  // no file qualified. `room` (disk pressure: the bytes the disk can still take above its
  // reserve): any closed file under half live whose live bytes fit in it, however young,
  // the one with the least live bytes first; with none, the open file under the same
  // rule once a quarter of a file's bytes in it are dead (it is closed for it).
  absl::StatusOr<bool> CopyForward(const Relocate& relocate,
                                   std::optional<uint64_t> room = std::nullopt)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A sync point: Take what it covers, Sync it (fdatasync; a failure stops the log),
  // Mark it synced (returns the marker to write), once the marker is durable Finish it
  // (deletes the emptied files), and always Dispose of it.
  LogSyncPoint TakeSyncPoint() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Sync(const LogSyncPoint& p);
  std::string MarkSynced(const LogSyncPoint& p) ABSL_LOCKS_EXCLUDED(mu_);
  void FinishSyncPoint(const LogSyncPoint& p) ABSL_LOCKS_EXCLUDED(mu_);
  void Dispose(LogSyncPoint p) ABSL_LOCKS_EXCLUDED(dispose_mu_);
  // Hands punches to the disposer (after the batch that dropped their bytes is written).
  void Dispose(std::vector<LogPunch> punches) ABSL_LOCKS_EXCLUDED(dispose_mu_);

  // Once `s` failed, every later call fails with it (returns what stopped the log).
  absl::Status Stop(absl::Status s) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Stopped() ABSL_LOCKS_EXCLUDED(mu_);
  // Every file's path, by number.
  std::vector<std::string> Paths() ABSL_LOCKS_EXCLUDED(mu_);
  const std::string& dir() const { return options_.dir; }

 private:
  absl::StatusOr<std::shared_ptr<LogFile>> OpenFileLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Under disk pressure (CopyForward's `room`) with no closed file to copy: the open file,
  // closed, when it is under half live with a quarter of a file's bytes dead and its live
  // bytes fit in `room` (a removed job's versions, synced, would otherwise hold the disk
  // until the file fills); else null.
  std::shared_ptr<LogFile> CloseMostlyDeadLocked(uint64_t room) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeEmptyLocked(LogFile& file) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Dispose(std::vector<LogPunch> punches, std::vector<std::shared_ptr<LogFile>> files)
      ABSL_LOCKS_EXCLUDED(dispose_mu_);
  void DisposeLoop() ABSL_LOCKS_EXCLUDED(dispose_mu_);

  const Options options_;
  absl::Mutex mu_;
  absl::Status failed_ ABSL_GUARDED_BY(mu_);  // set once a disk write fails
  std::map<uint64_t, std::shared_ptr<LogFile>> files_ ABSL_GUARDED_BY(mu_);  // emptied leave
  std::shared_ptr<LogFile> current_ ABSL_GUARDED_BY(mu_);                    // where new bytes go
  // Emptied files, deleted after the next sync point.
  std::vector<std::shared_ptr<LogFile>> empty_files_ ABSL_GUARDED_BY(mu_);
  uint64_t next_file_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t syncs_ ABSL_GUARDED_BY(mu_) = 0;      // sync points so far
  bool dir_dirty_ ABSL_GUARDED_BY(mu_) = false;  // a file was created since the last dir sync

  absl::Mutex dispose_mu_;
  absl::CondVar dispose_cv_;
  std::vector<LogPunch> dispose_punches_ ABSL_GUARDED_BY(dispose_mu_);
  std::vector<std::shared_ptr<LogFile>> dispose_files_ ABSL_GUARDED_BY(dispose_mu_);
  bool stop_disposer_ ABSL_GUARDED_BY(dispose_mu_) = false;
  std::thread disposer_;
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_BLOB_LOG_H_
