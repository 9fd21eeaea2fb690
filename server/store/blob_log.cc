#include "server/store/blob_log.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pith::store {

// One append-only file of blob bytes. Owns its descriptor; mappings of it outlive it.
struct LogFile {
  LogFile(uint64_t n, std::string p, int f) : number(n), path(std::move(p)), fd(f) {}
  ~LogFile() {
    if (map != nullptr) ::munmap(map, map_length);
    ::close(fd);
  }
  LogFile(const LogFile&) = delete;
  LogFile& operator=(const LogFile&) = delete;

  const uint64_t number;
  const std::string path;
  const int fd;
  // Guarded by the log's mu_:
  uint64_t end = 0;                     // bytes reserved (written or being written)
  uint64_t live = 0;                    // bytes of indexed versions
  int writers = 0;                      // reservations still being written
  std::multiset<uint64_t> writing;      // their offsets
  bool dirty = false;                   // written since the last fdatasync
  uint64_t synced = 0;                  // bytes known to be on disk (the last sync marker's)
  std::map<uint64_t, int> refs;         // offset -> indexed versions there (LinkData shares bytes)
  std::atomic<int> pins{0};             // reads of its bytes in progress (also without mu_)
  uint64_t writeback_from = 0;          // first byte no writeback was started for
  uint64_t closed_at = 0;               // the log's sync count when it stopped taking bytes
  std::map<LogEntry, LogSpan> entries;  // indexed versions in it
  // A read-only mapping of the file's first map_length bytes (its capacity, past the
  // bytes written so far: only written ranges are ever touched), made on the first read.
  std::once_flag map_once;
  void* map = nullptr;
  uint64_t map_length = 0;
};

namespace {

constexpr uint64_t kWritebackBytes = 256ull << 10;  // start writeback every this many bytes
constexpr uint64_t kCopyForwardAge = 16;            // sync points a file stays closed first

absl::Status PwriteAll(int fd, const uint8_t* data, uint64_t size, uint64_t offset,
                       const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("write", path);
    }
    data += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status PreadAll(int fd, uint8_t* out, uint64_t size, uint64_t offset,
                      const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::pread(fd, out, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("read", path);
    }
    if (n == 0) return absl::DataLossError(absl::StrCat("read ", path, ": file ends early"));
    out += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

// After the batch that dropped them is written: a file that stays keeps no dirty pages
// of them for the next sync point to write. Best effort (a file system without holes
// writes them). A punch that runs after a sync point covered its bytes is harmless: that
// sync point made the batch that dropped them durable too.
void PunchDead(const std::vector<LogPunch>& punches) {
  for (const LogPunch& p : punches) {
    (void)::fallocate(p.file->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(p.from), static_cast<off_t>(p.to - p.from));
  }
}

}  // namespace

absl::Status ErrnoError(absl::string_view what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOSPC || e == EDQUOT) return DiskFullError(msg);
  if (e == ENOENT) return absl::NotFoundError(msg);
  return absl::InternalError(msg);
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError("open", dir);
  const int rc = ::fsync(fd);
  const absl::Status s = rc == 0 ? absl::OkStatus() : ErrnoError("fsync", dir);
  ::close(fd);
  return s;
}

BlobLog::BlobLog(Options options) : options_(std::move(options)) {}

BlobLog::~BlobLog() {
  if (!disposer_.joinable()) return;
  {
    absl::MutexLock lock(&dispose_mu_);
    stop_disposer_ = true;
  }
  dispose_cv_.SignalAll();
  disposer_.join();  // after it has punched and closed what it was given
}

absl::Status BlobLog::OpenFiles() {
  const std::string& dir = options_.dir;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", dir, ": ", ec.message()));
  absl::MutexLock lock(&mu_);
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t number = 0;
    if (!absl::EndsWith(name, ".log") ||
        !absl::SimpleAtoi(name.substr(0, name.size() - 4), &number) || number == 0) {
      continue;
    }
    const std::string path = entry.path().string();
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return ErrnoError("open", path);
    auto file = std::make_shared<LogFile>(number, path, fd);
    struct stat st;
    if (::fstat(fd, &st) != 0) return ErrnoError("stat", path);
    file->end = file->writeback_from = static_cast<uint64_t>(st.st_size);
    files_[number] = file;
    next_file_ = std::max(next_file_, number + 1);
  }
  if (ec) return absl::InternalError(absl::StrCat("list ", dir, ": ", ec.message()));
  disposer_ = std::thread([this] { DisposeLoop(); });
  return absl::OkStatus();
}

