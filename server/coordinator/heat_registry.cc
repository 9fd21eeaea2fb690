#include "server/coordinator/heat_registry.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pith::coordinator {

absl::Status HeatRegistry::Report(const v1::Job& job, const v1::HeatReport& report) {
  absl::MutexLock lock(&mu_);
  JobHeat& heat = jobs_[job.job_id()];
  if (!heat.map) {
    const v1::ModelConfig& m = job.spec().model();
    heat.map = std::make_unique<HeatMap>(m.n_layer(), m.n_expert(),
                                         job.spec().cluster().replication().heat_decay());
  }
  if (report.step() < heat.step) {
    return absl::FailedPreconditionError(
        absl::StrCat("heat report for step ", report.step(), " after step ", heat.step));
  }
  if (report.step() > heat.step) {
    if (heat.step >= 0) heat.map->EndStep();
    heat.step = report.step();
  }
  for (const v1::LayerRouting& routing : report.layers()) {
    RETURN_IF_ERROR(heat.map->Add(routing));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ExpertHeatResponse> HeatRegistry::Heat(const std::string& job_id, int layer,
                                                          int max_pairs) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("no heat reported for job ", job_id, " yet"));
  }
  const HeatMap& map = *it->second.map;
  if (layer < -1 || layer >= map.layers()) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  v1::ExpertHeatResponse out;
  out.set_job_id(job_id);
  out.set_step(it->second.step);
  for (int l = layer < 0 ? 0 : layer; l < (layer < 0 ? map.layers() : layer + 1); ++l) {
    for (int e = 0; e < map.experts(); ++e) {
      v1::ExpertHeatEntry* entry = out.add_experts();
      entry->mutable_expert()->set_layer(l);
      entry->mutable_expert()->set_expert(e);
      entry->set_heat(map.heat(l, e));
    }
    int n = 0;
    for (const auto& [pair, weight] : map.Pairs(l)) {
      if (n++ == max_pairs) break;
      v1::CoActivationPair* p = out.add_pairs();
      p->set_layer(l);
      p->set_expert_a(pair.first);
      p->set_expert_b(pair.second);
      p->set_weight(weight);
    }
  }
  return out;
}

}  // namespace pith::coordinator
