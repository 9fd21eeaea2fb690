#include "server/coordinator/job_registry.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_spec.h"
#include "common/job_state.h"
#include "common/status.h"
#include "rocksdb/db.h"
#include "server/coordinator/job_memory.h"

namespace pith::coordinator {
namespace {

// A job id the registry does not know; a name alone (the spec's) is the usual mistake.
absl::Status NoJob(const std::string& job_id) {
  const size_t dash = job_id.rfind('-');
  const bool numbered = dash != std::string::npos && dash + 1 < job_id.size() &&
                        job_id.find_first_not_of("0123456789", dash + 1) == std::string::npos;
  return absl::NotFoundError(absl::StrCat(
      "no job ", job_id,
      numbered ? ""
               : absl::StrCat(" (a job's id is its spec's name and a number, as submit "
                              "answered, e.g. ",
                              job_id, "-7; pith status lists them)")));
}

constexpr char kJobPrefix[] = "job/";
constexpr char kNextIdKey[] = "meta/next_job_id";

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

absl::Status FromRocks(const rocksdb::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("rocksdb ", what, ": ", s.ToString()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<JobRegistry>> JobRegistry::Open(const std::string& data_dir,
                                                               uint64_t jobs_memory_bytes) {
  if (data_dir.empty()) return absl::InvalidArgumentError("--data_dir is required");
  rocksdb::Options options;
  options.create_if_missing = true;
  rocksdb::DB* raw = nullptr;
  RETURN_IF_ERROR(FromRocks(rocksdb::DB::Open(options, data_dir, &raw), "open " + data_dir));
  std::unique_ptr<JobRegistry> r(new JobRegistry());
  r->db_.reset(raw);
  r->jobs_memory_bytes_ = jobs_memory_bytes;
  absl::MutexLock lock(&r->mu_);
  std::unique_ptr<rocksdb::Iterator> it(r->db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(kJobPrefix); it->Valid() && it->key().starts_with(kJobPrefix); it->Next()) {
    v1::Job job;
    if (!job.ParseFromArray(it->value().data(), static_cast<int>(it->value().size()))) {
      return absl::DataLossError(absl::StrCat("unreadable job record ", it->key().ToString()));
    }
    if (job.removed_unix_ms() != 0) {
      r->removed_[job.job_id()] = std::move(job);
      continue;
    }
    r->versions_[job.job_id()] = 0;
    r->jobs_[job.job_id()] = std::move(job);
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan"));
  std::string next;
  if (r->db_->Get(rocksdb::ReadOptions(), kNextIdKey, &next).ok()) {
    (void)absl::SimpleAtoi(next, &r->next_id_);
  }
  // Past every id recorded, whatever the counter says: an id is never handed out twice.
  for (const auto* jobs : {&r->jobs_, &r->removed_}) {
    for (const auto& [id, job] : *jobs) {
      int64_t number = 0;
      if (absl::SimpleAtoi(absl::string_view(id).substr(id.rfind('-') + 1), &number)) {
        r->next_id_ = std::max(r->next_id_, number + 1);
      }
    }
  }
  return r;
}

JobRegistry::~JobRegistry() = default;

absl::Status JobRegistry::Persist(const v1::Job& job) {
  rocksdb::WriteOptions sync;
  sync.sync = true;
  return FromRocks(db_->Put(sync, absl::StrCat(kJobPrefix, job.job_id()), job.SerializeAsString()),
                   "put job");
}

absl::StatusOr<v1::Job> JobRegistry::Submit(v1::JobSpec spec, std::string owner, int owner_limit) {
  spec.DiscardUnknownFields();  // a newer client's fields mean nothing here; never kept
  ApplyJobSpecDefaults(&spec);
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(AdmitLocked(spec));
  if (owner_limit > 0) {
    const int unfinished =
        static_cast<int>(std::count_if(jobs_.begin(), jobs_.end(), [&](const auto& j) {
          return j.second.owner() == owner && !IsFinal(j.second.state());
        }));
    if (unfinished >= owner_limit) {
      return absl::ResourceExhaustedError(
          absl::StrCat(owner, " has ", unfinished,
                       " unfinished job(s), the most this coordinator allows a user "
                       "(--max_jobs_per_user=",
                       owner_limit, "); wait for one to end, or cancel one"));
    }
  }
  v1::Job job;
  job.set_job_id(absl::StrCat(spec.name(), "-", next_id_));
  *job.mutable_spec() = std::move(spec);
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_committed_step(-1);  // no initial weights yet
  job.set_created_unix_ms(NowMs());
  job.set_owner(std::move(owner));
  rocksdb::WriteOptions sync;
  sync.sync = true;
  RETURN_IF_ERROR(FromRocks(db_->Put(sync, kNextIdKey, absl::StrCat(next_id_ + 1)), "put id"));
  RETURN_IF_ERROR(Persist(job));
  ++next_id_;
  versions_[job.job_id()] = 0;
  jobs_[job.job_id()] = job;
  if (observer_) observer_(job);
  return job;
}

void JobRegistry::OnChange(std::function<void(const v1::Job&)> observer) {
  absl::MutexLock lock(&mu_);
  observer_ = std::move(observer);
}

absl::Status JobRegistry::AdmitLocked(const v1::JobSpec& spec) const {
  if (jobs_memory_bytes_ == 0) return absl::OkStatus();
  const uint64_t need = JobStateBytes(spec);
  uint64_t held = 0;
  int unfinished = 0;
  for (const auto& [id, job] : jobs_) {
    if (IsFinal(job.state())) continue;
    held += JobStateBytes(job.spec());
    ++unfinished;
  }
  if (need <= jobs_memory_bytes_ && held <= jobs_memory_bytes_ - need) return absl::OkStatus();
  constexpr double kMiB = 1 << 20;
  return absl::ResourceExhaustedError(absl::StrFormat(
      "the coordinator cannot hold this job: its state (%d layers x %d experts, %d store copies, "
      "%d workers) takes about %.1f MiB, and %.1f MiB of --jobs_memory_bytes=%d are left beside "
      "%d unfinished job(s)",
      spec.model().n_layer(), spec.model().n_expert(), spec.cluster().store_replicas(),
      spec.cluster().workers(), need / kMiB,
      (jobs_memory_bytes_ - std::min(held, jobs_memory_bytes_)) / kMiB, jobs_memory_bytes_,
      unfinished));
}

absl::StatusOr<v1::Job> JobRegistry::Get(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return NoJobLocked(job_id);
  return it->second;
}

absl::Status JobRegistry::NoJobLocked(const std::string& job_id) const {
  auto removed = removed_.find(job_id);
  if (removed == removed_.end()) return NoJob(job_id);
  return absl::NotFoundError(
      absl::StrCat("job ", job_id, " was removed (", StateName(removed->second.state()), ")"));
}

absl::StatusOr<std::string> JobRegistry::Owner(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  if (auto it = jobs_.find(job_id); it != jobs_.end()) return it->second.owner();
  if (auto it = removed_.find(job_id); it != removed_.end()) return it->second.owner();
  return NoJob(job_id);
}

bool JobRegistry::Removed(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  return removed_.count(job_id) > 0;
}

absl::StatusOr<v1::Job> JobRegistry::Remove(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return NoJobLocked(job_id);
  const v1::Job& job = it->second;
  if (!IsFinal(job.state())) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_id, " is ", StateName(job.state()),
                     "; only an ended job is removed (pith cancel ", job_id, " first)"));
  }
  v1::Job tombstone;
  tombstone.set_job_id(job.job_id());
  tombstone.set_owner(job.owner());
  tombstone.set_state(job.state());
  tombstone.set_created_unix_ms(job.created_unix_ms());
  tombstone.set_finished_unix_ms(job.finished_unix_ms());
  tombstone.set_removed_unix_ms(NowMs());
  RETURN_IF_ERROR(Persist(tombstone));
  v1::Job last = std::move(it->second);
  jobs_.erase(it);
  removed_[job_id] = tombstone;
  ++versions_[job_id];  // wakes its waiters, who find it gone
  if (observer_) observer_(tombstone);
  return last;
}

std::vector<v1::Job> JobRegistry::List(const std::vector<v1::JobState>& states, int limit,
                                       const std::optional<std::string>& owner) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  for (const auto& [id, job] : jobs_) {
    if (owner.has_value() && job.owner() != *owner) continue;
    if (states.empty() || std::find(states.begin(), states.end(), job.state()) != states.end()) {
      out.push_back(job);
    }
  }
  std::sort(out.begin(), out.end(), [](const v1::Job& a, const v1::Job& b) {
    return a.created_unix_ms() != b.created_unix_ms() ? a.created_unix_ms() > b.created_unix_ms()
                                                      : a.job_id() > b.job_id();
  });
  if (limit > 0 && static_cast<int>(out.size()) > limit) out.resize(limit);
  return out;
}

std::map<v1::JobState, int> JobRegistry::CountByState() const {
  absl::MutexLock lock(&mu_);
  std::map<v1::JobState, int> out;
  for (const auto& [id, job] : jobs_) ++out[job.state()];
  return out;
}

absl::StatusOr<v1::Job> JobRegistry::Update(const std::string& job_id,
                                            const std::function<absl::Status(v1::Job&)>& update) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return NoJobLocked(job_id);
  v1::Job job = it->second;
  RETURN_IF_ERROR(update(job));
  RETURN_IF_ERROR(Persist(job));
  it->second = job;
  ++versions_[job_id];
  if (observer_) observer_(job);
  return job;
}