absl::Status BlobLog::SetSynced(const std::string* marker) {
  absl::MutexLock lock(&mu_);
  if (marker == nullptr) {
    for (auto& [number, file] : files_) file->synced = file->end;
    return absl::OkStatus();
  }
  if (marker->size() % 16 != 0) return absl::DataLossError("rocksdb: bad sync marker");
  for (size_t i = 0; i < marker->size(); i += 16) {
    uint64_t number, bytes;
    std::memcpy(&number, marker->data() + i, 8);
    std::memcpy(&bytes, marker->data() + i + 8, 8);
    if (auto f = files_.find(number); f != files_.end()) f->second->synced = bytes;
  }
  return absl::OkStatus();
}

BlobLog::SpanState BlobLog::Check(const LogSpan& span) {
  absl::MutexLock lock(&mu_);
  auto f = files_.find(span.file);
  if (f == files_.end() || span.offset + span.size > f->second->end) return SpanState::kMissing;
  if (span.offset + span.size > f->second->synced) return SpanState::kUnsynced;
  return SpanState::kOnDisk;
}

absl::Status BlobLog::DropUnused() {
  absl::MutexLock lock(&mu_);
  for (auto f = files_.begin(); f != files_.end();) {
    if (f->second->entries.empty()) {
      if (::unlink(f->second->path.c_str()) != 0) return ErrnoError("unlink", f->second->path);
      f = files_.erase(f);
    } else {
      f->second->closed_at = 0;
      f->second->dirty = true;  // what a crashed process left in the page cache
      ++f;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<BlobLog::Appended> BlobLog::Append(const uint8_t* data, uint64_t size) {
  Appended a;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(failed_);
    ASSIGN_OR_RETURN(a.file, OpenFileLocked());
    a.span = LogSpan{a.file->number, a.file->end, size};
    a.file->end += size;
    ++a.file->writers;
    a.file->writing.insert(a.span.offset);
  }
  a.written = PwriteAll(a.file->fd, data, size, a.span.offset, a.file->path);
  return a;
}

void BlobLog::EndAppend(const Appended& a) {
  LogFile& file = *a.file;
  uint64_t writeback_from = 0, writeback_to = 0;
  {
    absl::MutexLock lock(&mu_);
    file.dirty = true;
    --file.writers;
    file.writing.erase(file.writing.find(a.span.offset));
    MaybeEmptyLocked(file);
    if (options_.writeback && file.end - file.writeback_from >= kWritebackBytes) {
      writeback_from = file.writeback_from;
      writeback_to = file.writeback_from = file.end;
    }
  }
  if (writeback_to > writeback_from) {
    // Starts writing the bytes back now, so the next sync waits for less. Best effort.
    (void)::sync_file_range(file.fd, static_cast<off_t>(writeback_from),
                            static_cast<off_t>(writeback_to - writeback_from),
                            SYNC_FILE_RANGE_WRITE);
  }
}

// The file new bytes go to: the last one, or a new one once it is full.
absl::StatusOr<std::shared_ptr<LogFile>> BlobLog::OpenFileLocked() {
  if (current_ != nullptr && current_->end < options_.file_bytes) return current_;
  const uint64_t number = next_file_++;
  const std::string path = absl::StrFormat("%s/%08d.log", options_.dir, number);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError("create", path);
  std::shared_ptr<LogFile> closed =
      std::exchange(current_, std::make_shared<LogFile>(number, path, fd));
  files_[number] = current_;
  dir_dirty_ = true;
  if (closed != nullptr) {
    closed->closed_at = syncs_;
    MaybeEmptyLocked(*closed);
  }
  return current_;
}

std::shared_ptr<LogFile> BlobLog::CloseMostlyDeadLocked(uint64_t room) {
  const std::shared_ptr<LogFile> open = current_;
  if (open == nullptr || open->writers > 0 || open->live * 2 >= open->end ||
      open->end - open->live < options_.file_bytes / 4 || open->live > room) {
    return nullptr;
  }
  current_ = nullptr;  // the next append opens a new file
  open->closed_at = syncs_;
  return open;
}

// A closed file nothing points into is deleted after the next sync point.
void BlobLog::MaybeEmptyLocked(LogFile& file) {
  if (&file == current_.get() || file.writers > 0 || !file.entries.empty()) return;
  auto f = files_.find(file.number);
  if (f == files_.end()) return;
  empty_files_.push_back(f->second);
  files_.erase(f);
}

absl::Status BlobLog::Ref(const LogEntry& entry, const LogSpan& span, bool shared) {
  absl::MutexLock lock(&mu_);
  auto f = files_.find(span.file);
  if (f == files_.end()) return absl::NotFoundError("the log file is gone");
  LogFile& file = *f->second;
  file.live += span.size;
  file.entries[entry] = span;
  if (shared) ++file.refs[span.offset];
  return absl::OkStatus();
}

void BlobLog::Unref(const LogEntry& entry, const LogSpan& span, std::vector<LogPunch>* punches) {
  absl::MutexLock lock(&mu_);
  auto f = files_.find(span.file);
  if (f == files_.end()) return;
  LogFile& file = *f->second;
  file.live -= span.size;
  file.entries.erase(entry);
  auto ref = file.refs.find(span.offset);
  if (ref != file.refs.end() && --ref->second == 0) {
    file.refs.erase(ref);
    if (punches != nullptr && span.offset + span.size > file.synced && file.pins.load() == 0) {
      punches->push_back({f->second, std::max(span.offset, file.synced), span.offset + span.size});
    }
  }
  MaybeEmptyLocked(file);
}

absl::StatusOr<LogPin> BlobLog::Pin(uint64_t number) {
  absl::MutexLock lock(&mu_);
  auto f = files_.find(number);
  if (f == files_.end()) return absl::DataLossError(absl::StrCat("log file ", number, " is gone"));
  ++f->second->pins;
  LogFile* raw = f->second.get();
  return LogPin{f->second, std::shared_ptr<void>(raw, [keep = f->second](void*) { --keep->pins; })};
}

absl::Status BlobLog::Read(const LogPin& pin, const LogSpan& span, absl::Span<uint8_t> out) {
  return PreadAll(pin.file->fd, out.data(), out.size(), span.offset, pin.file->path);
}

absl::StatusOr<ColdRead> BlobLog::Map(LogPin pin, const LogSpan& l) {
  if (l.size == 0) return ColdRead{nullptr, 0, nullptr};
  LogFile& file = *pin.file;
  std::call_once(file.map_once, [&] {
    const uint64_t length = std::max(options_.file_bytes, l.offset + l.size);
    void* mapped = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, file.fd, 0);
    if (mapped == MAP_FAILED) return;  // each read maps its own range instead
    file.map = mapped;
    file.map_length = length;
  });
  if (file.map != nullptr && l.offset + l.size <= file.map_length) {
    const uint8_t* data = static_cast<const uint8_t*>(file.map) + l.offset;
    return ColdRead{data, l.size, std::move(pin.hold)};  // it keeps the file too
  }
  // Past the capacity (one blob larger than the rest of the file): its own mapping.
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t start = l.offset / page * page;
  const uint64_t length = l.offset + l.size - start;
  void* mapped = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, file.fd, static_cast<off_t>(start));
  if (mapped == MAP_FAILED) return ErrnoError("map", file.path);
  std::shared_ptr<void> mapping(mapped,
                                [length, hold = pin.hold](void* p) { ::munmap(p, length); });
  return ColdRead{static_cast<const uint8_t*>(mapped) + (l.offset - start), l.size,
                  std::move(mapping)};
}

