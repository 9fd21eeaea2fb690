// ColdTier: the durable home of every blob version (DESIGN §4). Data lives under
// (encoded key, version); a small record per blob names its committed version, one per
// prepared pending version names it, and one per job its committed step. Batches apply atomically,
// so a step's versions become current together or not at all. RocksColdTier is the real one;
// MemoryColdTier is the seam for unit tests (and can simulate a crash by dropping unsynced writes).
//
// Thread safety: implementations are thread-safe.
#ifndef PITH_SERVER_STORE_COLD_TIER_H_
#define PITH_SERVER_STORE_COLD_TIER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace pith::store {

// The committed version of one blob.
struct BlobRecord {
  int64_t version = 0;
  uint64_t size = 0;
  uint32_t crc = 0;
};

// A prepared pending version (BlobStore::PrepareStep): its record, and the attempt (the
// coordinator's assignment version) that prepared it.
struct PendingRecord {
  BlobRecord record;
  int64_t attempt = 0;
};

// An atomic group of metadata changes.
struct ColdBatch {
  struct SetRecord {
    std::string key;
    BlobRecord record;
  };
  struct DataRef {
    std::string key;
    int64_t version;
  };
  struct PutData {
    std::string key;
    int64_t version;
    absl::Span<const uint8_t> bytes;
  };
  // Bytes written with the batch (before its records, so a record never names missing bytes).
  std::vector<PutData> put_data;
  std::vector<SetRecord> set_records;
  std::vector<std::string> delete_records;
  std::vector<DataRef> delete_data;
  std::map<std::string, int64_t> set_job_steps;  // job id -> committed step
  std::vector<std::string> delete_job_steps;
  // Pending versions made to outlive the process (a prepared step): each record names its
  // version, whose bytes must be stored; the restart finds them (ColdContents::pending).
  struct SetPending {
    std::string key;
    PendingRecord pending;
  };
  std::vector<SetPending> set_pending;
  std::vector<DataRef> delete_pending;
};

// Everything the tier holds, for recovery at start-up.
struct ColdContents {
  std::map<std::string, BlobRecord> records;  // encoded key -> committed version
  std::vector<ColdBatch::DataRef> data;       // every stored (key, version)
  std::map<std::string, int64_t> job_steps;   // job id -> committed step
  // Prepared pending versions: (encoded key, version) -> record.
  std::map<std::pair<std::string, int64_t>, PendingRecord> pending;
};

// Bytes read from the cold tier in place: valid while `pin` lives.
struct ColdRead {
  const uint8_t* data = nullptr;
  uint64_t size = 0;
  std::shared_ptr<void> pin;
};

class ColdTier {
 public:
  virtual ~ColdTier() = default;

  // Stores the bytes of (key, version); durable at the next synced Apply at the latest.
  virtual absl::Status PutData(absl::string_view key, int64_t version,
                               absl::Span<const uint8_t> bytes) = 0;
  // Makes (key, version) share the stored bytes of (source_key, source_version), `size`
  // bytes, durable as PutData's. NOT_FOUND when the tier cannot (no such version of that
  // size: write the bytes with PutData instead).
  virtual absl::Status LinkData(absl::string_view key, int64_t version,
                                absl::string_view source_key, int64_t source_version,
                                uint64_t size) = 0;
  // Reads exactly out.size() bytes of (key, version). NOT_FOUND if absent, DATA_LOSS if the
  // stored size differs.
  virtual absl::Status ReadData(absl::string_view key, int64_t version,
                                absl::Span<uint8_t> out) = 0;
  // Reads (key, version) without copying where the tier can (RocksDB: the page cache,
  // through its mapping). NOT_FOUND if absent.
  virtual absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) = 0;
  // Applies `batch` atomically. On return it survives the process's death; with `sync` it
  // and every earlier write are also on disk on return, or (RocksColdTier with a sync
  // interval) by the end of the interval.
  virtual absl::Status Apply(const ColdBatch& batch, bool sync) = 0;
  virtual absl::StatusOr<ColdContents> Load() = 0;
  // A consistent copy of the whole tier in `dir` (UNIMPLEMENTED where there is no disk).
  virtual absl::Status Checkpoint(const std::string& dir) = 0;
  // Flushes and compactions running or waiting to run (0 when the tier is settled).
  virtual uint64_t BackgroundJobs() { return 0; }
  // OK while the tier works; once a write to its disk failed it is stopped, and this says
  // why (the store then reports itself unhealthy and leaves the cluster).
  virtual absl::Status Health() { return absl::OkStatus(); }
};

