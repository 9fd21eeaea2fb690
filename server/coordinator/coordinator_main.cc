// pith-coordinator: membership, placement, heat and the job API (DESIGN §1, §5).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/member_identity.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/server_process.h"
#include "common/status.h"
#include "common/ucx.h"
#include "common/ucx_auth.h"
#include "glog/logging.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "pith/v1/job.grpc.pb.h"
#include "security/flags.h"
#include "security/tokens.h"
#include "server/coordinator/cluster_gauges.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/dashboard.h"
#include "server/coordinator/grpc_store_control.h"
#include "server/coordinator/job_history.h"
#include "server/coordinator/job_registry.h"
#include "server/coordinator/job_service.h"
#include "server/coordinator/scheduler.h"
#include "server/coordinator/simulator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7000", "gRPC listen address (host:port)");
ABSL_FLAG(int, metrics_port, 9100, "Prometheus /metrics port; -1 disables it, 0 picks one");
ABSL_FLAG(std::string, metrics_listen, "",
          "Host (interface address) /metrics and the dashboard bind (plain HTTP, no "
          "authentication: they show every job); default: the host of --listen");
ABSL_FLAG(std::string, ucx_net_devices, "auto",
          "Network devices UCX may use: auto (those of --listen's address, plus RDMA ports; "
          "every device for 0.0.0.0), all, or a UCX_NET_DEVICES list");
ABSL_FLAG(std::string, data_dir, "", "Directory of the coordinator's embedded RocksDB (required)");
ABSL_FLAG(uint64_t, disk_reserve_bytes, 64ull << 20,
          "Free bytes the coordinator needs on its --data_dir's disk to start (4 MiB at least): "
          "its RocksDB cannot recover onto a full disk");
ABSL_FLAG(int64_t, lease_ms, 3000, "Member lease: a member silent this long is marked dead");
ABSL_FLAG(uint64_t, replication_bytes_per_second, 256ull << 20,
          "Throttle of each store-to-store copy (re-replication, hot replicas, rebalancing), "
          "so that training fetches keep priority");
ABSL_FLAG(int, max_pulls, 4, "Store-to-store group copies in flight at most");
ABSL_FLAG(uint64_t, jobs_memory_bytes, 0,
          "Memory the coordinator gives its unfinished jobs' state (placement, heat, step "
          "records; estimated per job from its spec): a job past it is refused at submit. "
          "0: half of this host's RAM");
ABSL_FLAG(int, max_jobs_per_user, 0,
          "Unfinished (pending or running) jobs a caller of the user role may have at once; "
          "one more is refused at submit with the count. 0: no limit. Admins have none");
ABSL_FLAG(std::string, export_root, "",
          "Directory under which CheckpointJob may write exports (never over a file, never "
          "through '..' or symlinks). Empty: server-side exports are off; pith checkpoint "
          "--out downloads instead");
ABSL_FLAG(int, step_attempts, 8,
          "Failed attempts of one step (reported by its workers) after which the job fails "
          "with the last reason (a worker that could not reach a peer still holding its lease "
          "counts only once that peer heartbeats again)");
ABSL_FLAG(bool, keep_ended_weights, true,
          "An ended job's committed weights stay on the stores (for `pith checkpoint`); its "
          "optimizer state goes. false: everything of an ended job is deleted");
ABSL_FLAG(std::string, tokens_file, "",
          "Bearer tokens users and admins may present instead of a client certificate "
          "(pith token writes them; re-read when it changes). Empty: certificates only");
ABSL_FLAG(double, client_requests_per_second, 100,
          "Job API requests a client (a certificate, a token, or a host without TLS) may make "
          "a second, sustained; <= 0: unlimited");
ABSL_FLAG(int, client_burst, 200, "Job API requests a client may make at once");
ABSL_FLAG(int, client_streams, 16,
          "Watches and downloads a client may hold open at once; <= 0: unlimited");
ABSL_FLAG(bool, simulate, false, "Run the placement simulator, print one line and exit");
ABSL_FLAG(int, layers, 58, "--simulate: MoE layers");
ABSL_FLAG(int, experts, 256, "--simulate: experts per layer");
ABSL_FLAG(int, top_k, 8, "--simulate: experts per token");
ABSL_FLAG(int, workers, 256, "--simulate: workers");
ABSL_FLAG(int, stores, 32, "--simulate: stores");
ABSL_FLAG(double, zipf, 1.2, "--simulate: Zipf exponent of expert popularity");
ABSL_FLAG(int, steps, 10, "--simulate: steps of routing that build the heat map");
ABSL_FLAG(int, tokens_per_step, 4096, "--simulate: tokens per step and layer");
ABSL_FLAG(std::string, trace, "",
          "--simulate: replay this heat trace (a <job>.heat.jsonl from --heat_trace_dir) "
          "instead of synthetic routing");
