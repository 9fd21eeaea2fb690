// A job whose only copy of a group is on a store that refuses puts for want of disk
// (DESIGN §5.5): it waits, training no step, for room on that store or for its copies to
// move to stores with room, and fails with the refusal after kRoomWait.
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/job_state.h"
#include "glog/logging.h"
#include "server/coordinator/replication.h"
#include "server/coordinator/scheduler.h"

namespace pith::coordinator {
namespace {

// What a job that waited in vain fails with.
std::string RoomWaitFailure(int64_t step, const std::string& why, absl::Duration waited) {
  return absl::StrCat("step ", step, ": ", why, " (no room for ", absl::FormatDuration(waited),
                      " on the store holding the job's only copy, nor a store with room to "
                      "move it to)");
}

// Whether `store` (alive) has room for the job's puts again: it is not low on disk (the
// membership's judgment, with its margin), or, with no store to move its copies to, it
// has twice its reserve free.
bool HasRoom(const std::string& store, const Alive& alive) {
  if (!alive.full.count(store)) return true;
  const std::vector<std::string> room = alive.placeable_ids();
  const v1::MemberInfo& m = alive.stores.at(store);
  return room.empty() && m.disk_free_bytes() >= 2 * m.disk_reserve_bytes();
}

}  // namespace

std::vector<std::string> Scheduler::OnlyCopiesOn(const Run& run, const std::string& store,
                                                 const Alive& alive) {
  std::vector<std::string> groups;
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    bool elsewhere = false, here = false;
    for (const std::string& id : e.store_ids()) {
      here |= id == store;
      elsewhere |= id != store && alive.stores.count(id) > 0 && !alive.full.count(id);
    }
    if (!here || elsewhere) continue;
    groups.push_back(e.layer() < 0 ? "the dense tensors"
                                   : absl::StrCat("layer ", e.layer(), " expert ", e.expert()));
  }
  return groups;
}

std::string Scheduler::WaitForRoomLocked(const std::string& job_id, Run& run,
                                         const std::string& store, const std::string& why,
                                         const Alive& alive, std::vector<StoreCall>* aborts) {
  AbortLocked(run, why, aborts);  // not counted: no retry has room before the wait ends
  const absl::Time now = options_.clock();
  if (run.room_step != step_in_flight(run)) {
    run.room_step = step_in_flight(run);
    run.room_since = now;
  }
  if (run.room_store != store) {
    LOG(WARNING) << "job " << job_id << " waits for disk room on store " << store
                 << ", which holds the only copy of some of its groups (" << why << ")";
  }
  // Set also when the job fails: its workers wait for the run's release.
  run.room_store = store;
  run.room_why = why;
  if (now - run.room_since >= kRoomWait) {
    return RoomWaitFailure(run.room_step, why, now - run.room_since);
  }
  NoteWaitLocked(job_id, run, Wait::kRoom, RoomWaitReason(run, alive));
  return "";
}

std::string Scheduler::RoomWaitReason(const Run& run, const Alive& alive) const {
  const std::vector<std::string> groups = OnlyCopiesOn(run, run.room_store, alive);
  const auto member = alive.stores.find(run.room_store);
  const uint64_t reserve = member == alive.stores.end() ? 0 : member->second.disk_reserve_bytes();
  const std::string which = groups.empty() ? "some of the job's groups"
                            : groups.size() == 1
                                ? groups[0]
                                : absl::StrCat(groups.size(), " groups (", groups[0], ", ...)");
  return absl::StrCat(
      "waiting until ",
      absl::FormatTime("%H:%M:%S UTC", run.room_since + kRoomWait, absl::UTCTimeZone()), " (",
      absl::FormatDuration(kRoomWait), " from its first refusal) for disk room on store ",
      run.room_store, ", which holds the only copy of ", which, " (", run.room_why,
      "): free space on its disk (",
      absl::StrFormat("%.1f MB", 2e-6 * static_cast<double>(reserve)),
      " free, twice its reserve, for 5 minutes), or add a store with room and its copies move "
      "there (pith cluster shows both)");
}

bool Scheduler::ReviewRoomWaitLocked(const std::string& job_id, Run& run, const v1::Job& job,
                                     const Alive& all) {
  if (run.room_store.empty() || IsFinal(job.state())) return false;
  const std::string store = run.room_store;
  const Alive alive = ForJob(all, run);
  // Copies pulled while the job waits join as readers, and the full store may leave.
  const v1::PlacementTable before = run.record.placement();
  std::string why;
  if (Replication::ApplyCopiesWhilePaused(job, run.committed, alive, heat_->Snapshot(job_id),
                                          run.copies, *run.record.mutable_placement(), &why)) {
    NewEpochLocked(job_id, run, before, step_in_flight(run), why);
    if (absl::Status s = PersistLocked(run); !s.ok()) LOG(ERROR) << s;
  }
  std::string ended;
  if (!JobStores(run).count(store)) {
    ended = "holds none of its groups now";
  } else if (!alive.stores.count(store)) {
    ended = "is gone";  // the repair of a lost store takes over
  } else if (HasRoom(store, alive)) {
    ended = "has room again";
  } else if (DropFullStoreLocked(run, store, run.room_why, alive)) {
    ended = "holds no group's only copy now";
  } else {
    if (options_.clock() - run.room_since < kRoomWait) return false;  // waits on
    (void)MarkFailed(
        job_id, RoomWaitFailure(run.room_step, run.room_why, options_.clock() - run.room_since));
    return true;  // the next tick releases the run
  }
  LOG(INFO) << "job " << job_id << ": store " << store << " " << ended << "; the job goes on";
  run.room_store.clear();
  NoteWaitLocked(job_id, run, Wait::kRoom, "");
  return false;
}

void Scheduler::NewEpochLocked(const std::string& job_id, Run& run,
                               const v1::PlacementTable& before, int64_t from,
                               const std::string& why) {
  run.record.mutable_placement()->set_epoch(before.epoch() + 1);
  run.record.mutable_placement()->set_effective_step(from);
  run.record.set_assignment_version(NextVersion(run.record.assignment_version()));
  NoteLeftLocked(run, before);
  const int64_t epoch = run.record.placement().epoch();
  (void)jobs_->Update(job_id, [&](v1::Job& j) {
    j.set_placement_epoch(epoch);
    return absl::OkStatus();
  });
  LOG(INFO) << "job " << job_id << ": placement epoch " << epoch << " from step " << from << " ("
            << why << ")";
}

}  // namespace pith::coordinator
