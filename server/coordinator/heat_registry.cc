#include "server/coordinator/heat_registry.h"

#include <fstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/step_protocol.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"

namespace pith::coordinator {

absl::Status HeatRegistry::Report(const v1::Job& job, const v1::HeatReport& report) {
  if (report.worker_id().empty()) return absl::InvalidArgumentError("worker_id is required");
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
  for (const v1::LayerRouting& routing : report.layers()) {
    RETURN_IF_ERROR(heat.map->Check(routing));
    // Workers report pairs of narrow layers only, which bounds the pairs a job keeps.
    if (routing.coactivation_size() != 0 && heat.map->experts() > kMaxCoactivationExperts) {
      return absl::InvalidArgumentError(
          absl::StrCat("routing.coactivation: layers of more than ", kMaxCoactivationExperts,
                       " experts report no pairs (this one has ", heat.map->experts(), ")"));
    }
  }
  if (report.step() > heat.step) {
    AddReports(heat, *heat.map);
    heat.reports.clear();
    if (heat.step >= 0) heat.map->EndStep();
    heat.step = report.step();
  }
  heat.reports[report.worker_id()] = report;
  if (!trace_dir_.empty()) {
    std::string line;
    google::protobuf::util::JsonPrintOptions compact;
    if (google::protobuf::util::MessageToJsonString(report, &line, compact).ok()) {
      std::ofstream out(trace_dir_ + "/" + job.job_id() + ".heat.jsonl", std::ios::app);
      out << line << "\n";
      if (!out) LOG(WARNING) << "heat trace of job " << job.job_id() << " not written";
    }
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
  const HeatMap map = Current(it->second);
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
      entry->set_fetches(map.fetches(l, e));
    }
    int n = 0;
    for (const auto& [pair, weight] : map.Pairs(l)) {
      if (n++ == max_pairs) break;  // never for max_pairs < 0
      v1::CoActivationPair* p = out.add_pairs();
      p->set_layer(l);
      p->set_expert_a(pair.first);
      p->set_expert_b(pair.second);
      p->set_weight(weight);
    }
  }
  return out;
}

std::optional<HeatMap> HeatRegistry::Snapshot(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return std::nullopt;
  return Current(it->second);
}

HeatMap HeatRegistry::Current(const JobHeat& heat) {
  HeatMap map = *heat.map;
  AddReports(heat, map);
  return map;
}

void HeatRegistry::AddReports(const JobHeat& heat, HeatMap& map) {
  // Checked when they came in.
  for (const auto& [worker, r] : heat.reports) {
    for (const v1::LayerRouting& routing : r.layers()) (void)map.Add(routing);
  }
}

void HeatRegistry::DropStep(const std::string& job_id, int64_t step) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it != jobs_.end() && it->second.step == step) it->second.reports.clear();
}

std::string HeatRegistry::Save(const std::string& job_id) const {
  absl::StatusOr<v1::ExpertHeatResponse> all = Heat(job_id, -1, /*max_pairs=*/-1);
  return all.ok() ? all->SerializeAsString() : std::string();
}

absl::Status HeatRegistry::Restore(const v1::Job& job, const std::string& saved) {
  v1::ExpertHeatResponse all;
  if (!all.ParseFromString(saved)) {
    return absl::DataLossError(absl::StrCat("unreadable heat record of job ", job.job_id()));
  }
  const v1::ModelConfig& m = job.spec().model();
  auto map = std::make_unique<HeatMap>(m.n_layer(), m.n_expert(),
                                       job.spec().cluster().replication().heat_decay());
  auto fits = [&](int layer, int expert) {
    return layer >= 0 && layer < m.n_layer() && expert >= 0 && expert < m.n_expert();
  };
  for (const v1::ExpertHeatEntry& e : all.experts()) {
    if (!fits(e.expert().layer(), e.expert().expert())) {
      return absl::DataLossError(
          absl::StrCat("heat record of job ", job.job_id(), " does not fit its model"));
    }
    map->SetHeat(e.expert().layer(), e.expert().expert(), e.heat());
    map->SetFetches(e.expert().layer(), e.expert().expert(), e.fetches());
  }
  for (const v1::CoActivationPair& p : all.pairs()) {
    if (!fits(p.layer(), p.expert_a()) || !fits(p.layer(), p.expert_b()) ||
        p.expert_a() == p.expert_b()) {
      return absl::DataLossError(
          absl::StrCat("heat record of job ", job.job_id(), " does not fit its model"));
    }
    map->SetPair(p.layer(), p.expert_a(), p.expert_b(), p.weight());
  }
  absl::MutexLock lock(&mu_);
  JobHeat& heat = jobs_[job.job_id()];
  heat.map = std::move(map);
  heat.step = all.step();
  heat.reports.clear();
  return absl::OkStatus();
}

void HeatRegistry::Drop(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  jobs_.erase(job_id);
}

}  // namespace pith::coordinator
