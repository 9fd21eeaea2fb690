#include "common/pause_watch.h"

#include <chrono>
#include <thread>

#include "glog/logging.h"

namespace pith {
namespace {

// Stops remembered: a wait asks about its own few seconds.
constexpr size_t kKeep = 64;

absl::Duration SteadyNow() {
  return absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

}  // namespace

PauseWatch::PauseWatch(SteadyClock steady, WallClock wall)
    : steady_(std::move(steady)), wall_(std::move(wall)), last_(steady_()) {}

void PauseWatch::Look() {
  absl::MutexLock lock(&mu_);
  LookLocked();
}

void PauseWatch::LookLocked() {
  const absl::Duration now = steady_();
  const absl::Duration gap = now - last_;
  last_ = now;
  if (gap <= kStop) return;
  LOG(WARNING) << "this process did not run for " << absl::FormatDuration(gap)
               << ": its waits' deadlines move on by as much";
  stops_.emplace_back(wall_(), gap);
  if (stops_.size() > kKeep) stops_.pop_front();
}

absl::Duration PauseWatch::StoppedSince(absl::Time since) {
  absl::MutexLock lock(&mu_);
  LookLocked();
  absl::Duration stopped;
  for (const auto& [ended, length] : stops_) {
    if (ended > since) stopped += std::min(length, ended - since);
  }
  return stopped;
}

absl::Duration StoppedSince(absl::Time since) {
  // Never destroyed: its thread runs until the process exits.
  static PauseWatch* const watch = [] {
    auto* w = new PauseWatch(SteadyNow, [] { return absl::Now(); });
    std::thread([w] {
      for (;;) {
        absl::SleepFor(absl::Milliseconds(100));
        w->Look();
      }
    }).detach();
    return w;
  }();
  return watch->StoppedSince(since);
}

}  // namespace pith
