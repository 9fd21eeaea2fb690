// The RocksDB cold tier. Key space (one column family):
//   'D' + blob key + big-endian version -> blob bytes
//   'M' + blob key                      -> committed record (version, size, crc)
//   'J' + job id                        -> committed step
// Blob bytes are written without the WAL: a synced batch first flushes the memtable (to
// a table file, synced), then writes itself through the WAL, synced. So a commit record
// never reaches the disk before the bytes it names, and the bytes are written once (the
// WAL would write them twice, and checksum them with a table-driven CRC in this RocksDB
// build: two thirds of a store's CPU under training). Records, job steps and deletes go
// through the WAL. A crash loses only versions no synced batch has covered: uncommitted
// ones, which a crashed step gives up anyway.
#include <atomic>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "rocksdb/db.h"
#include "rocksdb/table.h"
#include "rocksdb/utilities/checkpoint.h"
#include "rocksdb/write_batch.h"
#include "server/store/cold_tier.h"

namespace pith::store {
namespace {

std::string DataKey(absl::string_view key, int64_t version) {
  std::string out = "D";
  out.append(key.data(), key.size());
  for (int shift = 56; shift >= 0; shift -= 8) {
    out.push_back(static_cast<char>((static_cast<uint64_t>(version) >> shift) & 0xff));
  }
  return out;
}

std::string RecordKey(absl::string_view key) { return absl::StrCat("M", key); }
std::string JobKey(absl::string_view job) { return absl::StrCat("J", job); }

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

class RocksColdTier final : public ColdTier {
 public:
  explicit RocksColdTier(std::unique_ptr<rocksdb::DB> db) : db_(std::move(db)) {}

  absl::Status PutData(absl::string_view key, int64_t version,
                       absl::Span<const uint8_t> bytes) override {
    rocksdb::WriteOptions options;
    options.disableWAL = true;  // durable at the next synced Apply, which flushes
    RETURN_IF_ERROR(ToStatus(
        db_->Put(options, DataKey(key, version),
                 rocksdb::Slice(reinterpret_cast<const char*>(bytes.data()), bytes.size())),
        "put"));
    unflushed_.store(true);
    return absl::OkStatus();
  }

  absl::Status ReadData(absl::string_view key, int64_t version, absl::Span<uint8_t> out) override {
    ASSIGN_OR_RETURN(ColdRead read, ReadPinned(key, version));
    if (read.size != out.size()) {
      return absl::DataLossError(
          absl::StrCat("rocksdb blob has ", read.size, " bytes, want ", out.size()));
    }
    std::memcpy(out.data(), read.data, out.size());
    return absl::OkStatus();
  }

  // Reads through an iterator parked on the key, not Get: Get copies every value of a
  // block it cannot pin (a mapped block of a table that can still be compacted away)
  // into the PinnableSlice, while an iterator's value points into the block itself (the
  // page cache, through the mapping) and stays valid as long as the iterator lives.
  absl::StatusOr<ColdRead> ReadPinned(absl::string_view key, int64_t version) override {
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
    // The RAM tier is the cache; RocksDB's block cache would only hold a second copy.
    options.fill_cache = false;
    options.iterate_upper_bound = &pin->upper;
    pin->it.reset(db_->NewIterator(options));
    pin->it->Seek(data_key);
    if (!pin->it->Valid()) {
      if (!pin->it->status().ok()) return ToStatus(pin->it->status(), "get");
      return absl::NotFoundError(absl::StrCat("rocksdb has no version ", version, " of the blob"));
    }
    if (pin->it->key() != rocksdb::Slice(data_key)) {
      return absl::NotFoundError(absl::StrCat("rocksdb has no version ", version, " of the blob"));
    }
    const rocksdb::Slice value = pin->it->value();
    return ColdRead{reinterpret_cast<const uint8_t*>(value.data()), value.size(), pin};
  }

