// BlobStore: the expert store's core — versioned blobs in a RAM tier (one arena, buddy
// blocks, LRU demotion, promotion on read, pinned while read) over a durable ColdTier.
// It knows nothing of gRPC or UCX; the transports call it.
//
// Versions (DESIGN §4): a blob is written as version s+1 (pending) while version s stays
// the committed one; PrepareStep(job, s+1) makes the job's pending s+1 outlive the
// process; CommitStep(job, s+1) makes them current in one synced batch and frees what
// they replace; AbortStep, or a crash before the prepare, discards them.
//
// Attempts (the coordinator's assignment versions, which only grow): puts, prepares and
// commits may name the attempt of the step they belong to (0: none). The newest one a job
// named here fences the older ones off: their puts and prepares are refused (ABORTED),
// and their pending versions are left out of a later attempt's prepare and commit. So a
// put from a voided attempt (a stalled worker's, landing late) never becomes part of the
// step its successor commits.
//
// Thread safety: all methods are thread-safe. BlobRef and PutReservation may be released
// from any thread.
#ifndef PITH_SERVER_STORE_BLOB_STORE_H_
#define PITH_SERVER_STORE_BLOB_STORE_H_

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/btree_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/metrics.h"
#include "pith/v1/common.pb.h"
#include "pith/v1/store.pb.h"
#include "server/store/buddy_allocator.h"
#include "server/store/cold_tier.h"

namespace pith::store {

struct BlobStoreOptions {
  // RAM-tier budget in bytes; the arena passed to Open has at least this many.
  uint64_t ram_bytes = 1ull << 30;
  // Largest blob accepted.
  uint64_t max_blob_bytes = 64ull << 20;
  // Smallest RAM block.
  uint64_t min_block_bytes = 4096;
  // Admission: a blob read from the cold tier is promoted into RAM only when it was read
  // from there before, among the last `admission_window` cold reads, and either fits in
  // free RAM or was last read more recently than the least recently used resident blob
  // (promoting it would evict a blob in use longer ago than its own reuse). Otherwise the
  // read is served in place from the cold tier. A pass over more data than the RAM tier
  // holds then neither flushes the hot blobs out nor pays a copy per read for blobs it
  // would demote again before their next use. 0 promotes on every read.
  uint64_t admission_window = 4096;
};

class BlobStore;

// A block of the RAM arena, returned to the allocator when the last holder lets go.
class RamBlock {
 public:
  RamBlock(BlobStore* store, uint64_t offset, uint64_t size)
      : store_(store), offset_(offset), size_(size) {}
  ~RamBlock();
  RamBlock(const RamBlock&) = delete;
  RamBlock& operator=(const RamBlock&) = delete;
  uint64_t offset() const { return offset_; }
  uint64_t size() const { return size_; }

 private:
  BlobStore* store_;
  uint64_t offset_, size_;
};

// A pinned, readable blob version in RAM. While it lives the bytes stay put.
class BlobRef {
 public:
  BlobRef() = default;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  int64_t version() const { return version_; }
  uint32_t crc() const { return crc_; }
  // True when the bytes are in the RAM tier (registered memory), false when they are
  // read in place from the cold tier.
  bool in_ram() const { return block_ != nullptr; }

 private:
  friend class BlobStore;
  std::shared_ptr<RamBlock> block_;
  std::shared_ptr<void> cold_pin_;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  int64_t version_ = 0;
  uint32_t crc_ = 0;
};

// RAM reserved for a version being received; FinishPut makes it a pending version,
// dropping it unused returns the RAM.
class PutReservation {
 public:
  PutReservation() = default;
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  friend class BlobStore;
  v1::BlobKey key_;
  int64_t version_ = 0;
  int64_t attempt_ = 0;
  std::shared_ptr<RamBlock> block_;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

class BlobStore {
 public:
  // Recovers the cold tier's contents (discarding versions no commit made current) over
  // `arena` (options.ram_bytes bytes, owned by the caller and outliving the store).
  static absl::StatusOr<std::unique_ptr<BlobStore>> Open(const BlobStoreOptions& options,
                                                         std::unique_ptr<ColdTier> cold,
                                                         uint8_t* arena,
                                                         MetricsRegistry* metrics = nullptr);
  ~BlobStore();

