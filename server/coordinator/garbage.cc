// The coordinator's garbage collection (DESIGN §5.7): the groups stores left, and the
// blobs of ended jobs, are deleted from the stores. See scheduler.h.
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {
namespace {

// Every store of every group of `p` (complete or joining copies), by GroupOf.
std::map<std::pair<int, int>, std::set<std::string>> StoresByGroup(const v1::PlacementTable& p) {
  std::map<std::pair<int, int>, std::set<std::string>> out;
  for (const v1::ExpertPlacement& e : p.experts()) {
    std::set<std::string>& ids = out[GroupOf(e.layer(), e.expert())];
    ids.insert(e.store_ids().begin(), e.store_ids().end());
    ids.insert(e.joining_store_ids().begin(), e.joining_store_ids().end());
  }
  return out;
}

}  // namespace

void Scheduler::NoteLeftLocked(Run& run, const v1::PlacementTable& before) {
  const auto now = StoresByGroup(run.record.placement());
  for (const auto& [group, ids] : StoresByGroup(before)) {
    auto kept = now.find(group);
    for (const std::string& id : ids) {
      if (kept != now.end() && kept->second.count(id)) continue;
      run.left[{id, group.first, group.second}] = run.record.placement().effective_step();
    }
  }
}

int Scheduler::CollectGarbageOnce() {
  const Alive alive = Snapshot(*members_);
  struct Deletion {
    v1::MemberInfo store;
    v1::DeleteJobRequest request;
    std::tuple<std::string, int, int> left;  // a group left: its entry in the run
  };
  std::vector<Deletion> deletions;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      const auto placed = StoresByGroup(run.record.placement());
      for (auto it = run.left.begin(); it != run.left.end();) {
        const auto& [id, layer, expert] = it->first;
        auto group = placed.find({layer, expert});
        if (group != placed.end() && group->second.count(id)) {
          it = run.left.erase(it);  // placed there again: nothing to delete
          continue;
        }
        auto store = alive.stores.find(id);
        auto join = run.copies.join_requests.find({layer, expert});
        const bool joining_again = join != run.copies.join_requests.end() && join->second == id;
        // A step under the placement without the store committed: no attempt reads there.
        if (store != alive.stores.end() && run.committed >= it->second && !joining_again) {
          Deletion& d = deletions.emplace_back();
          d.store = store->second;
          d.request.set_job_id(job_id);
          d.request.set_layer(layer);
          d.request.set_expert(expert);
          d.left = it->first;
          collecting_.insert({job_id, id, layer, expert});
        }
        ++it;
      }
    }
  }
  // By job id, looked up once a pass (not once a store): what goes of the job's blobs.
  enum class Fate { kKeep, kAllButWeights, kAll };
  std::map<std::string, Fate> fates;
  for (const auto& [id, store] : alive.stores) {
    absl::StatusOr<std::vector<v1::StoreJob>> held = stores_->ListJobs(store);
    if (!held.ok()) continue;  // its lease, not the collector, decides about it
    for (const v1::StoreJob& j : *held) {
      auto [known, fresh] = fates.try_emplace(j.job_id(), Fate::kKeep);
      if (fresh) {
        absl::StatusOr<v1::Job> job = jobs_->Get(j.job_id());
        if (job.ok() && IsFinal(job->state())) {
          known->second = options_.keep_ended_weights ? Fate::kAllButWeights : Fate::kAll;
        } else if (!job.ok() && jobs_->Removed(j.job_id())) {
          known->second = Fate::kAll;
        }
      }
      if (known->second == Fate::kKeep) continue;  // unknown, or still going
      const bool keep = known->second == Fate::kAllButWeights;
      if (keep ? j.blobs_besides_weights() == 0 : j.blobs() == 0) continue;
      Deletion& d = deletions.emplace_back();
      d.store = store;
      d.request.set_job_id(j.job_id());
      d.request.set_keep_weights(keep);
    }
  }
  int done = 0;
  for (const Deletion& d : deletions) {
    absl::Status s = stores_->DeleteJob(d.store, d.request);
    if (!s.ok()) LOG(WARNING) << "garbage collection: " << s;
    done += s.ok();
    if (!d.request.has_layer()) continue;
    absl::MutexLock lock(&mu_);
    collecting_.erase(
        {d.request.job_id(), d.store.member_id(), d.request.layer(), d.request.expert()});
    auto run = runs_.find(d.request.job_id());
    if (s.ok() && run != runs_.end()) run->second.left.erase(d.left);
  }
  return done;
}

}  // namespace pith::coordinator
