#include "common/pause_watch.h"

#include <time.h>

#include <algorithm>
#include <thread>

#include "glog/logging.h"

namespace pith {
namespace {

// Stops remembered: a wait asks about its own few seconds.
constexpr size_t kKeep = 64;

}  // namespace

PauseWatch::PauseWatch(Clock clock) : clock_(std::move(clock)), last_(clock_()) {}

void PauseWatch::Look() {
  absl::MutexLock lock(&mu_);
  LookLocked();
}

void PauseWatch::LookLocked() {
  const absl::Duration now = clock_();
  const absl::Duration gap = now - last_;
  last_ = now;
  if (gap <= kStop) return;
  LOG(WARNING) << "this process did not run for " << absl::FormatDuration(gap)
               << ": its waits' deadlines move on by as much";
  stops_.emplace_back(now, gap);
  if (stops_.size() > kKeep) stops_.pop_front();
}

absl::Duration PauseWatch::StoppedSince(absl::Duration since) {
  absl::MutexLock lock(&mu_);
  LookLocked();
  absl::Duration stopped;
  for (const auto& [ended, length] : stops_) {
    if (ended > since) stopped += std::min(length, ended - since);
  }
  return stopped;
}

absl::Duration SteadyNow() {
  timespec ts{};
  clock_gettime(CLOCK_BOOTTIME, &ts);
  return absl::DurationFromTimespec(ts);
}

absl::Duration StoppedSince(absl::Duration since) {
  // Never destroyed: its thread runs until the process exits.
  static PauseWatch* const watch = [] {
    auto* w = new PauseWatch(SteadyNow);
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
