// BlobStore's step and job operations: prepare, commit, abort and delete, over the
// versions the puts recorded (blob_store.cc). See blob_store.h.
#include <algorithm>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "server/store/blob_key.h"
#include "server/store/blob_store.h"

namespace pith::store {
namespace {

// What a job's kept weights are (DeleteJob's keep_weights): its weights and master blobs,
// the master being what a checkpoint reads of a bf16 job's experts.
bool IsWeightsOrMaster(const v1::BlobKey& key) {
  return key.kind() == v1::BLOB_KIND_WEIGHTS || key.kind() == v1::BLOB_KIND_MASTER;
}

}  // namespace

void BlobStore::EraseVersionLocked(const std::string& key, Blob& blob, int64_t version,
                                   ColdBatch* batch) {
  auto it = blob.versions.find(version);
  if (it == blob.versions.end()) return;
  DropRamLocked(key, it->second);
  cold_bytes_ -= it->second.size;
  batch->delete_data.push_back({key, version});
  if (it->second.prepared) batch->delete_pending.push_back({key, version});
  blob.versions.erase(it);
}

absl::StatusOr<BlobStore::CommitResult> BlobStore::CommitStep(const std::string& job_id,
                                                              int64_t step,
                                                              std::optional<int64_t> previous,
                                                              std::optional<int64_t> attempt) {
  if (job_id.empty() || step < 0)
    return absl::InvalidArgumentError("job_id and step >= 0 required");
  if (previous && step != *previous + 1) {
    return absl::InvalidArgumentError(absl::StrCat("commit of step ", step, " of job ", job_id,
                                                   " after step ", *previous,
                                                   ": not the next step"));
  }
  const std::string prefix = JobKeyPrefix(job_id);
  absl::MutexLock commit_lock(&commit_mu_);
  ColdBatch batch;
  uint64_t committed = 0;
  {
    // The puts in flight write first (a put of the step's version that passed its check
    // would otherwise write its bytes under the record this commit makes); one after
    // the scan finds the version committing and writes nothing.
    absl::MutexLock fence(&prepare_mu_);
    absl::MutexLock lock(&mu_);
    auto job_it = job_steps_.find(job_id);
    if (job_it != job_steps_.end() && job_it->second == step) {
      return CommitResult{step, 0, /*already=*/true};  // a retry: idempotent
    }
    if (job_it != job_steps_.end() && job_it->second > step) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " is at step ", job_it->second,
                       " on this store, past the commit of step ", step));
    }
    // First the metadata batch (nothing in memory changes until it is durable).
    for (auto it = blobs_.lower_bound(prefix);
         it != blobs_.end() && absl::StartsWith(it->first, prefix); ++it) {
      Blob& blob = it->second;
      auto v = blob.versions.find(step);
      if (v == blob.versions.end()) continue;
      // Written or prepared by another attempt and not written since: a voided attempt's
      // (its abort missed this store, or it came late), dropped below with what the
      // commit replaces.
      if (attempt && Voided(v->second, *attempt)) continue;
      batch.set_records.push_back({it->first, {v->second.version, v->second.size, v->second.crc}});
      if (v->second.prepared) batch.delete_pending.push_back({it->first, step});
      ++committed;
    }
    batch.set_job_steps[job_id] = step;
    // The decided attempt: nothing older is part of the job's later steps either.
    if (attempt) (void)AdmitAttemptLocked(job_id, *attempt, "a commit");
    committing_[job_id] = step;
  }
  absl::Cleanup committing = [this, &job_id] {  // a commit that failed its sync
    absl::MutexLock lock(&mu_);
    committing_.erase(job_id);
  };
  // NOTE: the sync (the step's bytes to disk) runs without mu_: gets (of the committed
  // versions, or of this step's by version) go on meanwhile. The step's pending versions
  // cannot go away under it: the coordinator never aborts a step it is committing, and a
  // copy installed meanwhile carries the same bytes.
  RETURN_IF_ERROR(cold_->Apply(batch, /*sync=*/true));

  // Then free what the commit replaced, and any stale pending version below it.
  std::set<std::string> recorded;
  for (const auto& r : batch.set_records) recorded.insert(r.key);
  absl::MutexLock lock(&mu_);
  ColdBatch cleanup;
  for (auto it = blobs_.lower_bound(prefix);
       it != blobs_.end() && absl::StartsWith(it->first, prefix); ++it) {
    Blob& blob = it->second;
    if (blob.versions.count(step) && recorded.count(it->first)) {
      blob.committed = step;
      blob.versions.at(step).prepared = false;
    }
    std::vector<int64_t> drop;
    for (const auto& [version, unused] : blob.versions) {
      if (version < blob.committed || (version <= step && version != blob.committed)) {
        drop.push_back(version);
      }
    }
    for (int64_t version : drop) EraseVersionLocked(it->first, blob, version, &cleanup);
  }
  job_steps_[job_id] = step;
  committing_.erase(job_id);  // the versions are committed now: that check takes over
  std::move(committing).Cancel();
  if (!cleanup.delete_data.empty()) RETURN_IF_ERROR(cold_->Apply(cleanup, false));
  UpdateGaugesLocked();
  return CommitResult{step, committed};
}