absl::StatusOr<bool> BlobLog::CopyForward(const Relocate& relocate, std::optional<uint64_t> room) {
  std::shared_ptr<LogFile> victim;
  std::vector<std::pair<LogEntry, LogSpan>> moving;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [number, file] : files_) {
      if (file == current_ || file->writers > 0 || file->live * 2 >= file->end) continue;
      if (room.has_value()) {  // a full disk: the cheapest copy that frees the most
        if (file->live <= *room && (victim == nullptr || file->live < victim->live)) {
          victim = file;
        }
        continue;
      }
      // Only a file closed for a while: versions of recent steps go away by themselves.
      if (syncs_ - file->closed_at < kCopyForwardAge) continue;
      victim = file;
      break;
    }
    if (victim == nullptr && room.has_value()) victim = CloseMostlyDeadLocked(*room);
    if (victim == nullptr) return false;
    moving.assign(victim->entries.begin(), victim->entries.end());
    ++victim->writers;  // stays while its bytes are read
  }
  std::vector<uint8_t> buffer;
  absl::Status s;
  for (const auto& [entry, from] : moving) {
    buffer.resize(from.size);
    s = PreadAll(victim->fd, buffer.data(), from.size, from.offset, victim->path);
    if (!s.ok()) break;
    absl::StatusOr<Appended> a = Append(buffer.data(), from.size);
    if (!a.ok()) {
      s = a.status();
      break;
    }
    s = a->written;
    if (s.ok()) relocate(entry, from, a->span);  // else the copy is dead space
    EndAppend(*a);
    if (!s.ok()) break;
  }
  {
    absl::MutexLock lock(&mu_);
    --victim->writers;
    MaybeEmptyLocked(*victim);
  }
  RETURN_IF_ERROR(s);
  return true;
}

