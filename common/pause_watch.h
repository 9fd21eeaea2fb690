// Time this process did not run. A process stopped for a while (SIGSTOP, a paused VM, a
// suspended host) finds, when it runs again, that every deadline it set passed meanwhile:
// a wait times out at once and blames whoever it waited for (a store, a peer) for its own
// stop. A watch thread that wakes every 100 ms and finds more than a second gone on the
// boot-time clock (which runs through a suspend) has seen such a stop; waits over the
// network count only the time this process ran, as the coordinator moves leases on past
// its own stops.
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
  using Clock = std::function<absl::Duration()>;  // monotonic, since any origin
  // Gaps between two looks longer than this are stops.
  static constexpr absl::Duration kStop = absl::Seconds(1);

  explicit PauseWatch(Clock clock);

  // Looks at the clock: a gap since the last look longer than kStop is a stop, ending now.
  // Every thread that runs may look; the watch thread does every 100 ms.
  void Look() ABSL_LOCKS_EXCLUDED(mu_);
  // How long this process did not run after `since` (a reading of the clock), by the
  // stops seen up to this look.
  absl::Duration StoppedSince(absl::Duration since) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void LookLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Clock clock_;
  absl::Mutex mu_;
  absl::Duration last_ ABSL_GUARDED_BY(mu_);
  // The latest stops: (when each ended, how long it was), oldest first.
  std::deque<std::pair<absl::Duration, absl::Duration>> stops_ ABSL_GUARDED_BY(mu_);
};

// The process-wide watch's clock (CLOCK_BOOTTIME).
absl::Duration SteadyNow();

// How long this process did not run after `since` (a SteadyNow reading), by the
// process-wide watch (none before the watch's first call).
absl::Duration StoppedSince(absl::Duration since);

// What is left of a wait of `budget` begun at `start` (a SteadyNow reading), counting
// only the time this process ran; zero or less when it is over.
inline absl::Duration RunningLeft(absl::Duration start, absl::Duration budget) {
  return budget - (SteadyNow() - start) + StoppedSince(start);
}

}  // namespace pith

#endif  // PITH_COMMON_PAUSE_WATCH_H_
