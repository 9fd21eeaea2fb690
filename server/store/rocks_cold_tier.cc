// The RocksDB cold tier, with its blob bytes kept beside the LSM tree (key-value
// separation, as RocksDB's own BlobDB does for large values). Key space (one column family):
//   'L' + blob key + big-endian version -> where its bytes are (log file, offset, size)
//   'M' + blob key                      -> committed record (version, size, crc)
//   'P' + blob key + big-endian version -> a prepared pending version's record, attempt
//   'J' + job id                        -> committed step
//   'S'                                 -> the sync marker (which log bytes are on disk)
// The bytes go once, by a buffered pwrite, into the append-only files of a BlobLog under
// <dir>/blobs (blob_log.h: appends, punches, copy-forward, the files' half of a sync
// point); this file is the index: which version is where, and the RocksDB batches that
// name them. The LSM tree holds only small entries, through the WAL. Two versions can name
// the same bytes (LinkData: fp32 weights and their master copy). Keeping ~70 MB of new
// versions a step inside the tree cost a memtable copy, a table file and compactions: four
// times the CPU and 2.4 times the disk writes of one log append (measured; the store
// shares the cores with the workers).
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
// committed or prepared (or, copied forward, renamed by the next sync point); the bytes
// of a version whose location is written never change (a prepared version written again
// is deleted first, by the blob store). Log files are deleted only after a sync point covers the
// batch that emptied them; the unsynced bytes of a version dropped before then are punched out of
// its file (nothing names them), so the sync point does not write them either. A failed sync or
// batch write stops the tier (every later call fails) until a restart recovers from what the disk
// holds.
//
// Space: a log file is deleted once none of its versions is indexed, after the synced
// write that dropped the last one. A closed file whose live bytes fall under half of it
// has them copied forward into the open one (at most one file per synced Apply), so a
// version that is never replaced pins no more than its own bytes for long, and the log
// holds about twice the live bytes at most in a steady state (plus the open file and the
// young ones).
//
// Thread safety: thread-safe. Lock order: apply_mu_ (one RocksDB batch at a time), then
// mu_ (the index), then the log's own lock; sync_mu_ is taken under apply_mu_ only.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/crc32c.h"
#include "common/file.h"
#include "common/status.h"
#include "glog/logging.h"
#include "rocksdb/db.h"
#include "rocksdb/table.h"
#include "rocksdb/utilities/checkpoint.h"
#include "rocksdb/write_batch.h"
#include "server/store/blob_log.h"
#include "server/store/cold_tier.h"

