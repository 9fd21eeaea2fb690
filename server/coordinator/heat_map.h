// HeatMap: the decayed per-expert token counts and co-activation weights of one job
// (DESIGN §5), fed by the workers' per-step routing reports and read by the placement
// policy. heat = decay * heat + tokens at every step.
//
// Thread safety: none; the coordinator serializes access per job.
#ifndef PITH_SERVER_COORDINATOR_HEAT_MAP_H_
#define PITH_SERVER_COORDINATOR_HEAT_MAP_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "pith/v1/common.pb.h"

namespace pith::coordinator {

class HeatMap {
 public:
  HeatMap(int layers, int experts, double decay);

  // Adds one worker's routing of one step (several reports may come per step).
  // INVALID_ARGUMENT for a layer or sizes that do not match the model.
  absl::Status Add(const v1::LayerRouting& routing);
  // Whether Add would take `routing` (the same errors, nothing changes).
  absl::Status Check(const v1::LayerRouting& routing) const;
  // Ends a step: decays everything by `decay` before the next step's reports.
  void EndStep();
  // Restoring a saved map: sets one expert's heat, or one pair's weight (a != b).
  void SetHeat(int layer, int expert, double heat) { heat_[Index(layer, expert)] = heat; }
  void SetPair(int layer, int a, int b, double weight) { pairs_[layer][PairKey(a, b)] = weight; }
  void SetFetches(int layer, int expert, uint64_t n) { fetches_[Index(layer, expert)] = n; }

  int layers() const { return layers_; }
  int experts() const { return experts_; }
  double heat(int layer, int expert) const { return heat_[Index(layer, expert)]; }
  // Fetches of the expert into workers' caches, all reports so far (never decayed).
  uint64_t fetches(int layer, int expert) const { return fetches_[Index(layer, expert)]; }
  // Decayed co-activation weight of experts a != b of one layer (0 if never seen).
  double coactivation(int layer, int a, int b) const;
  // Calls fn(a, b, weight) for every pair of `layer` with a < b, in no particular order.
  template <typename Fn>
  void ForEachPair(int layer, Fn&& fn) const {
    for (const auto& [key, w] : pairs_[layer]) {
      fn(static_cast<int>(key >> 32), static_cast<int>(key & 0xffffffff), w);
    }
  }
  // The pairs of `layer` with their weights, strongest first.
  std::vector<std::pair<std::pair<int, int>, double>> Pairs(int layer) const;
  // Index of (i, j), i < j, in LayerRouting.coactivation's packed upper triangle.
  static int64_t PairIndex(int experts, int i, int j) {
    return int64_t{i} * experts - int64_t{i} * (i + 1) / 2 + (j - i - 1);
  }

 private:
  int64_t Index(int layer, int expert) const { return int64_t{layer} * experts_ + expert; }
  static uint64_t PairKey(int a, int b) {
    return (uint64_t{static_cast<uint32_t>(std::min(a, b))} << 32) |
           static_cast<uint32_t>(std::max(a, b));
  }

  int layers_, experts_;
  double decay_;
  std::vector<double> heat_;
  std::vector<uint64_t> fetches_;
  std::vector<absl::flat_hash_map<uint64_t, double>> pairs_;  // per layer
};

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_HEAT_MAP_H_
