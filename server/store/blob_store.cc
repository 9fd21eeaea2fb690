#include "server/store/blob_store.h"

#include <bit>
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status.h"
#include "server/store/blob_key.h"

namespace pith::store {
struct BlobStore::Metrics {
  prometheus::Gauge* ram_bytes = nullptr;
  prometheus::Gauge* rocksdb_bytes = nullptr;
  prometheus::Counter* ram_gets = nullptr;
  prometheus::Counter* rocksdb_gets = nullptr;
  prometheus::Counter* puts = nullptr;
  prometheus::Counter* promotions = nullptr;
  prometheus::Counter* demotions = nullptr;

  static absl::StatusOr<std::unique_ptr<Metrics>> Create(MetricsRegistry& r) {
    auto m = std::make_unique<Metrics>();
    const std::string tier_help = "Bytes of blobs held in each tier";
    ASSIGN_OR_RETURN(m->ram_bytes, r.Gauge("pith_store_tier_bytes", tier_help, {{"tier", "ram"}}));
    ASSIGN_OR_RETURN(m->rocksdb_bytes,
                     r.Gauge("pith_store_tier_bytes", tier_help, {{"tier", "rocksdb"}}));
    const std::string gets_help = "Blob reads by the tier that served them";
    ASSIGN_OR_RETURN(m->ram_gets, r.Counter("pith_store_gets_total", gets_help, {{"tier", "ram"}}));
    ASSIGN_OR_RETURN(m->rocksdb_gets,
                     r.Counter("pith_store_gets_total", gets_help, {{"tier", "rocksdb"}}));
    ASSIGN_OR_RETURN(m->puts, r.Counter("pith_store_puts_total", "Blob versions written"));
    ASSIGN_OR_RETURN(m->promotions, r.Counter("pith_store_promotions_total",
                                              "Blobs read from RocksDB into the RAM tier"));
    ASSIGN_OR_RETURN(m->demotions, r.Counter("pith_store_demotions_total",
                                             "Blobs dropped from the RAM tier to make room"));
    return m;
  }
};

RamBlock::~RamBlock() { store_->ReleaseBlock(offset_); }

BlobStore::BlobStore(const BlobStoreOptions& options, std::unique_ptr<ColdTier> cold,
                     uint8_t* arena)
    : options_(options),
      cold_(std::move(cold)),
      arena_(arena),
      allocator_(options.ram_bytes, options.min_block_bytes, LargestBlock(options)) {}

uint64_t BlobStore::LargestBlock(const BlobStoreOptions& options) {
  // A block as large as the biggest blob, but no larger than the RAM tier: a tier smaller
  // than --max_blob_bytes still holds blobs that fit it.
  const uint64_t want = std::bit_ceil(std::max(options.max_blob_bytes, options.min_block_bytes));
  const uint64_t ram = std::bit_floor(std::max(options.ram_bytes, options.min_block_bytes));
  return std::max(std::min(want, ram), options.min_block_bytes);
}

BlobStore::~BlobStore() {
  // Blocks still referenced by BlobRefs must not outlive the store; the owner joins its
  // transports first. Drop the index's references here.
  absl::MutexLock lock(&mu_);
  blobs_.clear();
  lru_.clear();
}

absl::StatusOr<std::unique_ptr<BlobStore>> BlobStore::Open(const BlobStoreOptions& options,
                                                           std::unique_ptr<ColdTier> cold,
                                                           uint8_t* arena,
                                                           MetricsRegistry* metrics) {
  // A tier smaller than --max_blob_bytes is fine: a blob larger than the tier is refused
  // when it comes (BeginPut).
  if (options.ram_bytes < options.min_block_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("--ram_bytes ", options.ram_bytes,
                                                   " is below one block (", options.min_block_bytes,
                                                   " bytes)"));
  }
  std::unique_ptr<BlobStore> store(new BlobStore(options, std::move(cold), arena));
  if (metrics != nullptr) {
    ASSIGN_OR_RETURN(store->metrics_, Metrics::Create(*metrics));
  }
  RETURN_IF_ERROR(store->Recover());
  return store;
}

