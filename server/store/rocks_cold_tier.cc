// The RocksDB cold tier, with its blob bytes kept beside the LSM tree (key-value
// separation, as RocksDB's own BlobDB does for large values). Key space (one column family):
//   'L' + blob key + big-endian version -> where its bytes are (log file, offset, size)
//   'D' + blob key + big-endian version -> blob bytes (stores written before the log)
//   'M' + blob key                      -> committed record (version, size, crc)
//   'J' + job id                        -> committed step
// The bytes go once, by a buffered pwrite, into append-only log files under <dir>/blobs
// (writeback starts in the background every 256 KB); the LSM tree holds only small
// entries, through the WAL. Two versions can name the same bytes (LinkData: fp32 weights
// and their master copy). Keeping ~70 MB of new versions a step inside the tree cost a
// memtable copy, a table file and compactions: four times the CPU and 2.4 times the disk
// writes of one log append (measured; the store shares the cores with the workers).
//
// Durability: a synced Apply first fdatasyncs the logs written since the last one, then
// writes itself through the WAL, synced. A version's location is written with the record
// that makes it committed (or, copied forward, renamed by the next synced Apply), so a
// location never reaches the disk before its bytes; a committed version's bytes never
// change. A crash loses only versions no synced batch has named: uncommitted ones, which
// a crashed step gives up anyway. A failed sync or batch write stops the tier (every later
// call fails) until a restart recovers from what the disk holds.
//
// Space: a log file is deleted once none of its versions is indexed, after the synced
// write that dropped the last one. A closed file whose live bytes fall under a quarter of
// it has them copied forward into the open one (at most one file per synced Apply), so a
// version that is never replaced pins no more than its own bytes for long.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status.h"
#include "glog/logging.h"
#include "rocksdb/db.h"
#include "rocksdb/table.h"
#include "rocksdb/utilities/checkpoint.h"
#include "rocksdb/write_batch.h"
#include "server/store/cold_tier.h"

namespace pith::store {
namespace {

constexpr uint64_t kWritebackBytes = 256ull << 10;  // start writeback every this many bytes
constexpr uint64_t kLegacyFile = 0;                 // bytes held in RocksDB ('D')
constexpr uint64_t kCopyForwardAge = 16;            // synced Applies a file stays closed first

std::string VersionedKey(char space, absl::string_view key, int64_t version) {
  std::string out(1, space);
  out.append(key.data(), key.size());
  for (int shift = 56; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(version) >> shift) & 0xff));
  }
  return out;
}
std::string DataKey(absl::string_view key, int64_t version) {
  return VersionedKey('D', key, version);
}
std::string LocationKey(absl::string_view key, int64_t version) {
  return VersionedKey('L', key, version);
}
std::string RecordKey(absl::string_view key) { return absl::StrCat("M", key); }
std::string JobKey(absl::string_view job) { return absl::StrCat("J", job); }

// Splits a versioned key's rest (after the space byte) into blob key and version.
bool SplitVersioned(absl::string_view rest, std::string* key, int64_t* version) {
  if (rest.size() < 8) return false;
  uint64_t v = 0;
  for (size_t i = rest.size() - 8; i < rest.size(); ++i)
    v = (v << 8) | static_cast<uint8_t>(rest[i]);
  *key = std::string(rest.substr(0, rest.size() - 8));
  *version = static_cast<int64_t>(v);
  return true;
}

std::string EncodeRecord(const BlobRecord& r) {
  std::string out(20, '\0');
  std::memcpy(out.data(), &r.version, 8);
  std::memcpy(out.data() + 8, &r.size, 8);
  std::memcpy(out.data() + 16, &r.crc, 4);
  return out;
}