namespace pith::store {
namespace {

std::string VersionedKey(char prefix, absl::string_view key, int64_t version) {
  std::string out(1, prefix);
  out.append(key.data(), key.size());
  for (int shift = 56; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(version) >> shift) & 0xff));
  }
  return out;
}
std::string LocationKey(absl::string_view key, int64_t version) {
  return VersionedKey('L', key, version);
}
std::string PendingKey(absl::string_view key, int64_t version) {
  return VersionedKey('P', key, version);
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

std::string EncodePending(const PendingRecord& p) {
  std::string out = EncodeRecord(p.record);
  out.append(reinterpret_cast<const char*>(&p.attempt), 8);
  return out;
}

// A pending record's 28 bytes; nullopt when they are not 28.
std::optional<PendingRecord> DecodePending(absl::string_view in) {
  if (in.size() != 28) return std::nullopt;
  std::optional<BlobRecord> r = DecodeRecord(in.substr(0, 20));
  if (!r) return std::nullopt;
  PendingRecord p{*r, 0};
  std::memcpy(&p.attempt, in.data() + 20, 8);
  return p;
}

absl::Status ToStatus(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  const std::string msg = absl::StrCat("rocksdb ", what, ": ", s.ToString());
  if (s.IsNotFound()) return absl::NotFoundError(msg);
  if (s.IsCorruption()) return absl::DataLossError(msg);
  if (s.IsNoSpace()) return DiskFullError(msg);
  return absl::InternalError(msg);
}

// Where one version's bytes are.
struct Location : LogSpan {
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

class RocksColdTier final : public ColdTier {
 public:
  RocksColdTier(std::unique_ptr<rocksdb::DB> db, std::string log_dir,
                const RocksColdTierOptions& options)
      : db_(std::move(db)),
        log_(BlobLog::Options{std::move(log_dir), options.log_file_bytes,
                              /*writeback=*/options.sync_interval == absl::ZeroDuration()}),
        sync_interval_(absl::ToChronoMilliseconds(options.sync_interval)),
        disk_reserve_bytes_(options.disk_reserve_bytes),
        log_file_bytes_(options.log_file_bytes) {}

  // A clean stop leaves nothing to check at the next start: one last sync point. (The
  // log's disposer stops after it, with the log.)
  ~RocksColdTier() override {
    if (syncer_.joinable()) {
      {
        absl::MutexLock lock(&sync_mu_);
        stop_syncer_ = true;
      }
      sync_cv_.SignalAll();
      syncer_.join();
    }
    absl::MutexLock apply_lock(&apply_mu_);
    if (recovered_) {  // else what the disk holds stays as it was found
      rocksdb::WriteBatch wb;
      if (absl::Status s = SyncPointLocked(&wb); !s.ok()) LOG(WARNING) << "cold tier: " << s;
    }
  }

  // A zero sync interval: every synced Apply is a sync point before it returns.
  bool EveryCommitSynced() const { return sync_interval_.count() == 0; }

  // Starts the group sync thread (a nonzero sync interval).
  void StartThreads() {
    if (!EveryCommitSynced()) syncer_ = std::thread([this] { SyncLoop(); });
  }

  // Opens the log files and indexes every location. A location whose bytes are missing is
  // dropped unless a record names it (then: DATA_LOSS); files nothing points into are
  // deleted.
  absl::Status Recover() ABSL_LOCKS_EXCLUDED(apply_mu_, mu_) {
    RETURN_IF_ERROR(log_.OpenFiles());
    // What the last sync point found on disk. No marker: the store was written by a
    // build that synced every commit, so all of it is.
    std::string marker;
    const rocksdb::Status got = db_->Get(rocksdb::ReadOptions(), kSyncedKey, &marker);
    if (!got.ok() && !got.IsNotFound()) return ToStatus(got, "get");
    RETURN_IF_ERROR(log_.SetSynced(got.ok() ? &marker : nullptr));
    rocksdb::WriteBatch dangling;
    RETURN_IF_ERROR(IndexLocations(&dangling));
    if (dangling.Count() > 0) {
      rocksdb::WriteOptions sync;
      sync.sync = true;
      RETURN_IF_ERROR(ToStatus(db_->Write(sync, &dangling), "write batch"));
    }
    RETURN_IF_ERROR(log_.DropUnused());
    // Everything found is on disk before the store takes new writes.
    absl::MutexLock apply_lock(&apply_mu_);
    rocksdb::WriteBatch wb;
    RETURN_IF_ERROR(SyncPointLocked(&wb));
    recovered_ = true;
    return absl::OkStatus();
  }

  absl::Status PutData(absl::string_view key, int64_t version,
                       absl::Span<const uint8_t> bytes) override ABSL_LOCKS_EXCLUDED(mu_) {
    RETURN_IF_ERROR(CheckDiskRoom(log_.dir(), disk_reserve_bytes_, bytes.size()));
    ASSIGN_OR_RETURN(BlobLog::Appended a, log_.Append(bytes.data(), bytes.size()));
    if (a.written.ok()) {
      absl::MutexLock lock(&mu_);
      (void)IndexLocked({std::string(key), version}, Location{a.span});  // its file is there
    }
    log_.EndAppend(a);
    return a.written;
  }

  // Another location entry for the same bytes: the file stays while either is indexed.
  absl::Status LinkData(absl::string_view key, int64_t version, absl::string_view source_key,
                        int64_t source_version, uint64_t size) override ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(log_.Stopped());
    auto src = index_.find({std::string(source_key), source_version});
    if (src == index_.end() || src->second.size != size) {
      return absl::NotFoundError("no such blob version in a log file to share");
    }
    return IndexLocked({std::string(key), version}, Location{LogSpan(src->second)});
  }

  absl::Status ReadData(absl::string_view key, int64_t version, absl::Span<uint8_t> out) override {
    Location l;
    ASSIGN_OR_RETURN(LogPin pin, Find(key, version, &l));
    if (l.size != out.size()) {
      return absl::DataLossError(
          absl::StrCat("cold tier blob has ", l.size, " bytes, want ", out.size()));
    }
    return log_.Read(pin, l, out);
  }

  absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) override {
    Location l;
    ASSIGN_OR_RETURN(LogPin pin, Find(key, version, &l));
    return log_.Map(std::move(pin), l);
  }

  absl::Status Apply(const ColdBatch& batch, bool sync) override
      ABSL_LOCKS_EXCLUDED(apply_mu_, mu_) {
    for (const auto& p : batch.put_data) RETURN_IF_ERROR(PutData(p.key, p.version, p.bytes));
    // One batch at a time: a location written by one must not land after another's
    // delete of it, and a synced one must not overtake another's sync still running.
    absl::MutexLock apply_lock(&apply_mu_);
    rocksdb::WriteBatch wb;
    std::vector<LogPunch> punches;
    {
      absl::MutexLock lock(&mu_);
      RETURN_IF_ERROR(log_.Stopped());
      for (const auto& r : batch.set_pending) {
        if (!index_.contains({r.key, r.pending.record.version})) {
          return absl::FailedPreconditionError("a pending record names bytes the tier lacks");
        }
      }
      for (const auto& r : batch.set_pending) {
        wb.Put(PendingKey(r.key, r.pending.record.version), EncodePending(r.pending));
        auto it = index_.find({r.key, r.pending.record.version});
        NameLocked(it->first, it->second, &wb);
      }
      for (const auto& d : batch.delete_pending) wb.Delete(PendingKey(d.key, d.version));
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
        log_.Unref(it->first, it->second, &punches);
        index_.erase(it);
      }
      for (const auto& [job, step] : batch.set_job_steps) {
        wb.Put(JobKey(job), rocksdb::Slice(reinterpret_cast<const char*>(&step), 8));
      }
      for (const auto& job : batch.delete_job_steps) wb.Delete(JobKey(job));
    }
    RETURN_IF_ERROR(WriteNamedLocked(&wb, sync));
    log_.Dispose(std::move(punches));
    if (sync && EveryCommitSynced()) {
      // Best effort: the batch is durable whatever happens here.
      if (absl::Status s = CopyForwardLocked(); !s.ok()) LOG(WARNING) << "cold tier: " << s;
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ColdContents> Load() override ABSL_LOCKS_EXCLUDED(mu_) {
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
    for (it->Seek("P"); it->Valid() && it->key()[0] == 'P'; it->Next()) {
      std::string key;
      int64_t version;
      std::optional<PendingRecord> r =
          DecodePending(absl::string_view(it->value().data(), it->value().size()));
      if (!SplitVersioned(Rest(it->key()), &key, &version) || !r || r->record.version != version) {
        return absl::DataLossError("rocksdb: bad pending record");
      }
      out.pending[{std::move(key), version}] = *r;
    }
    if (!it->status().ok()) return ToStatus(it->status(), "scan");
    absl::MutexLock lock(&mu_);
    for (const auto& [kv, l] : index_) out.data.push_back({kv.first, kv.second});
    return out;
  }

  absl::Status Checkpoint(const std::string& dir_in) override ABSL_LOCKS_EXCLUDED(apply_mu_) {
    std::string dir = dir_in;
    while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
    absl::MutexLock apply_lock(&apply_mu_);  // no file is deleted meanwhile
    {
      rocksdb::WriteBatch wb;  // every log byte the tree names is on disk
      RETURN_IF_ERROR(SyncPointLocked(&wb));
    }
    rocksdb::Checkpoint* raw = nullptr;
    rocksdb::Status s = rocksdb::Checkpoint::Create(db_.get(), &raw);
    if (!s.ok()) return ToStatus(s, "checkpoint");
    std::unique_ptr<rocksdb::Checkpoint> checkpoint(raw);
    // The logs first (every location on disk names bytes already synced), then the tree.
    const std::vector<std::string> paths = log_.Paths();
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
        if (fd < 0) return ErrnoError("open", to);
        const int rc = ::fdatasync(fd);
        ::close(fd);
        if (rc != 0) return ErrnoError("sync", to);
      }
    }
    RETURN_IF_ERROR(FsyncDir(staging));
    RETURN_IF_ERROR(ToStatus(checkpoint.CreateCheckpoint(dir), "checkpoint"));
    std::filesystem::rename(staging, dir + "/blobs", ec);
    if (ec) return absl::InternalError(absl::StrCat("checkpoint logs: ", ec.message()));
    return FsyncDir(dir);
  }

  absl::Status Health() override { return log_.Stopped(); }

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
  using IndexKey = LogEntry;

  static absl::string_view Rest(const rocksdb::Slice& k) {
    return absl::string_view(k.data() + 1, k.size() - 1);
  }

  // Indexes every location entry at start-up; a dropped version's entry whose bytes are
  // gone goes into `dangling`.
  absl::Status IndexLocations(rocksdb::WriteBatch* dangling) ABSL_LOCKS_EXCLUDED(mu_) {
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
      // The record naming this version as committed (or prepared), if one does (looked up
      // only where the bytes are missing or past the last sync point).
      const auto stored = [&](const std::string& record_key) -> std::string {
        std::string value;  // empty (no record decodes from it) when there is none
        (void)db_->Get(rocksdb::ReadOptions(), record_key, &value);
        return value;
      };
      const auto of_version = [&](std::optional<BlobRecord> r) {
        return r && r->version == version ? r : std::nullopt;
      };
      const auto committed = [&] { return of_version(DecodeRecord(stored(RecordKey(key)))); };
      const auto prepared = [&] {
        std::optional<PendingRecord> p = DecodePending(stored(PendingKey(key, version)));
        return of_version(p ? std::optional<BlobRecord>(p->record) : std::nullopt);
      };
      const BlobLog::SpanState state = log_.Check(l);
      if (state == BlobLog::SpanState::kMissing) {
        if (committed()) {
          return absl::DataLossError(absl::StrCat("committed version ", version, " of blob ",
                                                  absl::CHexEscape(key), " names log file ", l.file,
                                                  " bytes it does not have", LostSyncAdvice()));
        }
        dangling->Delete(it->key());  // a dropped version: nothing names it
        continue;
      }
      if (state == BlobLog::SpanState::kUnsynced) {
        // Past the last sync point: in the page cache after a process crash, maybe not
        // on disk after the machine stopped.
        if (std::optional<BlobRecord> r = committed()) {
          RETURN_IF_ERROR(VerifyUnsynced(l, key, *r));
        } else if (std::optional<BlobRecord> p = prepared();
                   p && !VerifyUnsynced(l, key, *p).ok()) {
          dangling->Delete(it->key());  // a prepared version the disk lost: the store drops it
          continue;
        }
      }
      RETURN_IF_ERROR(log_.Ref({key, version}, l));
      absl::MutexLock lock(&mu_);
      index_[{key, version}] = l;
    }
    return ToStatus(it->status(), "scan");
  }

  // At start: a committed version past the last sync point must have its bytes.
  absl::Status VerifyUnsynced(const Location& l, const std::string& key, const BlobRecord& record) {
    ASSIGN_OR_RETURN(LogPin pin, log_.Pin(l.file));
    std::vector<uint8_t> bytes(l.size);
    RETURN_IF_ERROR(log_.Read(pin, l, absl::MakeSpan(bytes)));
    if (Crc32c(bytes.data(), bytes.size()) == record.crc) return absl::OkStatus();
    return absl::DataLossError(absl::StrCat("committed version ", record.version, " of blob ",
                                            absl::CHexEscape(key), " in log file ", l.file,
                                            " fails its checksum", LostSyncAdvice()));
  }
  static std::string LostSyncAdvice() {
    return ": the machine stopped before the store's last sync point reached the disk "
           "(--sync_interval_ms); start this store with an empty --data_dir and the "
           "coordinator copies its groups back from their replicas";
  }

  // Indexes freshly written bytes of (key, version). A committed version's bytes never
  // change: a second write of one (a stale retry, or a copy of what the store has) leaves
  // dead space only.
  absl::Status IndexLocked(const IndexKey& key, const Location& l)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [it, inserted] = index_.try_emplace(key, l);
    if (!inserted) {
      if (it->second.persisted) return absl::OkStatus();
      log_.Unref(it->first, it->second);
      it->second = l;
    }
    absl::Status s = log_.Ref(it->first, l);
    if (!s.ok()) index_.erase(it);
    return s;
  }

  // Adds the location to `wb` unless RocksDB has it already.
  void NameLocked(const IndexKey& key, Location& l, rocksdb::WriteBatch* wb)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (l.persisted && !l.moved) return;
    wb->Put(LocationKey(key.first, key.second), EncodeLocation(l));
    l.persisted = true;
    l.moved = false;
  }

  // Where (key, version) is, its file pinned while the caller reads it.
  absl::StatusOr<LogPin> Find(absl::string_view key, int64_t version, Location* l)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find({std::string(key), version});
    if (it == index_.end()) {
      return absl::NotFoundError(
          absl::StrCat("cold tier has no version ", version, " of the blob"));
    }
    *l = it->second;
    return log_.Pin(l->file);
  }

  // Writes `wb`. A synced write is a sync point when the sync interval is zero; otherwise
  // it is written like any other (the process may die, the kernel keeps it) and the group
  // sync covers it within the interval.
  absl::Status WriteNamedLocked(rocksdb::WriteBatch* wb, bool sync)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_) ABSL_LOCKS_EXCLUDED(sync_mu_) {
    if (sync && EveryCommitSynced()) return SyncPointLocked(wb);
    RETURN_IF_ERROR(WriteLocked(wb, /*sync=*/false));
    if (sync) {
      {
        absl::MutexLock lock(&sync_mu_);
        sync_due_ = true;
      }
      sync_cv_.SignalAll();
    }
    return absl::OkStatus();
  }

  // Writes `wb` through the WAL. A failed write stops the tier: what RocksDB holds is then
  // unknown, and a restart recovers from the disk.
  absl::Status WriteLocked(rocksdb::WriteBatch* wb, bool sync)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_) {
    RETURN_IF_ERROR(log_.Stopped());
    rocksdb::WriteOptions options;
    options.sync = sync;
    return log_.Stop(ToStatus(db_->Write(options, wb), "write batch"));
  }

  // What a sync point covers: the logs written before it, the copies made before it, the
  // files emptied before it.
  struct SyncPoint {
    LogSyncPoint log;
    std::vector<IndexKey> moved;
  };
  // No batch is half applied under apply_mu_.
  SyncPoint TakeSyncPointLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_) {
    SyncPoint p;
    absl::MutexLock lock(&mu_);
    p.log = log_.TakeSyncPoint();
    p.moved.swap(moved_);
    return p;
  }
  // After the log's Sync(p): names p's copies, writes the marker with `wb` through the
  // WAL, synced (so every earlier batch is on disk too), then deletes p's emptied files.
  absl::Status FinishSyncPointLocked(SyncPoint& p, rocksdb::WriteBatch* wb)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_) {
    {
      absl::MutexLock lock(&mu_);
      const std::string marker = log_.MarkSynced(p.log);
      for (const IndexKey& key : p.moved) {
        // Still the copy: a version dropped and written again meanwhile (a prepared one a
        // retry replaced) is named by its own batch, not here.
        auto it = index_.find(key);
        if (it != index_.end() && it->second.moved) NameLocked(it->first, it->second, wb);
      }
      wb->Put(kSyncedKey, marker);
    }
    RETURN_IF_ERROR(WriteLocked(wb, /*sync=*/true));
    log_.FinishSyncPoint(p.log);
    return absl::OkStatus();
  }
  // A whole sync point.
  absl::Status SyncPointLocked(rocksdb::WriteBatch* wb) ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_) {
    SyncPoint p = TakeSyncPointLocked();
    absl::Status s = log_.Sync(p.log);
    if (s.ok()) s = FinishSyncPointLocked(p, wb);
    log_.Dispose(std::move(p.log));
    return s;
  }

  // The group sync: every sync interval in which a synced Apply came, one sync point
  // (with the copy-forward), its fdatasyncs outside apply_mu_ so commits go on meanwhile.
  void SyncLoop() ABSL_LOCKS_EXCLUDED(sync_mu_, apply_mu_) {
    auto last = std::chrono::steady_clock::now();
    while (WaitForSyncDue(last)) {
      SyncPoint p;
      {
        absl::MutexLock apply_lock(&apply_mu_);
        if (absl::Status c = CopyForwardLocked(); !c.ok()) LOG(WARNING) << "cold tier: " << c;
        p = TakeSyncPointLocked();
      }
      absl::Status s = log_.Sync(p.log);
      if (s.ok()) {
        absl::MutexLock apply_lock(&apply_mu_);
        rocksdb::WriteBatch wb;
        s = FinishSyncPointLocked(p, &wb);
      }
      if (!s.ok()) LOG(ERROR) << "cold tier group sync: " << s;
      log_.Dispose(std::move(p.log));
      last = std::chrono::steady_clock::now();
    }
  }
  // Waits for a synced Apply, then for the interval since the `last` group sync; false
  // once the tier stops.
  bool WaitForSyncDue(std::chrono::steady_clock::time_point last) ABSL_LOCKS_EXCLUDED(sync_mu_) {
    absl::MutexLock lock(&sync_mu_);
    while (!stop_syncer_ && !sync_due_) sync_cv_.Wait(&sync_mu_);
    while (!stop_syncer_) {
      const auto left = last + sync_interval_ - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) break;
      sync_cv_.WaitWithTimeout(&sync_mu_, absl::FromChrono(left));
    }
    if (stop_syncer_) return false;
    sync_due_ = false;
    return true;
  }

  // Copies the live versions of one mostly-dead file, closed for a while, into the open
  // one and names the copies durably; the file goes with that write.
  // Under disk pressure (less than 4 log files above the reserve), a young file too: the
  // dead versions a job leaves behind would otherwise fill a small disk within a few steps.
  absl::Status CopyForwardLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(apply_mu_) {
    std::optional<uint64_t> room;
    if (absl::StatusOr<uint64_t> free = FreeBytes(log_.dir());
        free.ok() && *free < disk_reserve_bytes_ + 4 * log_file_bytes_) {
      // Half of it: puts land beside the copy meanwhile (each checks the reserve alone).
      room = *free > disk_reserve_bytes_ ? (*free - disk_reserve_bytes_) / 2 : 0;
    }
    ASSIGN_OR_RETURN(bool copied,
                     log_.CopyForward([this](const IndexKey& key, const LogSpan& from,
                                             const LogSpan& to) { Relocate(key, from, to); },
                                      room));
    if (!copied || !EveryCommitSynced()) return absl::OkStatus();  // the group sync names them
    rocksdb::WriteBatch wb;
    return SyncPointLocked(&wb);
  }
  // A copy of (key, version)'s bytes is at `to`: it lives there now unless it was dropped
  // or written again meanwhile (then the copy is dead space).
  void Relocate(const IndexKey& key, const LogSpan& from, const LogSpan& to)
      ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = index_.find(key);
    if (it == index_.end() || it->second.file != from.file || it->second.offset != from.offset) {
      return;
    }
    const bool persisted = it->second.persisted;
    log_.Unref(it->first, it->second);
    // Still committed (its bytes never change); RocksDB names the old place until the
    // next synced write names the new one, before the old file can go.
    it->second = Location{to, persisted, persisted};
    (void)log_.Ref(it->first, to, /*shared=*/false);  // the open file is there
    if (persisted) moved_.push_back(it->first);
  }

  const std::unique_ptr<rocksdb::DB> db_;
  BlobLog log_;
  absl::Mutex apply_mu_;  // held by Apply and Checkpoint: one RocksDB batch at a time
  absl::Mutex mu_;        // the index; held across no I/O
  std::map<IndexKey, Location> index_ ABSL_GUARDED_BY(mu_);
  // Copied forward while RocksDB names the old place.
  std::vector<IndexKey> moved_ ABSL_GUARDED_BY(mu_);
  bool recovered_ ABSL_GUARDED_BY(apply_mu_) = false;  // Recover succeeded
  // The group sync (a nonzero interval).
  const std::chrono::milliseconds sync_interval_;
  const uint64_t disk_reserve_bytes_;
  const uint64_t log_file_bytes_;
  absl::Mutex sync_mu_;
  absl::CondVar sync_cv_;
  bool sync_due_ ABSL_GUARDED_BY(sync_mu_) = false;  // a synced Apply since the last sync point
  bool stop_syncer_ ABSL_GUARDED_BY(sync_mu_) = false;
  std::thread syncer_;
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
  // Debian's RocksDB asserts (aborts) on some writes to a full disk: it opens with room.
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  RETURN_IF_ERROR(CheckDiskRoom(dir, tier.disk_reserve_bytes, 0));
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