absl::Status BlobStore::Recover() {
  ASSIGN_OR_RETURN(ColdContents contents, cold_->Load());
  absl::MutexLock lock(&mu_);
  ColdBatch discard;
  for (const auto& [key, record] : contents.records) {
    ASSIGN_OR_RETURN(v1::BlobKey decoded, DecodeBlobKey(key));
    Blob& blob = blobs_[key];
    blob.key = std::move(decoded);
    blob.committed = record.version;
    blob.versions[record.version] = Version{record.version, record.size, record.crc, nullptr, {}};
  }
  // Prepared versions of a step the job has not committed here stay pending: the
  // coordinator may have decided to commit it.
  std::set<std::pair<std::string, int64_t>> stored, kept;
  for (const auto& d : contents.data) stored.emplace(d.key, d.version);
  for (const auto& [at, record] : contents.pending) {
    const auto& [key, version] = at;
    ASSIGN_OR_RETURN(v1::BlobKey decoded, DecodeBlobKey(key));
    auto step = contents.job_steps.find(decoded.job_id());
    auto committed = contents.records.find(key);
    if (!stored.contains(at) || (step != contents.job_steps.end() && step->second >= version) ||
        (committed != contents.records.end() && committed->second.version >= version)) {
      discard.delete_pending.push_back({key, version});
      continue;
    }
    Blob& blob = blobs_[key];
    if (blob.versions.empty()) blob.key = std::move(decoded);
    Version& v = blob.versions[version];
    v = Version{record.record.version, record.record.size, record.record.crc, nullptr, {}};
    v.prepared = true;
    v.attempt = record.attempt;
    int64_t& newest = job_attempts_[blob.key.job_id()];
    newest = std::max(newest, record.attempt);
    kept.insert(at);
  }
  // Keep those and the committed versions; anything else is a pending version of a step
  // that never committed, or one a commit replaced.
  for (const auto& d : contents.data) {
    auto it = contents.records.find(d.key);
    if ((it == contents.records.end() || it->second.version != d.version) &&
        !kept.contains({d.key, d.version})) {
      discard.delete_data.push_back(d);
    }
  }
  for (const auto& [key, blob] : blobs_) {
    for (const auto& [version, v] : blob.versions) cold_bytes_ += v.size;
  }
  job_steps_ = contents.job_steps;
  if (!discard.delete_data.empty() || !discard.delete_pending.empty()) {
    RETURN_IF_ERROR(cold_->Apply(discard, true));
  }
  UpdateGaugesLocked();
  return absl::OkStatus();
}

void BlobStore::ReleaseBlock(uint64_t offset) {
  absl::MutexLock lock(&alloc_mu_);
  allocator_.Free(offset);
}

absl::StatusOr<std::shared_ptr<RamBlock>> BlobStore::AllocateLocked(uint64_t size) {
  if (std::bit_ceil(std::max(size, options_.min_block_bytes)) > LargestBlock(options_)) {
    // No demotion can make room (a replica installed from a store with a larger tier).
    return absl::ResourceExhaustedError(absl::StrCat(
        "blob of ", size, " bytes does not fit the RAM tier of ", options_.ram_bytes, " bytes"));
  }
  while (true) {
    {
      absl::MutexLock lock(&alloc_mu_);
      if (std::optional<uint64_t> offset = allocator_.Allocate(size)) {
        return std::make_shared<RamBlock>(this, *offset, size);
      }
    }
    // Demote the least recently used blob nobody is reading.
    bool demoted = false;
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      Blob& blob = blobs_.at(it->first);
      Version& v = blob.versions.at(it->second);
      if (v.ram.use_count() > 1) continue;  // pinned by a reader
      const std::string key = it->first;
      DropRamLocked(key, v);
      ++demotions_;
      if (metrics_) metrics_->demotions->Increment();
      demoted = true;
      break;
    }
    if (!demoted) {
      return absl::UnavailableError(
          absl::StrCat("RAM tier: no room for ", size, " bytes now: ", RamHoldersLocked()));
    }
  }
}

