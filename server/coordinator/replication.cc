#include "server/coordinator/replication.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "server/coordinator/placement_table.h"

namespace pith::coordinator {

namespace {

// The steps of Replication::ApplyCopies, in order, over the job's groups.
using Entries = std::map<JobCopies::Group, v1::ExpertPlacement*>;

// A joining store must have committed every step since it joined; one that missed this
// commit (it died, or did not answer) leaves, and joins again from scratch.
bool DropMissedJoins(JobCopies& copies, Entries& entries) {
  bool changed = false;
  for (auto& [key, e] : entries) {
    const JobCopies::Group group = key;  // a lambda cannot capture a structured binding
    auto* joining = e->mutable_joining_store_ids();
    const int before = joining->size();
    joining->erase(std::remove_if(joining->begin(), joining->end(),
                                  [&](const std::string& id) {
                                    if (copies.committed_on.count(id)) return false;
                                    copies.joined_at.erase({group, id});
                                    return true;
                                  }),
                   joining->end());
    changed |= joining->size() != before;
  }
  copies.committed_on.clear();
  return changed;
}

// A joining store whose copy is complete is a reader from now on: it got every version
// written since it joined, and the pull (begun after it joined) brought the committed
// one from before.
bool PromoteFinishedCopies(const Alive& alive, JobCopies& copies, Entries& entries) {
  bool changed = false;
  for (const JobCopies::Copy& copy : copies.copied) {
    auto it = entries.find(copy.group);
    if (it == entries.end()) continue;
    auto* joining = it->second->mutable_joining_store_ids();
    auto pos = std::find(joining->begin(), joining->end(), copy.target);
    auto joined = copies.joined_at.find({copy.group, copy.target});
    if (pos == joining->end() || joined == copies.joined_at.end() ||
        copy.start_step < joined->second) {
      continue;
    }
    copies.joined_at.erase(joined);
    joining->erase(pos);
    auto* ids = it->second->mutable_store_ids();
    if (alive.stores.count(copy.target) &&
        std::find(ids->begin(), ids->end(), copy.target) == ids->end()) {
      *ids->Add() = copy.target;
    }
    changed = true;
  }
  copies.copied.clear();
  return changed;
}

// Stores a group is short of join it: writers include them from the next step on.
bool AddRequestedJoins(int64_t committed, const Alive& alive, JobCopies& copies, Entries& entries) {
  bool changed = false;
  for (const auto& [group, target] : copies.join_requests) {
    auto it = entries.find(group);
    if (it == entries.end() || !alive.placeable(target)) continue;
    const auto& ids = it->second->store_ids();
    const auto& joining = it->second->joining_store_ids();
    if (std::find(ids.begin(), ids.end(), target) != ids.end() ||
        std::find(joining.begin(), joining.end(), target) != joining.end()) {
      continue;
    }
    *it->second->add_joining_store_ids() = target;
    copies.joined_at[{group, target}] = committed;
    changed = true;
  }
  copies.join_requests.clear();
  return changed;
}

// Surplus copies (a store joined and took over a share, a store is draining, an expert
// cooled down) leave once every desired store holds the group — and never below the
// replica count (too few stores take new copies: the draining ones keep theirs).
bool DropSurplusCopies(const v1::Job& job, const Alive& alive, const std::optional<HeatMap>& heat,
                       Entries& entries) {
  const std::vector<std::string> live = alive.placeable_ids();
  const std::vector<double> means = heat ? LayerMeans(*heat) : std::vector<double>();
  const size_t replicas = std::max(1, job.spec().cluster().store_replicas());
  bool changed = false;
  for (auto& [group, e] : entries) {
    const std::vector<std::string> desired =
        DesiredStores(job, e->layer(), e->expert(), live, heat ? &*heat : nullptr, means);
    const std::set<std::string> held(e->store_ids().begin(), e->store_ids().end());
    bool complete = desired.size() >= replicas;
    for (const std::string& d : desired) complete &= held.count(d) > 0;
    if (!complete || held.size() == desired.size()) continue;
    e->clear_store_ids();
    for (const std::string& d : desired) e->add_store_ids(d);
    changed = true;
  }
  return changed;
}

}  // namespace

Replication::Replication(MetricsRegistry* metrics) {
  if (metrics == nullptr) return;
  blobs_moved_total_ =
      *metrics->Counter("pith_coordinator_blobs_moved_total", "Blobs copied store to store");
  bytes_moved_total_ =
      *metrics->Counter("pith_coordinator_moved_bytes_total", "Bytes copied store to store");
  moves_in_flight_ = *metrics->Gauge("pith_coordinator_moves_in_flight",
                                     "Store-to-store group copies in progress");
  replica_deficit_ =
      *metrics->Gauge("pith_coordinator_replica_deficit",
                      "Store copies missing to give every group its configured replica count");
}

bool Replication::ApplyCopies(const v1::Job& job, int64_t committed, const Alive& alive,
                              const std::optional<HeatMap>& heat, JobCopies& copies,
                              v1::PlacementTable& placement, std::string* why) {
  return Apply(job, committed, alive, heat, copies, placement, why, /*paused=*/false);
}

bool Replication::ApplyCopiesWhilePaused(const v1::Job& job, int64_t committed, const Alive& alive,
                                         const std::optional<HeatMap>& heat, JobCopies& copies,
                                         v1::PlacementTable& placement, std::string* why) {
  return Apply(job, committed, alive, heat, copies, placement, why, /*paused=*/true);
}

bool Replication::Apply(const v1::Job& job, int64_t committed, const Alive& alive,
                        const std::optional<HeatMap>& heat, JobCopies& copies,
                        v1::PlacementTable& placement, std::string* why, bool paused) {
  Entries entries;
  for (v1::ExpertPlacement& e : *placement.mutable_experts()) {
    entries[GroupOf(e.layer(), e.expert())] = &e;
  }
  bool changed = false;
  const auto step = [&](bool step_changed, const char* what) {
    changed |= step_changed;
    if (step_changed && why != nullptr) absl::StrAppend(why, why->empty() ? "" : ", ", what);
  };
  if (!paused) step(DropMissedJoins(copies, entries), "joins that missed a commit dropped");
  step(PromoteFinishedCopies(alive, copies, entries), "finished copies joined");
  step(AddRequestedJoins(committed, alive, copies, entries), "stores joined groups");
  step(DropSurplusCopies(job, alive, heat, entries), "surplus copies dropped");
  return changed;
}

void Replication::PlanCopies(const v1::Job& job, const v1::PlacementTable& placement,
                             int64_t committed, const Alive& alive,
                             const std::optional<HeatMap>& heat, int max_pulls, JobCopies& copies,
                             std::vector<CopyTask>* tasks) {
  const std::vector<std::string> live = alive.placeable_ids();
  const std::string& job_id = job.job_id();
  const std::vector<double> means = heat ? LayerMeans(*heat) : std::vector<double>();
  for (const v1::ExpertPlacement& e : placement.experts()) {
    const std::pair<int, int> group = GroupOf(e.layer(), e.expert());
    std::vector<std::string> holders;
    for (const std::string& id : e.store_ids()) {
      if (alive.stores.count(id)) holders.push_back(id);
    }
    if (holders.empty()) continue;  // nothing to copy from
    // A store the group is short of joins it at the next step boundary.
    if (!copies.join_requests.count(group)) {
      std::set<std::string> have(e.store_ids().begin(), e.store_ids().end());
      have.insert(e.joining_store_ids().begin(), e.joining_store_ids().end());
      for (const std::string& d :
           DesiredStores(job, e.layer(), e.expert(), live, heat ? &*heat : nullptr, means)) {
        if (have.count(d)) continue;
        copies.join_requests[group] = d;
        break;  // one new copy of a group at a time
      }
    }
    // A store that joined gets the committed copy.
    if (copies.copying.count(group) || static_cast<int>(tasks->size()) >= max_pulls) {
      continue;
    }
    for (const std::string& target : e.joining_store_ids()) {
      if (!alive.stores.count(target)) continue;
      bool done = false;
      for (const JobCopies::Copy& c : copies.copied) done |= c.group == group && c.target == target;
      if (done) continue;
      // A drain's copies read from the draining store, so the others keep serving.
      std::string source = holders.front();
      for (const std::string& id : holders) {
        if (alive.draining.count(id)) source = id;
      }
      tasks->push_back({job_id, e.layer(), e.expert(), alive.stores.at(source),
                        alive.stores.at(target), committed});
      copies.copying.insert(group);
      const bool drain = alive.draining.count(source) > 0;  // a draining holder if any
      v1::BlobMove move;
      move.mutable_key()->set_job_id(job_id);
      move.mutable_key()->set_layer(e.layer());
      move.mutable_key()->set_expert(e.expert());
      move.set_from_store_id(source);
      move.set_to_store_id(target);
      move.set_reason(static_cast<int>(holders.size()) <
                              std::max(1, job.spec().cluster().store_replicas())
                          ? "replicate"
                      : drain ? "drain"
                              : "rebalance");
      moves_.push_back(std::move(move));
      break;
    }
  }
  SetMovesGauge();
}

CopyResult Replication::Copy(StoreControl& stores, const CopyTask& t, uint64_t bytes_per_second) {
  CopyResult result;
  absl::StatusOr<std::vector<v1::BlobInfo>> listed =
      stores.ListGroup(t.source, t.job_id, t.layer, t.expert);
  if (listed.ok()) {
    std::vector<v1::BlobKey> keys;
    for (const v1::BlobInfo& b : *listed) keys.push_back(b.key());
    absl::StatusOr<std::vector<v1::BlobInfo>> pulled =
        stores.Pull(t.target, t.source, keys, bytes_per_second);
    if (pulled.ok()) {
      result.blobs = pulled->size();
      for (const v1::BlobInfo& b : *pulled) result.bytes += b.size_bytes();
    }
    result.status = pulled.status();
  } else {
    result.status = listed.status();
  }
  if (!result.status.ok()) {
    LOG(WARNING) << "copy of " << GroupName(t.job_id, t.layer, t.expert) << " to "
                 << t.target.member_id() << ": " << result.status;
  }
  return result;
}

bool Replication::Finish(const CopyTask& t, const CopyResult& result, JobCopies* copies) {
  moves_.erase(std::remove_if(moves_.begin(), moves_.end(),
                              [&](const v1::BlobMove& m) {
                                return m.key().job_id() == t.job_id && m.key().layer() == t.layer &&
                                       m.key().expert() == t.expert &&
                                       m.to_store_id() == t.target.member_id();
                              }),
               moves_.end());
  SetMovesGauge();
  if (copies == nullptr) return false;
  copies->copying.erase(GroupOf(t.layer, t.expert));
  if (!result.status.ok()) return false;
  copies->copied.push_back({GroupOf(t.layer, t.expert), t.target.member_id(), t.start_step});
  blobs_moved_ += result.blobs;
  bytes_moved_ += result.bytes;
  if (blobs_moved_total_ != nullptr) {
    blobs_moved_total_->Increment(static_cast<double>(result.blobs));
    bytes_moved_total_->Increment(static_cast<double>(result.bytes));
  }
  return true;
}

uint64_t Replication::MovesOn(const std::string& store) const {
  uint64_t groups = 0;
  for (const v1::BlobMove& m : moves_) {
    groups += m.from_store_id() == store || m.to_store_id() == store;
  }
  return groups;
}

void Replication::Report(uint64_t deficit, v1::ClusterStatusResponse* out) const {
  for (const v1::BlobMove& m : moves_) *out->add_moves() = m;
  out->set_blobs_moved(blobs_moved_);
  out->set_bytes_moved(bytes_moved_);
  out->set_replica_deficit(deficit);
  if (replica_deficit_ != nullptr) replica_deficit_->Set(static_cast<double>(deficit));
}

void Replication::SetMovesGauge() {
  if (moves_in_flight_ != nullptr) moves_in_flight_->Set(static_cast<double>(moves_.size()));
}

}  // namespace pith::coordinator