absl::Status ToStatus(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat("rocksdb ", what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsNoSpace()) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

absl::Status Errno(absl::string_view what, const std::string& path) {
  const int e = errno;
  const std::string msg = absl::StrCat(what, " ", path, ": ", std::strerror(e));
  if (e == ENOSPC || e == EDQUOT) return absl::ResourceExhaustedError(msg);
  if (e == ENOENT) return absl::NotFoundError(msg);
  return absl::InternalError(msg);
}

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
  // Guarded by the tier's mu_:
  uint64_t end = 0;             // bytes reserved (written or being written)
  uint64_t live = 0;            // bytes of indexed versions
  int writers = 0;              // reservations still being written
  bool dirty = false;           // written since the last fdatasync
  uint64_t writeback_from = 0;  // first byte no writeback was started for
  uint64_t closed_at = 0;       // the tier's synced-Apply count when it stopped taking bytes
  std::set<std::pair<std::string, int64_t>> entries;  // indexed versions in it
  // A read-only mapping of the file's first map_length bytes (its capacity, past the
  // bytes written so far: only written ranges are ever touched), made on the first read.
  std::once_flag map_once;
  void* map = nullptr;
  uint64_t map_length = 0;
};

// Where one version's bytes are.
struct Location {
  uint64_t file = kLegacyFile;
  uint64_t offset = 0;
  uint64_t size = 0;
  bool persisted = false;  // its 'L' (or 'D') entry is in RocksDB (a record named it)
  bool moved = false;      // persisted, but RocksDB's entry names its place before a copy
};

std::string EncodeLocation(const Location& l) {
  std::string out(24, '\0');
  std::memcpy(out.data(), &l.file, 8);
  std::memcpy(out.data() + 8, &l.offset, 8);
  std::memcpy(out.data() + 16, &l.size, 8);
  return out;
}

absl::Status PwriteAll(int fd, const uint8_t* data, uint64_t size, uint64_t offset,
                       const std::string& path) {
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("write", path);
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
      return Errno("read", path);
    }
    if (n == 0) return absl::DataLossError(absl::StrCat("read ", path, ": file ends early"));
    out += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
  return absl::OkStatus();
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open", dir);
  const int rc = ::fsync(fd);
  const absl::Status s = rc == 0 ? absl::OkStatus() : Errno("fsync", dir);
  ::close(fd);
  return s;
}

class RocksColdTier final : public ColdTier {
 public:
  RocksColdTier(std::unique_ptr<rocksdb::DB> db, std::string log_dir, uint64_t log_file_bytes)
      : db_(std::move(db)), log_dir_(std::move(log_dir)), log_file_bytes_(log_file_bytes) {}

