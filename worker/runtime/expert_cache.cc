#include "worker/runtime/expert_cache.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pith::runtime {

absl::StatusOr<std::unique_ptr<ExpertCache>> ExpertCache::Create(
    std::unique_ptr<ucx::MemoryRegion> memory, size_t slot_bytes, int slots, FetchFn fetch,
    absl::Duration pinned_wait) {
  if (slots < 2 || slot_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the expert cache needs 2 slots at least, got ", slots));
  }
  if (memory == nullptr || memory->size() < slot_bytes * static_cast<size_t>(slots)) {
    return absl::InvalidArgumentError("the expert cache's memory is smaller than its slots");
  }
  std::unique_ptr<ExpertCache> c(new ExpertCache());
  c->memory_ = std::move(memory);
  c->slot_bytes_ = slot_bytes;
  c->fetch_ = std::move(fetch);
  c->pinned_wait_ = pinned_wait;
  c->slot_count_ = slots;
  {
    absl::MutexLock lock(&c->mu_);
    c->slots_.resize(slots);
  }
  c->prefetcher_ = std::thread([p = c.get()] { p->Prefetch(); });
  return c;
}

ExpertCache::~ExpertCache() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (prefetcher_.joinable()) prefetcher_.join();
}

int ExpertCache::VictimLocked() {
  // Soon needed: the next entries of the schedule, as many as there are slots.
  std::vector<Expert> soon;
  for (size_t i = cursor_; i < schedule_.size() && soon.size() < slots_.size(); ++i) {
    soon.push_back(schedule_[i]);
  }
  int best = -1;
  for (int i = 0; i < static_cast<int>(slots_.size()); ++i) {
    const Slot& s = slots_[i];
    if (s.fetching || s.pins > 0) continue;
    if (!s.valid) return i;  // free
    if (std::find(soon.begin(), soon.end(), s.expert) != soon.end()) continue;
    if (best < 0 || s.last_use < slots_[best].last_use) best = i;
  }
  return best;
}

absl::StatusOr<float*> ExpertCache::Acquire(Expert expert) {
  absl::MutexLock lock(&mu_);
  return AcquireLocked(expert, /*consumer=*/true, /*move_cursor=*/true);
}

absl::StatusOr<float*> ExpertCache::AcquireForUpdate(Expert expert) {
  absl::MutexLock lock(&mu_);
  return AcquireLocked(expert, /*consumer=*/false, /*move_cursor=*/false);
}

bool ExpertCache::ReadyLocked(Expert expert) const {
  if (updating_.count(expert) && updates_failed_.ok()) return false;
  auto it = index_.find(expert);
  return it != index_.end() && slots_[it->second].valid && !slots_[it->second].fetching;
}

