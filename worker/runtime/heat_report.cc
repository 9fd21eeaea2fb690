#include "worker/runtime/heat_report.h"

#include <algorithm>

namespace pith::runtime {

v1::HeatReport MakeHeatReport(const HeatInput& in) {
  v1::HeatReport r;
  r.set_job_id(in.job_id);
  r.set_worker_id(in.worker_id);
  r.set_step(in.step);
  r.set_tokens(in.tokens);
  const int E = in.experts, k = in.top_k;
  const int64_t tokens = in.tokens;
  const bool pairs = E <= kMaxCoactivationExperts;
  std::vector<int32_t> chosen(pairs ? tokens * k : 0);
  for (int l = 0; l < static_cast<int>(in.routed.size()); ++l) {
    v1::LayerRouting* routing = r.add_layers();
    routing->set_layer(l);
    for (int64_t n : in.routed[l]) routing->add_tokens_per_expert(n);
    routing->mutable_fetches_per_expert()->Resize(E, 0);
    for (auto it = in.fetched.lower_bound({l, 0}); it != in.fetched.end() && it->first.first == l;
         ++it) {
      if (it->first.second < E) routing->set_fetches_per_expert(it->first.second, it->second);
    }
    if (!pairs || !in.chosen || !in.chosen(l, chosen.data())) continue;
    routing->mutable_coactivation()->Resize(E * (E - 1) / 2, 0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int i = 0; i < k; ++i) {
        for (int j = i + 1; j < k; ++j) {
          const int a = std::min(chosen[t * k + i], chosen[t * k + j]);
          const int b = std::max(chosen[t * k + i], chosen[t * k + j]);
          if (a == b || a < 0) continue;
          const int64_t idx = CoactivationIndex(a, b, E);
          routing->set_coactivation(idx, routing->coactivation(idx) + 1);
        }
      }
    }
  }
  return r;
}

}  // namespace pith::runtime
