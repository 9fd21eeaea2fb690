// The RocksDB cold tier, with its blob bytes kept beside the LSM tree (key-value
// separation, as RocksDB's own BlobDB does for large values). Key space (one column family):
//   'L' + blob key + big-endian version -> where its bytes are (log file, offset, size)
//   'M' + blob key                      -> committed record (version, size, crc)
//   'J' + job id                        -> committed step
// The bytes go once, by a buffered pwrite, into append-only log files under <dir>/blobs
// (writeback starts in the background every 256 KB); the LSM tree holds only small
// entries, through the WAL. Two versions can name the same bytes (LinkData: fp32 weights
// and their master copy). Keeping ~70 MB of new versions a step inside the tree cost a
// memtable copy, a table file and compactions: four times the CPU and 2.4 times the disk
// writes of one log append (measured; the store shares the cores with the workers).
//
// Durability: every batch goes through the WAL before Apply returns, and every log byte
// is in the kernel's page cache before the batch that names it: a process crash (kill -9)
// loses nothing a batch named. A sync point fdatasyncs the logs written since the last
// one, then writes a marker (which log bytes are on disk) through the WAL, synced. With a
// zero sync interval every synced Apply is a sync point before it returns; otherwise a
// group sync runs in the background within the interval of a synced Apply (one fdatasync
// of a step's bytes costs about what the step's compute does on a VM's disk, and a version
// replaced before the next sync point never goes to disk at all: its file is gone by then).
// A machine that stops between sync points may lose the bytes of committed versions whose
// records reached the disk: the restart checks every committed version past the marker
// against its CRC and refuses to start (DATA_LOSS, one line saying what to do) rather
// than serve them. A version's location is written with the record that makes it
// committed (or, copied forward, renamed by the next sync point); a committed version's
// bytes never change. Log files are deleted only after a sync point covers the batch
// that emptied them; the unsynced bytes of a version dropped before then are punched out
// of its file (nothing names them), so the sync point does not write them either. The
// punches and the closing of deleted log files run on a disposer thread: on a file system
// mounted with `discard` both wait for the device. A failed sync or batch write stops the
// tier (every later call fails) until a restart recovers from what the disk holds.
//
// Space: a log file is deleted once none of its versions is indexed, after the synced
// write that dropped the last one. A closed file whose live bytes fall under a quarter of
// it has them copied forward into the open one (at most one file per synced Apply), so a
// version that is never replaced pins no more than its own bytes for long.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/crc32c.h"
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
constexpr uint64_t kCopyForwardAge = 16;            // synced Applies a file stays closed first

std::string VersionedKey(char space, absl::string_view key, int64_t version) {
  std::string out(1, space);
  out.append(key.data(), key.size());
  for (int shift = 56; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(version) >> shift) & 0xff));
  }
  return out;
}
std::string LocationKey(absl::string_view key, int64_t version) {
  return VersionedKey('L', key, version);
}
std::string RecordKey(absl::string_view key) { return absl::StrCat("M", key); }
std::string JobKey(absl::string_view job) { return absl::StrCat("J", job); }
// The sync marker: (log file number, bytes of it on disk) pairs, 16 bytes each.
constexpr char kSyncedKey[] = "S";

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

// A record's 20 bytes; nullopt when they are not 20.
std::optional<BlobRecord> DecodeRecord(absl::string_view in) {
  if (in.size() != 20) return std::nullopt;
  BlobRecord r;
  std::memcpy(&r.version, in.data(), 8);
  std::memcpy(&r.size, in.data() + 8, 8);
  std::memcpy(&r.crc, in.data() + 16, 4);
  return r;
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
  uint64_t end = 0;                 // bytes reserved (written or being written)
  uint64_t live = 0;                // bytes of indexed versions
  int writers = 0;                  // reservations still being written
  std::multiset<uint64_t> writing;  // their offsets
  bool dirty = false;               // written since the last fdatasync
  uint64_t synced = 0;              // bytes known to be on disk (the last sync marker's)
  std::map<uint64_t, int> refs;     // offset -> indexed versions there (LinkData shares bytes)
  std::atomic<int> pins{0};         // reads of its bytes in progress (also without mu_)
  uint64_t writeback_from = 0;      // first byte no writeback was started for
  uint64_t closed_at = 0;           // the tier's synced-Apply count when it stopped taking bytes
  std::set<std::pair<std::string, int64_t>> entries;  // indexed versions in it
  // A read-only mapping of the file's first map_length bytes (its capacity, past the
  // bytes written so far: only written ranges are ever touched), made on the first read.
  std::once_flag map_once;
  void* map = nullptr;
  uint64_t map_length = 0;
};

