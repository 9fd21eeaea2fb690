// The step loop of a job run (DESIGN §6): the state machine that takes a worker from its
// assignment's committed step to the job's last, independent of what a step computes.
//
//   start:     no committed step: write the initial weights (step 0, reported);
//              else load the committed step
//   each step: step s is reported -> compute step s + 1 while s settles (the stores sync
//              it) -> s settles:
//                committed       -> write step s + 1, report it
//                reassigned      -> adopt the new placement in place and compute s + 1
//                                   again, or, when it cannot be adopted, end (OK: the
//                                   caller fetches the assignment and starts over from
//                                   the last commit)
//                stopped/aborted -> end (OK: start over from the last commit)
//                unreachable     -> end with the error (start over)
//   a failure computing or writing a step is reported for it and ends the run with it;
//   a failure to load the committed step (a blob missing or failing its checks; not a
//   store down or slow for now), for the step after it (the coordinator counts a step's
//   failed attempts and fails the job after --step_attempts of them).
//
// A StepDriver does the work; JobRun (job_run.h) is the real one, tests drive fakes.
//
// Thread safety: RunSteps calls the driver on the calling thread only.
#ifndef PITH_WORKER_RUNTIME_STEP_LOOP_H_
#define PITH_WORKER_RUNTIME_STEP_LOOP_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pith::runtime {

// How a reported step ended.
enum class Settled {
  kCommitted,   // under this assignment
  kReassigned,  // committed, with a new assignment from the next step
  kStop,        // aborted, or the job ended
};

class StepDriver {
 public:
  virtual ~StepDriver() = default;
  // Step 0: the initial weights written and reported.
  virtual absl::Status WriteInitial() = 0;
  // The state of the committed step, from the stores.
  virtual absl::Status LoadCommitted() = 0;
  // Step s is written and reported, not committed: reads ask for its versions.
  virtual void SetPending(int64_t s) = 0;
  virtual void ClearPending() = 0;
  // The first half of step s (forward, backward, reductions): needs nothing from the
  // commit of s - 1.
  virtual absl::Status Compute(int64_t s) = 0;
  // Waits for step s to settle (an error: the coordinator is unreachable).
  virtual absl::StatusOr<Settled> Finish(int64_t s) = 0;
  // Takes the new assignment in place: false when it cannot (start over).
  virtual absl::StatusOr<bool> Adopt() = 0;
  // The second half of step s, once s - 1 is committed: the updates written, reported.
  virtual absl::Status Write(int64_t s) = 0;
  // Step s failed here with `why`.
  virtual void ReportFailure(int64_t s, const absl::Status& why) = 0;
};

// What one round of waiting for a reported step says: how it settled, not yet (nullopt:
// the round ended first), or an error (the coordinator is unreachable).
using SettleRound = std::function<absl::StatusOr<std::optional<Settled>>()>;

// Waits for a reported step to settle: rounds of `round` until one says how, or an error,
// or `stop` (may be null) is true after a round that did not settle (kStop: a stopping
// process does not wait for the step, and starts over from the last commit like any end).
absl::StatusOr<Settled> WaitSettled(const SettleRound& round, const std::atomic<bool>* stop);

// Runs steps from `committed_step` (-1: none yet) up to `steps` until the job ends, the
// assignment changes, a failure, or `stop` becomes true (checked between steps). A failure
// to load the committed step that may pass (a store down or slow for now) is retried
// unreported, unless `report_passing` (the same attempt failed so again and again).
absl::Status RunSteps(StepDriver& driver, int64_t committed_step, int64_t steps,
                      const std::atomic<bool>& stop, bool report_passing = false);

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_STEP_LOOP_H_
