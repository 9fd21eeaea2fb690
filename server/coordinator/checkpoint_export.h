// Checkpoint export (DESIGN §3): a job's committed weights, read from the stores that
// hold them, written as one safetensors file under the model's tensor names, with the
// job spec in its metadata (the file `pith eval`/`sample` and PyTorch load).
//
// Thread safety: ExportCheckpoint keeps no state; it calls the (thread-safe) StoreControl
// and writes its own file. Scheduler::Checkpoint (defined with it) holds the job's commits
// meanwhile so that every blob read is of one step.
#ifndef PITH_SERVER_COORDINATOR_CHECKPOINT_EXPORT_H_
#define PITH_SERVER_COORDINATOR_CHECKPOINT_EXPORT_H_

#include <string>

#include "absl/status/statusor.h"
#include "pith/v1/job.pb.h"
#include "server/coordinator/membership.h"
#include "server/coordinator/store_control.h"

namespace pith::coordinator {

// Exports `job`'s committed step as `<output_dir>/<job>.step<N>.safetensors`, reading
// each weights blob (the newest committed version at most the step) from a live store of
// `alive` that holds it. FAILED_PRECONDITION before the initial weights are committed or
// when a blob is on no live store; ABORTED when a blob changed version meanwhile.
absl::StatusOr<v1::CheckpointJobResponse> ExportCheckpoint(StoreControl& stores, const Alive& alive,
                                                           const v1::Job& job,
                                                           const std::string& output_dir);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_CHECKPOINT_EXPORT_H_
