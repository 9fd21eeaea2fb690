#include "server/coordinator/dashboard.h"

#include <cmath>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "server/coordinator/dashboard_assets.h"

namespace pith::coordinator {
namespace {

constexpr int kJobsShown = 50;

std::string Json(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  return out;
}

HttpResponse JsonResponse(std::string body) { return {200, "application/json", std::move(body)}; }

HttpResponse JsonError(int status, const std::string& message) {
  std::string quoted;
  google::protobuf::Value v;
  v.set_string_value(message);
  (void)google::protobuf::util::MessageToJsonString(v, &quoted);
  return {status, "application/json", absl::StrCat("{\"error\": ", quoted, "}")};
}

// A JSON number, or null for NaN and infinities (a diverged job's loss), which JSON lacks.
std::string Number(double v, int digits) {
  return std::isfinite(v) ? absl::StrFormat("%.*g", digits, v) : "null";
}

// [[step, loss, tokens_per_second], ...]
std::string CurveJson(const std::vector<JobHistory::Point>& points) {
  std::string out = "[";
  for (size_t i = 0; i < points.size(); ++i) {
    absl::StrAppend(&out, i ? "," : "", "[", points[i].step, ",", Number(points[i].loss, 9), ",",
                    Number(points[i].tokens_per_second, 6), "]");
  }
  return out + "]";
}

std::string Overview(const JobRegistry& jobs, const JobHistory& history,
                     const JobServiceImpl& views) {
  v1::ListJobsResponse listed;
  for (v1::Job& j : jobs.List({}, kJobsShown)) *listed.add_jobs() = std::move(j);
  std::string curves = "{";
  for (int i = 0; i < listed.jobs_size(); ++i) {
    absl::StrAppend(&curves, i ? "," : "", "\"", listed.jobs(i).job_id(),
                    "\":", CurveJson(history.Curve(listed.jobs(i).job_id())));
  }
  curves += "}";
  v1::ClusterStatusResponse cluster = views.ClusterView();
  // Addresses for UCX are long and of no use on a page.
  for (auto* members : {cluster.mutable_stores(), cluster.mutable_workers()}) {
    for (v1::MemberInfo& m : *members) m.clear_ucx_address();
  }
  return absl::StrCat("{\"jobs\": ", Json(listed), ", \"curves\": ", curves,
                      ", \"cluster\": ", Json(cluster), "}");
}

}  // namespace

std::string QueryValue(const std::string& query, const std::string& key) {
  for (absl::string_view part : absl::StrSplit(query, '&')) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(part, absl::MaxSplits('=', 1));
    if (kv.first != key) continue;
    std::string out;
    for (size_t i = 0; i < kv.second.size(); ++i) {
      const char c = kv.second[i];
      int byte = 0;
      if (c == '%' && i + 2 < kv.second.size() &&
          absl::SimpleHexAtoi(kv.second.substr(i + 1, 2), &byte)) {
        out.push_back(static_cast<char>(byte));
        i += 2;
      } else {
        out.push_back(c == '+' ? ' ' : c);
      }
    }
    return out;
  }
  return "";
}

std::map<std::string, HttpHandler> DashboardRoutes(const JobRegistry* jobs,
                                                   const JobHistory* history,
                                                   const JobServiceImpl* views) {
  std::map<std::string, HttpHandler> routes;
  routes["/"] = [](const std::string&) {
    return HttpResponse{200, "text/html; charset=utf-8", kDashboardHtml};
  };
  routes["/favicon.svg"] = [](const std::string&) {
    return HttpResponse{200, "image/svg+xml", kDashboardIcon};
  };
  routes["/dashboard.js"] = [](const std::string&) {
    return HttpResponse{200, "text/javascript; charset=utf-8", kDashboardJs};
  };
  routes["/api/overview"] = [=](const std::string&) {
    return JsonResponse(Overview(*jobs, *history, *views));
  };
  routes["/api/experts"] = [=](const std::string& query) {
    const std::string job = QueryValue(query, "job");
    if (job.empty()) return JsonError(400, "the query needs job=ID");
    // Anyone who reaches the dashboard reads it: a removed job is as unknown as any other
    // (only its owner learns it was removed, through the job API).
    if (jobs->Removed(job)) return JsonError(404, absl::StrCat("no job ", job));
    absl::StatusOr<v1::ExpertHeatResponse> heat = views->HeatView(job, -1);
    if (absl::IsNotFound(heat.status()) && jobs->Get(job).ok()) {
      v1::ExpertHeatResponse none;  // a job whose workers have not reported yet
      none.set_job_id(job);
      return JsonResponse(Json(none));
    }
    if (!heat.ok()) {
      return JsonError(absl::IsNotFound(heat.status()) ? 404 : 400,
                       std::string(heat.status().message()));
    }
    return JsonResponse(Json(*heat));
  };
  return routes;
}

}  // namespace pith::coordinator