LogSyncPoint BlobLog::TakeSyncPoint() {
  LogSyncPoint p;
  absl::MutexLock lock(&mu_);
  for (auto& [number, file] : files_) {
    if (!file->dirty) continue;
    // Bytes still being written are not covered; everything before them is.
    p.files.emplace_back(file, file->writing.empty() ? file->end : *file->writing.begin());
    file->dirty = false;  // writes still in flight set it again when they end
  }
  p.to_delete.swap(empty_files_);
  p.sync_dir = std::exchange(dir_dirty_, false);
  return p;
}

absl::Status BlobLog::Sync(const LogSyncPoint& p) {
  for (const auto& [file, bytes] : p.files) {
    if (::fdatasync(file->fd) != 0) return Stop(ErrnoError("sync", file->path));
  }
  if (p.sync_dir) return Stop(FsyncDir(options_.dir));
  return absl::OkStatus();
}

std::string BlobLog::MarkSynced(const LogSyncPoint& p) {
  absl::MutexLock lock(&mu_);
  for (const auto& [file, bytes] : p.files) file->synced = std::max(file->synced, bytes);
  std::string marker;
  for (const auto& [number, file] : files_) {
    marker.append(reinterpret_cast<const char*>(&number), 8);
    marker.append(reinterpret_cast<const char*>(&file->synced), 8);
  }
  return marker;
}

void BlobLog::FinishSyncPoint(const LogSyncPoint& p) {
  absl::MutexLock lock(&mu_);
  ++syncs_;
  for (auto& file : p.to_delete) (void)::unlink(file->path.c_str());
}

void BlobLog::Dispose(LogSyncPoint p) {
  std::vector<std::shared_ptr<LogFile>> files = std::move(p.to_delete);
  for (auto& synced : p.files) files.push_back(std::move(synced.first));
  Dispose({}, std::move(files));
}

void BlobLog::Dispose(std::vector<LogPunch> punches) { Dispose(std::move(punches), {}); }

// Hands punches and log files (deleted ones close when their last reference goes) to
// the disposer thread. On a file system mounted with `discard`, freeing blocks waits
// for the device (ext4 discards them before the punch or the close of a deleted file
// returns: tens of ms a file), and neither a commit nor the group sync waits with it.
void BlobLog::Dispose(std::vector<LogPunch> punches, std::vector<std::shared_ptr<LogFile>> files) {
  if (punches.empty() && files.empty()) return;
  {
    absl::MutexLock lock(&dispose_mu_);
    for (LogPunch& p : punches) dispose_punches_.push_back(std::move(p));
    for (auto& f : files) dispose_files_.push_back(std::move(f));
  }
  dispose_cv_.Signal();
}

void BlobLog::DisposeLoop() {
  while (true) {
    std::vector<LogPunch> punches;  // the last references close their files out of the lock
    std::vector<std::shared_ptr<LogFile>> files;
    {
      absl::MutexLock lock(&dispose_mu_);
      while (!stop_disposer_ && dispose_punches_.empty() && dispose_files_.empty()) {
        dispose_cv_.Wait(&dispose_mu_);
      }
      if (dispose_punches_.empty() && dispose_files_.empty()) return;  // stopped, all done
      punches = std::exchange(dispose_punches_, {});
      files = std::exchange(dispose_files_, {});
    }
    PunchDead(punches);
  }
}

absl::Status BlobLog::Stop(absl::Status s) {
  if (s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (failed_.ok()) {
    failed_ = absl::Status(s.code(), absl::StrCat("cold tier stopped after: ", s.message()));
    LOG(ERROR) << failed_;
  }
  return failed_;
}

absl::Status BlobLog::Stopped() {
  absl::MutexLock lock(&mu_);
  return failed_;
}

std::vector<std::string> BlobLog::Paths() {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> paths;
  for (const auto& [number, file] : files_) paths.push_back(file->path);
  return paths;
}

}  // namespace pith::store
