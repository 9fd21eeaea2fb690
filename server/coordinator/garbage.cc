// The coordinator's garbage collection (DESIGN §5.7): the groups stores left, and the
// blobs of ended jobs, are deleted from the stores. See scheduler.h.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_state.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/coordinator/placement.h"
#include "server/coordinator/placement_table.h"
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

// A kept blob's identity across stores: (layer, expert, dense tensor, kind).
using KeptKey = std::tuple<int, int, std::string, int>;

KeptKey KeyOf(const v1::BlobKey& k) { return {k.layer(), k.expert(), k.tensor(), k.kind()}; }

}  // namespace

int Scheduler::HomeEndedWeights(const v1::MemberInfo& source, const std::string& job_id,
                                const Alive& alive) {
  absl::StatusOr<std::vector<v1::BlobInfo>> mine =
      stores_->ListGroup(source, job_id, /*layer=*/-2, 0);
  if (!mine.ok()) {
    LOG(WARNING) << "drain of " << source.member_id() << ": " << mine.status();
    return -1;
  }
  // The newest version of each kept blob on the stores that stay.
  std::map<KeptKey, int64_t> elsewhere;
  for (const auto& [id, store] : alive.stores) {
    if (alive.draining.count(id)) continue;
    absl::StatusOr<std::vector<v1::BlobInfo>> theirs = stores_->ListGroup(store, job_id, -2, 0);
    if (!theirs.ok()) continue;  // copies there do not count this pass
    for (const v1::BlobInfo& b : *theirs) {
      int64_t& newest = elsewhere.try_emplace(KeyOf(b.key()), -1).first->second;
      newest = std::max(newest, b.version());
    }
  }
  const std::vector<std::string> targets = alive.placeable_ids();
  // Each blob no store that stays holds, with the stores it may go to, best first.
  std::vector<std::pair<v1::BlobKey, std::vector<std::string>>> homeless;
  for (const v1::BlobInfo& b : *mine) {
    const v1::BlobKind kind = b.key().kind();
    if (kind != v1::BLOB_KIND_WEIGHTS && kind != v1::BLOB_KIND_MASTER) continue;
    auto there = elsewhere.find(KeyOf(b.key()));
    if (there != elsewhere.end() && there->second >= b.version()) continue;
    const std::string group = GroupName(job_id, b.key().layer(), b.key().expert());
    homeless.emplace_back(b.key(), RendezvousStores(group, targets, targets.size()));
  }
  if (!homeless.empty() && targets.empty()) {
    LOG(WARNING) << "drain of " << source.member_id() << ": ended job " << job_id << " keeps "
                 << homeless.size() << " weights blob(s) there and no other store takes copies";
  }
  // Pulled to each blob's first choice; a store that fails passes its blobs to their next.
  for (size_t choice = 0; choice < targets.size() && !homeless.empty(); ++choice) {
    std::map<std::string, std::vector<size_t>> by_target;
    for (size_t i = 0; i < homeless.size(); ++i) by_target[homeless[i].second[choice]].push_back(i);
    std::vector<std::pair<v1::BlobKey, std::vector<std::string>>> still;
    for (const auto& [target, blobs] : by_target) {
      std::vector<v1::BlobKey> keys;
      for (size_t i : blobs) keys.push_back(homeless[i].first);
      absl::StatusOr<std::vector<v1::BlobInfo>> pulled = stores_->Pull(
          alive.stores.at(target), source, keys, options_.replication_bytes_per_second);
      if (pulled.ok()) {  // a newer version there (one not pulled) counts as well
        LOG(INFO) << "drain of " << source.member_id() << ": ended job " << job_id << "'s "
                  << keys.size() << " weights blob(s) copied to " << target;
        continue;
      }
      LOG(WARNING) << "drain of " << source.member_id() << ": copying ended job " << job_id
                   << "'s weights to " << target << ": " << pulled.status();
      for (size_t i : blobs) still.push_back(std::move(homeless[i]));
    }
    homeless = std::move(still);
  }
  return static_cast<int>(homeless.size());
}

