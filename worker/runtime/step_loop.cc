#include "worker/runtime/step_loop.h"

namespace pith::runtime {

absl::StatusOr<Settled> WaitSettled(const SettleRound& round, const std::atomic<bool>* stop) {
  while (true) {
    absl::StatusOr<std::optional<Settled>> settled = round();
    if (!settled.ok()) return settled.status();
    if (settled->has_value()) return **settled;
    if (stop != nullptr && *stop) return Settled::kStop;
  }
}

absl::Status RunSteps(StepDriver& driver, int64_t committed_step, int64_t steps,
                      const std::atomic<bool>& stop, bool report_passing) {
  int64_t step = committed_step;  // the last committed step
  bool reported = false;          // step `step` is written and reported, not committed
  absl::Status s;
  if (step < 0) {
    step = 0;
    s = driver.WriteInitial();
    reported = true;
  } else if (s = driver.LoadCommitted(); !s.ok()) {
    // A blob missing or failing its checks is reported for the step it keeps from
    // starting (the coordinator ignores failures of a step it has committed, and the job
    // would retry with no end); a store that is down or slow for now is only retried.
    const bool passing = absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s) ||
                         absl::IsAborted(s) || absl::IsCancelled(s);
    if ((!passing || report_passing) && !stop) driver.ReportFailure(step + 1, s);
    return s;
  }
  // NOTE: step s + 1's compute runs while step s commits (the stores sync it to disk):
  // it needs nothing step s's commit decides. Its writes wait for the commit; if step s
  // is aborted instead, or the assignment changes, the compute is thrown away.
  while (s.ok() && !stop) {
    const bool more = step < steps;
    absl::Status computed = absl::OkStatus();
    if (reported) {
      if (more) {
        driver.SetPending(step);
        computed = driver.Compute(step + 1);
      }
      absl::StatusOr<Settled> settled = driver.Finish(step);
      driver.ClearPending();
      if (!settled.ok()) return settled.status();  // the coordinator is unreachable: start over
      if (*settled == Settled::kStop) return absl::OkStatus();
      if (*settled == Settled::kReassigned) {
        // A new placement from the next step: adopted in place when only the placement
        // changed (the model, optimizer, dataset and cache stay), else start over. The
        // step computed under the old one is computed again.
        absl::StatusOr<bool> adopted = driver.Adopt();
        if (!adopted.ok() || !*adopted) return absl::OkStatus();
        if (more) computed = driver.Compute(step + 1);
      }
    } else if (more) {
      computed = driver.Compute(step + 1);
    }
    if (!more) return absl::OkStatus();
    ++step;
    s = computed.ok() ? driver.Write(step) : computed;
    reported = true;
  }
  if (!s.ok() && stop) return absl::OkStatus();  // a stop abandons the step: no failure of it
  if (!s.ok()) {
    driver.ReportFailure(step, s);
    return s;
  }
  return absl::OkStatus();
}

}  // namespace pith::runtime
