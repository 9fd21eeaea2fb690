// Job states every part of Pith reads the same way (the coordinator, the CLI, the SDK).
//
// Thread safety: a pure function.
#ifndef PITH_COMMON_JOB_STATE_H_
#define PITH_COMMON_JOB_STATE_H_

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/strip.h"
#include "pith/v1/job.pb.h"

namespace pith {

// Whether a job in `state` has ended for good: succeeded, failed or cancelled.
inline bool IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

// "running" for JOB_STATE_RUNNING: a state as `pith status` and the job's messages say it.
inline std::string StateName(v1::JobState state) {
  return absl::AsciiStrToLower(absl::StripPrefix(v1::JobState_Name(state), "JOB_STATE_"));
}

}  // namespace pith

#endif  // PITH_COMMON_JOB_STATE_H_