ABSL_FLAG(std::string, heat_trace_dir, "",
          "Record every heat report, one JSON line each, in DIR/<job>.heat.jsonl");

namespace {

int Simulate() {
  pith::coordinator::SimOptions o;
  o.layers = absl::GetFlag(FLAGS_layers);
  o.experts = absl::GetFlag(FLAGS_experts);
  o.top_k = absl::GetFlag(FLAGS_top_k);
  o.workers = absl::GetFlag(FLAGS_workers);
  o.stores = absl::GetFlag(FLAGS_stores);
  o.zipf = absl::GetFlag(FLAGS_zipf);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.tokens_per_step = absl::GetFlag(FLAGS_tokens_per_step);
  o.trace_path = absl::GetFlag(FLAGS_trace);
  absl::StatusOr<pith::coordinator::SimResult> r = pith::coordinator::RunSimulation(o);
  if (r.ok()) printf("%s\n", r->ToString().c_str());
  return pith::ExitStatus("pith-coordinator", r.status());
}

// --jobs_memory_bytes, 0 meaning half of the host's RAM.
uint64_t JobsMemoryBytes() {
  const uint64_t flag = absl::GetFlag(FLAGS_jobs_memory_bytes);
  if (flag > 0) return flag;
  return pith::PhysicalMemoryBytes() / 2;
}

// The job registry, opened only with room on its disk (Debian's RocksDB aborts when it
// recovers onto a full one).
absl::StatusOr<std::unique_ptr<pith::coordinator::JobRegistry>> OpenJobs() {
  const std::string dir = absl::GetFlag(FLAGS_data_dir);
  const uint64_t reserve = absl::GetFlag(FLAGS_disk_reserve_bytes);
  RETURN_IF_ERROR(pith::CheckDiskReserve(reserve));
  if (!dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    // Downloads a killed process was staging: nothing reads them any more.
    std::filesystem::remove_all(dir + "/downloads", ec);
    RETURN_IF_ERROR(pith::CheckDiskRoom(dir, reserve, 0));
  }
  return pith::coordinator::JobRegistry::Open(dir, JobsMemoryBytes());
}

// The cluster's data-plane key (DESIGN §8), made once and kept beside the jobs so that
// members keep theirs across a coordinator restart; this process tags with it too.
absl::StatusOr<std::string> DataPlaneKey(pith::coordinator::JobRegistry& jobs) {
  constexpr char kRecord[] = "security/data_plane_key";
  ASSIGN_OR_RETURN(auto records, jobs.Records(kRecord));
  std::string key;
  if (auto it = records.find(kRecord); it != records.end()) key = it->second;
  if (key.size() != pith::ucx::kDataPlaneKeyBytes) {
    key = pith::ucx::MakeDataPlaneKey();
    if (key.empty()) return absl::InternalError("cannot make a data-plane key");
    RETURN_IF_ERROR(jobs.PutRecord(kRecord, key));
  }
  pith::ucx::SetDataPlaneKey(key);
  // The key is in the data dir's RocksDB: only this process's user may read it.
  std::error_code ec;
  std::filesystem::permissions(absl::GetFlag(FLAGS_data_dir), std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, ec);
  if (ec) return absl::InternalError("cannot restrict --data_dir to its owner: " + ec.message());
  return key;
}

// The cluster's id (RegisterResponse.cluster_id), made once and kept beside the jobs: the
// stores keep it with their data, so that a coordinator whose data was replaced, handing
// out its jobs' ids again, is not given the old jobs' blobs under them.
absl::StatusOr<std::string> ClusterId(pith::coordinator::JobRegistry& jobs) {
  constexpr char kRecord[] = "cluster/id";
  ASSIGN_OR_RETURN(auto records, jobs.Records(kRecord));
  if (auto it = records.find(kRecord); it != records.end() && !it->second.empty()) {
    return it->second;
  }
  const std::string id = pith::NewRandomId();
  RETURN_IF_ERROR(jobs.PutRecord(kRecord, id));
  return id;
}

// Without TLS there is no key, but the jobs (specs, owners, failure reasons) are still
// nobody else's to read.
void RestrictDataDir() {
  std::error_code ec;
  std::filesystem::permissions(absl::GetFlag(FLAGS_data_dir), std::filesystem::perms::owner_all,
                               std::filesystem::perm_options::replace, ec);
  if (ec) LOG(WARNING) << "cannot restrict --data_dir to its owner: " << ec.message();
}

struct ClusterKeys {
  std::string data_plane_key;  // with TLS only: set before any store is called (DESIGN §8)
  std::string cluster_id;
};

absl::StatusOr<ClusterKeys> LoadClusterKeys(pith::coordinator::JobRegistry& jobs, bool tls) {
  RestrictDataDir();
  ClusterKeys keys;
  ASSIGN_OR_RETURN(keys.cluster_id, ClusterId(jobs));
  if (tls) {
    ASSIGN_OR_RETURN(keys.data_plane_key, DataPlaneKey(jobs));
  }
  return keys;
}

// The bearer tokens of --tokens_file; null without one.
absl::StatusOr<std::unique_ptr<pith::security::TokenTable>> OpenTokens() {
  const std::string path = absl::GetFlag(FLAGS_tokens_file);
  if (path.empty()) return nullptr;
  return pith::security::TokenTable::Open(path);
}

// The flags' TLS (or --insecure), checked against --listen: members dial the address it
// listens on, so its certificate must name that host.
absl::StatusOr<pith::security::TransportSecurity> Security() {
  ASSIGN_OR_RETURN(pith::security::TransportSecurity security,
                   pith::security::TransportSecurityFromFlags("pith-coordinator",
                                                              pith::security::Role::kCoordinator));
  const std::string listen = absl::GetFlag(FLAGS_listen);
  const std::string host = listen.substr(0, listen.rfind(':'));
  RETURN_IF_ERROR(security.CheckListen(listen));
  if (host != "0.0.0.0" && host != "[::]" && !host.empty()) {
    RETURN_IF_ERROR(security.CheckNames(host));
  }
  return security;
}

// --max_jobs_per_user, which holds callers of the user role: without TLS there are none.
void SetUserLimit(pith::coordinator::JobServiceImpl& job_service, bool tls) {
  const int limit = std::max(0, absl::GetFlag(FLAGS_max_jobs_per_user));
  job_service.set_max_jobs_per_user(limit);
  if (limit > 0 && !tls) {
    LOG(WARNING) << "--max_jobs_per_user holds no one without TLS: callers have no role";
  }
}

}  // namespace

