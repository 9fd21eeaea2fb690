// Limits of the step protocol (DESIGN §5.5) that the coordinator and the workers must
// agree on; both sides include this header, so the dependency between them is compiled in
// rather than remembered.
//
// Thread safety: constants only.
#ifndef PITH_COMMON_STEP_PROTOCOL_H_
#define PITH_COMMON_STEP_PROTOCOL_H_

#include "absl/time/time.h"

namespace pith {

// The longest a coordinator holds one WaitStep call before answering with the step's
// current status (a caller with a shorter deadline is answered by its deadline).
inline constexpr absl::Duration kWaitStepServerCap = absl::Seconds(30);

// Heat reports carry co-activation counts only for layers of at most this many experts
// (wider layers' packed triangle would outweigh the step); the coordinator refuses them
// for wider layers, which bounds the pairs it keeps per job.
inline constexpr int kMaxCoactivationExperts = 64;

}  // namespace pith

#endif  // PITH_COMMON_STEP_PROTOCOL_H_
