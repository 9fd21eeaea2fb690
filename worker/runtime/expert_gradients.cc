#include "worker/runtime/expert_gradients.h"

#include <algorithm>
#include <string>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/runtime/peer_channels.h"

namespace pith::runtime {

absl::Status ExpertGradients::ReduceReplicas(PeerGroup& peers, int64_t step,
                                             const std::vector<Expert>& owned) const {
  const model::ModelShape& shape = layout->shape();
  const int64_t floats = shape.expert_floats();
  std::vector<float> sum(floats);
  for (const Expert& x : owned) {
    const auto [l, e] = x;
    const ExpertOwners& who = (*owners)[l][e];
    if (who.size() < 2 || !used(l, e)) continue;
    ASSIGN_OR_RETURN(float* g, grads->Acquire(x, GradPool::Use::kUpdate));
    const int to = (*primary)[l][e];
    // A copy sent to the primary is done with here.
    absl::Cleanup release = [this, x = x, sent = to != rank] { grads->Release(x, sent); };
    const uint64_t tag = channels::ReplicaGradient(step, l * shape.experts + e);
    if (to != rank) {
      RETURN_IF_ERROR(peers.Send(
          to, tag, std::string(reinterpret_cast<const char*>(g), floats * sizeof(float))));
      continue;
    }
    std::vector<int> ranks;
    for (const auto& [r, share] : who) ranks.push_back(r);
    std::sort(ranks.begin(), ranks.end());
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int r : ranks) {
      const float* part = g;
      std::string got;
      if (r != rank) {
        ASSIGN_OR_RETURN(got, peers.Receive(r, tag));
        if (got.size() != floats * sizeof(float)) {
          return absl::DataLossError(
              absl::StrCat("replica gradient from rank ", r, " has ", got.size(), " bytes"));
        }
        part = reinterpret_cast<const float*>(got.data());
      }
      for (int64_t i = 0; i < floats; ++i) sum[i] += part[i];
    }
    std::copy(sum.begin(), sum.end(), g);
  }
  return absl::OkStatus();
}

absl::StatusOr<double> ExpertGradients::AddSumOfSquares(compute::Backend& backend, double sum_sq,
                                                        const std::vector<Expert>& updated) const {
  for (const Expert& x : updated) {
    const auto [l, e] = x;
    if (!used(l, e) || !grads->Has(x)) continue;  // no gradient here: zeros
    ASSIGN_OR_RETURN(const float* g, grads->Acquire(x));
    const int64_t base = layout->ExpertOffset(l, e);
    const int first = layout->ExpertTensorIndex(l, e);
    for (int i = first; i < first + 4; ++i) {
      const model::ParamTensor& t = layout->tensors()[i];
      sum_sq += backend.SumOfSquares(g + (t.offset - base), t.numel);
    }
    grads->Release(x);
  }
  return sum_sq;
}

}  // namespace pith::runtime