  // Opens the log files and indexes every location and legacy data entry. A location
  // whose bytes are missing is dropped unless a record names it (then: DATA_LOSS); files
  // nothing points into are deleted.
  absl::Status Recover() {
    std::error_code ec;
    std::filesystem::create_directories(log_dir_, ec);
    if (ec) return absl::InternalError(absl::StrCat("create ", log_dir_, ": ", ec.message()));
    for (const auto& entry : std::filesystem::directory_iterator(log_dir_, ec)) {
      const std::string name = entry.path().filename().string();
      uint64_t number = 0;
      if (!absl::EndsWith(name, ".log") ||
          !absl::SimpleAtoi(name.substr(0, name.size() - 4), &number) || number == kLegacyFile) {
        continue;
      }
      const std::string path = entry.path().string();
      const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return Errno("open", path);
      auto file = std::make_shared<LogFile>(number, path, fd);
      struct stat st;
      if (::fstat(fd, &st) != 0) return Errno("stat", path);
      file->end = file->writeback_from = static_cast<uint64_t>(st.st_size);
      files_[number] = file;
      next_file_ = std::max(next_file_, number + 1);
    }
    if (ec) return absl::InternalError(absl::StrCat("list ", log_dir_, ": ", ec.message()));

    rocksdb::WriteBatch dangling;
    rocksdb::ReadOptions options;
    options.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(options));
    for (it->Seek("D"); it->Valid() && it->key()[0] == 'D'; it->Next()) {
      std::string key;
      int64_t version;
      if (!SplitVersioned(Rest(it->key()), &key, &version)) {
        return absl::DataLossError("rocksdb: short data key");
      }
      index_[{key, version}] = Location{kLegacyFile, 0, it->value().size(), true};
    }
    for (it->Seek("L"); it->Valid() && it->key()[0] == 'L'; it->Next()) {
      std::string key;
      int64_t version;
      if (!SplitVersioned(Rest(it->key()), &key, &version) || it->value().size() != 24) {
        return absl::DataLossError("rocksdb: bad location entry");
      }
      Location l;
      std::memcpy(&l.file, it->value().data(), 8);
      std::memcpy(&l.offset, it->value().data() + 8, 8);
      std::memcpy(&l.size, it->value().data() + 16, 8);
      l.persisted = true;
      auto f = files_.find(l.file);
      if (f == files_.end() || l.offset + l.size > f->second->end) {
        std::string record;
        if (db_->Get(rocksdb::ReadOptions(), RecordKey(key), &record).ok() && record.size() == 20 &&
            std::memcmp(record.data(), &version, 8) == 0) {
          return absl::DataLossError(absl::StrCat("committed version ", version,
                                                  " of a blob names log file ", l.file,
                                                  " bytes it does not have"));
        }
        dangling.Delete(it->key());  // a dropped version: nothing names it
        continue;
      }
      f->second->live += l.size;
      f->second->entries.insert({key, version});
      index_[{key, version}] = l;
    }
    if (!it->status().ok()) return ToStatus(it->status(), "scan");
    if (dangling.Count() > 0) {
      rocksdb::WriteOptions sync;
      sync.sync = true;
      RETURN_IF_ERROR(ToStatus(db_->Write(sync, &dangling), "write batch"));
    }
    for (auto f = files_.begin(); f != files_.end();) {
      if (f->second->entries.empty()) {
        if (::unlink(f->second->path.c_str()) != 0) return Errno("unlink", f->second->path);
        f = files_.erase(f);
      } else {
        f->second->closed_at = 0;
        ++f;
      }
    }
    return absl::OkStatus();
  }

  absl::Status PutData(absl::string_view key, int64_t version,
                       absl::Span<const uint8_t> bytes) override {
    ASSIGN_OR_RETURN(Appended a, Append(bytes.data(), bytes.size()));
    const std::shared_ptr<LogFile>& file = a.file;
    uint64_t writeback_from = 0, writeback_to = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (a.written.ok()) {
        IndexLocked({std::string(key), version}, Location{file->number, a.offset, bytes.size()},
                    *file);
      }
      EndAppendLocked(*file);
      if (file->end - file->writeback_from >= kWritebackBytes) {
        writeback_from = file->writeback_from;
        writeback_to = file->writeback_from = file->end;
      }
    }
    if (writeback_to > writeback_from) {
      // Starts writing the bytes back now, so the next sync waits for less. Best effort.
      (void)::sync_file_range(file->fd, static_cast<off_t>(writeback_from),
                              static_cast<off_t>(writeback_to - writeback_from),
                              SYNC_FILE_RANGE_WRITE);
    }
    return a.written;
  }

  // Another location entry for the same bytes: the file stays while either is indexed.
  absl::Status LinkData(absl::string_view key, int64_t version, absl::string_view source_key,
                        int64_t source_version, uint64_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    RETURN_IF_ERROR(failed_);
    auto src = index_.find({std::string(source_key), source_version});
    if (src == index_.end() || src->second.file == kLegacyFile || src->second.size != size) {
      return absl::NotFoundError("no such blob version in a log file to share");
    }
    auto f = files_.find(src->second.file);
    if (f == files_.end()) return absl::NotFoundError("the log file is gone");
    IndexLocked({std::string(key), version},
                Location{src->second.file, src->second.offset, src->second.size}, *f->second);
    return absl::OkStatus();
  }

  absl::Status ReadData(absl::string_view key, int64_t version, absl::Span<uint8_t> out) override {
    std::shared_ptr<LogFile> file;
    Location l;
    ASSIGN_OR_RETURN(bool legacy, Find(key, version, &file, &l));
    if (l.size != out.size()) {
      return absl::DataLossError(
          absl::StrCat("cold tier blob has ", l.size, " bytes, want ", out.size()));
    }
    if (!legacy) return PreadAll(file->fd, out.data(), out.size(), l.offset, file->path);
    ASSIGN_OR_RETURN(ColdRead read, ReadLegacy(key, version));
    if (read.size != out.size()) {
      return absl::DataLossError(
          absl::StrCat("rocksdb blob has ", read.size, " bytes, want ", out.size()));
    }
    std::memcpy(out.data(), read.data, out.size());
    return absl::OkStatus();
  }

  // The bytes in place through the file's mapping (the page cache, no copy); the pin
  // keeps the file, and its mapping, after the file is deleted.
  absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) override {
    std::shared_ptr<LogFile> file;
    Location l;
    ASSIGN_OR_RETURN(bool legacy, Find(key, version, &file, &l));
    if (legacy) return ReadLegacy(key, version);
    if (l.size == 0) return ColdRead{nullptr, 0, nullptr};
    std::call_once(file->map_once, [&] {
      const uint64_t length = std::max(log_file_bytes_, l.offset + l.size);
      void* mapped = ::mmap(nullptr, length, PROT_READ, MAP_SHARED, file->fd, 0);
      if (mapped == MAP_FAILED) return;  // each read maps its own range instead
      file->map = mapped;
      file->map_length = length;
    });
    if (file->map != nullptr && l.offset + l.size <= file->map_length) {
      const uint8_t* data = static_cast<const uint8_t*>(file->map) + l.offset;
      return ColdRead{data, l.size, std::move(file)};
    }
    // Past the capacity (one blob larger than the rest of the file): its own mapping.
    static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t start = l.offset / page * page;
    const uint64_t length = l.offset + l.size - start;
    void* mapped =
        ::mmap(nullptr, length, PROT_READ, MAP_SHARED, file->fd, static_cast<off_t>(start));
    if (mapped == MAP_FAILED) return Errno("map", file->path);
    std::shared_ptr<void> pin(mapped, [length](void* p) { ::munmap(p, length); });
    return ColdRead{static_cast<const uint8_t*>(mapped) + (l.offset - start), l.size,
                    std::move(pin)};
  }

  absl::Status Apply(const ColdBatch& batch, bool sync) override {
    for (const auto& p : batch.put_data) RETURN_IF_ERROR(PutData(p.key, p.version, p.bytes));
    // One batch at a time: a location written by one must not land after another's
    // delete of it, and a synced one must not overtake another's sync still running.
    std::lock_guard<std::mutex> apply_lock(apply_mu_);
    rocksdb::WriteBatch wb;
    {
      std::lock_guard<std::mutex> lock(mu_);
      RETURN_IF_ERROR(failed_);
      for (const auto& r : batch.set_records) {
        wb.Put(RecordKey(r.key), EncodeRecord(r.record));
        auto it = index_.find({r.key, r.record.version});
        if (it != index_.end()) NameLocked(it->first, it->second, &wb);
      }
      for (const auto& k : batch.delete_records) wb.Delete(RecordKey(k));
      for (const auto& d : batch.delete_data) {
        auto it = index_.find({d.key, d.version});
        if (it == index_.end()) continue;
        if (it->second.persisted) {
          wb.Delete(it->second.file == kLegacyFile ? DataKey(d.key, d.version)
                                                   : LocationKey(d.key, d.version));
        }
        ReleaseLocked(it->first, it->second);
        index_.erase(it);
      }
      for (const auto& [job, step] : batch.set_job_steps) {
        wb.Put(JobKey(job), rocksdb::Slice(reinterpret_cast<const char*>(&step), 8));
      }
      for (const auto& job : batch.delete_job_steps) wb.Delete(JobKey(job));
    }
    RETURN_IF_ERROR(WriteNamed(&wb, sync));
    if (sync) {
      // Best effort: the batch is durable whatever happens here.
      if (absl::Status s = CopyForward(); !s.ok()) LOG(WARNING) << "cold tier: " << s;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ColdContents> Load() override {
    ColdContents out;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->Seek("J"); it->Valid() && it->key()[0] == 'J'; it->Next()) {
      if (it->value().size() != 8) return absl::DataLossError("rocksdb: bad job record");
      int64_t step;
      std::memcpy(&step, it->value().data(), 8);
      out.job_steps[std::string(Rest(it->key()))] = step;
    }
    for (it->Seek("M"); it->Valid() && it->key()[0] == 'M'; it->Next()) {
      if (it->value().size() != 20) return absl::DataLossError("rocksdb: bad blob record");
      BlobRecord r;
      std::memcpy(&r.version, it->value().data(), 8);
      std::memcpy(&r.size, it->value().data() + 8, 8);
      std::memcpy(&r.crc, it->value().data() + 16, 4);
      out.records[std::string(Rest(it->key()))] = r;
    }
    if (!it->status().ok()) return ToStatus(it->status(), "scan");
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [kv, l] : index_) out.data.push_back({kv.first, kv.second});
    return out;
  }

  absl::Status Checkpoint(const std::string& dir_in) override {
    std::string dir = dir_in;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    std::lock_guard<std::mutex> apply_lock(apply_mu_);  // no file is deleted meanwhile
    rocksdb::Checkpoint* raw = nullptr;
    rocksdb::Status s = rocksdb::Checkpoint::Create(db_.get(), &raw);
    if (!s.ok()) return ToStatus(s, "checkpoint");
    std::unique_ptr<rocksdb::Checkpoint> checkpoint(raw);
    // The logs first (every location on disk names bytes already synced), then the tree.
    std::vector<std::string> paths;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [number, file] : files_) paths.push_back(file->path);
    }
    const std::string staging = dir + ".blobs";
    std::error_code ec;
    std::filesystem::remove_all(staging, ec);
    if (!std::filesystem::create_directories(staging, ec) || ec) {
      return absl::InternalError(absl::StrCat("create ", staging, ": ", ec.message()));
    }
    absl::Status done = LinkAndCheckpoint(*checkpoint, paths, staging, dir);
    if (!done.ok()) std::filesystem::remove_all(staging, ec);  // its links pin deleted logs
    return done;
  }

  // Checkpoint's second half: the logs into `staging`, the tree into `dir`, then the logs
  // into `dir`/blobs.
  absl::Status LinkAndCheckpoint(rocksdb::Checkpoint& checkpoint,
                                 const std::vector<std::string>& paths, const std::string& staging,
                                 const std::string& dir) {
    std::error_code ec;
    for (const std::string& path : paths) {
      const std::string to = staging + "/" + std::filesystem::path(path).filename().string();
      if (::link(path.c_str(), to.c_str()) != 0) {
        std::filesystem::copy_file(path, to, ec);
        if (ec) return absl::InternalError(absl::StrCat("copy ", path, ": ", ec.message()));
        const int fd = ::open(to.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) return Errno("open", to);
        const int rc = ::fdatasync(fd);
        ::close(fd);
        if (rc != 0) return Errno("sync", to);
      }
    }
    RETURN_IF_ERROR(FsyncDir(staging));
    RETURN_IF_ERROR(ToStatus(checkpoint.CreateCheckpoint(dir), "checkpoint"));
    std::filesystem::rename(staging, dir + "/blobs", ec);
    if (ec) return absl::InternalError(absl::StrCat("checkpoint logs: ", ec.message()));
    return FsyncDir(dir);
  }

  uint64_t BackgroundJobs() override {
    uint64_t total = 0;
    for (const std::string& property : {rocksdb::DB::Properties::kNumRunningFlushes,
                                        rocksdb::DB::Properties::kNumRunningCompactions,
                                        rocksdb::DB::Properties::kMemTableFlushPending,
                                        rocksdb::DB::Properties::kCompactionPending}) {
      uint64_t value = 0;
      if (db_->GetIntProperty(property, &value)) total += value;
    }
    return total;
  }

 private:
  using IndexKey = std::pair<std::string, int64_t>;

  static absl::string_view Rest(const rocksdb::Slice& k) {
    return absl::string_view(k.data() + 1, k.size() - 1);
  }

  // Bytes written at the end of the open log file: the range is reserved under mu_ and
  // written without it; the file counts the caller as a writer until EndAppendLocked.
  struct Appended {
    std::shared_ptr<LogFile> file;
    uint64_t offset = 0;
    absl::Status written;  // on failure the range is dead space
  };
  absl::StatusOr<Appended> Append(const uint8_t* data, uint64_t size) {
    Appended a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      RETURN_IF_ERROR(failed_);
      ASSIGN_OR_RETURN(a.file, OpenFileLocked());
      a.offset = a.file->end;
      a.file->end += size;
      ++a.file->writers;
    }
    a.written = PwriteAll(a.file->fd, data, size, a.offset, a.file->path);
    return a;
  }
  // After Append, once its bytes are indexed (or not): the file is dirty and may now be
  // empty.
  void EndAppendLocked(LogFile& file) {
    file.dirty = true;
    --file.writers;
    MaybeEmptyLocked(file);
  }

  // The file new bytes go to: the last one, or a new one once it is full.
  absl::StatusOr<std::shared_ptr<LogFile>> OpenFileLocked() {
    if (current_ != nullptr && current_->end < log_file_bytes_) return current_;
    const uint64_t number = next_file_++;
    const std::string path = absl::StrFormat("%s/%08d.log", log_dir_, number);
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) return Errno("create", path);
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

  // Indexes freshly written bytes of (key, version) in `file` (whose writers count
  // includes the caller). A committed version's bytes never change: a second write of
  // one (a stale retry, or a copy of what the store has) leaves dead space only.
  void IndexLocked(const IndexKey& key, const Location& l, LogFile& file) {
    auto [it, inserted] = index_.try_emplace(key, l);
    if (!inserted) {
      if (it->second.persisted) return;
      ReleaseLocked(it->first, it->second);
      it->second = l;
    }
    file.live += l.size;
    file.entries.insert(it->first);
  }

  // Takes a version's bytes out of its file's accounting.
  void ReleaseLocked(const IndexKey& key, const Location& l) {
    if (l.file == kLegacyFile) return;
    auto f = files_.find(l.file);
    if (f == files_.end()) return;
    LogFile& file = *f->second;
    file.live -= l.size;
    file.entries.erase(key);
    MaybeEmptyLocked(file);
  }

  // A closed file nothing points into is deleted after the next synced write.
  void MaybeEmptyLocked(LogFile& file) {
    if (&file == current_.get() || file.writers > 0 || !file.entries.empty()) return;
    auto f = files_.find(file.number);
    if (f == files_.end()) return;
    empty_files_.push_back(f->second);
    files_.erase(f);
  }

  // Adds the location to `wb` unless RocksDB has it already.
  void NameLocked(const IndexKey& key, Location& l, rocksdb::WriteBatch* wb) {
    if (l.persisted && !l.moved) return;
    wb->Put(LocationKey(key.first, key.second), EncodeLocation(l));
    l.persisted = true;
    l.moved = false;
  }

  // Under apply_mu_: writes `wb`, with the locations of versions copied forward. A synced
  // write first fdatasyncs the logs (so no location reaches the disk before its bytes),
  // then deletes the files emptied before it. A failed sync or write stops the tier: what
  // the kernel or RocksDB holds is then unknown, and a restart recovers from the disk.
  absl::Status WriteNamed(rocksdb::WriteBatch* wb, bool sync) {
    std::vector<std::shared_ptr<LogFile>> to_sync, to_delete;
    bool sync_dir = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      RETURN_IF_ERROR(failed_);
      // Only a synced write names copies: their bytes are synced first.
      for (const IndexKey& key : sync ? moved_ : std::vector<IndexKey>{}) {
        auto it = index_.find(key);
        if (it != index_.end()) NameLocked(it->first, it->second, wb);
      }
      if (sync) moved_.clear();
      if (sync) {
        for (auto& [number, file] : files_) {
          if (file->dirty) to_sync.push_back(file);
          file->dirty = false;
        }
        sync_dir = std::exchange(dir_dirty_, false);
        to_delete.swap(empty_files_);  // emptied before this write, which covers their drops
      }
    }
    absl::Status s;
    for (const auto& file : to_sync) {
      if (::fdatasync(file->fd) != 0) {
        s = Errno("sync", file->path);
        break;
      }
    }
    if (s.ok() && sync_dir) s = FsyncDir(log_dir_);
    if (s.ok()) {
      rocksdb::WriteOptions options;
      options.sync = sync;
      s = ToStatus(db_->Write(options, wb), "write batch");
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok()) {
      failed_ = absl::Status(s.code(), absl::StrCat("cold tier stopped after: ", s.message()));
      LOG(ERROR) << failed_;
      return failed_;
    }
    if (!sync) return absl::OkStatus();
    ++syncs_;
    for (auto& file : to_delete) (void)::unlink(file->path.c_str());
    return absl::OkStatus();
  }

  absl::StatusOr<bool> Find(absl::string_view key, int64_t version, std::shared_ptr<LogFile>* file,
                            Location* l) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find({std::string(key), version});
    if (it == index_.end()) {
      return absl::NotFoundError(
          absl::StrCat("cold tier has no version ", version, " of the blob"));
    }
    *l = it->second;
    if (l->file == kLegacyFile) return true;
    auto f = files_.find(l->file);
    if (f == files_.end()) {
      return absl::DataLossError(absl::StrCat("log file ", l->file, " is gone"));
    }
    *file = f->second;
    return false;
  }

  // Bytes written before the log, in RocksDB: read in place through an iterator (whose
  // value points into the mapped block as long as the iterator lives).
  absl::StatusOr<ColdRead> ReadLegacy(absl::string_view key, int64_t version) {
    const std::string data_key = DataKey(key, version);
    struct Pin {  // the bound outlives the iterator that points at it
      std::string upper_key;
      rocksdb::Slice upper;
      std::unique_ptr<rocksdb::Iterator> it;
    };
    auto pin = std::make_shared<Pin>();
    pin->upper_key = DataKey(key, static_cast<int64_t>(static_cast<uint64_t>(version) + 1));
    pin->upper = rocksdb::Slice(pin->upper_key);
    rocksdb::ReadOptions options;
    options.fill_cache = false;
    options.iterate_upper_bound = &pin->upper;
    pin->it.reset(db_->NewIterator(options));
    pin->it->Seek(data_key);
    if (!pin->it->Valid() || pin->it->key() != rocksdb::Slice(data_key)) {
      if (!pin->it->status().ok()) return ToStatus(pin->it->status(), "get");
      return absl::NotFoundError(absl::StrCat("rocksdb has no version ", version, " of the blob"));
    }
    const rocksdb::Slice value = pin->it->value();
    return ColdRead{reinterpret_cast<const uint8_t*>(value.data()), value.size(), pin};
  }

  // Under apply_mu_: copies the live versions of one mostly-dead file, closed for a while,
  // into the open one and names the copies durably; the file goes with that write.
  absl::Status CopyForward() {
    std::shared_ptr<LogFile> victim;
    std::vector<std::pair<IndexKey, Location>> moving;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [number, file] : files_) {
        // Only a file closed for a while: versions of recent steps go away by themselves.
        if (file == current_ || file->writers > 0 || file->live * 4 >= file->end ||
            syncs_ - file->closed_at < kCopyForwardAge) {
          continue;
        }
        victim = file;
        break;
      }
      if (victim == nullptr) return absl::OkStatus();
      for (const IndexKey& key : victim->entries) moving.emplace_back(key, index_.at(key));
      ++victim->writers;  // stays while its bytes are read
    }
    std::vector<uint8_t> buffer;
    absl::Status s;
    for (auto& [key, from] : moving) {
      buffer.resize(from.size);
      s = PreadAll(victim->fd, buffer.data(), from.size, from.offset, victim->path);
      if (!s.ok()) break;
      absl::StatusOr<Appended> a = Append(buffer.data(), from.size);
      if (!a.ok()) {
        s = a.status();
        break;
      }
      const std::shared_ptr<LogFile>& file = a->file;
      const uint64_t offset = a->offset;
      s = a->written;
      std::lock_guard<std::mutex> lock(mu_);
      auto it = index_.find(key);
      if (s.ok() && it != index_.end() && it->second.file == from.file &&
          it->second.offset == from.offset) {
        const bool persisted = it->second.persisted;
        ReleaseLocked(it->first, it->second);
        // Still committed (its bytes never change); RocksDB names the old place until the
        // next synced write names the new one, before the old file can go.
        it->second = Location{file->number, offset, from.size, persisted, persisted};
        file->live += from.size;
        file->entries.insert(it->first);
        if (persisted) moved_.push_back(it->first);
      }  // else dropped or written again meanwhile: the copy is dead space
      EndAppendLocked(*file);
      if (!s.ok()) break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --victim->writers;
      MaybeEmptyLocked(*victim);
    }
    RETURN_IF_ERROR(s);
    rocksdb::WriteBatch wb;
    return WriteNamed(&wb, /*sync=*/true);
  }

  const std::unique_ptr<rocksdb::DB> db_;
  const std::string log_dir_;
  const uint64_t log_file_bytes_;
  std::mutex apply_mu_;  // held by Apply and Checkpoint: one RocksDB batch at a time
  std::mutex mu_;        // guards what follows; held across no I/O but a log file's creation
  absl::Status failed_;  // set once a sync or batch write fails: the tier refuses all else
  std::map<IndexKey, Location> index_;
  std::map<uint64_t, std::shared_ptr<LogFile>> files_;  // by number; emptied ones leave
  std::shared_ptr<LogFile> current_;                    // where new bytes go
  std::vector<std::shared_ptr<LogFile>> empty_files_;   // to delete after the next sync
  std::vector<IndexKey> moved_;  // copied forward while RocksDB names the old place
  uint64_t next_file_ = 1;
  uint64_t syncs_ = 0;      // synced writes so far
  bool dir_dirty_ = false;  // a log file was created since the last directory sync
};

}  // namespace

absl::StatusOr<std::unique_ptr<ColdTier>> OpenRocksColdTier(const std::string& dir,
                                                            uint64_t log_file_bytes) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.compression = rocksdb::kNoCompression;
  options.IncreaseParallelism(2);
  // Only small entries live in the tree (and blobs of stores written before the log).
  options.write_buffer_size = 32 << 20;
  options.allow_mmap_reads = true;
  rocksdb::BlockBasedTableOptions table;
  table.index_type = rocksdb::BlockBasedTableOptions::kBinarySearchWithFirstKey;
  // XXH3 block checksums: this RocksDB build's CRC32C is table-driven. (Each table file
  // records its own type.)
  table.checksum = rocksdb::kXXH3;
  options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &raw);
  if (!s.ok()) return ToStatus(s, absl::StrCat("open ", dir));
  auto tier = std::make_unique<RocksColdTier>(std::unique_ptr<rocksdb::DB>(raw), dir + "/blobs",
                                              log_file_bytes);
  RETURN_IF_ERROR(tier->Recover());
  return std::unique_ptr<ColdTier>(std::move(tier));
}

}  // namespace pith::store
