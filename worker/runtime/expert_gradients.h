// ExpertGradients: what happens to a step's expert gradients between the backward and
// the updates (DESIGN §6, step 4): those of experts computed by several workers summed at
// their primary owner, and the squares of those updated here added to the global norm.
// They live in the GradPool; each is held only while used.
//
// Thread safety: the training thread's, between ForwardBackward and the step's updates.
#ifndef PITH_WORKER_RUNTIME_EXPERT_GRADIENTS_H_
#define PITH_WORKER_RUNTIME_EXPERT_GRADIENTS_H_

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/param_layout.h"
#include "worker/compute/backend.h"
#include "worker/runtime/dispatch.h"
#include "worker/runtime/grad_pool.h"
#include "worker/runtime/peer_group.h"

namespace pith::runtime {

struct ExpertGradients {
  using Expert = std::pair<int, int>;

  GradPool* grads;
  const model::ParamLayout* layout;
  const std::vector<std::vector<ExpertOwners>>* owners;  // [layer][expert]
  const std::vector<std::vector<int>>* primary;          // [layer][expert] -> rank
  int rank;
  std::function<bool(int, int)> used;  // the expert got tokens this step (any worker)

  // The gradients of the experts of `owned` (computed here) that have several owners are
  // summed at their primary, in rank order (the same bits every run); the others' copies
  // are sent there and dropped. An owner with no rows of an expert adds zeros.
  absl::Status ReduceReplicas(PeerGroup& peers, int64_t step,
                              const std::vector<Expert>& owned) const;
  // `sum_sq` plus the squares of the gradients of the experts of `updated` (in layout
  // order) that got tokens, tensor by tensor, as AdamWOptimizer::LocalSumOfSquares sums.
  absl::StatusOr<double> AddSumOfSquares(compute::Backend& backend, double sum_sq,
                                         const std::vector<Expert>& updated) const;
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_EXPERT_GRADIENTS_H_