absl::StatusOr<std::pair<size_t, float*>> ExpertCache::AcquireAny(
    absl::Span<const Expert> experts) {
  if (experts.empty()) return absl::InvalidArgumentError("AcquireAny of no experts");
  absl::MutexLock lock(&mu_);
  // The layer's run of entries at the cursor holds these experts and no others: one
  // scheduled but not computed here would hold the cursor back from the next layer. The
  // run ends where the layer does, or once it holds them all (the updates' entries may
  // follow the backward's first layer: they stay).
  const int layer = experts.front().first;
  size_t kept = 0;
  for (size_t i = cursor_;
       i < schedule_.size() && schedule_[i].first == layer && kept < experts.size();) {
    if (std::find(experts.begin(), experts.end(), schedule_[i]) == experts.end()) {
      schedule_.erase(schedule_.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++kept;
      ++i;
    }
  }
  // On their way: being fetched, or resident and waiting for their update.
  auto on_the_way = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Expert& x : experts) {
      auto it = index_.find(x);
      if (it != index_.end() && (slots_[it->second].fetching || slots_[it->second].valid)) {
        return true;
      }
    }
    return false;
  };
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = 0; i < experts.size(); ++i) {
      if (ReadyLocked(experts[i])) return i;
    }
    return experts.size();
  };
  size_t pick = ready();
  if (pick == experts.size() && on_the_way()) {
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return ready() < experts.size() || !on_the_way();
    };
    mu_.Await(absl::Condition(&changed));
    pick = ready();
  }
  if (pick == experts.size()) pick = 0;  // none coming: fetch the first here
  // The others stay ahead of the consumer: the one taken leaves the schedule where it is,
  // and the cursor moves past it only when it is the next entry.
  const Expert x = experts[pick];
  bool move_cursor = false;
  const size_t end = std::min(schedule_.size(), cursor_ + experts.size());
  for (size_t i = cursor_; i < end; ++i) {
    if (schedule_[i] != x) continue;
    if (i == cursor_) {
      move_cursor = true;
    } else {
      schedule_.erase(schedule_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    break;
  }
  ASSIGN_OR_RETURN(float* w, AcquireLocked(x, /*consumer=*/true, move_cursor));
  return std::make_pair(pick, w);
}

absl::StatusOr<float*> ExpertCache::AcquireLocked(Expert expert, bool consumer, bool move_cursor) {
  if (move_cursor) {
    // The consumer's position in the schedule: just past this expert's next occurrence.
    for (size_t i = cursor_; i < schedule_.size(); ++i) {
      if (schedule_[i] == expert) {
        cursor_ = i + 1;
        break;
      }
    }
  }
  if (consumer) {
    // Its update first (the prefetcher may fetch it meanwhile: the bytes the update reads).
    auto updated = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !updating_.count(expert) || !updates_failed_.ok();
    };
    mu_.Await(absl::Condition(&updated));
    if (updating_.count(expert)) return updates_failed_;
  }
  absl::Time pinned_since = absl::InfiniteFuture();  // when every slot was found pinned
  while (true) {
    auto it = index_.find(expert);
    if (it != index_.end()) {
      Slot& s = slots_[it->second];
      if (s.fetching) {  // the prefetcher is on it
        auto done = [&s]() { return !s.fetching; };
        mu_.Await(absl::Condition(&done));
        continue;
      }
      if (s.valid) {
        ++s.pins;
        s.last_use = ++clock_;
        ++stats_.hits;
        if (s.prefetched) ++stats_.prefetch_hits;
        s.prefetched = false;
        return SlotData(it->second);
      }
    }
    int victim = VictimLocked();
    if (victim < 0) {
      // Every slot is pinned or being filled: take any unpinned one, or wait for a fetch.
      for (int i = 0; i < static_cast<int>(slots_.size()) && victim < 0; ++i) {
        if (slots_[i].pins == 0 && !slots_[i].fetching) victim = i;
      }
    }
    if (victim < 0) {
      bool fetching = false;
      for (const Slot& s : slots_) fetching |= s.fetching;
      const uint64_t seen = clock_;
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return clock_ != seen; };
      if (fetching) {
        mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(10));
        continue;
      }
      // Every slot is pinned: wait for a Release (a write sending from its slot), until
      // the pinned wait has passed since the slots were first found all pinned.
      if (pinned_since == absl::InfiniteFuture()) pinned_since = absl::Now();
      if (!mu_.AwaitWithDeadline(absl::Condition(&changed), pinned_since + pinned_wait_)) {
        return absl::ResourceExhaustedError(
            absl::StrCat("every one of the ", slots_.size(), " expert cache slots is in use"));
      }
      continue;
    }
    ASSIGN_OR_RETURN(const bool filled, FillLocked(victim, expert, /*pins=*/1));
    if (!filled) continue;  // invalidated meanwhile: fetch the new version
    ++stats_.misses;
    return SlotData(victim);
  }
}

void ExpertCache::ClaimLocked(int victim, Expert expert, int pins) {
  Slot& s = slots_[victim];
  if (s.valid) index_.erase(s.expert);
  s = Slot{expert, false, true, false, pins, ++clock_};
  index_[expert] = victim;
  ++fetch_counts_[expert];
}

std::map<ExpertCache::Expert, uint64_t> ExpertCache::TakeFetchCounts() {
  absl::MutexLock lock(&mu_);
  return std::exchange(fetch_counts_, {});
}

bool ExpertCache::LandLocked(int victim, Expert expert, const absl::Status& status) {
  Slot& s = slots_[victim];
  s.fetching = false;
  ++clock_;
  if (!status.ok() || s.stale) {
    index_.erase(expert);
    s = Slot{};
    return false;
  }
  s.valid = true;
  s.generation = ++generations_;
  stats_.bytes_fetched += slot_bytes_;
  return true;
}

uint64_t ExpertCache::Generation(Expert expert) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(expert);
  return it == index_.end() || !slots_[it->second].valid ? 0 : slots_[it->second].generation;
}

absl::StatusOr<bool> ExpertCache::FillLocked(int victim, Expert expert, int pins) {
  ClaimLocked(victim, expert, pins);
  std::vector<bool> landed;
  const absl::Status status = FetchClaimedLocked({victim}, &landed);
  if (landed[0]) return true;
  if (!status.ok()) return status;
  return false;
}

absl::Status ExpertCache::FetchClaimedLocked(const std::vector<int>& victims,
                                             std::vector<bool>* landed) {
  std::vector<FetchRequest> requests;
  for (int v : victims) {
    const Expert x = slots_[v].expert;
    requests.push_back({x, SlotData(v), updating_.count(x) > 0, absl::OkStatus()});
  }
  mu_.Unlock();
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = fetch_(absl::MakeSpan(requests), slot_bytes_, memory_->handle());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  mu_.Lock();
  stats_.seconds_fetching += seconds;
  // An error no request carries fails them all.
  bool carried = status.ok();
  for (const FetchRequest& r : requests) carried |= !r.status.ok();
  landed->clear();
  for (size_t i = 0; i < victims.size(); ++i) {
    landed->push_back(
        LandLocked(victims[i], requests[i].expert, carried ? requests[i].status : status));
  }
  return status;
}