absl::StatusOr<v1::Job> JobRegistry::Cancel(const std::string& job_id, const std::string& reason) {
  return Update(job_id, [&](v1::Job& job) -> absl::Status {
    if (IsFinal(job.state())) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " already ended (", StateName(job.state()), ")"));
    }
    job.set_state(v1::JOB_STATE_CANCELLED);
    job.clear_pending_reason();
    job.set_failure_reason(reason.empty() ? "cancelled" : reason);
    job.set_finished_unix_ms(NowMs());
    return absl::OkStatus();
  });
}

int64_t JobRegistry::Version(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = versions_.find(job_id);
  return it == versions_.end() ? -1 : it->second;
}

absl::StatusOr<v1::Job> JobRegistry::WaitForChange(const std::string& job_id, int64_t seen_version,
                                                   absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  if (!jobs_.count(job_id)) return NoJobLocked(job_id);
  auto changed = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return versions_.at(job_id) != seen_version;
  };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return NoJobLocked(job_id);  // removed meanwhile
  return it->second;
}

absl::Status JobRegistry::PutRecord(const std::string& key, const std::string& value) {
  if (absl::StartsWith(key, kJobPrefix) || absl::StartsWith(key, "meta/")) {
    return absl::InvalidArgumentError(absl::StrCat("reserved record key ", key));
  }
  rocksdb::WriteOptions sync;
  sync.sync = true;
  return FromRocks(db_->Put(sync, key, value), "put record");
}

absl::Status JobRegistry::DeleteRecord(const std::string& key) {
  rocksdb::WriteOptions sync;
  sync.sync = true;
  return FromRocks(db_->Delete(sync, key), "delete record");
}

absl::StatusOr<std::map<std::string, std::string>> JobRegistry::Records(
    const std::string& prefix) const {
  std::map<std::string, std::string> out;
  std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions()));
  for (it->Seek(prefix); it->Valid() && it->key().starts_with(prefix); it->Next()) {
    out.emplace(it->key().ToString(), it->value().ToString());
  }
  RETURN_IF_ERROR(FromRocks(it->status(), "scan records"));
  return out;
}

}  // namespace pith::coordinator