  absl::Status Apply(const ColdBatch& batch, bool sync) override {
    rocksdb::WriteBatch wb;
    for (const auto& p : batch.put_data) {
      wb.Put(DataKey(p.key, p.version),
             rocksdb::Slice(reinterpret_cast<const char*>(p.bytes.data()), p.bytes.size()));
    }
    for (const auto& r : batch.set_records) wb.Put(RecordKey(r.key), EncodeRecord(r.record));
    for (const auto& k : batch.delete_records) wb.Delete(RecordKey(k));
    for (const auto& d : batch.delete_data) wb.Delete(DataKey(d.key, d.version));
    for (const auto& [job, step] : batch.set_job_steps) {
      wb.Put(JobKey(job), rocksdb::Slice(reinterpret_cast<const char*>(&step), 8));
    }
    for (const auto& job : batch.delete_job_steps) wb.Delete(JobKey(job));
    // Synced batches one at a time: one that finds nothing to flush must not overtake
    // another's flush still in progress.
    std::unique_lock<std::mutex> sync_lock(sync_mu_, std::defer_lock);
    if (sync) sync_lock.lock();
    if (sync && batch.records_need_flush && unflushed_.exchange(false)) {
      rocksdb::FlushOptions flush;
      flush.wait = true;
      flush.allow_write_stall = true;
      rocksdb::Status s = db_->Flush(flush);
      if (!s.ok()) {
        unflushed_.store(true);
        return ToStatus(s, "flush");
      }
    }
    rocksdb::WriteOptions options;
    options.sync = sync;
    return ToStatus(db_->Write(options, &wb), "write batch");
  }

  absl::StatusOr<ColdContents> Load() override {
    ColdContents out;
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
    for (it->SeekToFirst(); it->Valid(); it->Next()) {
      const rocksdb::Slice k = it->key();
      if (k.empty()) continue;
      const absl::string_view rest(k.data() + 1, k.size() - 1);
      switch (k[0]) {
        case 'D': {
          if (rest.size() < 8) return absl::DataLossError("rocksdb: short data key");
          uint64_t v = 0;
          for (size_t i = rest.size() - 8; i < rest.size(); ++i)
            v = (v << 8) | static_cast<uint8_t>(rest[i]);
          out.data.push_back(
              {std::string(rest.substr(0, rest.size() - 8)), static_cast<int64_t>(v)});
          break;
        }
        case 'M': {
          if (it->value().size() != 20) return absl::DataLossError("rocksdb: bad blob record");
          BlobRecord r;
          std::memcpy(&r.version, it->value().data(), 8);
          std::memcpy(&r.size, it->value().data() + 8, 8);
          std::memcpy(&r.crc, it->value().data() + 16, 4);
          out.records[std::string(rest)] = r;
          break;
        }
        case 'J': {
          if (it->value().size() != 8) return absl::DataLossError("rocksdb: bad job record");
          int64_t step;
          std::memcpy(&step, it->value().data(), 8);
          out.job_steps[std::string(rest)] = step;
          break;
        }
        default:
          return absl::DataLossError("rocksdb: unknown key space");
      }
    }
    if (!it->status().ok()) return ToStatus(it->status(), "scan");
    return out;
  }

  absl::Status Checkpoint(const std::string& dir) override {
    rocksdb::Checkpoint* raw = nullptr;
    rocksdb::Status s = rocksdb::Checkpoint::Create(db_.get(), &raw);
    if (!s.ok()) return ToStatus(s, "checkpoint");
    std::unique_ptr<rocksdb::Checkpoint> checkpoint(raw);
    return ToStatus(checkpoint->CreateCheckpoint(dir), "checkpoint");
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
  std::unique_ptr<rocksdb::DB> db_;
  std::mutex sync_mu_;                  // held by synced Applies
  std::atomic<bool> unflushed_{false};  // PutData wrote since the last waited-for flush
};

}  // namespace

absl::StatusOr<std::unique_ptr<ColdTier>> OpenRocksColdTier(const std::string& dir) {
  rocksdb::Options options;
  options.create_if_missing = true;
  options.compression = rocksdb::kNoCompression;  // fp32 tensors do not compress
  options.IncreaseParallelism(2);
  // Blobs are large: keep the memtable big enough for a few of them.
  options.write_buffer_size = 128 << 20;
  // Reads come straight out of the page cache through the mapping: RocksDB then copies
  // nothing, and the promotion copy into the RAM tier is the only one on this side.
  options.allow_mmap_reads = true;
  // Index entries carry their block's first key, so a Seek that lands in a sorted run
  // not holding the key compares against the index and never reads (and checksums) that
  // run's block: only the block holding the wanted blob is touched.
  rocksdb::BlockBasedTableOptions table;
  table.index_type = rocksdb::BlockBasedTableOptions::kBinarySearchWithFirstKey;
  // XXH3 block checksums: this RocksDB build's CRC32C is table-driven, several times
  // slower than the memory copies it guards. (Each table file records its own type.)
  table.checksum = rocksdb::kXXH3;
  options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(options, dir, &raw);
  if (!s.ok()) return ToStatus(s, absl::StrCat("open ", dir));
  return std::unique_ptr<ColdTier>(new RocksColdTier(std::unique_ptr<rocksdb::DB>(raw)));
}

}  // namespace pith::store