std::string BlobStore::RamHoldersLocked() {
  uint64_t resident = 0, read = 0;
  for (const auto& [key, version] : lru_) {
    const Version& v = blobs_.at(key).versions.at(version);
    resident += v.ram->size();
    if (v.ram.use_count() > 1) read += v.ram->size();
  }
  uint64_t used;
  {
    absl::MutexLock lock(&alloc_mu_);
    used = allocator_.used();
  }
  // What is allocated but not resident: blocks of puts being received, and of versions
  // dropped from RAM while a reader still sends them.
  return absl::StrCat(options_.ram_bytes, " bytes in all, ", read, " in blobs being read, ",
                      used - resident, " in puts being received (or sends of dropped blobs), ",
                      options_.ram_bytes - used, " free in pieces too small");
}

void BlobStore::DropRamLocked(const std::string& key, Version& v) {
  if (!v.ram) return;
  lru_.erase(v.lru);
  v.ram.reset();  // the block returns to the allocator once no reader holds it
}

std::shared_ptr<RamBlock> BlobStore::TryAllocateLocked(uint64_t size) {
  absl::MutexLock lock(&alloc_mu_);
  if (std::optional<uint64_t> offset = allocator_.Allocate(size)) {
    return std::make_shared<RamBlock>(this, *offset, size);
  }
  return nullptr;
}

bool BlobStore::MoreRecentThanVictimLocked(uint64_t use) {
  // The least recently used resident blob nobody is reading is the one a promotion
  // would evict first.
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    const Version& victim = blobs_.at(it->first).versions.at(it->second);
    if (victim.ram.use_count() > 1) continue;
    return use > victim.last_use;
  }
  return false;  // everything resident is being read: nothing to evict
}

void BlobStore::TouchLocked(const std::string& key, Version& v) {
  v.last_use = ++clock_;
  if (v.ram) {
    lru_.splice(lru_.begin(), lru_, v.lru);
  }
}

v1::BlobInfo BlobStore::InfoLocked(const Blob& blob, const Version& v) const {
  v1::BlobInfo info;
  *info.mutable_key() = blob.key;
  info.set_version(v.version);
  info.set_size_bytes(v.size);
  info.set_crc32c(v.crc);
  info.set_tier(v.ram ? v1::TIER_RAM : v1::TIER_ROCKSDB);
  info.set_committed(v.version == blob.committed);
  return info;
}

void BlobStore::UpdateGaugesLocked() {
  if (!metrics_) return;
  uint64_t ram;
  {
    absl::MutexLock lock(&alloc_mu_);
    ram = allocator_.used();
  }
  metrics_->ram_bytes->Set(static_cast<double>(ram));
  metrics_->rocksdb_bytes->Set(static_cast<double>(cold_bytes_));
}

absl::Status BlobStore::AdmitAttemptLocked(const std::string& job_id, int64_t attempt,
                                           const char* what) {
  if (attempt == 0) return absl::OkStatus();
  int64_t& newest = job_attempts_[job_id];
  if (attempt < newest) {
    return absl::AbortedError(absl::StrCat(what, " of attempt ", attempt, " of job ", job_id,
                                           ": attempt ", newest, " replaced it"));
  }
  newest = attempt;
  return absl::OkStatus();
}

BlobStore::VersionWrite::VersionWrite(BlobStore* store, std::string encoded, int64_t version)
    : store_(store), id_(std::move(encoded), version) {
  absl::MutexLock lock(&store_->mu_);
  auto free = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(store_->mu_) {
    return store_->writing_.count(id_) == 0;
  };
  store_->mu_.Await(absl::Condition(&free));
  store_->writing_.insert(id_);
}