int main(int argc, char** argv) {
  pith::ShutdownSignals signals;
  pith::InitProcess(argc, argv,
                    "the brain of a Pith cluster.\n"
                    "Usage: pith-coordinator --data_dir=DIR (--tls_dir=DIR | --insecure) "
                    "[--listen=HOST:PORT] [--metrics_port=PORT]\n"
                    "       pith-coordinator --simulate [--layers --experts --top_k --workers "
                    "--stores --zipf --steps | --trace FILE]");
  pith::ucx::RestrictUcxDevices(absl::GetFlag(FLAGS_listen), absl::GetFlag(FLAGS_ucx_net_devices));
  if (absl::GetFlag(FLAGS_simulate)) return Simulate();
  absl::StatusOr<pith::security::TransportSecurity> security = Security();
  if (!security.ok()) return pith::ExitStatus("pith-coordinator", security.status());
  absl::StatusOr<std::unique_ptr<pith::coordinator::JobRegistry>> jobs = OpenJobs();
  if (!jobs.ok()) return pith::ExitStatus("pith-coordinator", jobs.status());
  // The dashboard's loss curves; outlives everything that changes jobs (declared first).
  pith::coordinator::JobHistory history;
  (*jobs)->OnChange([&history](const pith::v1::Job& job) { history.Observe(job); });
  absl::StatusOr<ClusterKeys> keys = LoadClusterKeys(**jobs, security->tls());
  if (!keys.ok()) return pith::ExitStatus("pith-coordinator", keys.status());
  if (const std::string root = absl::GetFlag(FLAGS_export_root); !root.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(root, ec);
    if (ec) {
      return pith::ExitStatus("pith-coordinator",
                              absl::InvalidArgumentError(absl::StrCat(
                                  "cannot create --export_root ", root, ": ", ec.message())));
    }
  }
  pith::coordinator::Membership members(absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms)));
  members.WatchPauses();  // a pause of this process does not cost the members their leases
  // Member identities (a store's data dir -> its id), durable beside the jobs.
  const std::string kIdentityPrefix = "identity/";
  absl::StatusOr<std::map<std::string, std::string>> identities = (*jobs)->Records(kIdentityPrefix);
  if (!identities.ok()) return pith::ExitStatus("pith-coordinator", identities.status());
  std::map<std::string, std::string> id_to_identity;
  for (const auto& [key, identity] : *identities) {
    id_to_identity[key.substr(kIdentityPrefix.size())] = identity;
  }
  members.RestoreIdentities(
      id_to_identity, [registry = jobs->get(), kIdentityPrefix](const std::string& id,
                                                                const std::string& identity) {
        return registry->PutRecord(absl::StrCat(kIdentityPrefix, id), identity);
      });
  pith::coordinator::HeatRegistry heat;
  heat.RecordTo(absl::GetFlag(FLAGS_heat_trace_dir));
  pith::MetricsRegistry metrics;
  const absl::Duration lease = absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  auto store_control = pith::coordinator::NewGrpcStoreControl(  // to stores: a member's role
      std::max(lease, absl::Seconds(5)),
      security->ChannelCredentials(pith::security::Role::kMember));
  pith::coordinator::SchedulerOptions scheduler_options;
  scheduler_options.replication_bytes_per_second =
      absl::GetFlag(FLAGS_replication_bytes_per_second);
  scheduler_options.max_pulls = std::max(1, absl::GetFlag(FLAGS_max_pulls));
  scheduler_options.step_attempts = std::max(1, absl::GetFlag(FLAGS_step_attempts));
  scheduler_options.keep_ended_weights = absl::GetFlag(FLAGS_keep_ended_weights);
  scheduler_options.gc_period = std::max(absl::Seconds(1), 3 * lease);
  pith::coordinator::Scheduler scheduler(jobs->get(), &members, &heat, store_control.get(),
                                         &metrics, scheduler_options);
  if (absl::Status s = scheduler.Recover(); !s.ok()) return pith::ExitStatus("pith-coordinator", s);
  pith::coordinator::ExportClusterGauges(metrics, &members, jobs->get());
  // Leases are checked and jobs scheduled several times per lease.
  scheduler.Start(std::clamp(lease / 8, absl::Milliseconds(20), absl::Milliseconds(500)));
  absl::StatusOr<std::unique_ptr<pith::security::TokenTable>> tokens = OpenTokens();
  if (!tokens.ok()) return pith::ExitStatus("pith-coordinator", tokens.status());
  const pith::security::Policy::TokenLookup lookup =
      *tokens ? pith::security::Policy::TokenLookup(
                    [t = tokens->get()](const std::string& token) { return t->Lookup(token); })
              : nullptr;
  pith::coordinator::JobServiceImpl job_service(
      jobs->get(), &members, &heat, &scheduler, absl::GetFlag(FLAGS_data_dir) + "/downloads",
      absl::GetFlag(FLAGS_export_root), security->tls(), lookup,
      std::make_shared<pith::security::ClientLimits>(pith::security::ClientLimits::Options{
          .requests_per_second = absl::GetFlag(FLAGS_client_requests_per_second),
          .burst = std::max(1, absl::GetFlag(FLAGS_client_burst)),
          .streams = absl::GetFlag(FLAGS_client_streams)}));
  SetUserLimit(job_service, security->tls());
  job_service.set_disk_reserve_bytes(absl::GetFlag(FLAGS_disk_reserve_bytes));
  pith::coordinator::CoordinatorServiceImpl coordinator_service(
      &members, jobs->get(), &heat, &scheduler, security->tls(), lookup);
  coordinator_service.set_data_plane_key(keys->data_plane_key);
  coordinator_service.set_cluster_id(keys->cluster_id);
  absl::Status status = pith::RunServerProcess(
      {.component = "coordinator",
       .listen_address = absl::GetFlag(FLAGS_listen),
       .metrics_port = absl::GetFlag(FLAGS_metrics_port),
       .metrics_host = absl::GetFlag(FLAGS_metrics_listen),
       .credentials = security->ServerCredentials(),
       .services = {&job_service, &coordinator_service},
       .http_routes = pith::coordinator::DashboardRoutes(jobs->get(), &history, &job_service),
       // No member is judged once heartbeats go unanswered: the restarted coordinator
       // finds the schedule as it was (a job is not aborted for stores that were alive).
       .on_stopping = [&scheduler] { scheduler.Stop(); }},
      metrics, signals);
  return pith::ExitStatus("pith-coordinator", status);
}
