// The heat report of one step (DESIGN §5): per layer, the tokens each expert of this
// worker's rows was routed, and for layers of up to kMaxCoactivationExperts experts the
// co-activation counts (pairs of experts chosen by one token) as a packed upper triangle,
// and the fetches of each expert into the worker's cache.
// The coordinator places hot experts and pairs from it.
//
// Thread safety: a pure function of its arguments.
#ifndef PITH_WORKER_RUNTIME_HEAT_REPORT_H_
#define PITH_WORKER_RUNTIME_HEAT_REPORT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "common/step_protocol.h"
#include "pith/v1/coordinator.pb.h"

namespace pith::runtime {

using ::pith::kMaxCoactivationExperts;  // wider layers report token counts only

struct HeatInput {
  std::string job_id;
  std::string worker_id;
  int64_t step = 0;
  int64_t tokens = 0;  // this worker's tokens in the step
  int experts = 0;     // E
  int top_k = 0;       // k
  // Per layer: the tokens routed to each expert.
  std::vector<std::vector<int64_t>> routed;
  // Fetches of (layer, expert) into this worker's cache since its last report.
  std::map<std::pair<int, int>, uint64_t> fetched;
  // Fills `chosen` (tokens * top_k expert indices, -1: none) for a layer; false when the
  // layer's choices are not available (it then reports token counts only).
  std::function<bool(int layer, int32_t* chosen)> chosen;
};

// Index of the pair (a, b), a < b, in the packed upper triangle of E experts.
inline int64_t CoactivationIndex(int a, int b, int experts) {
  return int64_t{a} * experts - int64_t{a} * (a + 1) / 2 + (b - a - 1);
}

v1::HeatReport MakeHeatReport(const HeatInput& in);

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_HEAT_REPORT_H_