BlobStore::VersionWrite::~VersionWrite() {
  absl::MutexLock lock(&store_->mu_);
  store_->writing_.erase(id_);
}

absl::Status BlobStore::AdmitPut(const std::string& job_id, int64_t attempt) {
  absl::MutexLock lock(&mu_);
  return AdmitAttemptLocked(job_id, attempt, "a put");
}

absl::Status BlobStore::AdmitPut(const v1::BlobKey& key, const std::string& encoded,
                                 int64_t version, int64_t attempt) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(AdmitAttemptLocked(key.job_id(), attempt, "a put"));
  // Reserved before its version was committed (a commit, an installed copy): its bytes
  // would replace the committed ones where they are stored.
  auto it = blobs_.find(encoded);
  auto committing = committing_.find(key.job_id());
  if ((it != blobs_.end() && it->second.committed >= version) ||
      (committing != committing_.end() && committing->second >= version)) {
    return absl::FailedPreconditionError(
        absl::StrCat(BlobKeyDebugString(key), ": version ", version, " was committed meanwhile"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PutReservation> BlobStore::BeginPut(const v1::BlobKey& key, int64_t version,
                                                   uint64_t size, int64_t attempt) {
  RETURN_IF_ERROR(ValidateBlobKey(key));
  if (size > options_.max_blob_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("blob of ", size, " bytes is over the limit of ", options_.max_blob_bytes));
  }
  if (version < 0) return absl::InvalidArgumentError("version must be >= 0");
  const std::string encoded = EncodeBlobKey(key);
  absl::MutexLock lock(&mu_);
  auto it = blobs_.find(encoded);
  if (it != blobs_.end() && it->second.committed >= version) {
    return absl::FailedPreconditionError(
        absl::StrCat(BlobKeyDebugString(key), ": version ", version,
                     " is not newer than the committed version ", it->second.committed));
  }
  RETURN_IF_ERROR(AdmitAttemptLocked(key.job_id(), attempt, "a put"));
  PutReservation r;
  ASSIGN_OR_RETURN(r.block_, AllocateLocked(std::max<uint64_t>(size, 1)));
  r.key_ = key;
  r.version_ = version;
  r.attempt_ = attempt;
  r.data_ = arena_ + r.block_->offset();
  r.size_ = size;
  return r;
}

absl::StatusOr<v1::BlobInfo> BlobStore::FinishPut(PutReservation r,
                                                  std::optional<uint32_t> expected_crc) {
  if (!r.block_) return absl::InvalidArgumentError("empty put reservation");
  const uint32_t crc = Crc32c(r.data_, r.size_);
  if (expected_crc && *expected_crc != crc) {
    return absl::DataLossError(absl::StrCat(BlobKeyDebugString(r.key_), ": checksum mismatch"));
  }
  const std::string encoded = EncodeBlobKey(r.key_);
  return FencedPut(encoded, r.version_, r.key_.job_id(), r.attempt_,
                   [&]() -> absl::StatusOr<v1::BlobInfo> {
                     // The bytes go to the cold tier before the version exists anywhere, so every
                     // version a reader can see survives a crash once its step commits. fp32
                     // weights are their own master copy: bytes equal to the other kind's of the
                     // same version are stored once. A voided attempt's bytes do not go there (the
                     // version's location may be its successor's): the check and the write are one
                     // put of the version at a time.
                     const VersionWrite writing(this, encoded, r.version_);
                     RETURN_IF_ERROR(AdmitPut(r.key_, encoded, r.version_, r.attempt_));
                     if (!LinkToSibling(r, encoded, crc)) {
                       RETURN_IF_ERROR(cold_->PutData(encoded, r.version_, {r.data_, r.size_}));
                     }
                     absl::MutexLock lock(&mu_);
                     return AddPendingLocked(r.key_, encoded, r.version_, r.size_, crc, r.attempt_,
                                             std::move(r.block_));
                   });
}

absl::StatusOr<v1::BlobInfo> BlobStore::FencedPut(
    const std::string& encoded, int64_t version, const std::string& job_id, int64_t attempt,
    absl::FunctionRef<absl::StatusOr<v1::BlobInfo>()> put) {
  {
    absl::ReaderMutexLock fence(&prepare_mu_);
    if (!IsPrepared(encoded, version)) return put();
  }
  // A retried step writes a prepared version again: the new bytes replace it. The old ones
  // leave the cold tier first (its location is written, and written bytes never change),
  // with commits, prepares and other puts held off.
  absl::MutexLock commit_lock(&commit_mu_);
  absl::MutexLock fence(&prepare_mu_);
  RETURN_IF_ERROR(AdmitPut(job_id, attempt));
  RETURN_IF_ERROR(DropPrepared(encoded, version));
  return put();
}

bool BlobStore::IsPrepared(const std::string& encoded, int64_t version) {
  absl::MutexLock lock(&mu_);
  auto it = blobs_.find(encoded);
  if (it == blobs_.end()) return false;
  auto v = it->second.versions.find(version);
  return v != it->second.versions.end() && v->second.prepared;
}

absl::Status BlobStore::DropPrepared(const std::string& encoded, int64_t version) {
  ColdBatch batch;
  {
    absl::MutexLock lock(&mu_);
    auto it = blobs_.find(encoded);
    if (it == blobs_.end()) return absl::OkStatus();
    auto v = it->second.versions.find(version);
    if (v == it->second.versions.end() || !v->second.prepared) return absl::OkStatus();
    EraseVersionLocked(encoded, it->second, version, &batch);
    if (it->second.versions.empty()) blobs_.erase(it);  // as AbortStep leaves none empty
    UpdateGaugesLocked();
  }
  return cold_->Apply(batch, /*sync=*/false);
}

absl::StatusOr<v1::BlobInfo> BlobStore::AddPendingLocked(const v1::BlobKey& key,
                                                         const std::string& encoded,
                                                         int64_t version, uint64_t size,
                                                         uint32_t crc, int64_t attempt,
                                                         std::shared_ptr<RamBlock> ram) {
  RETURN_IF_ERROR(AdmitAttemptLocked(key.job_id(), attempt, "a put"));
  Blob& blob = blobs_[encoded];
  if (blob.versions.empty() && blob.committed < 0) blob.key = key;
  if (blob.committed >= version) {
    return absl::FailedPreconditionError(
        absl::StrCat(BlobKeyDebugString(key), ": version ", version, " was committed meanwhile"));
  }
  auto existing = blob.versions.find(version);
  if (existing != blob.versions.end()) {  // a retried write of the same step replaces it
    cold_bytes_ -= existing->second.size;
    DropRamLocked(encoded, existing->second);
    blob.versions.erase(existing);
  }
  Version& v = blob.versions[version];
  v.version = version;
  v.size = size;
  v.crc = crc;
  v.attempt = attempt;
  v.last_use = ++clock_;
  if (ram != nullptr) {
    v.ram = std::move(ram);
    lru_.emplace_front(encoded, version);
    v.lru = lru_.begin();
  }
  cold_bytes_ += size;
  ++puts_;
  if (metrics_) metrics_->puts->Increment();
  UpdateGaugesLocked();
  return InfoLocked(blob, v);
}

namespace {

// The same expert or tensor's other one of weights and master; nullopt for other kinds.
std::optional<v1::BlobKey> SiblingKey(const v1::BlobKey& key) {
  if (key.kind() != v1::BLOB_KIND_WEIGHTS && key.kind() != v1::BLOB_KIND_MASTER) {
    return std::nullopt;
  }
  v1::BlobKey sibling = key;
  sibling.set_kind(key.kind() == v1::BLOB_KIND_WEIGHTS ? v1::BLOB_KIND_MASTER
                                                       : v1::BLOB_KIND_WEIGHTS);
  return sibling;
}

}  // namespace

absl::StatusOr<v1::BlobInfo> BlobStore::PutSibling(const v1::BlobKey& key, int64_t version,
                                                   uint64_t size, uint32_t crc, int64_t attempt) {
  RETURN_IF_ERROR(ValidateBlobKey(key));
  const std::optional<v1::BlobKey> sibling_key = SiblingKey(key);
  if (!sibling_key)
    return absl::InvalidArgumentError("only weights and master have a sibling kind");
  const std::string encoded = EncodeBlobKey(key), sibling = EncodeBlobKey(*sibling_key);
  const auto missing = [&] {
    return absl::FailedPreconditionError(absl::StrCat("no version ", version, " of ",
                                                      BlobKeyDebugString(*sibling_key), " with ",
                                                      size, " bytes and that checksum"));
  };
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(AdmitAttemptLocked(key.job_id(), attempt, "a put"));
    auto it = blobs_.find(sibling);
    if (it == blobs_.end()) return missing();
    auto v = it->second.versions.find(version);
    if (v == it->second.versions.end() || v->second.size != size || v->second.crc != crc) {
      return missing();
    }
  }
  return FencedPut(encoded, version, key.job_id(), attempt, [&]() -> absl::StatusOr<v1::BlobInfo> {
    // The sibling's bytes stay in the cold tier while either version is there.
    const VersionWrite writing(this, encoded, version);
    RETURN_IF_ERROR(AdmitPut(key, encoded, version, attempt));
    if (absl::Status linked = cold_->LinkData(encoded, version, sibling, version, size);
        !linked.ok()) {
      return absl::IsNotFound(linked) ? missing() : linked;
    }
    absl::MutexLock lock(&mu_);
    return AddPendingLocked(key, encoded, version, size, crc, attempt, nullptr);
  });
}

bool BlobStore::LinkToSibling(const PutReservation& r, const std::string& encoded, uint32_t crc) {
  const std::optional<v1::BlobKey> sibling_key = SiblingKey(r.key_);
  if (!sibling_key) return false;
  const std::string sibling = EncodeBlobKey(*sibling_key);
  std::shared_ptr<RamBlock> block;  // pins the sibling's bytes for the comparison
  {
    absl::MutexLock lock(&mu_);
    auto it = blobs_.find(sibling);
    if (it == blobs_.end()) return false;
    auto v = it->second.versions.find(r.version_);
    if (v == it->second.versions.end() || v->second.size != r.size_ || v->second.crc != crc) {
      return false;
    }
    block = v->second.ram;
  }
  if (block == nullptr || std::memcmp(arena_ + block->offset(), r.data_, r.size_) != 0) {
    return false;
  }
  return cold_->LinkData(encoded, r.version_, sibling, r.version_, r.size_).ok();
}

absl::StatusOr<v1::BlobInfo> BlobStore::Put(const v1::BlobKey& key, int64_t version,
                                            absl::Span<const uint8_t> bytes, int64_t attempt) {
  ASSIGN_OR_RETURN(PutReservation r, BeginPut(key, version, bytes.size(), attempt));
  if (!bytes.empty()) std::memcpy(r.data(), bytes.data(), bytes.size());
  return FinishPut(std::move(r));
}

absl::StatusOr<v1::BlobInfo> BlobStore::InstallCommitted(const v1::BlobKey& key, int64_t version,
                                                         absl::Span<const uint8_t> bytes) {
  RETURN_IF_ERROR(ValidateBlobKey(key));
  if (bytes.size() > options_.max_blob_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("blob of ", bytes.size(), " bytes is over the limit"));
  }
  const std::string encoded = EncodeBlobKey(key);
  const uint32_t crc = Crc32c(bytes.data(), bytes.size());
  // No commit, abort or delete changes the blob's committed version meanwhile.
  absl::MutexLock commit_lock(&commit_mu_);
  RETURN_IF_ERROR(DropPrepared(encoded, version));  // its written bytes would stay
  // A put of the version in flight writes first; one after finds the version committed.
  const VersionWrite writing(this, encoded, version);
  {
    absl::MutexLock lock(&mu_);
    auto it = blobs_.find(encoded);
    if (it != blobs_.end() && it->second.committed > version) {
      return absl::FailedPreconditionError(absl::StrCat(
          BlobKeyDebugString(key), ": version ", it->second.committed, " is already committed"));
    }
  }
  // The bytes and their record in one synced batch, without mu_: reads and puts go on
  // meanwhile.
  ColdBatch batch;
  batch.put_data.push_back({encoded, version, bytes});
  batch.set_records.push_back({encoded, {version, bytes.size(), crc}});
  RETURN_IF_ERROR(cold_->Apply(batch, /*sync=*/true));
  absl::MutexLock lock(&mu_);
  Blob& blob = blobs_[encoded];
  if (blob.versions.empty() && blob.committed < 0) blob.key = key;
  ColdBatch cleanup;  // the version this one replaces
  if (blob.committed >= 0 && blob.committed != version) {
    EraseVersionLocked(encoded, blob, blob.committed, &cleanup);
  }
  if (auto old = blob.versions.find(version); old != blob.versions.end()) {
    DropRamLocked(encoded, old->second);
    cold_bytes_ -= old->second.size;
    blob.versions.erase(old);
  }
  if (!cleanup.delete_data.empty()) (void)cold_->Apply(cleanup, /*sync=*/false);
  Version& v = blob.versions[version];
  v.version = version;
  v.size = bytes.size();
  v.crc = crc;
  blob.committed = version;
  cold_bytes_ += bytes.size();
  UpdateGaugesLocked();
  return InfoLocked(blob, v);
}