absl::StatusOr<uint64_t> BlobStore::PrepareStep(const std::string& job_id, int64_t step,
                                                int64_t attempt) {
  if (job_id.empty() || step < 0)
    return absl::InvalidArgumentError("job_id and step >= 0 required");
  const std::string prefix = JobKeyPrefix(job_id);
  absl::MutexLock commit_lock(&commit_mu_);
  absl::MutexLock fence(&prepare_mu_);  // no put between a record and the bytes it names
  ColdBatch batch;
  uint64_t pending = 0;
  {
    absl::MutexLock lock(&mu_);
    if (auto job = job_steps_.find(job_id); job != job_steps_.end() && job->second >= step) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is at step ", job->second,
                                                        " on this store: step ", step,
                                                        " is not pending"));
    }
    RETURN_IF_ERROR(AdmitAttemptLocked(job_id, attempt, "a prepare"));
    for (auto it = blobs_.lower_bound(prefix);
         it != blobs_.end() && absl::StartsWith(it->first, prefix);) {
      Blob& blob = it->second;
      auto v = blob.versions.find(step);
      if (v == blob.versions.end() || blob.committed == step) {
        ++it;
        continue;
      }
      if (Voided(v->second, attempt)) {
        // A voided attempt's, not written again by this one (the abort missed this store,
        // down at the time, or its put came late): not part of this step.
        EraseVersionLocked(it->first, blob, step, &batch);
        it = blob.versions.empty() ? blobs_.erase(it) : std::next(it);
        continue;
      }
      ++pending;
      if (!v->second.prepared) {
        batch.set_pending.push_back({it->first, {{step, v->second.size, v->second.crc}, attempt}});
      }
      ++it;
    }
    UpdateGaugesLocked();
  }
  // Through the WAL, not synced: a process crash keeps it (DESIGN §4, the prepare).
  if (!batch.set_pending.empty() || !batch.delete_data.empty()) {
    RETURN_IF_ERROR(cold_->Apply(batch, /*sync=*/false));
  }
  absl::MutexLock lock(&mu_);
  for (const auto& r : batch.set_pending) {
    auto it = blobs_.find(r.key);
    if (it == blobs_.end()) continue;
    if (auto v = it->second.versions.find(step); v != it->second.versions.end()) {
      v->second.prepared = true;
      v->second.attempt = attempt;
    }
  }
  return pending;
}

absl::StatusOr<uint64_t> BlobStore::AbortStep(const std::string& job_id, int64_t step,
                                              int64_t successor) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id is required");
  const std::string prefix = JobKeyPrefix(job_id);
  absl::MutexLock commit_lock(&commit_mu_);  // not inside a commit's sync
  absl::MutexLock fence(&prepare_mu_);       // no put between its write and its record
  absl::MutexLock lock(&mu_);
  if (successor != 0) {
    int64_t& newest = job_attempts_[job_id];
    newest = std::max(newest, successor);
  }
  ColdBatch batch;
  uint64_t discarded = 0;
  for (auto it = blobs_.lower_bound(prefix);
       it != blobs_.end() && absl::StartsWith(it->first, prefix); ++it) {
    Blob& blob = it->second;
    auto v = blob.versions.find(step);
    if (blob.committed == step || v == blob.versions.end()) continue;
    if (successor != 0 && v->second.attempt >= successor) continue;  // the successor's
    EraseVersionLocked(it->first, blob, step, &batch);
    ++discarded;
  }
  // Blobs that only ever had the aborted version disappear.
  for (auto it = blobs_.lower_bound(prefix);
       it != blobs_.end() && absl::StartsWith(it->first, prefix);) {
    it = it->second.versions.empty() ? blobs_.erase(it) : std::next(it);
  }
  if (!batch.delete_data.empty()) RETURN_IF_ERROR(cold_->Apply(batch, false));
  UpdateGaugesLocked();
  return discarded;
}