struct RocksColdTierOptions {
  // A new log file is started past this size.
  uint64_t log_file_bytes = 64ull << 20;
  // Zero: every synced Apply is on disk before it returns. Otherwise synced Applies are
  // on disk within this interval (one group sync for all of them, in the background); a
  // machine that stops meanwhile may lose them, and the tier then refuses to open
  // (DATA_LOSS) rather than serve their bytes. A process crash loses nothing either way.
  absl::Duration sync_interval = absl::ZeroDuration();
  // Free bytes the tier keeps on its disk: it does not open with less, and refuses a put
  // that would leave less (RESOURCE_EXHAUSTED), so RocksDB's own writes (commits, the
  // WAL, compactions) never meet a full disk.
  uint64_t disk_reserve_bytes = 64ull << 20;
};

// Opens (creating if needed) a RocksDB tier in `dir` with the WAL on; blob bytes go to
// append-only log files under `dir`/blobs, RocksDB holds where they are.
absl::StatusOr<std::unique_ptr<ColdTier>> OpenRocksColdTier(const std::string& dir,
                                                            const RocksColdTierOptions& options);
absl::StatusOr<std::unique_ptr<ColdTier>> OpenRocksColdTier(const std::string& dir,
                                                            uint64_t log_file_bytes = 64ull << 20);

// An in-memory tier. Crash() forgets every write made since the last synced Apply, as a
// power cut would.
class MemoryColdTier final : public ColdTier {
 public:
  absl::Status PutData(absl::string_view key, int64_t version,
                       absl::Span<const uint8_t> bytes) override;
  absl::Status LinkData(absl::string_view key, int64_t version, absl::string_view source_key,
                        int64_t source_version, uint64_t size) override;
  absl::Status ReadData(absl::string_view key, int64_t version, absl::Span<uint8_t> out) override;
  absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) override;
  absl::Status Apply(const ColdBatch& batch, bool sync) override;
  absl::StatusOr<ColdContents> Load() override;
  absl::Status Checkpoint(const std::string& dir) override {
    return absl::UnimplementedError("the in-memory tier has no checkpoint");
  }
  void Crash();

 private:
  struct State {
    std::map<std::pair<std::string, int64_t>, std::string> data;
    ColdContents meta;
  };
  absl::Mutex mu_;
  State live_ ABSL_GUARDED_BY(mu_);
  State durable_ ABSL_GUARDED_BY(mu_);
};

// A ColdTier forwarding every call to `tier`, which outlives it: a store opened over it
// can be dropped and opened again over what `tier` holds, as a restart would (after a
// process crash; MemoryColdTier::Crash makes it a power cut). Tests override a call to
// step into it.
class ForwardingColdTier : public ColdTier {
 public:
  explicit ForwardingColdTier(MemoryColdTier* tier) : t_(tier) {}
  absl::Status PutData(absl::string_view key, int64_t version,
                       absl::Span<const uint8_t> bytes) override;
  absl::Status LinkData(absl::string_view key, int64_t version, absl::string_view source_key,
                        int64_t source_version, uint64_t size) override;
  absl::Status ReadData(absl::string_view key, int64_t version, absl::Span<uint8_t> out) override;
  absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) override;
  absl::Status Apply(const ColdBatch& batch, bool sync) override;
  absl::StatusOr<ColdContents> Load() override;
  absl::Status Checkpoint(const std::string& dir) override;

 private:
  MemoryColdTier* const t_;
};

std::unique_ptr<ColdTier> ForwardTo(MemoryColdTier* tier);

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_COLD_TIER_H_
