// MemoryPlan: how a cluster worker divides its memory for one job (DESIGN §6, memory).
// What it holds is the dense state (parameters, gradients, both AdamW moments of every
// dense tensor: small, and applied alike on every worker, so kept rather than fetched),
// the activations of its rows, and three pools sized in experts: the expert cache's slots,
// the gradient pool (GradPool) and the updater's moment buffers. Nothing is sized by the
// model's number of experts, beyond per-expert counters.
//
// The budget is --memory_bytes (everything above, for the job; a cache budget as well
// caps the cache within it), else the cache budget (the job's cluster.cache_bytes or
// --cache_bytes: the cache's slots, with a gradient pool as large and the updater's
// scratch beside them), else none: every expert this worker computes stays resident, as
// do its gradients and moments.
//
// Thread safety: pure functions.
#ifndef PITH_WORKER_RUNTIME_MEMORY_PLAN_H_
#define PITH_WORKER_RUNTIME_MEMORY_PLAN_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "common/param_layout.h"

namespace pith::runtime {

// How the expert updater keeps AdamW moments: one buffer pair per expert updated here
// (resident), or a ring of `ring` scratch segments of `batch` experts each.
struct MomentPlan {
  bool resident = true;
  int batch = 1;
  int ring = 1;
  // Moment buffer pairs for `updated` experts.
  int64_t Buffers(int64_t updated) const { return resident ? updated : int64_t{ring} * batch; }
};

// The update batches and ring for a cache of `slots` slots.
MomentPlan PlanMoments(int slots, bool resident);

struct MemoryInput {
  uint64_t memory_bytes = 0;  // --memory_bytes; 0: none
  uint64_t cache_bytes = 0;   // the cache budget (with memory_bytes: a cap); 0: none
  uint64_t dense_bytes = 0;   // the dense state: 4 floats per dense parameter
  uint64_t activation_bytes = 0;
  uint64_t expert_bytes = 0;  // one expert's fp32 parameters (a gradient, a moment)
  uint64_t slot_bytes = 0;    // one expert's weights blob (a cache slot); 0: expert_bytes
  int moment_kinds = 2;       // fp32 buffers per expert updated: m and v (and a bf16 master)
  int owned = 0;              // experts computed here
  int updated = 0;            // experts updated here (their primary)
};

struct MemoryPlan {
  int cache_slots = 2;
  int grad_buffers = 2;
  MomentPlan moments;
  // Bytes by kind, as planned (the worker reports them as metrics).
  uint64_t dense_bytes = 0, activation_bytes = 0, cache_bytes = 0, gradient_bytes = 0,
           moment_bytes = 0;
  uint64_t total() const {
    return dense_bytes + activation_bytes + cache_bytes + gradient_bytes + moment_bytes;
  }
};

// What a job of `shape` needs with `owned` experts computed and `updated` updated here:
// its per-expert sizes (a bf16 job's slots hold its bf16 blob, its moment buffers the fp32
// master too), the dense state (4 floats per dense parameter) and the activations.
MemoryInput MemoryNeedsOf(const model::ModelShape& shape, uint64_t memory_bytes,
                          uint64_t cache_bytes, int64_t dense_floats, int64_t activation_bytes,
                          int owned, int updated);

// FAILED_PRECONDITION, saying what does not fit, when memory_bytes cannot hold the dense
// state, the activations and the smallest pools (2 slots, 2 gradients, 2 experts' moments).
absl::StatusOr<MemoryPlan> PlanMemory(const MemoryInput& in);

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_MEMORY_PLAN_H_