absl::StatusOr<BlobRef> BlobStore::Get(const v1::BlobKey& key, int64_t version) {
  RETURN_IF_ERROR(ValidateBlobKey(key));
  const std::string encoded = EncodeBlobKey(key);
  absl::MutexLock lock(&mu_);
  auto it = blobs_.find(encoded);
  if (it == blobs_.end() || (version < 0 && it->second.committed < 0)) {
    return absl::NotFoundError(absl::StrCat("no blob ", BlobKeyDebugString(key)));
  }
  Blob& blob = it->second;
  const int64_t want = version < 0 ? blob.committed : version;
  auto vit = blob.versions.find(want);
  if (vit == blob.versions.end()) {
    return absl::NotFoundError(absl::StrCat("no version ", want, " of ", BlobKeyDebugString(key)));
  }
  Version& v = vit->second;
  if (v.ram) {
    TouchLocked(encoded, v);
    ++ram_gets_;
    if (metrics_) metrics_->ram_gets->Increment();
  } else {
    ++cold_gets_;
    if (metrics_) metrics_->rocksdb_gets->Increment();
    const uint64_t previous_use = v.last_use, previous_cold_read = v.last_cold_read;
    v.last_use = ++clock_;
    v.last_cold_read = cold_gets_;
    std::shared_ptr<RamBlock> block;
    bool promote = true;
    if (options_.admission_window > 0) {
      const bool seen =
          previous_cold_read != 0 && cold_gets_ - previous_cold_read <= options_.admission_window;
      if (seen) block = TryAllocateLocked(std::max<uint64_t>(v.size, 1));
      promote = seen && (block != nullptr || MoreRecentThanVictimLocked(previous_use));
    }
    if (promote && block == nullptr) {
      // No room now (every resident blob is being read or received): served in place.
      absl::StatusOr<std::shared_ptr<RamBlock>> room =
          AllocateLocked(std::max<uint64_t>(v.size, 1));
      if (room.ok()) block = *std::move(room);
      promote = block != nullptr;
    }
    if (!promote) {
      ASSIGN_OR_RETURN(ColdRead read, cold_->ReadPinned(encoded, v.version));
      if (read.size != v.size) {
        return absl::DataLossError(absl::StrCat(BlobKeyDebugString(key), ": cold copy has ",
                                                read.size, " bytes, want ", v.size));
      }
      if (Crc32c(read.data, read.size) != v.crc) {
        return absl::DataLossError(
            absl::StrCat(BlobKeyDebugString(key), ": cold copy fails its checksum"));
      }
      BlobRef ref;
      ref.cold_pin_ = std::move(read.pin);
      ref.data_ = read.data;
      ref.size_ = v.size;
      ref.version_ = v.version;
      ref.crc_ = v.crc;
      return ref;
    }
    RETURN_IF_ERROR(cold_->ReadData(encoded, v.version, {arena_ + block->offset(), v.size}));
    if (Crc32c(arena_ + block->offset(), v.size) != v.crc) {
      return absl::DataLossError(
          absl::StrCat(BlobKeyDebugString(key), ": cold copy fails its checksum"));
    }
    v.ram = std::move(block);
    lru_.emplace_front(encoded, v.version);
    v.lru = lru_.begin();
    ++promotions_;
    if (metrics_) metrics_->promotions->Increment();
    UpdateGaugesLocked();
  }
  BlobRef ref;
  ref.block_ = v.ram;
  ref.data_ = arena_ + v.ram->offset();
  ref.size_ = v.size;
  ref.version_ = v.version;
  ref.crc_ = v.crc;
  return ref;
}