  // Reserves RAM for (key, version) of `size` bytes. INVALID_ARGUMENT for a bad key,
  // RESOURCE_EXHAUSTED over max_blob_bytes or larger than the RAM tier's largest block
  // (the largest power of two not above ram_bytes),
  // UNAVAILABLE while every RAM block is held by reads and receives in flight (it frees
  // as they end: the caller waits and asks again), FAILED_PRECONDITION when `version` is
  // not newer than the committed one, ABORTED for an `attempt` older than one the job
  // named here. Resident versions, pending or committed, are always in the cold tier too:
  // they are demoted (least recently used first) to make room.
  absl::StatusOr<PutReservation> BeginPut(const v1::BlobKey& key, int64_t version, uint64_t size,
                                          int64_t attempt = 0);
  // Checksums the received bytes, stores them in the cold tier and records the pending
  // version. `expected_crc`, when given, must match (DATA_LOSS otherwise); ABORTED when a
  // newer attempt of the job came meanwhile.
  absl::StatusOr<v1::BlobInfo> FinishPut(PutReservation reservation,
                                         std::optional<uint32_t> expected_crc = std::nullopt);
  // Records (key, version) as a pending version with the bytes of the same version of the
  // sibling kind (weights <-> master), which must be on this store with `size` bytes and
  // checksum `crc`: shared in the cold tier, not copied (reads come from there).
  // FAILED_PRECONDITION when there is no such sibling version, or `version` is not newer
  // than the committed one; ABORTED as BeginPut.
  absl::StatusOr<v1::BlobInfo> PutSibling(const v1::BlobKey& key, int64_t version, uint64_t size,
                                          uint32_t crc, int64_t attempt = 0);
  // BeginPut + copy + FinishPut.
  absl::StatusOr<v1::BlobInfo> Put(const v1::BlobKey& key, int64_t version,
                                   absl::Span<const uint8_t> bytes, int64_t attempt = 0);

  // Installs `bytes` as the committed `version` of `key` at once (a replica copied from a
  // peer store): durable on return. FAILED_PRECONDITION when a newer version is committed.
  absl::StatusOr<v1::BlobInfo> InstallCommitted(const v1::BlobKey& key, int64_t version,
                                                absl::Span<const uint8_t> bytes);

  // Pins `version` (-1: the committed one) in RAM, promoting it from the cold tier.
  // NOT_FOUND for an unknown key or version.
  absl::StatusOr<BlobRef> Get(const v1::BlobKey& key, int64_t version = -1);
  absl::StatusOr<v1::BlobInfo> Stat(const v1::BlobKey& key, int64_t version = -1);
  // Committed versions of a job's blobs (layer -2: all), in key order, from `after`
  // (an encoded key; empty: the start), at most `limit`.
  absl::StatusOr<std::vector<v1::BlobInfo>> List(const std::string& job_id, int layer,
                                                 std::string after, int limit, std::string* next);

  struct CommitResult {
    int64_t committed_step = -1;
    uint64_t blobs_committed = 0;
    bool already = false;  // the step was committed before: nothing changed
  };
  // Makes the job's pending versions of `step` current. With `previous` (the job's
  // committed step as the coordinator knows it), `step` must be previous + 1
  // (INVALID_ARGUMENT). A job already at `step` here answers `already`; one past it is
  // FAILED_PRECONDITION (this copy is not the job's history: a far-future commit must not
  // turn every later real one into a no-op). With `attempt` (the decided attempt), a
  // version another attempt wrote or prepared (and nobody wrote since) is dropped, not
  // committed.
  absl::StatusOr<CommitResult> CommitStep(const std::string& job_id, int64_t step,
                                          std::optional<int64_t> previous = std::nullopt,
                                          std::optional<int64_t> attempt = std::nullopt);
  // Makes the job's pending versions of `step` survive a crash of the process (a kill -9
  // between the coordinator's decision to commit and the commit): their records, tagged
  // with `attempt` (the coordinator's assignment version), go through the cold tier's
  // WAL, and the restarted store has them pending. Versions another attempt wrote or
  // prepared (and nobody wrote since) belong to a voided attempt whose abort this store
  // missed, or came after it: they are dropped. A put of a prepared version replaces it,
  // as any retried write does (and waits for a commit in progress: rare, a put after its
  // step's prepare). Returns how many versions there are; FAILED_PRECONDITION when the
  // job is at `step` or past it, ABORTED for an attempt older than one the job named.
  absl::StatusOr<uint64_t> PrepareStep(const std::string& job_id, int64_t step,
                                       int64_t attempt = 0);
  // Discards the job's pending versions of `step`; returns how many. With `successor`
  // (the attempt that replaces the aborted one), only those older attempts wrote (or that
  // name none): a late abort keeps what the successor wrote already; and the successor
  // fences the older attempts' puts off from now on.
  absl::StatusOr<uint64_t> AbortStep(const std::string& job_id, int64_t step,
                                     int64_t successor = 0);
  // Deletes every version; returns the bytes freed.
  absl::StatusOr<uint64_t> DeleteBlob(const v1::BlobKey& key);
  // What DeleteJob deletes: everything of the job, or only one group's blobs (layer -1:
  // the dense tensors), and with keep_weights all but the committed weights and masters.
  struct DeleteScope {
    bool keep_weights = false;
    std::optional<std::pair<int, int>> group;  // (layer, expert)
  };
  // Deletes the job's blobs in `scope`; returns (blobs deleted, bytes freed). The job's
  // committed step goes with everything, or with the job's last group here.
  absl::StatusOr<std::pair<uint64_t, uint64_t>> DeleteJob(const std::string& job_id,
                                                          const DeleteScope& scope);
  absl::StatusOr<std::pair<uint64_t, uint64_t>> DeleteJob(const std::string& job_id) {
    return DeleteJob(job_id, DeleteScope());
  }
  // Every job with a blob here, in job id order.
  std::vector<v1::StoreJob> Jobs();
  // The job's committed step; -1 when nothing is committed.
  // The RAM tier's largest block: the biggest blob it can hold (a put
  // of a larger one is refused, whatever --max_blob_bytes says).
  static uint64_t LargestBlock(const BlobStoreOptions& options);
  int64_t CommittedStep(const std::string& job_id);

