// Time this process did not run. A process stopped for a while (SIGSTOP, a paused VM, a
// host that swapped it out) finds, when it runs again, that every deadline it set passed
// meanwhile: a wait times out at once and blames whoever it waited for (a store, a peer)
// for its own stop. A watch thread that wakes every 100 ms and finds more than a second
// gone has seen such a stop; waits over the network measure the time this process ran
// (RunningDeadline), as the coordinator moves leases on past its own stops.
//
// Thread safety: PauseWatch is safe from any thread; the free functions use one
// process-wide watch, started on their first call and never stopped.
#ifndef PITH_COMMON_PAUSE_WATCH_H_
#define PITH_COMMON_PAUSE_WATCH_H_

#include <deque>
#include <functional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pith {

class PauseWatch {
 public:
  using SteadyClock = std::function<absl::Duration()>;  // monotonic, since any origin
  using WallClock = std::function<absl::Time()>;
  // Gaps between two looks longer than this are stops.
  static constexpr absl::Duration kStop = absl::Seconds(1);

  PauseWatch(SteadyClock steady, WallClock wall);

  // Looks at the clock: a gap since the last look longer than kStop is a stop, ending now.
  // Every thread that runs may look; the watch thread does every 100 ms.
  void Look() ABSL_LOCKS_EXCLUDED(mu_);
  // How long this process did not run after `since` (the stops seen, up to this look).
  absl::Duration StoppedSince(absl::Time since) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void LookLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const SteadyClock steady_;
  const WallClock wall_;
  absl::Mutex mu_;
  absl::Duration last_ ABSL_GUARDED_BY(mu_);
  // The latest stops: (when each ended, how long it was), oldest first.
  std::deque<std::pair<absl::Time, absl::Duration>> stops_ ABSL_GUARDED_BY(mu_);
};

// How long this process did not run after `since`, by the process-wide watch (none before
// the watch's first call).
absl::Duration StoppedSince(absl::Time since);

// The deadline of a wait of `budget` that began at `start`, moved on by how long this
// process did not run since: a wait measures the time its process ran.
inline absl::Time RunningDeadline(absl::Time start, absl::Duration budget) {
  return start + budget + StoppedSince(start);
}

}  // namespace pith

#endif  // PITH_COMMON_PAUSE_WATCH_H_