absl::StatusOr<uint64_t> BlobStore::DeleteBlob(const v1::BlobKey& key) {
  RETURN_IF_ERROR(ValidateBlobKey(key));
  const std::string encoded = EncodeBlobKey(key);
  absl::MutexLock commit_lock(&commit_mu_);  // not inside a commit's sync
  absl::MutexLock fence(&prepare_mu_);       // no put between its write and its record
  ColdBatch batch;
  uint64_t bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = blobs_.find(encoded);
    if (it == blobs_.end())
      return absl::NotFoundError(absl::StrCat("no blob ", BlobKeyDebugString(key)));
    while (!it->second.versions.empty()) {
      bytes += it->second.versions.begin()->second.size;
      EraseVersionLocked(encoded, it->second, it->second.versions.begin()->first, &batch);
    }
    batch.delete_records.push_back(encoded);
    blobs_.erase(it);
    UpdateGaugesLocked();
  }
  // The sync without mu_: reads go on (the blob is gone from them already).
  RETURN_IF_ERROR(cold_->Apply(batch, true));
  return bytes;
}

absl::StatusOr<std::pair<uint64_t, uint64_t>> BlobStore::DeleteJob(const std::string& job_id,
                                                                   const DeleteScope& scope) {
  if (job_id.empty()) return absl::InvalidArgumentError("job_id is required");
  const std::string prefix = JobKeyPrefix(job_id);
  absl::MutexLock commit_lock(&commit_mu_);  // not inside a commit's sync
  absl::MutexLock fence(&prepare_mu_);       // no put between its write and its record
  ColdBatch batch;
  uint64_t blobs = 0, bytes = 0;
  absl::ReleasableMutexLock lock(&mu_);
  for (auto it = blobs_.lower_bound(prefix);
       it != blobs_.end() && absl::StartsWith(it->first, prefix);) {
    Blob& blob = it->second;
    const v1::BlobKey& k = blob.key;
    if (scope.group && (k.layer() != scope.group->first ||
                        (k.layer() >= 0 && k.expert() != scope.group->second))) {
      ++it;
      continue;
    }
    const bool keep = scope.keep_weights && IsWeightsOrMaster(k) && blob.committed >= 0;
    std::vector<int64_t> drop;
    for (const auto& [version, unused] : blob.versions) {
      if (!keep || version != blob.committed) drop.push_back(version);
    }
    for (int64_t version : drop) {
      bytes += blob.versions.at(version).size;
      EraseVersionLocked(it->first, blob, version, &batch);
    }
    if (keep) {
      ++it;
      continue;
    }
    batch.delete_records.push_back(it->first);
    ++blobs;
    it = blobs_.erase(it);
  }
  const auto rest = blobs_.lower_bound(prefix);
  const bool none_left = rest == blobs_.end() || !absl::StartsWith(rest->first, prefix);
  if (!scope.keep_weights && !scope.group) {
    batch.delete_job_steps.push_back(job_id);
    job_steps_.erase(job_id);
    job_attempts_.erase(job_id);
  } else if (scope.group && none_left && job_steps_.erase(job_id) > 0) {
    // Its last group of the job went: the step it committed is no longer its step of the
    // job (ListJobs), should it take a copy of a group again without committing one.
    batch.delete_job_steps.push_back(job_id);
  }
  UpdateGaugesLocked();
  lock.Release();
  // The sync without mu_: reads go on (the blobs are gone from them already).
  RETURN_IF_ERROR(cold_->Apply(batch, true));
  return std::make_pair(blobs, bytes);
}

std::vector<v1::StoreJob> BlobStore::Jobs() {
  absl::MutexLock lock(&mu_);
  std::vector<v1::StoreJob> out;
  for (const auto& [encoded, blob] : blobs_) {
    if (out.empty() || out.back().job_id() != blob.key.job_id()) {
      v1::StoreJob& job = out.emplace_back();
      job.set_job_id(blob.key.job_id());
      auto step = job_steps_.find(blob.key.job_id());
      job.set_committed_step(step == job_steps_.end() ? -1 : step->second);
    }
    v1::StoreJob& job = out.back();
    job.set_blobs(job.blobs() + 1);
    const bool weights_only =
        IsWeightsOrMaster(blob.key) && blob.committed >= 0 && blob.versions.size() == 1;
    if (!weights_only) job.set_blobs_besides_weights(job.blobs_besides_weights() + 1);
    for (const auto& [version, v] : blob.versions) job.set_bytes(job.bytes() + v.size);
  }
  return out;
}

int64_t BlobStore::CommittedStep(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = job_steps_.find(job_id);
  return it == job_steps_.end() ? -1 : it->second;
}

}  // namespace pith::store
