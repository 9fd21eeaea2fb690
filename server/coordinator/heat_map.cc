#include "server/coordinator/heat_map.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pith::coordinator {

HeatMap::HeatMap(int layers, int experts, double decay)
    : layers_(layers),
      experts_(experts),
      decay_(decay),
      heat_(int64_t{layers} * experts, 0.0),
      fetches_(int64_t{layers} * experts, 0),
      pairs_(layers) {}

absl::Status HeatMap::Add(const v1::LayerRouting& r) {
  RETURN_IF_ERROR(Check(r));
  for (int e = 0; e < experts_; ++e) heat_[Index(r.layer(), e)] += r.tokens_per_expert(e);
  for (int e = 0; e < r.fetches_per_expert_size(); ++e) {
    fetches_[Index(r.layer(), e)] += r.fetches_per_expert(e);
  }
  auto& pairs = pairs_[r.layer()];
  for (int i = 0, idx = 0; i < experts_ && r.coactivation_size() > 0; ++i) {
    for (int j = i + 1; j < experts_; ++j, ++idx) {
      if (r.coactivation(idx) != 0)
        pairs[PairKey(i, j)] += static_cast<double>(r.coactivation(idx));
    }
  }
  return absl::OkStatus();
}

absl::Status HeatMap::Check(const v1::LayerRouting& r) const {
  if (r.layer() < 0 || r.layer() >= layers_) {
    return absl::InvalidArgumentError(absl::StrCat("routing.layer ", r.layer(), " out of range"));
  }
  if (r.tokens_per_expert_size() != experts_) {
    return absl::InvalidArgumentError(absl::StrCat(
        "routing.tokens_per_expert has ", r.tokens_per_expert_size(), " entries, want ", experts_));
  }
  if (r.fetches_per_expert_size() != 0 && r.fetches_per_expert_size() != experts_) {
    return absl::InvalidArgumentError(absl::StrCat("routing.fetches_per_expert has ",
                                                   r.fetches_per_expert_size(),
                                                   " entries, want 0 or ", experts_));
  }
  const int64_t packed = int64_t{experts_} * (experts_ - 1) / 2;
  if (r.coactivation_size() != 0 && r.coactivation_size() != packed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "routing.coactivation has ", r.coactivation_size(), " entries, want 0 or ", packed));
  }
  return absl::OkStatus();
}

void HeatMap::EndStep() {
  for (double& h : heat_) h *= decay_;
  for (auto& layer : pairs_) {
    for (auto it = layer.begin(); it != layer.end();) {
      it->second *= decay_;
      // Forget pairs that have faded, so that the map stays bounded.
      if (it->second < 1e-3) {
        layer.erase(it++);
      } else {
        ++it;
      }
    }
  }
}

double HeatMap::coactivation(int layer, int a, int b) const {
  auto it = pairs_[layer].find(PairKey(a, b));
  return it == pairs_[layer].end() ? 0.0 : it->second;
}

std::vector<std::pair<std::pair<int, int>, double>> HeatMap::Pairs(int layer) const {
  std::vector<std::pair<std::pair<int, int>, double>> out;
  for (const auto& [key, w] : pairs_[layer]) {
    out.push_back({{static_cast<int>(key >> 32), static_cast<int>(key & 0xffffffff)}, w});
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  return out;
}

}  // namespace pith::coordinator