void ExpertCache::Release(Expert expert) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(expert);
  if (it == index_.end()) return;
  Slot& s = slots_[it->second];
  if (s.pins > 0) --s.pins;
  ++clock_;
}

void ExpertCache::BeginUpdates(absl::Span<const Expert> experts) {
  absl::MutexLock lock(&mu_);
  updating_.clear();
  updating_.insert(experts.begin(), experts.end());
  updates_failed_ = absl::OkStatus();
  // A fetch in flight may have asked for a newer version than the update starts from.
  for (const Expert& x : experts) {
    auto it = index_.find(x);
    if (it != index_.end() && slots_[it->second].fetching) slots_[it->second].stale = true;
  }
}

void ExpertCache::Updated(Expert expert) {
  absl::MutexLock lock(&mu_);
  updating_.erase(expert);
  auto it = index_.find(expert);  // its bytes changed in place
  if (it != index_.end()) slots_[it->second].generation = ++generations_;
}

void ExpertCache::EndUpdates(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (updating_.empty()) return;
  // Experts left over stay unreadable: their slots hold weights the update never reached.
  updates_failed_ = status.ok() ? absl::InternalError("an expert update ended unapplied") : status;
}

absl::Status ExpertCache::AwaitUpdates() {
  absl::MutexLock lock(&mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return updating_.empty() || !updates_failed_.ok();
  };
  mu_.Await(absl::Condition(&done));
  return updating_.empty() ? absl::OkStatus() : updates_failed_;
}

void ExpertCache::Expect(int layer, absl::Span<const Expert> experts) {
  absl::MutexLock lock(&mu_);
  size_t end = cursor_;
  for (int last = -1;
       end < schedule_.size() && schedule_[end].first <= layer && schedule_[end].first >= last;
       ++end) {
    last = schedule_[end].first;
  }
  const auto at = schedule_.begin() + static_cast<std::ptrdiff_t>(cursor_);
  schedule_.insert(schedule_.erase(at, schedule_.begin() + static_cast<std::ptrdiff_t>(end)),
                   experts.begin(), experts.end());
  ++clock_;
}

void ExpertCache::SetSchedule(std::vector<Expert> order) {
  absl::MutexLock lock(&mu_);
  schedule_ = std::move(order);
  cursor_ = 0;
  ++clock_;
}

void ExpertCache::Clear() {
  absl::MutexLock lock(&mu_);
  for (Slot& s : slots_) {
    if (s.pins > 0 || s.fetching || !s.valid) continue;
    index_.erase(s.expert);
    s = Slot{};
  }
  ++clock_;
}

void ExpertCache::Invalidate(Expert expert) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(expert);
  if (it == index_.end()) return;
  Slot& s = slots_[it->second];
  if (s.fetching) {
    s.stale = true;  // the fetch may have read the old version: dropped when it lands
    return;
  }
  if (s.pins > 0) return;
  index_.erase(it);
  s = Slot{};
  ++clock_;
}

ExpertCache::Stats ExpertCache::stats() {
  absl::MutexLock lock(&mu_);
  Stats out = stats_;
  out.resident_bytes = 0;
  for (const Slot& s : slots_) out.resident_bytes += s.valid ? slot_bytes_ : 0;
  return out;
}

void ExpertCache::Prefetch() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    // The next scheduled experts within reach (a slot's worth ahead of the consumer) that
    // are not resident yet, as many as there are slots to reuse (kPrefetchBatch at most),
    // each slot claimed as it is chosen.
    std::vector<int> victims;
    const size_t reach = std::min(schedule_.size(), cursor_ + slots_.size() - 1);
    for (size_t i = cursor_; i < reach && victims.size() < kPrefetchBatch; ++i) {
      if (index_.count(schedule_[i])) continue;
      const int victim = VictimLocked();
      if (victim < 0) break;
      ClaimLocked(victim, schedule_[i], /*pins=*/0);
      victims.push_back(victim);
    }
    if (victims.empty()) {
      const uint64_t seen = clock_;
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || clock_ != seen; };
      mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(50));
      continue;
    }
    std::vector<bool> landed;
    const absl::Status fetched = FetchClaimedLocked(victims, &landed);
    for (size_t i = 0; i < victims.size(); ++i) {
      if (landed[i]) slots_[victims[i]].prefetched = true;
    }
    if (!fetched.ok()) {
      // The consumer fetches them itself and sees the error; back off meanwhile.
      const uint64_t seen = clock_;
      auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || clock_ != seen; };
      mu_.AwaitWithTimeout(absl::Condition(&changed), absl::Milliseconds(100));
    }
  }
}

}  // namespace pith::runtime
