// The coordinator's gauges that are read rather than kept: set at each scrape from the
// membership and the job registry (DESIGN §7), for dashboards and the alert rules of
// deploy/prometheus/ (a member down, a job that stopped committing).
//
// Thread safety: the hook runs on the scraping thread; Membership and JobRegistry are
// thread-safe, and the hook's own state is behind a mutex.
#ifndef PITH_SERVER_COORDINATOR_CLUSTER_GAUGES_H_
#define PITH_SERVER_COORDINATOR_CLUSTER_GAUGES_H_

#include "common/metrics.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/membership.h"

namespace pith::coordinator {

// Registers, on `metrics`, a scrape hook that sets
//   pith_coordinator_members{role,state}      members per role and state
//   pith_coordinator_jobs{state}              jobs per state
//   pith_coordinator_job_running{job}         1 while the job runs, 0 once it ended
//   pith_coordinator_job_committed_step{job}  the job's last committed step
// An ended job's two series stay (running at 0, the committed step its last) for 12
// scrapes, then go: the exposition holds the running jobs and those that ended lately,
// never every job.
// `members` and `jobs` must outlive every scrape of `metrics`.
void ExportClusterGauges(MetricsRegistry& metrics, const Membership* members,
                         const JobRegistry* jobs);

}  // namespace pith::coordinator

#endif  // PITH_SERVER_COORDINATOR_CLUSTER_GAUGES_H_