// Where one version's bytes are.
struct Location {
  uint64_t file = 0;
  uint64_t offset = 0;
  uint64_t size = 0;
  bool persisted = false;  // its 'L' entry is in RocksDB (a record named it)
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
  RocksColdTier(std::unique_ptr<rocksdb::DB> db, std::string log_dir,
                const RocksColdTierOptions& options)
      : db_(std::move(db)),
        log_dir_(std::move(log_dir)),
        log_file_bytes_(options.log_file_bytes),
        sync_interval_(absl::ToChronoMilliseconds(options.sync_interval)) {}

  // A clean stop leaves nothing to check at the next start: one last sync point.
  ~RocksColdTier() override {
    if (syncer_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(sync_mu_);
        stop_syncer_ = true;
      }
      sync_cv_.notify_all();
      syncer_.join();
    }
    if (recovered_) {  // else what the disk holds stays as it was found
      std::lock_guard<std::mutex> apply_lock(apply_mu_);
      rocksdb::WriteBatch wb;
      if (absl::Status s = SyncPointLocked(&wb); !s.ok()) LOG(WARNING) << "cold tier: " << s;
    }
    if (disposer_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(dispose_mu_);
        stop_disposer_ = true;
      }
      dispose_cv_.notify_all();
      disposer_.join();  // after it has punched and closed what it was given
    }
  }

  // A zero sync interval: every synced Apply is a sync point before it returns.
  bool EveryCommitSynced() const { return sync_interval_.count() == 0; }

  // Starts the disposer and the group sync thread (a nonzero sync interval).
  void StartThreads() {
    disposer_ = std::thread([this] { DisposeLoop(); });
    if (!EveryCommitSynced()) syncer_ = std::thread([this] { SyncLoop(); });
  }

  // Opens the log files and indexes every location. A location
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
          !absl::SimpleAtoi(name.substr(0, name.size() - 4), &number) || number == 0) {
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

    // What the last sync point found on disk. No marker: the store was written by a
    // build that synced every commit, so all of it is.
    std::string marker;
    const rocksdb::Status got = db_->Get(rocksdb::ReadOptions(), kSyncedKey, &marker);
    if (!got.ok() && !got.IsNotFound()) return ToStatus(got, "get");
    const bool check_unsynced = got.ok();
    if (marker.size() % 16 != 0) return absl::DataLossError("rocksdb: bad sync marker");
    for (size_t i = 0; i < marker.size(); i += 16) {
      uint64_t number, bytes;
      std::memcpy(&number, marker.data() + i, 8);
      std::memcpy(&bytes, marker.data() + i + 8, 8);
      if (auto f = files_.find(number); f != files_.end()) f->second->synced = bytes;
    }
    if (!check_unsynced) {
      for (auto& [number, file] : files_) file->synced = file->end;
    }

    rocksdb::WriteBatch dangling;
    rocksdb::ReadOptions options;
    options.fill_cache = false;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(options));
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
      // The record naming this version as committed, if one does (looked up only where
      // the bytes are missing or past the last sync point).
      const auto committed = [&]() -> std::optional<BlobRecord> {
        std::string value;
        if (!db_->Get(rocksdb::ReadOptions(), RecordKey(key), &value).ok()) return std::nullopt;
        std::optional<BlobRecord> r = DecodeRecord(value);
        if (!r || r->version != version) return std::nullopt;
        return r;
      };
      if (f == files_.end() || l.offset + l.size > f->second->end) {
        if (committed()) {
          return absl::DataLossError(absl::StrCat("committed version ", version, " of blob ",
                                                  absl::CHexEscape(key), " names log file ", l.file,
                                                  " bytes it does not have", LostSyncAdvice()));
        }
        dangling.Delete(it->key());  // a dropped version: nothing names it
        continue;
      }
      if (l.offset + l.size > f->second->synced) {
        // Past the last sync point: in the page cache after a process crash, maybe not
        // on disk after the machine stopped.
        if (std::optional<BlobRecord> r = committed()) {
          RETURN_IF_ERROR(VerifyUnsynced(*f->second, l, key, *r));
        }
      }
      f->second->live += l.size;
      f->second->entries.insert({key, version});
      ++f->second->refs[l.offset];
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
        f->second->dirty = true;  // what a crashed process left in the page cache
        ++f;
      }
    }
    // Everything found is on disk before the store takes new writes.
    std::lock_guard<std::mutex> apply_lock(apply_mu_);
    rocksdb::WriteBatch wb;
    RETURN_IF_ERROR(SyncPointLocked(&wb));
    recovered_ = true;
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
      EndAppendLocked(*file, a.offset);
      // Only when every commit syncs: otherwise most versions are replaced, and their
      // files deleted, before a sync point would write them.
      if (EveryCommitSynced() && file->end - file->writeback_from >= kWritebackBytes) {
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
    if (src == index_.end() || src->second.size != size) {
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
    std::shared_ptr<void> pin;
    RETURN_IF_ERROR(Find(key, version, &file, &l, &pin));
    if (l.size != out.size()) {
      return absl::DataLossError(
          absl::StrCat("cold tier blob has ", l.size, " bytes, want ", out.size()));
    }
    return PreadAll(file->fd, out.data(), out.size(), l.offset, file->path);
  }

  // The bytes in place through the file's mapping (the page cache, no copy); the pin
  // keeps the file, and its mapping, after the file is deleted.
  absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) override {
    std::shared_ptr<LogFile> file;
    Location l;
    std::shared_ptr<void> pin;
    RETURN_IF_ERROR(Find(key, version, &file, &l, &pin));
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
      return ColdRead{data, l.size, std::move(pin)};  // it keeps the file too
    }
    // Past the capacity (one blob larger than the rest of the file): its own mapping.
    static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t start = l.offset / page * page;
    const uint64_t length = l.offset + l.size - start;
    void* mapped =
        ::mmap(nullptr, length, PROT_READ, MAP_SHARED, file->fd, static_cast<off_t>(start));
    if (mapped == MAP_FAILED) return Errno("map", file->path);
    std::shared_ptr<void> mapping(mapped, [length, pin](void* p) { ::munmap(p, length); });
    return ColdRead{static_cast<const uint8_t*>(mapped) + (l.offset - start), l.size,
                    std::move(mapping)};
  }

  absl::Status Apply(const ColdBatch& batch, bool sync) override {
    for (const auto& p : batch.put_data) RETURN_IF_ERROR(PutData(p.key, p.version, p.bytes));
    // One batch at a time: a location written by one must not land after another's
    // delete of it, and a synced one must not overtake another's sync still running.
    std::lock_guard<std::mutex> apply_lock(apply_mu_);
    rocksdb::WriteBatch wb;
    std::vector<Punch> punches;
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
        if (it->second.persisted) wb.Delete(LocationKey(d.key, d.version));
        ReleaseLocked(it->first, it->second, &punches);
        index_.erase(it);
      }
      for (const auto& [job, step] : batch.set_job_steps) {
        wb.Put(JobKey(job), rocksdb::Slice(reinterpret_cast<const char*>(&step), 8));
      }
      for (const auto& job : batch.delete_job_steps) wb.Delete(JobKey(job));
    }
    RETURN_IF_ERROR(WriteNamed(&wb, sync));
    Dispose(std::move(punches), {});
    if (sync && EveryCommitSynced()) {
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
      std::optional<BlobRecord> r =
          DecodeRecord(absl::string_view(it->value().data(), it->value().size()));
      if (!r) return absl::DataLossError("rocksdb: bad blob record");
      out.records[std::string(Rest(it->key()))] = *r;
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
    {
      rocksdb::WriteBatch wb;  // every log byte the tree names is on disk
      RETURN_IF_ERROR(SyncPointLocked(&wb));
    }
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
      a.file->writing.insert(a.offset);
    }
    a.written = PwriteAll(a.file->fd, data, size, a.offset, a.file->path);
    return a;
  }
  // After Append, once its bytes are indexed (or not): the file is dirty and may now be
  // empty.
  void EndAppendLocked(LogFile& file, uint64_t offset) {
    file.dirty = true;
    --file.writers;
    file.writing.erase(file.writing.find(offset));
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
    ++file.refs[l.offset];
  }

  // Bytes of a file nothing names any more, not yet on disk.
  struct Punch {
    std::shared_ptr<LogFile> file;
    uint64_t from = 0, to = 0;
  };
  // Takes a version's bytes out of its file's accounting; with `punches`, queues the
  // unsynced part of bytes no other version shares and no read is using.
  void ReleaseLocked(const IndexKey& key, const Location& l,
                     std::vector<Punch>* punches = nullptr) {
    auto f = files_.find(l.file);
    if (f == files_.end()) return;
    LogFile& file = *f->second;
    file.live -= l.size;
    file.entries.erase(key);
    auto ref = file.refs.find(l.offset);
    if (ref != file.refs.end() && --ref->second == 0) {
      file.refs.erase(ref);
      if (punches != nullptr && l.offset + l.size > file.synced && file.pins.load() == 0) {
        punches->push_back({f->second, std::max(l.offset, file.synced), l.offset + l.size});
      }
    }
    MaybeEmptyLocked(file);
  }

  // After the batch that dropped them is written: a file that stays keeps no dirty pages
  // of them for the next sync point to write. Best effort (a file system without holes
  // writes them). A punch that runs after a sync point covered its bytes is harmless: that
  // sync point made the batch that dropped them durable too.
  static void PunchDead(const std::vector<Punch>& punches) {
    for (const Punch& p : punches) {
      (void)::fallocate(p.file->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                        static_cast<off_t>(p.from), static_cast<off_t>(p.to - p.from));
    }
  }

  // Hands punches and log files (deleted ones close when their last reference goes) to
  // the disposer thread. On a file system mounted with `discard`, freeing blocks waits
  // for the device (ext4 discards them before the punch or the close of a deleted file
  // returns: tens of ms a file), and neither a commit (under apply_mu_) nor the group
  // sync waits with it.
  void Dispose(std::vector<Punch> punches, std::vector<std::shared_ptr<LogFile>> files) {
    if (punches.empty() && files.empty()) return;
    {
      std::lock_guard<std::mutex> lock(dispose_mu_);
      for (Punch& p : punches) dispose_punches_.push_back(std::move(p));
      for (auto& f : files) dispose_files_.push_back(std::move(f));
    }
    dispose_cv_.notify_one();
  }
  void DisposeLoop() {
    std::unique_lock<std::mutex> lock(dispose_mu_);
    while (true) {
      dispose_cv_.wait(lock, [&] {
        return stop_disposer_ || !dispose_punches_.empty() || !dispose_files_.empty();
      });
      if (dispose_punches_.empty() && dispose_files_.empty()) return;  // stopped, all done
      std::vector<Punch> punches = std::exchange(dispose_punches_, {});
      std::vector<std::shared_ptr<LogFile>> files = std::exchange(dispose_files_, {});
      lock.unlock();
      PunchDead(punches);
      punches.clear();  // the last references close their files here
      files.clear();
      lock.lock();
    }
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

  // Under apply_mu_: writes `wb`. A synced write is a sync point when the sync interval is
  // zero; otherwise it is written like any other (the process may die, the kernel keeps
  // it) and the group sync covers it within the interval.
  absl::Status WriteNamed(rocksdb::WriteBatch* wb, bool sync) {
    if (sync && EveryCommitSynced()) return SyncPointLocked(wb);
    RETURN_IF_ERROR(WriteLocked(wb, /*sync=*/false));
    if (sync) {
      {
        std::lock_guard<std::mutex> lock(sync_mu_);
        sync_due_ = true;
      }
      sync_cv_.notify_all();
    }
    return absl::OkStatus();
  }

  // Writes `wb` through the WAL. A failed write stops the tier: what RocksDB holds is then
  // unknown, and a restart recovers from the disk.
  absl::Status WriteLocked(rocksdb::WriteBatch* wb, bool sync) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      RETURN_IF_ERROR(failed_);
    }
    rocksdb::WriteOptions options;
    options.sync = sync;
    return Stop(ToStatus(db_->Write(options, wb), "write batch"));
  }

  // Once `s` failed, every later call fails with it.
  absl::Status Stop(absl::Status s) {
    if (s.ok()) return s;
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_.ok()) {
      failed_ = absl::Status(s.code(), absl::StrCat("cold tier stopped after: ", s.message()));
      LOG(ERROR) << failed_;
    }
    return failed_;
  }

  // What a sync point covers: the logs written before it, the copies made before it, the
  // files emptied before it.
  struct SyncPoint {
    std::vector<std::pair<std::shared_ptr<LogFile>, uint64_t>> files;  // to sync, safe bytes
    std::vector<IndexKey> moved;
    std::vector<std::shared_ptr<LogFile>> to_delete;
    bool sync_dir = false;
  };
  // Gives every log file of `p` to the disposer.
  void Dispose(SyncPoint& p) {
    std::vector<std::shared_ptr<LogFile>> files = std::move(p.to_delete);
    for (auto& synced : p.files) files.push_back(std::move(synced.first));
    p = SyncPoint();
    Dispose({}, std::move(files));
  }
  // Under apply_mu_ (no batch is half applied).
  SyncPoint TakeSyncPointLocked() {
    SyncPoint p;
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [number, file] : files_) {
      if (!file->dirty) continue;
      // Bytes still being written are not covered; everything before them is.
      p.files.emplace_back(file, file->writing.empty() ? file->end : *file->writing.begin());
      file->dirty = false;  // writes still in flight set it again when they end
    }
    p.moved.swap(moved_);
    p.to_delete.swap(empty_files_);
    p.sync_dir = std::exchange(dir_dirty_, false);
    return p;
  }
  // The fdatasyncs, with or without apply_mu_.
  absl::Status SyncFiles(const SyncPoint& p) {
    for (const auto& [file, bytes] : p.files) {
      if (::fdatasync(file->fd) != 0) return Stop(Errno("sync", file->path));
    }
    if (p.sync_dir) return Stop(FsyncDir(log_dir_));
    return absl::OkStatus();
  }
  // Under apply_mu_, after SyncFiles(p): names p's copies, writes the marker with `wb`
  // through the WAL, synced (so every earlier batch is on disk too), then deletes p's
  // emptied files.
  absl::Status FinishSyncPointLocked(SyncPoint& p, rocksdb::WriteBatch* wb) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [file, bytes] : p.files) file->synced = std::max(file->synced, bytes);
      for (const IndexKey& key : p.moved) {
        auto it = index_.find(key);
        if (it != index_.end()) NameLocked(it->first, it->second, wb);
      }
      std::string marker;
      for (const auto& [number, file] : files_) {
        marker.append(reinterpret_cast<const char*>(&number), 8);
        marker.append(reinterpret_cast<const char*>(&file->synced), 8);
      }
      wb->Put(kSyncedKey, marker);
    }
    RETURN_IF_ERROR(WriteLocked(wb, /*sync=*/true));
    std::lock_guard<std::mutex> lock(mu_);
    ++syncs_;
    for (auto& file : p.to_delete) (void)::unlink(file->path.c_str());
    return absl::OkStatus();
  }
  // A whole sync point under apply_mu_.
  absl::Status SyncPointLocked(rocksdb::WriteBatch* wb) {
    SyncPoint p = TakeSyncPointLocked();
    absl::Status s = SyncFiles(p);
    if (s.ok()) s = FinishSyncPointLocked(p, wb);
    Dispose(p);
    return s;
  }

  // The group sync: every sync interval in which a synced Apply came, one sync point
  // (with the copy-forward), its fdatasyncs outside apply_mu_ so commits go on meanwhile.
  void SyncLoop() {
    std::unique_lock<std::mutex> lock(sync_mu_);
    auto last = std::chrono::steady_clock::now();
    while (!stop_syncer_) {
      sync_cv_.wait(lock, [&] { return stop_syncer_ || sync_due_; });
      sync_cv_.wait_until(lock, last + sync_interval_, [&] { return stop_syncer_; });
      if (stop_syncer_) break;
      sync_due_ = false;
      lock.unlock();
      SyncPoint p;
      {
        std::lock_guard<std::mutex> apply_lock(apply_mu_);
        if (absl::Status c = CopyForward(); !c.ok()) LOG(WARNING) << "cold tier: " << c;
        p = TakeSyncPointLocked();
      }
      absl::Status s = SyncFiles(p);
      if (s.ok()) {
        std::lock_guard<std::mutex> apply_lock(apply_mu_);
        rocksdb::WriteBatch wb;
        s = FinishSyncPointLocked(p, &wb);
      }
      if (!s.ok()) LOG(ERROR) << "cold tier group sync: " << s;
      Dispose(p);
      lock.lock();
      last = std::chrono::steady_clock::now();
    }
  }

  // At start: a committed version past the last sync point must have its bytes.
  absl::Status VerifyUnsynced(LogFile& file, const Location& l, const std::string& key,
                              const BlobRecord& record) {
    std::vector<uint8_t> bytes(l.size);
    RETURN_IF_ERROR(PreadAll(file.fd, bytes.data(), l.size, l.offset, file.path));
    if (Crc32c(bytes.data(), bytes.size()) == record.crc) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat("committed version ", record.version, " of blob ",
                                            absl::CHexEscape(key), " in log file ", file.number,
                                            " fails its checksum", LostSyncAdvice()));
  }
  static std::string LostSyncAdvice() {
    return ": the machine stopped before the store's last sync point reached the disk "
           "(--sync_interval_ms); start this store with an empty --data_dir and the "
           "coordinator copies its groups back from their replicas";
  }

  // Where (key, version) is. `pin` holds off punches of the file's bytes while the caller
  // reads them.
  absl::Status Find(absl::string_view key, int64_t version, std::shared_ptr<LogFile>* file,
                    Location* l, std::shared_ptr<void>* pin) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find({std::string(key), version});
    if (it == index_.end()) {
      return absl::NotFoundError(
          absl::StrCat("cold tier has no version ", version, " of the blob"));
    }
    *l = it->second;
    auto f = files_.find(l->file);
    if (f == files_.end()) {
      return absl::DataLossError(absl::StrCat("log file ", l->file, " is gone"));
    }
    *file = f->second;
    ++f->second->pins;
    LogFile* raw = f->second.get();
    *pin = std::shared_ptr<void>(raw, [keep = f->second](void*) { --keep->pins; });
    return absl::OkStatus();
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
      EndAppendLocked(*file, offset);
      if (!s.ok()) break;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      --victim->writers;
      MaybeEmptyLocked(*victim);
    }
    RETURN_IF_ERROR(s);
    if (!EveryCommitSynced()) return absl::OkStatus();  // the group sync names them
    rocksdb::WriteBatch wb;
    return SyncPointLocked(&wb);
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
  uint64_t syncs_ = 0;      // sync points so far
  bool dir_dirty_ = false;  // a log file was created since the last directory sync
  bool recovered_ = false;  // Recover succeeded
  // The group sync (a nonzero interval).
  const std::chrono::milliseconds sync_interval_;
  std::mutex sync_mu_;
  std::condition_variable sync_cv_;
  bool sync_due_ = false;     // guarded by sync_mu_: a synced Apply since the last sync point
  bool stop_syncer_ = false;  // guarded by sync_mu_
  std::thread syncer_;
  // The disposer (Dispose).
  std::mutex dispose_mu_;
  std::condition_variable dispose_cv_;
  std::vector<Punch> dispose_punches_;                   // guarded by dispose_mu_
  std::vector<std::shared_ptr<LogFile>> dispose_files_;  // guarded by dispose_mu_
  bool stop_disposer_ = false;                           // guarded by dispose_mu_
  std::thread disposer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ColdTier>> OpenRocksColdTier(const std::string& dir,
                                                            uint64_t log_file_bytes) {
  RocksColdTierOptions options;
  options.log_file_bytes = log_file_bytes;
  return OpenRocksColdTier(dir, options);
}

absl::StatusOr<std::unique_ptr<ColdTier>> OpenRocksColdTier(const std::string& dir,
                                                            const RocksColdTierOptions& tier) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.compression = rocksdb::kNoCompression;
  options.IncreaseParallelism(2);
  // Only small entries live in the tree.
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
  auto cold =
      std::make_unique<RocksColdTier>(std::unique_ptr<rocksdb::DB>(raw), dir + "/blobs", tier);
  RETURN_IF_ERROR(cold->Recover());
  cold->StartThreads();
  return std::unique_ptr<ColdTier>(std::move(cold));
}

}  // namespace pith::store
