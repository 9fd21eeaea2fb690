// The coordinator's live dashboard, served on its HTTP (metrics) port beside /metrics:
//   /                    the page (HTML; no external assets, nothing leaves the cluster)
//   /dashboard.js        its script
//   /api/overview        JSON: jobs (newest first) with their loss curves, and the cluster
//                        (members with tiers and health, moves, drains, replica deficit)
//   /api/experts?job=ID  JSON: the job's expert heat map with replicas and fetches
// Read-only: it shows what `pith status`, `pith cluster` and `pith experts` show, to
// whoever reaches the HTTP port (bind it with --metrics_listen), and changes nothing.
//
// Thread safety: the handlers run on the HTTP server's thread and read thread-safe parts.
#ifndef PITH_SERVER_COORDINATOR_DASHBOARD_H_
#define PITH_SERVER_COORDINATOR_DASHBOARD_H_

#include <map>
#include <string>

#include "common/metrics.h"
#include "server/coordinator/job_history.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/job_service.h"

namespace pith::coordinator {

// The routes of the dashboard for MetricsExposer::Start. None of the pointers is owned;
// all outlive the HTTP server.
std::map<std::string, HttpHandler> DashboardRoutes(const JobRegistry* jobs,
                                                   const JobHistory* history,
                                                   const JobServiceImpl* views);

// "job=a%2Db&x=1" -> the decoded value of `key` ("a-b"), or "" when absent.
std::string QueryValue(const std::string& query, const std::string& key);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_DASHBOARD_H_