absl::StatusOr<v1::BlobInfo> BlobStore::Stat(const v1::BlobKey& key, int64_t version) {
  RETURN_IF_ERROR(ValidateBlobKey(key));
  absl::MutexLock lock(&mu_);
  auto it = blobs_.find(EncodeBlobKey(key));
  if (it == blobs_.end())
    return absl::NotFoundError(absl::StrCat("no blob ", BlobKeyDebugString(key)));
  const int64_t want = version < 0 ? it->second.committed : version;
  auto vit = it->second.versions.find(want);
  if (want < 0 || vit == it->second.versions.end()) {
    return absl::NotFoundError(absl::StrCat("no version ", want, " of ", BlobKeyDebugString(key)));
  }
  return InfoLocked(it->second, vit->second);
}

absl::StatusOr<std::vector<v1::BlobInfo>> BlobStore::List(const std::string& job_id, int layer,
                                                          std::string after, int limit,
                                                          std::string* next) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id is required");
  const std::string prefix = JobKeyPrefix(job_id);
  if (!after.empty() && !absl::StartsWith(after, prefix)) {
    return absl::InvalidArgumentError("page_token does not belong to this job");
  }
  std::vector<v1::BlobInfo> out;
  next->clear();
  absl::MutexLock lock(&mu_);
  auto it = after.empty() ? blobs_.lower_bound(prefix) : blobs_.upper_bound(after);
  for (; it != blobs_.end() && absl::StartsWith(it->first, prefix); ++it) {
    const Blob& blob = it->second;
    if (blob.committed < 0 || (layer != -2 && blob.key.layer() != layer)) continue;
    if (limit > 0 && static_cast<int>(out.size()) == limit) {
      *next = std::prev(it)->first;
      break;
    }
    out.push_back(InfoLocked(blob, blob.versions.at(blob.committed)));
  }
  return out;
}

v1::StoreStats BlobStore::Stats() {
  v1::StoreStats s;
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock alloc_lock(&alloc_mu_);
    s.set_ram_bytes(allocator_.used());
    s.set_ram_capacity_bytes(allocator_.capacity());
  }
  s.set_rocksdb_bytes(cold_bytes_);
  uint64_t committed = 0, pending = 0;
  for (const auto& [key, blob] : blobs_) {
    committed += blob.committed >= 0;
    pending += blob.versions.size() - (blob.committed >= 0 ? 1 : 0);
  }
  s.set_blobs(committed);
  s.set_pending_blobs(pending);
  s.set_ram_gets(ram_gets_);
  s.set_rocksdb_gets(cold_gets_);
  s.set_puts(puts_);
  s.set_promotions(promotions_);
  s.set_demotions(demotions_);
  return s;
}

}  // namespace pith::store