absl::Status Scheduler::EndedWeightsHaveAHome(const std::string& store_id, const Alive& alive) {
  const auto store = alive.stores.find(store_id);
  if (!options_.keep_ended_weights || store == alive.stores.end() ||
      alive.draining.count(store_id)) {
    return absl::OkStatus();
  }
  for (const std::string& id : alive.placeable_ids()) {
    if (id != store_id) return absl::OkStatus();
  }
  absl::StatusOr<std::vector<v1::StoreJob>> held = stores_->ListJobs(store->second);
  if (!held.ok()) return Annotate(held.status(), absl::StrCat("listing ", store_id, "'s jobs"));
  std::vector<std::string> ended;
  for (const v1::StoreJob& j : *held) {
    if (j.blobs() > 0 && FateOf(j.job_id()) == BlobFate::kAllButWeights) {
      ended.push_back(j.job_id());
    }
  }
  if (ended.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "draining ", store_id, " would leave no store to keep the weights of ended job(s) ",
      absl::StrJoin(ended, ", "),
      " (pith checkpoint reads them) and no other store takes copies now; add a store first, "
      "or pith remove the jobs"));
}

Scheduler::BlobFate Scheduler::FateOf(const std::string& job_id) const {
  absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
  if (job.ok() && IsFinal(job->state())) {
    return options_.keep_ended_weights ? BlobFate::kAllButWeights : BlobFate::kAll;
  }
  if (!job.ok() && jobs_->Removed(job_id)) return BlobFate::kAll;
  return BlobFate::kKeep;
}

void Scheduler::NoteJobEndedLocked(const Run& run) {
  std::set<std::string> used = JobStores(run);
  for (const auto& [id, why] : run.record.lost_stores()) used.insert(id);
  for (const auto& [left, step] : run.left) used.insert(std::get<0>(left));
  for (const std::string& id : used) {
    ended_homed_.erase(id);
    ++ended_on_[id];
  }
}

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

struct Scheduler::Deletion {
  v1::MemberInfo store;
  v1::DeleteJobRequest request;
  std::tuple<std::string, int, int> left;  // a group left: its entry in the run
};

void Scheduler::CollectLeftLocked(const Alive& alive, std::vector<Deletion>* deletions) {
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
        Deletion& d = deletions->emplace_back();
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

int Scheduler::CollectGarbageOnce() {
  const Alive alive = Snapshot(*members_);
  std::vector<Deletion> deletions;
  std::set<std::string> homed;  // draining stores whose ended jobs' weights are all homed
  std::map<std::string, uint64_t> ended_on;
  {
    absl::MutexLock lock(&mu_);
    homed = ended_homed_;  // no job that used them ended since they were found so
    ended_on = ended_on_;
    CollectLeftLocked(alive, &deletions);
  }
  // By job id, looked up once a pass (not once a store).
  std::map<std::string, BlobFate> fates;
  // Draining stores not yet found homed, with the ended jobs whose kept weights they hold.
  std::map<std::string, std::vector<std::string>> to_home;
  for (const auto& [id, store] : alive.stores) {
    absl::StatusOr<std::vector<v1::StoreJob>> held = stores_->ListJobs(store);
    if (!held.ok()) continue;  // its lease, not the collector, decides about it
    const bool to_look_at = store.state() == v1::MEMBER_STATE_DRAINING && !homed.count(id);
    if (to_look_at) to_home[id];
    for (const v1::StoreJob& j : *held) {
      auto [known, fresh] = fates.try_emplace(j.job_id(), BlobFate::kKeep);
      if (fresh) known->second = FateOf(j.job_id());
      if (known->second == BlobFate::kKeep) continue;
      const bool keep = known->second == BlobFate::kAllButWeights;
      if (keep && to_look_at && j.blobs() > 0) to_home[id].push_back(j.job_id());
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
  // After the deletions (none of this pass's lands on a copy made here; copies of running
  // jobs wait on none of the pulls), the drains' copies of ended jobs' weights.
  std::set<std::string> newly;
  for (const auto& [id, jobs] : to_home) {
    bool all = true;
    for (const std::string& job_id : jobs) {
      all &= HomeEndedWeights(alive.stores.at(id), job_id, alive) == 0;
    }
    if (all) newly.insert(id);
  }
  absl::MutexLock lock(&mu_);
  for (const std::string& id : newly) {
    if (ended_on_[id] == ended_on[id]) ended_homed_.insert(id);
  }
  // A store that is not draining now (drained, gone, or back) is looked at afresh.
  std::erase_if(ended_homed_, [&](const std::string& id) {
    const auto store = alive.stores.find(id);
    return store == alive.stores.end() || store->second.state() != v1::MEMBER_STATE_DRAINING;
  });
  return done;
}

}  // namespace pith::coordinator