  v1::StoreStats Stats();
  ColdTier& cold() { return *cold_; }
  uint8_t* arena() const { return arena_; }
  const BlobStoreOptions& options() const { return options_; }

 private:
  friend class RamBlock;

  struct Version {
    int64_t version = 0;
    uint64_t size = 0;
    uint32_t crc = 0;
    std::shared_ptr<RamBlock> ram;                             // null when only in the cold tier
    std::list<std::pair<std::string, int64_t>>::iterator lru;  // valid when ram is set
    uint64_t last_use = 0;        // clock_ at the last read or write; 0: never
    uint64_t last_cold_read = 0;  // cold_gets_ at the last read from the cold tier; 0: never
    bool prepared = false;        // pending, with its record in the cold tier (PrepareStep)
    int64_t attempt = 0;          // the attempt that wrote or prepared it (0: not named)
  };
  struct Blob {
    v1::BlobKey key;
    int64_t committed = -1;               // committed version, -1 when none
    std::map<int64_t, Version> versions;  // committed and pending
  };
  struct Metrics;

  BlobStore(const BlobStoreOptions& options, std::unique_ptr<ColdTier> cold, uint8_t* arena);
  // Whether pending `v` is no part of `attempt`'s step: another attempt named it (with
  // `attempt` 0, one that prepared it).
  static bool Voided(const Version& v, int64_t attempt) {
    return v.attempt != 0 && v.attempt != attempt && (attempt != 0 || v.prepared);
  }
  // `what` (a put, a prepare) of `attempt` of the job: ABORTED when the job named a newer
  // attempt here, else OK, and `attempt` is the newest. Attempt 0 passes.
  absl::Status AdmitAttemptLocked(const std::string& job_id, int64_t attempt, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AdmitAttemptLocked of a put, under mu_.
  absl::Status AdmitPut(const std::string& job_id, int64_t attempt) ABSL_LOCKS_EXCLUDED(mu_);
  // The same for the bytes of (key, version) about to be written, which must not be
  // committed meanwhile: FAILED_PRECONDITION when it was.
  absl::Status AdmitPut(const v1::BlobKey& key, const std::string& encoded, int64_t version,
                        int64_t attempt) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Recover();
  // A RAM block of `size` bytes, demoting unpinned LRU blobs as needed; UNAVAILABLE
  // (saying what holds the RAM) when every block is held, RESOURCE_EXHAUSTED at once for
  // a blob larger than the largest block. Requires mu_.
  absl::StatusOr<std::shared_ptr<RamBlock>> AllocateLocked(uint64_t size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where the RAM tier's bytes are: read, received, free. Requires mu_.
  std::string RamHoldersLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A RAM block from free space only (null when there is none). Requires mu_.
  std::shared_ptr<RamBlock> TryAllocateLocked(uint64_t size) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether a blob last used at `use` (clock_) was used after the blob a promotion would
  // evict first. Requires mu_.
  bool MoreRecentThanVictimLocked(uint64_t use) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropRamLocked(const std::string& key, Version& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void TouchLocked(const std::string& key, Version& v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseBlock(uint64_t offset) ABSL_LOCKS_EXCLUDED(alloc_mu_);
  v1::BlobInfo InfoLocked(const Blob& blob, const Version& v) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops one version from RAM and the cold tier bookkeeping. Requires mu_.
  void EraseVersionLocked(const std::string& key, Blob& blob, int64_t version, ColdBatch* batch)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs `put` (the cold-tier write and pending record of (encoded, version), of `attempt`
  // of `job_id`) so that no prepare falls between the two; a prepared version is dropped
  // from the cold tier first, once the attempt is admitted (ABORTED as AdmitAttemptLocked:
  // a voided attempt's late put never drops its successor's prepared version).
  absl::StatusOr<v1::BlobInfo> FencedPut(const std::string& encoded, int64_t version,
                                         const std::string& job_id, int64_t attempt,
                                         absl::FunctionRef<absl::StatusOr<v1::BlobInfo>()> put)
      ABSL_LOCKS_EXCLUDED(commit_mu_, prepare_mu_, mu_);
  bool IsPrepared(const std::string& encoded, int64_t version) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops (encoded, version) from memory and the cold tier if it is prepared.
  absl::Status DropPrepared(const std::string& encoded, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Stores the bytes of `r` by sharing those of the same version of its other kind
  // (weights <-> master) when they are equal; false when they are not (or not there).
  bool LinkToSibling(const PutReservation& r, const std::string& encoded, uint32_t crc)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Held by a put from its attempt check to its pending record: one put of a (key,
  // version) at a time, so a put of an attempt fenced meanwhile never leaves its bytes in
  // the cold tier under the record of a newer attempt's put of the same version.
  class VersionWrite {
   public:
    // Waits for the put of (encoded, version) in flight, if any. Requires no mu_.
    VersionWrite(BlobStore* store, std::string encoded, int64_t version);
    ~VersionWrite();
    VersionWrite(const VersionWrite&) = delete;
    VersionWrite& operator=(const VersionWrite&) = delete;

   private:
    BlobStore* const store_;
    const std::pair<std::string, int64_t> id_;
  };

  // Records a pending version of (key, version), written by `attempt`, whose bytes are in
  // the cold tier, and in `ram` when not null. ABORTED as AdmitAttemptLocked.
  absl::StatusOr<v1::BlobInfo> AddPendingLocked(const v1::BlobKey& key, const std::string& encoded,
                                                int64_t version, uint64_t size, uint32_t crc,
                                                int64_t attempt, std::shared_ptr<RamBlock> ram)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const BlobStoreOptions options_;
  const std::unique_ptr<ColdTier> cold_;
  uint8_t* const arena_;
  std::unique_ptr<Metrics> metrics_;

  absl::Mutex alloc_mu_;  // after mu_ in the lock order
  BuddyAllocator allocator_ ABSL_GUARDED_BY(alloc_mu_);

  // Held by whatever changes committed versions or their records (CommitStep,
  // InstallCommitted, AbortStep, DeleteBlob, DeleteJob): commits, installs and deletes
  // sync to disk without mu_ (reads go on meanwhile) and nothing else changes a record
  // under them. Before mu_ in the lock order.
  absl::Mutex commit_mu_;
  // Held shared by puts across their cold-tier write and pending record, and exclusively
  // by PrepareStep, the put of a prepared version, AbortStep, DeleteBlob and DeleteJob: a
  // prepare names the bytes of the version it records, and a discard never takes the bytes
  // of a put between its write and its record. Between commit_mu_ and mu_ in the lock
  // order.
  absl::Mutex prepare_mu_;
  absl::Mutex mu_;
  absl::btree_map<std::string, Blob> blobs_ ABSL_GUARDED_BY(mu_);  // by encoded key
  // RAM-resident, most recent first.
  std::list<std::pair<std::string, int64_t>> lru_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> job_steps_ ABSL_GUARDED_BY(mu_);
  // The newest attempt each job named here (puts, prepares, commits; recovered from the
  // prepared records).
  std::map<std::string, int64_t> job_attempts_ ABSL_GUARDED_BY(mu_);
  // (encoded key, version) of the puts holding a VersionWrite.
  std::set<std::pair<std::string, int64_t>> writing_ ABSL_GUARDED_BY(mu_);
  // The step each job is committing now (CommitStep from its scan to its records): a put
  // of that version is refused as one of a committed version.
  std::map<std::string, int64_t> committing_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;  // ticks on every read and write (admission)
  uint64_t cold_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ram_gets_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t cold_gets_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t puts_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t promotions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t demotions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_BLOB_STORE_H_
