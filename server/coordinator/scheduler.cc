#include "server/coordinator/scheduler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <thread>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_names.h"
#include "common/grpc_util.h"
#include "common/status.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/store.grpc.pb.h"
#include "server/store/store_client.h"
#include "common/param_layout.h"

namespace pith::coordinator {
namespace {

// The least relative cut of the lockstep load (LockstepLoad) for which a re-plan moves
// experts between workers.
constexpr double kReplanGain = 0.1;

constexpr char kRunPrefix[] = "run/";
constexpr char kHeatPrefix[] = "heat/";
constexpr char kDrainPrefix[] = "drain/";

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// Assignment versions only ever grow, across jobs and coordinator restarts alike, so a
// worker can tell any change by inequality.
int64_t NextVersion(int64_t previous) { return std::max(previous + 1, NowMs()); }

std::string GroupName(const std::string& job_id, int layer, int expert) {
  return layer < 0 ? absl::StrCat(job_id, "/dense") : absl::StrCat(job_id, "/", layer, "/", expert);
}

class GrpcStoreControl final : public StoreControl {
 public:
  explicit GrpcStoreControl(absl::Duration timeout) : timeout_(timeout) {}

  absl::Status Fetch(const v1::MemberInfo& store, std::vector<Read>& reads) override {
    std::vector<store::StoreClient::FetchItem> items(reads.size());
    for (size_t i = 0; i < reads.size(); ++i) {
      items[i].key = reads[i].key;
      items[i].version = reads[i].version;
      items[i].buffer = reads[i].buffer;
      items[i].capacity = reads[i].capacity;
    }
    {
      absl::MutexLock lock(&mu_);
      if (client_ == nullptr) {
        ASSIGN_OR_RETURN(client_, store::StoreClient::Create());
      }
    }
    ASSIGN_OR_RETURN(int peer, client_->Connect(store.ucx_address()));
    absl::Status s = client_->Fetch(peer, absl::MakeSpan(items), timeout_ + absl::Minutes(1));
    for (size_t i = 0; i < reads.size(); ++i) reads[i].info = items[i].info;
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("store ", store.member_id(), ": ", s.message()));
    }
    return s;
  }

  absl::Status CommitStep(const v1::MemberInfo& store, const std::string& job_id,
                          int64_t step) override {
    v1::CommitStepRequest request;
    request.set_job_id(job_id);
    request.set_step(step);
    v1::CommitStepResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    return Annotate(Stub(store)->CommitStep(&ctx, request, &reply), store);
  }

  absl::Status AbortStep(const v1::MemberInfo& store, const std::string& job_id,
                         int64_t step) override {
    v1::AbortStepRequest request;
    request.set_job_id(job_id);
    request.set_step(step);
    v1::AbortStepResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
    return Annotate(Stub(store)->AbortStep(&ctx, request, &reply), store);
  }

  absl::StatusOr<std::vector<v1::BlobInfo>> ListGroup(const v1::MemberInfo& store,
                                                      const std::string& job_id, int layer,
                                                      int expert) override {
    std::vector<v1::BlobInfo> out;
    v1::ListBlobsRequest request;
    request.set_job_id(job_id);
    request.set_layer(layer);
    request.set_page_size(10000);
    do {
      v1::ListBlobsResponse reply;
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
      RETURN_IF_ERROR(Annotate(Stub(store)->ListBlobs(&ctx, request, &reply), store));
      for (v1::BlobInfo& b : *reply.mutable_blobs()) {
        if (layer < 0 || b.key().expert() == expert) out.push_back(std::move(b));
      }
      request.set_page_token(reply.next_page_token());
    } while (!request.page_token().empty());
    return out;
  }

  absl::StatusOr<std::vector<v1::BlobInfo>> Pull(const v1::MemberInfo& target,
                                                 const v1::MemberInfo& source,
                                                 const std::vector<v1::BlobKey>& keys,
                                                 uint64_t max_bytes_per_second) override {
    v1::PullBlobsRequest request;
    request.set_source_store_id(source.member_id());
    request.set_source_ucx_address(source.ucx_address());
    for (const v1::BlobKey& k : keys) *request.add_keys() = k;
    request.set_max_bytes_per_second(max_bytes_per_second);
    v1::PullBlobsResponse reply;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    RETURN_IF_ERROR(Annotate(Stub(target)->PullBlobs(&ctx, request, &reply), target));
    return std::vector<v1::BlobInfo>(reply.pulled().begin(), reply.pulled().end());
  }

 private:
  std::unique_ptr<v1::StoreService::Stub> Stub(const v1::MemberInfo& store) {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<grpc::Channel>& channel = channels_[store.grpc_address()];
    if (channel == nullptr) {
      channel = grpc::CreateChannel(store.grpc_address(), grpc::InsecureChannelCredentials());
    }
    return v1::StoreService::NewStub(channel);
  }

  static absl::Status Annotate(const grpc::Status& s, const v1::MemberInfo& store) {
    absl::Status status = FromGrpcStatus(s);
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat("store ", store.member_id(), " (",
                                                    store.grpc_address(), "): ", status.message()));
  }

  const absl::Duration timeout_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<store::StoreClient> client_;  // set once under mu_, thread-safe after
};

struct Alive {
  // Live members by id; the stores include draining and drained ones, which still serve
  // what they hold.
  std::map<std::string, v1::MemberInfo> stores, workers;
  std::set<std::string> known;     // every id, dead ones included
  std::set<std::string> draining;  // live stores draining or drained: no new placement
  std::vector<std::string> store_ids() const {
    std::vector<std::string> ids;
    for (const auto& [id, m] : stores) ids.push_back(id);
    return ids;
  }
  // The stores new copies may go to.
  std::vector<std::string> placeable_ids() const {
    std::vector<std::string> ids;
    for (const auto& [id, m] : stores) {
      if (!draining.count(id)) ids.push_back(id);
    }
    return ids;
  }
};

Alive Snapshot(Membership& members) {
  Alive a;
  for (v1::MemberRole role : {v1::MEMBER_ROLE_STORE, v1::MEMBER_ROLE_WORKER}) {
    for (v1::MemberInfo& m : members.Members(role)) {
      a.known.insert(m.member_id());
      const bool store = role == v1::MEMBER_ROLE_STORE;
      const bool draining =
          m.state() == v1::MEMBER_STATE_DRAINING || m.state() == v1::MEMBER_STATE_DRAINED;
      if (m.state() != v1::MEMBER_STATE_ALIVE && !(store && draining)) continue;
      if (draining) a.draining.insert(m.member_id());
      (store ? a.stores : a.workers)[m.member_id()] = std::move(m);
    }
  }
  return a;
}

// What a placement's compute ownership costs under `heat`: each layer's experts run in
// lockstep across the workers, so per layer the heat on its busiest worker (an expert's
// heat split by token share), summed over the layers.
double LockstepLoad(const v1::PlacementTable& t, const HeatMap& heat) {
  std::map<std::pair<int, std::string>, double> load;  // (layer, worker)
  for (const v1::ExpertPlacement& e : t.experts()) {
    if (e.layer() < 0 || e.layer() >= heat.layers() || e.expert() >= heat.experts()) continue;
    for (const v1::ComputeOwner& o : e.owners()) {
      load[{e.layer(), o.worker_id()}] += heat.heat(e.layer(), e.expert()) * o.token_share();
    }
  }
  std::vector<double> busiest(heat.layers(), 0.0);
  for (const auto& [at, l] : load) busiest[at.first] = std::max(busiest[at.first], l);
  double sum = 0;
  for (double b : busiest) sum += b;
  return sum;
}

bool SameOwners(const v1::PlacementTable& a, const v1::PlacementTable& b) {
  if (a.experts_size() != b.experts_size()) return false;
  for (int i = 0; i < a.experts_size(); ++i) {
    const auto& x = a.experts(i).owners();
    const auto& y = b.experts(i).owners();
    if (x.size() != y.size()) return false;
    for (int j = 0; j < x.size(); ++j) {
      if (x[j].worker_id() != y[j].worker_id() ||
          std::abs(x[j].token_share() - y[j].token_share()) > 1e-9) {
        return false;
      }
    }
  }
  return true;
}

std::pair<int, int> GroupOf(int layer, int expert) { return {layer, layer < 0 ? 0 : expert}; }

// Mean heat per layer, for the hot-expert test.
std::vector<double> LayerMeans(const HeatMap& heat) {
  std::vector<double> means(heat.layers(), 0);
  for (int l = 0; l < heat.layers(); ++l) {
    for (int e = 0; e < heat.experts(); ++e) means[l] += heat.heat(l, e);
    means[l] /= std::max(1, heat.experts());
  }
  return means;
}

// The stores a group should be on: R of `live` by rendezvous (a hot expert, heat above
// hot_threshold x its layer's mean, up to max_store_replicas).
std::vector<std::string> DesiredStores(const v1::Job& job, int layer, int expert,
                                       const std::vector<std::string>& live, const HeatMap* heat,
                                       const std::vector<double>& means) {
  const v1::ClusterConfig& c = job.spec().cluster();
  int want = std::max(1, c.store_replicas());
  if (heat != nullptr && layer >= 0 && layer < heat->layers() && expert < heat->experts() &&
      means[layer] > 0 &&
      heat->heat(layer, expert) > c.replication().hot_threshold() * means[layer]) {
    want = std::max(want, c.replication().max_store_replicas());
  }
  return RendezvousStores(GroupName(job.job_id(), layer, expert), live, want);
}

// The compute owners of `placement` as a plan, when every owner is still the worker of its
// rank in `workers` (and every expert has owners); nullopt otherwise.
std::optional<ComputePlan> KeptPlan(const v1::PlacementTable& placement,
                                    const std::vector<std::string>& workers,
                                    const v1::ModelConfig& m) {
  ComputePlan plan(m.n_layer(), std::vector<Owners>(m.n_expert()));
  for (const v1::ExpertPlacement& e : placement.experts()) {
    if (e.layer() < 0) continue;
    if (e.layer() >= m.n_layer() || e.expert() >= m.n_expert()) return std::nullopt;
    for (const v1::ComputeOwner& o : e.owners()) {
      if (o.rank() < 0 || o.rank() >= static_cast<int>(workers.size()) ||
          workers[o.rank()] != o.worker_id()) {
        return std::nullopt;
      }
      plan[e.layer()][e.expert()].push_back({o.rank(), o.token_share()});
    }
  }
  for (const auto& layer : plan) {
    for (const Owners& owners : layer) {
      if (owners.empty()) return std::nullopt;
    }
  }
  return plan;
}

}  // namespace

std::unique_ptr<StoreControl> NewGrpcStoreControl(absl::Duration timeout) {
  return std::make_unique<GrpcStoreControl>(timeout);
}

v1::PlacementTable BuildPlacement(const v1::Job& job, const std::vector<std::string>& workers,
                                  const std::vector<std::string>& stores, const ComputePlan& plan,
                                  const v1::PlacementTable* previous, int64_t epoch,
                                  int64_t effective_step) {
  const v1::ModelConfig& m = job.spec().model();
  const int replicas = std::max(1, job.spec().cluster().store_replicas());
  std::map<std::pair<int, int>, const v1::ExpertPlacement*> before;
  if (previous != nullptr) {
    for (const v1::ExpertPlacement& e : previous->experts()) {
      before[{e.layer(), e.layer() < 0 ? 0 : e.expert()}] = &e;
    }
  }
  v1::PlacementTable table;
  table.set_job_id(job.job_id());
  table.set_epoch(epoch);
  table.set_effective_step(effective_step);
  auto place = [&](int layer, int expert) {
    v1::ExpertPlacement* e = table.add_experts();
    e->set_layer(layer);
    e->set_expert(layer < 0 ? 0 : expert);
    auto it = before.find({layer, layer < 0 ? 0 : expert});
    if (it != before.end() && it->second->store_ids_size() > 0) {
      *e->mutable_store_ids() = it->second->store_ids();
      *e->mutable_joining_store_ids() = it->second->joining_store_ids();
    } else {
      for (std::string& id :
           RendezvousStores(GroupName(job.job_id(), layer, expert), stores, replicas)) {
        e->add_store_ids(std::move(id));
      }
    }
    if (layer < 0 || workers.empty()) return;
    for (const auto& [rank, share] : plan.at(layer).at(expert)) {
      v1::ComputeOwner* o = e->add_owners();
      o->set_worker_id(workers.at(rank));
      o->set_rank(rank);
      o->set_token_share(share);
    }
  };
  place(-1, 0);
  for (int l = 0; l < m.n_layer(); ++l) {
    for (int x = 0; x < m.n_expert(); ++x) place(l, x);
  }
  return table;
}

Scheduler::Scheduler(JobRegistry* jobs, Membership* members, HeatRegistry* heat,
                     StoreControl* stores, MetricsRegistry* metrics, SchedulerOptions options)
    : jobs_(jobs),
      members_(members),
      heat_(heat),
      stores_(stores),
      metrics_(metrics),
      options_(options),
      started_(absl::Now()) {
  if (metrics_ != nullptr) {
    steps_committed_ = *metrics_->Counter("pith_coordinator_steps_committed_total",
                                          "Job steps committed on every store");
    steps_aborted_ = *metrics_->Counter("pith_coordinator_steps_aborted_total",
                                        "Step attempts aborted (worker failure, dead member)");
    blobs_moved_total_ =
        *metrics_->Counter("pith_coordinator_blobs_moved_total", "Blobs copied store to store");
    bytes_moved_total_ =
        *metrics_->Counter("pith_coordinator_moved_bytes_total", "Bytes copied store to store");
    moves_in_flight_ = *metrics_->Gauge("pith_coordinator_moves_in_flight",
                                        "Store-to-store group copies in progress");
    replica_deficit_ =
        *metrics_->Gauge("pith_coordinator_replica_deficit",
                         "Store copies missing to give every group its configured replica count");
  }
}

Scheduler::~Scheduler() {
  stop_.Notify();
  if (loop_.joinable()) loop_.join();
  if (replicator_.joinable()) replicator_.join();
}

void Scheduler::Start(absl::Duration period) {
  loop_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) Tick();
  });
  replicator_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) ReplicateOnce();
  });
}

absl::Status Scheduler::Recover() {
  ASSIGN_OR_RETURN(auto records, jobs_->Records(kRunPrefix));
  ASSIGN_OR_RETURN(auto heats, jobs_->Records(kHeatPrefix));
  ASSIGN_OR_RETURN(auto drains, jobs_->Records(kDrainPrefix));
  absl::MutexLock lock(&mu_);
  std::vector<std::string> draining;
  for (const auto& [key, value] : drains) {
    const std::string id = key.substr(std::strlen(kDrainPrefix));
    uint64_t groups = 0;
    if (!absl::SimpleAtoi(value, &groups)) groups = 0;
    drain_groups_[id] = groups;
    draining.push_back(id);
  }
  members_->RestoreDrains(draining);
  for (const auto& [key, bytes] : records) {
    Run run;
    if (!run.record.ParseFromString(bytes)) {
      return absl::DataLossError(absl::StrCat("unreadable schedule record ", key));
    }
    absl::StatusOr<v1::Job> job = jobs_->Get(run.record.job_id());
    if (!job.ok() || IsFinal(job->state())) {
      RETURN_IF_ERROR(jobs_->DeleteRecord(key));
      continue;
    }
    // Joining stores count from here: a copy pulled from now on completes them.
    run.committed = job->committed_step();
    for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
      for (const std::string& id : e.joining_store_ids()) {
        run.joined_at[{GroupOf(e.layer(), e.expert()), id}] = run.committed;
      }
    }
    if (auto h = heats.find(absl::StrCat(kHeatPrefix, job->job_id())); h != heats.end()) {
      absl::Status s = heat_->Restore(*job, h->second);
      if (!s.ok()) LOG(WARNING) << s;  // heat is advisory: start afresh
    }
    run.committed = job->committed_step();
    // Whatever attempt was in flight is void (its reports died with the old process); it
    // is aborted once the job's members are back (Tick).
    run.recovering = true;
    for (const std::string& w : run.record.workers()) worker_job_[w] = job->job_id();
    runs_[job->job_id()] = std::move(run);
  }
  return absl::OkStatus();
}

absl::Status Scheduler::PersistLocked(const Run& run) {
  return jobs_->PutRecord(absl::StrCat(kRunPrefix, run.record.job_id()),
                          run.record.SerializeAsString());
}

void Scheduler::AbortLocked(Run& run, const std::string& reason, std::vector<StoreCall>* aborts) {
  const Alive alive = Snapshot(*members_);
  for (const auto& [id, store] : alive.stores) {
    aborts->push_back({store, run.record.job_id(), step_in_flight(run)});
  }
  run.written.clear();
  run.tokens = run.cache_hits = run.cache_misses = 0;
  run.rank0.Clear();
  run.abort_reason = reason;
  // The redone step reports its heat again.
  heat_->DropStep(run.record.job_id(), step_in_flight(run));
  run.record.set_assignment_version(NextVersion(run.record.assignment_version()));
  if (steps_aborted_ != nullptr) steps_aborted_->Increment();
  LOG(INFO) << "job " << run.record.job_id() << ": step " << step_in_flight(run)
            << " aborted: " << reason;
}

ComputePlan Scheduler::PlanLocked(const v1::Job& job, int workers, std::optional<HeatMap> map) {
  if (workers == 0) return {};
  const v1::ModelConfig& m = job.spec().model();
  const v1::ReplicationConfig& r = job.spec().cluster().replication();
  if (!map) map.emplace(m.n_layer(), m.n_expert(), r.heat_decay());
  ComputePlanOptions options;
  options.workers = workers;
  options.max_replicas = std::max(1, r.max_compute_replicas());
  options.affinity = !r.disable_affinity();
  return PlanCompute(*map, options);
}

void Scheduler::ReplaceLocked(Run& run, const v1::Job& job,
                              const std::vector<std::string>& live_stores,
                              const std::vector<std::string>& stores) {
  v1::PlacementTable previous = run.record.placement();
  const std::set<std::string> live(live_stores.begin(), live_stores.end());
  std::string lost;
  for (v1::ExpertPlacement& e : *previous.mutable_experts()) {
    const bool had = e.store_ids_size() > 0;
    auto* ids = e.mutable_store_ids();
    ids->erase(std::remove_if(ids->begin(), ids->end(),
                              [&](const std::string& id) { return !live.count(id); }),
               ids->end());
    auto* joining = e.mutable_joining_store_ids();
    joining->erase(std::remove_if(joining->begin(), joining->end(),
                                  [&](const std::string& id) { return !live.count(id); }),
                   joining->end());
    if (had && ids->empty() && run.committed >= 0 && lost.empty()) {
      lost = e.layer() < 0 ? "the dense tensors"
                           : absl::StrCat("layer ", e.layer(), " expert ", e.expert());
    }
  }
  if (!lost.empty()) {
    const std::string reason = absl::StrCat("every store copy of ", lost, " was lost");
    LOG(ERROR) << "job " << job.job_id() << ": " << reason;
    (void)jobs_->Update(job.job_id(), [&](v1::Job& j) {
      j.set_state(v1::JOB_STATE_FAILED);
      j.set_failure_reason(reason);
      j.set_finished_unix_ms(NowMs());
      return absl::OkStatus();
    });
    return;  // the next Tick releases the run
  }
  std::vector<std::string> workers(run.record.workers().begin(), run.record.workers().end());
  // The same workers keep their experts (only stores changed): no cache moves, and the
  // job's math stays that of an undisturbed run. Otherwise the compute is re-planned.
  std::optional<ComputePlan> kept = KeptPlan(previous, workers, job.spec().model());
  const ComputePlan plan =
      kept ? *std::move(kept)
           : PlanLocked(job, static_cast<int>(workers.size()), heat_->Snapshot(job.job_id()));
  *run.record.mutable_placement() = BuildPlacement(job, workers, stores, plan, &previous,
                                                   previous.epoch() + 1, step_in_flight(run));
  const int64_t epoch = run.record.placement().epoch();
  (void)jobs_->Update(job.job_id(), [&](v1::Job& j) {
    j.set_placement_epoch(epoch);
    j.set_workers(static_cast<int>(workers.size()));
    return absl::OkStatus();
  });
  UpdateMetricsLocked(job, run);
}

bool Scheduler::Gone(const std::set<std::string>& alive, const std::set<std::string>& known,
                     const std::string& id) const {
  if (alive.count(id)) return false;
  return known.count(id) > 0 || absl::Now() > started_ + 3 * members_->lease();
}

void Scheduler::Tick() {
  members_->ExpireLeases();
  const Alive alive = Snapshot(*members_);
  std::set<std::string> live_stores, live_workers;
  for (const auto& [id, m] : alive.stores) live_stores.insert(id);
  for (const auto& [id, m] : alive.workers) live_workers.insert(id);
  auto gone = [&](const std::string& id, bool store) {
    return Gone(store ? live_stores : live_workers, alive.known, id);
  };
  std::vector<StoreCall> aborts;
  std::vector<std::pair<std::string, int64_t>> commits;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = runs_.begin(); it != runs_.end();) {
      const std::string job_id = it->first;
      Run& run = it->second;
      absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
      if (!job.ok() || IsFinal(job->state())) {
        // Cancelled or failed: drop the attempt in flight and free the workers.
        if (run.record.committing_step() < 0) AbortLocked(run, "job ended", &aborts);
        for (const std::string& w : run.record.workers()) worker_job_.erase(w);
        (void)jobs_->DeleteRecord(absl::StrCat(kRunPrefix, job_id));
        it = runs_.erase(it);
        continue;
      }
      ++it;
      if (run.record.committing_step() >= 0) {
        // The decision is made: finish it before anything else changes.
        if (!run.committing) commits.emplace_back(job_id, run.record.committing_step());
        continue;
      }
      std::vector<std::string> kept, lost;
      bool back = true;  // every member of the job is alive
      for (const std::string& w : run.record.workers()) {
        (gone(w, false) ? lost : kept).push_back(w);
        back &= live_workers.count(w) > 0;
      }
      bool stores_lost = false;
      for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
        for (const auto* ids : {&e.store_ids(), &e.joining_store_ids()}) {
          for (const std::string& s : *ids) {
            stores_lost |= gone(s, true);
            back &= live_stores.count(s) > 0;
          }
        }
      }
      if (run.recovering) {
        if (!back && lost.empty() && !stores_lost) continue;  // still in the grace period
        run.recovering = false;
        if (back) {
          AbortLocked(run, "the coordinator restarted", &aborts);
          absl::Status s = PersistLocked(run);
          if (!s.ok()) LOG(ERROR) << s;
          continue;
        }
      }
      const int want = std::max(1, job->spec().cluster().workers());
      std::vector<std::string> idle;
      for (const auto& [id, m] : alive.workers) {
        if (!worker_job_.count(id)) idle.push_back(id);
      }
      const bool grow = static_cast<int>(kept.size()) < want && !idle.empty();
      if (lost.empty() && !stores_lost && !grow) continue;
      std::string reason = lost.empty() ? (stores_lost ? "a store died" : "a worker joined")
                                        : absl::StrCat("worker ", lost.front(), " died");
      AbortLocked(run, reason, &aborts);
      for (const std::string& w : lost) worker_job_.erase(w);
      for (size_t i = 0; static_cast<int>(kept.size()) < want && i < idle.size(); ++i) {
        kept.push_back(idle[i]);
        worker_job_[idle[i]] = job_id;
      }
      run.record.clear_workers();
      for (const std::string& w : kept) run.record.add_workers(w);
      ReplaceLocked(run, *job, alive.store_ids(), alive.placeable_ids());
      absl::Status s = PersistLocked(run);
      if (!s.ok()) LOG(ERROR) << s;
    }

    // A drained store that left cleanly (deregistered, and not back after a restart's
    // grace period): its drain is over, and its id may be given out again.
    for (auto it = drain_groups_.begin(); it != drain_groups_.end();) {
      if (alive.known.count(it->first) || !gone(it->first, true) ||
          GroupsOnLocked(it->first, /*with_moves=*/true) > 0) {
        ++it;
        continue;
      }
      (void)jobs_->DeleteRecord(absl::StrCat(kDrainPrefix, it->first));
      members_->ForgetDrain(it->first);
      it = drain_groups_.erase(it);
    }
    // Draining stores that hold nothing any more can be stopped.
    for (const std::string& id : alive.draining) {
      if (alive.stores.at(id).state() == v1::MEMBER_STATE_DRAINING &&
          GroupsOnLocked(id, /*with_moves=*/true) == 0) {
        members_->MarkDrained(id);
        LOG(INFO) << "store " << id << " is drained: nothing is placed on it; it can be stopped";
      }
    }

    // Pending jobs, oldest first, while there are idle workers and a store.
    std::vector<v1::Job> waiting = jobs_->List({v1::JOB_STATE_PENDING, v1::JOB_STATE_RUNNING}, 0);
    std::reverse(waiting.begin(), waiting.end());
    for (const v1::Job& job : waiting) {
      if (runs_.count(job.job_id()) || alive.stores.empty()) continue;
      std::vector<std::string> idle;
      for (const auto& [id, m] : alive.workers) {
        if (!worker_job_.count(id)) idle.push_back(id);
      }
      const int want = std::max(1, job.spec().cluster().workers());
      if (static_cast<int>(idle.size()) < want) break;  // first come, first served
      idle.resize(want);
      Run run;
      run.committed = job.committed_step();
      run.record.set_job_id(job.job_id());
      for (const std::string& w : idle) run.record.add_workers(w);
      run.record.set_assignment_version(NextVersion(0));
      run.record.set_committing_step(-1);
      *run.record.mutable_placement() = BuildPlacement(
          job, idle, alive.placeable_ids(), PlanLocked(job, want, heat_->Snapshot(job.job_id())),
          nullptr, job.placement_epoch() + 1, run.committed + 1);
      absl::Status s = PersistLocked(run);
      if (!s.ok()) {
        LOG(ERROR) << s;
        continue;
      }
      const int64_t epoch = run.record.placement().epoch();
      (void)jobs_->Update(job.job_id(), [&](v1::Job& j) {
        j.set_state(v1::JOB_STATE_RUNNING);
        if (j.started_unix_ms() == 0) j.set_started_unix_ms(NowMs());
        j.set_placement_epoch(epoch);
        j.set_workers(want);
        return absl::OkStatus();
      });
      for (const std::string& w : idle) worker_job_[w] = job.job_id();
      LOG(INFO) << "job " << job.job_id() << " scheduled on " << want << " worker(s)";
      UpdateMetricsLocked(job, run);
      runs_[job.job_id()] = std::move(run);
    }
  }
  RunStoreAborts(aborts);
  for (const auto& [job_id, step] : commits) Commit(job_id, step);
}

void Scheduler::RunStoreAborts(const std::vector<StoreCall>& aborts) {
  for (const StoreCall& call : aborts) {
    absl::Status s = stores_->AbortStep(call.store, call.job_id, call.step);
    // Best effort: a store that missed it replaces the pending versions on the retry's
    // writes, and a dead one is dropped from the placement.
    if (!s.ok()) LOG(WARNING) << "abort of step " << call.step << ": " << s;
  }
}

absl::StatusOr<v1::Assignment> Scheduler::GetAssignment(const std::string& worker_id) {
  const Alive alive = Snapshot(*members_);
  if (!alive.workers.count(worker_id)) {
    return absl::NotFoundError(absl::StrCat("unknown worker ", worker_id, ": register again"));
  }
  absl::MutexLock lock(&mu_);
  v1::Assignment a;
  auto w = worker_job_.find(worker_id);
  if (w == worker_job_.end()) return a;  // idle
  const Run& run = runs_.at(w->second);
  if (run.recovering) {
    return absl::UnavailableError(absl::StrCat("job ", w->second,
                                               " is waiting for its members after a coordinator "
                                               "restart; retry"));
  }
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(w->second));
  a.set_assignment_version(run.record.assignment_version());
  a.set_job_id(job.job_id());
  *a.mutable_spec() = job.spec();
  a.set_world(run.record.workers_size());
  for (int rank = 0; rank < run.record.workers_size(); ++rank) {
    const std::string& id = run.record.workers(rank);
    if (id == worker_id) a.set_rank(rank);
    auto peer = alive.workers.find(id);
    v1::MemberInfo* p = a.add_peers();
    if (peer != alive.workers.end()) {
      *p = peer->second;
    } else {
      p->set_member_id(id);
    }
  }
  for (const auto& [id, store] : alive.stores) *a.add_stores() = store;
  *a.mutable_placement() = run.record.placement();
  a.set_committed_step(run.committed);
  return a;
}

int64_t Scheduler::AssignmentVersion(const std::string& worker_id) {
  absl::MutexLock lock(&mu_);
  auto w = worker_job_.find(worker_id);
  if (w == worker_job_.end()) return 0;
  return runs_.at(w->second).record.assignment_version();
}

absl::StatusOr<v1::PlacementTable> Scheduler::GetPlacement(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it == runs_.end())
    return absl::NotFoundError(absl::StrCat("job ", job_id, " is not running"));
  return it->second.record.placement();
}

v1::StepStatus Scheduler::StatusLocked(const std::string& job_id, const Run& run, int64_t step) {
  v1::StepStatus s;
  s.set_job_id(job_id);
  s.set_step(step);
  s.set_committed_step(run.committed);
  s.set_assignment_version(run.record.assignment_version());
  s.set_placement_epoch(run.record.placement().epoch());
  return s;
}

absl::StatusOr<v1::StepStatus> Scheduler::ReportStepWritten(const v1::StepWrittenRequest& r) {
  std::vector<StoreCall> aborts;
  bool commit = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(r.job_id());
    if (it == runs_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", r.job_id(), " is not running"));
    }
    Run& run = it->second;
    if (run.recovering) {
      return absl::UnavailableError(
          absl::StrCat("job ", r.job_id(), " is waiting for its members after a restart; retry"));
    }
    const auto& workers = run.record.workers();
    const auto pos = std::find(workers.begin(), workers.end(), r.worker_id());
    if (pos == workers.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker ", r.worker_id(), " is not training job ", r.job_id()));
    }
    if (r.step() <= run.committed) return StatusLocked(r.job_id(), run, r.step());
    if (r.assignment_version() != run.record.assignment_version()) {
      return absl::AbortedError(absl::StrCat("step ", r.step(), " of job ", r.job_id(),
                                             " was aborted (", run.abort_reason,
                                             "); fetch the new assignment"));
    }
    if (r.step() != step_in_flight(run)) {
      return absl::FailedPreconditionError(absl::StrCat("job ", r.job_id(), " is at step ",
                                                        step_in_flight(run), ", not ", r.step()));
    }
    if (run.record.committing_step() >= 0) return StatusLocked(r.job_id(), run, r.step());
    if (!r.ok()) {
      AbortLocked(run,
                  absl::StrCat("worker ", r.worker_id(), ": ",
                               r.failure().empty() ? "step failed" : r.failure()),
                  &aborts);
      absl::Status s = PersistLocked(run);
      if (!s.ok()) LOG(ERROR) << s;
    } else if (run.written.insert(r.worker_id()).second) {
      run.tokens += r.tokens();
      run.cache_hits += r.cache_hits();
      run.cache_misses += r.cache_misses();
      if (pos == workers.begin()) run.rank0 = r;
      if (run.written.size() == static_cast<size_t>(workers.size())) {
        run.record.set_committing_step(r.step());
        // The decision is durable before any store hears of it; if it cannot be made
        // durable, it is not made.
        if (absl::Status persisted = PersistLocked(run); !persisted.ok()) {
          run.record.set_committing_step(-1);
          run.written.erase(r.worker_id());
          return persisted;
        }
        commit = true;
      }
    }
  }
  RunStoreAborts(aborts);
  if (commit) Commit(r.job_id(), r.step());
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(r.job_id());
  v1::StepStatus status;
  if (it != runs_.end()) {
    status = StatusLocked(r.job_id(), it->second, r.step());
  } else {
    status.set_job_id(r.job_id());
    status.set_step(r.step());
    status.set_committed_step(r.step());
    status.set_job_ended(true);
  }
  if (!r.ok()) {
    status.set_aborted(true);
    status.set_abort_reason(it != runs_.end() ? it->second.abort_reason : r.failure());
  }
  return status;
}

void Scheduler::Commit(const std::string& job_id, int64_t step) {
  const Alive alive = Snapshot(*members_);
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it == runs_.end() || it->second.committing || it->second.holds > 0 ||
        it->second.record.committing_step() != step) {
      return;  // a held commit is finished by Tick once the checkpoint is done
    }
    it->second.committing = true;
  }
  // Every store of the placement must commit; one that is not alive yet (after a restart)
  // holds the commit back until it registers again or is declared gone.
  std::set<std::string> live;
  for (const auto& [id, store] : alive.stores) live.insert(id);
  bool all = true;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job_id);
    if (it != runs_.end()) {
      for (const v1::ExpertPlacement& e : it->second.record.placement().experts()) {
        for (const std::string& id : e.store_ids()) {
          if (!live.count(id) && !Gone(live, alive.known, id)) all = false;
        }
      }
    }
  }
  // The stores commit side by side: each syncs the step's bytes to its disk.
  std::vector<absl::Status> results(alive.stores.size());
  {
    std::vector<std::thread> committers;
    size_t i = 0;
    for (const auto& [id, store] : alive.stores) {
      committers.emplace_back([this, &results, i, store = &store, &job_id, step] {
        results[i] = stores_->CommitStep(*store, job_id, step);
      });
      ++i;
    }
    for (std::thread& t : committers) t.join();
  }
  std::set<std::string> committed_on;
  {
    size_t i = 0;
    for (const auto& [id, store] : alive.stores) {
      const absl::Status& s = results[i++];
      if (s.ok()) {
        committed_on.insert(id);
        continue;
      }
      LOG(WARNING) << "commit of step " << step << " of job " << job_id << ": " << s;
      all = false;  // retried by Tick until the store answers or is declared dead
    }
  }
  absl::MutexLock lock(&mu_);
  auto it = runs_.find(job_id);
  if (it == runs_.end()) return;
  it->second.committing = false;
  it->second.committed_on = std::move(committed_on);
  if (all) FinishCommitLocked(job_id, it->second);
}

void Scheduler::FinishCommitLocked(const std::string& job_id, Run& run) {
  const int64_t step = run.record.committing_step();
  const int64_t now = NowMs();
  const absl::Time now_time = absl::Now();
  double seconds = 0;
  if (run.last_commit != absl::InfinitePast()) {
    seconds = absl::ToDoubleSeconds(now_time - run.last_commit);
  } else if (run.record.last_commit_unix_ms() > 0) {  // the previous commit was before a restart
    seconds = (now - run.record.last_commit_unix_ms()) / 1e3;
  }
  bool ended = false;
  absl::StatusOr<v1::Job> job = jobs_->Update(job_id, [&](v1::Job& j) {
    j.set_committed_step(step);
    if (step >= 1) {
      j.set_last_loss(run.rank0.loss());
      j.set_last_ce(run.rank0.ce());
      j.set_last_lr(run.rank0.lr());
      j.set_step_seconds(seconds);
      j.set_tokens_per_second(seconds > 0 ? run.tokens / seconds : 0.0);
      const uint64_t lookups = run.cache_hits + run.cache_misses;
      j.set_cache_hit_rate(lookups > 0 ? static_cast<double>(run.cache_hits) / lookups : 0.0);
    }
    if (!IsFinal(j.state()) && step >= j.spec().train().steps()) {
      j.set_state(v1::JOB_STATE_SUCCEEDED);
      j.set_finished_unix_ms(now);
    }
    ended = IsFinal(j.state());
    return absl::OkStatus();
  });
  if (!job.ok()) {
    LOG(ERROR) << "job " << job_id << ": " << job.status();
    return;
  }
  run.committed = step;
  run.record.set_committing_step(-1);
  run.record.set_last_commit_unix_ms(now);
  run.last_commit = now_time;
  run.written.clear();
  run.tokens = run.cache_hits = run.cache_misses = 0;
  run.rank0.Clear();
  run.abort_reason.clear();
  if (steps_committed_ != nullptr) steps_committed_->Increment();
  if (ended) {
    for (const std::string& w : run.record.workers()) worker_job_.erase(w);
    (void)jobs_->DeleteRecord(absl::StrCat(kRunPrefix, job_id));
    (void)jobs_->PutRecord(absl::StrCat(kHeatPrefix, job_id), heat_->Save(job_id));
    runs_.erase(job_id);
    return;
  }
  const v1::PlacementTable before = run.record.placement();
  bool changed = ApplyCopiesLocked(run, *job);
  const int every = std::max(1, job->spec().cluster().replication().replan_every());
  if (step >= 1 && step % every == 0) {
    // Heat is durable at each re-plan boundary; a new placement applies from the next step.
    absl::Status s = jobs_->PutRecord(absl::StrCat(kHeatPrefix, job_id), heat_->Save(job_id));
    if (!s.ok()) LOG(WARNING) << s;
    std::vector<std::string> workers(run.record.workers().begin(), run.record.workers().end());
    std::vector<std::string> stores;  // unchanged: every group keeps its copies
    const std::optional<HeatMap> heat = heat_->Snapshot(job_id);
    v1::PlacementTable next = BuildPlacement(
        *job, workers, stores, PlanLocked(*job, static_cast<int>(workers.size()), heat),
        &run.record.placement(), before.epoch(), step + 1);
    // A new compute plan must pay for itself: moving experts costs the step computed
    // meanwhile (done again under the new plan) and their state fetched by the new owners,
    // so it is taken only when it cuts the lockstep load (under the heat it was planned
    // from) by kReplanGain.
    if (!SameOwners(next, run.record.placement()) &&
        (!heat || LockstepLoad(next, *heat) <
                      (1 - kReplanGain) * LockstepLoad(run.record.placement(), *heat))) {
      *run.record.mutable_placement() = std::move(next);
      changed = true;
    }
  }
  if (changed) {
    run.record.mutable_placement()->set_epoch(before.epoch() + 1);
    run.record.mutable_placement()->set_effective_step(step + 1);
    run.record.set_assignment_version(NextVersion(run.record.assignment_version()));
    const int64_t epoch = run.record.placement().epoch();
    (void)jobs_->Update(job_id, [&](v1::Job& j) {
      j.set_placement_epoch(epoch);
      return absl::OkStatus();
    });
    LOG(INFO) << "job " << job_id << ": placement epoch " << epoch << " from step " << step + 1;
  }
  if (changed || (step >= 1 && step % every == 0)) UpdateMetricsLocked(*job, run);
  absl::Status s = PersistLocked(run);
  if (!s.ok()) LOG(ERROR) << s;
}

absl::StatusOr<v1::StepStatus> Scheduler::WaitStep(const v1::WaitStepRequest& request,
                                                   absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = runs_.find(request.job_id());
    if (it == runs_.end()) return true;
    return it->second.committed >= request.step() ||
           it->second.record.assignment_version() != request.assignment_version();
  };
  mu_.AwaitWithTimeout(absl::Condition(&settled), timeout);
  auto it = runs_.find(request.job_id());
  if (it == runs_.end()) {
    ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(request.job_id()));
    v1::StepStatus s;
    s.set_job_id(job.job_id());
    s.set_step(request.step());
    s.set_committed_step(job.committed_step());
    s.set_job_ended(IsFinal(job.state()));
    if (!s.job_ended() && job.committed_step() < request.step()) {
      s.set_aborted(true);
      s.set_abort_reason("the job is waiting for workers");
    }
    return s;
  }
  v1::StepStatus s = StatusLocked(request.job_id(), it->second, request.step());
  if (it->second.committed < request.step() &&
      it->second.record.assignment_version() != request.assignment_version()) {
    s.set_aborted(true);
    s.set_abort_reason(it->second.abort_reason.empty() ? "the assignment changed"
                                                       : it->second.abort_reason);
  }
  return s;
}

void Scheduler::UpdateMetricsLocked(const v1::Job& job, const Run& run) {
  if (metrics_ == nullptr) return;
  std::optional<HeatMap> heat = heat_->Snapshot(job.job_id());
  for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
    if (e.layer() < 0) continue;
    MetricLabels labels = {{"job", job.job_id()},
                           {"layer", absl::StrCat(e.layer())},
                           {"expert", absl::StrCat(e.expert())}};
    if (heat) {
      absl::StatusOr<prometheus::Gauge*> g = metrics_->Gauge(
          "pith_coordinator_expert_heat", "Decayed tokens routed to an expert per step", labels);
      if (g.ok()) (*g)->Set(heat->heat(e.layer(), e.expert()));
    }
    for (const auto& [kind, count] :
         {std::pair<const char*, int>{"store", e.store_ids_size()}, {"compute", e.owners_size()}}) {
      labels["kind"] = kind;
      absl::StatusOr<prometheus::Gauge*> g = metrics_->Gauge(
          "pith_coordinator_replicas",
          "Copies of an expert: kind=store (stores holding it), kind=compute (owning workers)",
          labels);
      if (g.ok()) (*g)->Set(count);
    }
  }
}

bool Scheduler::ApplyCopiesLocked(Run& run, const v1::Job& job) {
  const Alive alive = Snapshot(*members_);
  const std::vector<std::string> live = alive.placeable_ids();
  std::map<std::pair<int, int>, v1::ExpertPlacement*> entries;
  for (v1::ExpertPlacement& e : *run.record.mutable_placement()->mutable_experts()) {
    entries[GroupOf(e.layer(), e.expert())] = &e;
  }
  bool changed = false;
  // A joining store must have committed every step since it joined; one that missed this
  // commit (it died, or did not answer) leaves, and joins again from scratch.
  for (auto& [group, e] : entries) {
    auto* joining = e->mutable_joining_store_ids();
    const int before = joining->size();
    joining->erase(std::remove_if(joining->begin(), joining->end(),
                                  [&](const std::string& id) {
                                    if (run.committed_on.count(id)) return false;
                                    run.joined_at.erase({group, id});
                                    return true;
                                  }),
                   joining->end());
    changed |= joining->size() != before;
  }
  run.committed_on.clear();
  // A joining store whose copy is complete is a reader from now on: it got every version
  // written since it joined, and the pull (begun after it joined) brought the committed
  // one from before.
  for (const Run::Copy& copy : run.copied) {
    auto it = entries.find(copy.group);
    if (it == entries.end()) continue;
    auto* joining = it->second->mutable_joining_store_ids();
    auto pos = std::find(joining->begin(), joining->end(), copy.target);
    auto joined = run.joined_at.find({copy.group, copy.target});
    if (pos == joining->end() || joined == run.joined_at.end() ||
        copy.start_step < joined->second) {
      continue;
    }
    run.joined_at.erase(joined);
    joining->erase(pos);
    auto* ids = it->second->mutable_store_ids();
    if (alive.stores.count(copy.target) &&
        std::find(ids->begin(), ids->end(), copy.target) == ids->end()) {
      *ids->Add() = copy.target;
    }
    changed = true;
  }
  run.copied.clear();
  // Stores a group is short of join it: writers include them from the next step on.
  for (const auto& [group, target] : run.join_requests) {
    auto it = entries.find(group);
    if (it == entries.end() || !alive.stores.count(target) || alive.draining.count(target)) {
      continue;
    }
    const auto& ids = it->second->store_ids();
    const auto& joining = it->second->joining_store_ids();
    if (std::find(ids.begin(), ids.end(), target) != ids.end() ||
        std::find(joining.begin(), joining.end(), target) != joining.end()) {
      continue;
    }
    *it->second->add_joining_store_ids() = target;
    run.joined_at[{group, target}] = run.committed;
    changed = true;
  }
  run.join_requests.clear();
  // Surplus copies (a store joined and took over a share, a store is draining, an expert
  // cooled down) leave once every desired store holds the group — and never below the
  // replica count (too few stores take new copies: the draining ones keep theirs).
  std::optional<HeatMap> heat = heat_->Snapshot(job.job_id());
  const std::vector<double> means = heat ? LayerMeans(*heat) : std::vector<double>();
  const size_t replicas = std::max(1, job.spec().cluster().store_replicas());
  for (auto& [group, e] : entries) {
    const std::vector<std::string> desired =
        DesiredStores(job, e->layer(), e->expert(), live, heat ? &*heat : nullptr, means);
    const std::set<std::string> held(e->store_ids().begin(), e->store_ids().end());
    bool complete = desired.size() >= replicas;
    for (const std::string& d : desired) complete &= held.count(d) > 0;
    if (!complete || held.size() == desired.size()) continue;
    e->clear_store_ids();
    for (const std::string& d : desired) e->add_store_ids(d);
    changed = true;
  }
  return changed;
}

int Scheduler::ReplicateOnce() {
  struct Task {
    std::string job_id;
    int layer, expert;
    v1::MemberInfo source, target;
    int64_t start_step;
  };
  const Alive alive = Snapshot(*members_);
  const std::vector<std::string> live = alive.placeable_ids();
  std::vector<Task> tasks;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [job_id, run] : runs_) {
      if (run.recovering || run.committed < 0) continue;
      absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
      if (!job.ok()) continue;
      std::optional<HeatMap> heat = heat_->Snapshot(job_id);
      const std::vector<double> means = heat ? LayerMeans(*heat) : std::vector<double>();
      for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
        const std::pair<int, int> group = GroupOf(e.layer(), e.expert());
        std::vector<std::string> holders;
        for (const std::string& id : e.store_ids()) {
          if (alive.stores.count(id)) holders.push_back(id);
        }
        if (holders.empty()) continue;  // nothing to copy from
        // A store the group is short of joins it at the next step boundary.
        if (!run.join_requests.count(group)) {
          std::set<std::string> have(e.store_ids().begin(), e.store_ids().end());
          have.insert(e.joining_store_ids().begin(), e.joining_store_ids().end());
          for (const std::string& d :
               DesiredStores(*job, e.layer(), e.expert(), live, heat ? &*heat : nullptr, means)) {
            if (have.count(d)) continue;
            run.join_requests[group] = d;
            break;  // one new copy of a group at a time
          }
        }
        // A store that joined gets the committed copy.
        if (run.copying.count(group) || static_cast<int>(tasks.size()) >= options_.max_pulls) {
          continue;
        }
        for (const std::string& target : e.joining_store_ids()) {
          if (!alive.stores.count(target)) continue;
          bool done = false;
          for (const Run::Copy& c : run.copied) done |= c.group == group && c.target == target;
          if (done) continue;
          // A drain's copies read from the draining store, so the others keep serving.
          std::string source = holders.front();
          for (const std::string& id : holders) {
            if (alive.draining.count(id)) source = id;
          }
          tasks.push_back({job_id, e.layer(), e.expert(), alive.stores.at(source),
                           alive.stores.at(target), run.committed});
          run.copying.insert(group);
          const bool drain = alive.draining.count(source) > 0;  // a draining holder if any
          v1::BlobMove move;
          move.mutable_key()->set_job_id(job_id);
          move.mutable_key()->set_layer(e.layer());
          move.mutable_key()->set_expert(e.expert());
          move.set_from_store_id(source);
          move.set_to_store_id(target);
          move.set_reason(static_cast<int>(holders.size()) <
                                  std::max(1, job->spec().cluster().store_replicas())
                              ? "replicate"
                          : drain ? "drain"
                                  : "rebalance");
          moves_.push_back(std::move(move));
          break;
        }
      }
    }
    if (moves_in_flight_ != nullptr) moves_in_flight_->Set(static_cast<double>(moves_.size()));
  }
  if (tasks.empty()) return 0;
  std::atomic<int> done{0};
  std::vector<std::thread> threads;
  for (const Task& t : tasks) {
    threads.emplace_back([this, &t, &done] {
      uint64_t bytes = 0;
      size_t blobs = 0;
      absl::Status status;
      absl::StatusOr<std::vector<v1::BlobInfo>> listed =
          stores_->ListGroup(t.source, t.job_id, t.layer, t.expert);
      if (listed.ok()) {
        std::vector<v1::BlobKey> keys;
        for (const v1::BlobInfo& b : *listed) keys.push_back(b.key());
        absl::StatusOr<std::vector<v1::BlobInfo>> pulled =
            stores_->Pull(t.target, t.source, keys, options_.replication_bytes_per_second);
        if (pulled.ok()) {
          blobs = pulled->size();
          for (const v1::BlobInfo& b : *pulled) bytes += b.size_bytes();
        }
        status = pulled.status();
      } else {
        status = listed.status();
      }
      if (!status.ok()) {
        LOG(WARNING) << "copy of " << GroupName(t.job_id, t.layer, t.expert) << " to "
                     << t.target.member_id() << ": " << status;
      }
      absl::MutexLock lock(&mu_);
      moves_.erase(std::remove_if(moves_.begin(), moves_.end(),
                                  [&](const v1::BlobMove& m) {
                                    return m.key().job_id() == t.job_id &&
                                           m.key().layer() == t.layer &&
                                           m.key().expert() == t.expert &&
                                           m.to_store_id() == t.target.member_id();
                                  }),
                   moves_.end());
      if (moves_in_flight_ != nullptr) moves_in_flight_->Set(static_cast<double>(moves_.size()));
      auto it = runs_.find(t.job_id);
      if (it == runs_.end()) return;
      it->second.copying.erase(GroupOf(t.layer, t.expert));
      if (!status.ok()) return;
      it->second.copied.push_back({GroupOf(t.layer, t.expert), t.target.member_id(), t.start_step});
      blobs_moved_ += blobs;
      bytes_moved_ += bytes;
      if (blobs_moved_total_ != nullptr) {
        blobs_moved_total_->Increment(static_cast<double>(blobs));
        bytes_moved_total_->Increment(static_cast<double>(bytes));
      }
      ++done;
    });
  }
  for (std::thread& th : threads) th.join();
  return done.load();
}

uint64_t Scheduler::GroupsOnLocked(const std::string& store, bool with_moves) const {
  uint64_t groups = 0;
  for (const auto& [job_id, run] : runs_) {
    for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
      groups += std::count(e.store_ids().begin(), e.store_ids().end(), store) +
                std::count(e.joining_store_ids().begin(), e.joining_store_ids().end(), store);
    }
  }
  if (!with_moves) return groups;
  for (const v1::BlobMove& m : moves_) {
    groups += m.from_store_id() == store || m.to_store_id() == store;
  }
  return groups;
}

absl::StatusOr<v1::DrainStoreResponse> Scheduler::Drain(const std::string& store_id) {
  if (store_id.empty()) return absl::InvalidArgumentError("store_id is required");
  absl::MutexLock drain_lock(&drain_mu_);  // one drain's capacity check at a time
  const Alive alive = Snapshot(*members_);
  if (!alive.known.count(store_id)) {
    return absl::NotFoundError(absl::StrCat("unknown store ", store_id));
  }
  struct Group {
    std::string job_id;
    int layer, expert;
  };
  std::vector<Group> groups;
  {
    absl::MutexLock lock(&mu_);
    // The others must be able to hold every running job's copies.
    std::vector<std::string> others = alive.placeable_ids();
    others.erase(std::remove(others.begin(), others.end(), store_id), others.end());
    for (const auto& [job_id, run] : runs_) {
      absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
      if (!job.ok()) continue;
      const int want = std::max(1, job->spec().cluster().store_replicas());
      if (!alive.draining.count(store_id) && static_cast<int>(others.size()) < want) {
        return absl::FailedPreconditionError(absl::StrCat(
            "draining ", store_id, " would leave ", others.size(), " store(s) for job ", job_id,
            ", which keeps ", want, " copies of every blob; add a store first"));
      }
      for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
        if (std::count(e.store_ids().begin(), e.store_ids().end(), store_id)) {
          groups.push_back({job_id, e.layer(), e.expert()});
        }
      }
    }
  }
  // Durable first, then in force; undone if the store cannot be drained after all.
  bool recorded = false;
  {
    absl::MutexLock lock(&mu_);
    if (!drain_groups_.count(store_id)) {
      RETURN_IF_ERROR(
          jobs_->PutRecord(absl::StrCat(kDrainPrefix, store_id), absl::StrCat(groups.size())));
      drain_groups_[store_id] = groups.size();
      recorded = true;
    }
  }
  if (absl::Status s = members_->Drain(store_id); !s.ok()) {
    if (recorded) {
      absl::MutexLock lock(&mu_);
      (void)jobs_->DeleteRecord(absl::StrCat(kDrainPrefix, store_id));
      drain_groups_.erase(store_id);
    }
    return s;
  }
  LOG(INFO) << "draining store " << store_id << ": " << groups.size() << " groups to move";
  v1::DrainStoreResponse out;
  out.set_groups_to_move(groups.size());
  auto store = alive.stores.find(store_id);
  if (store == alive.stores.end()) return out;
  for (const Group& g : groups) {
    absl::StatusOr<std::vector<v1::BlobInfo>> blobs =
        stores_->ListGroup(store->second, g.job_id, g.layer, g.expert);
    if (!blobs.ok()) continue;  // the figures are an estimate; the drain goes on
    for (const v1::BlobInfo& b : *blobs) {
      out.set_blobs_to_move(out.blobs_to_move() + 1);
      out.set_bytes_to_move(out.bytes_to_move() + b.size_bytes());
    }
  }
  return out;
}

void Scheduler::ReplicationStatus(v1::ClusterStatusResponse* out) {
  const Alive alive = Snapshot(*members_);
  absl::MutexLock lock(&mu_);
  for (const v1::BlobMove& m : moves_) *out->add_moves() = m;
  out->set_blobs_moved(blobs_moved_);
  out->set_bytes_moved(bytes_moved_);
  uint64_t deficit = 0;
  for (const auto& [job_id, run] : runs_) {
    absl::StatusOr<v1::Job> job = jobs_->Get(job_id);
    if (!job.ok()) continue;
    const int want = std::min<int>(std::max(1, job->spec().cluster().store_replicas()),
                                   static_cast<int>(alive.stores.size()));
    for (const v1::ExpertPlacement& e : run.record.placement().experts()) {
      int held = 0;
      for (const std::string& id : e.store_ids()) held += alive.stores.count(id) > 0;
      deficit += static_cast<uint64_t>(std::max(0, want - held));
    }
  }
  out->set_replica_deficit(deficit);
  if (replica_deficit_ != nullptr) replica_deficit_->Set(static_cast<double>(deficit));
  for (const auto& [id, total] : drain_groups_) {
    if (!alive.known.count(id)) continue;  // stopped and gone
    v1::StoreDrain* d = out->add_drains();
    d->set_store_id(id);
    d->set_groups_total(total);
    d->set_groups_left(GroupsOnLocked(id, /*with_moves=*/false));
    d->set_can_stop(alive.stores.count(id) && alive.draining.count(id) &&
                    alive.stores.at(id).state() == v1::MEMBER_STATE_DRAINED);
  }
}

absl::StatusOr<v1::CheckpointJobResponse> Scheduler::Checkpoint(
    const v1::CheckpointJobRequest& request) {
  if (request.output_dir().empty()) return absl::InvalidArgumentError("output_dir is required");
  if (request.include_optimizer()) {
    return absl::UnimplementedError(
        "include_optimizer: exporting the optimizer state is not supported yet; export the "
        "weights only");
  }
  ASSIGN_OR_RETURN(v1::Job job, jobs_->Get(request.job_id()));
  // Hold the job's commits (after any in progress) so every blob read is of one step.
  bool held = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job.job_id());
    if (it != runs_.end()) {
      auto idle = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        auto r = runs_.find(job.job_id());
        return r == runs_.end() || !r->second.committing;
      };
      mu_.Await(absl::Condition(&idle));
      it = runs_.find(job.job_id());
      if (it != runs_.end()) {
        ++it->second.holds;
        held = true;
      }
    }
  }
  auto release = [&] {
    if (!held) return;
    absl::MutexLock lock(&mu_);
    auto it = runs_.find(job.job_id());
    if (it != runs_.end()) --it->second.holds;
  };
  absl::StatusOr<v1::CheckpointJobResponse> out =
      [&]() -> absl::StatusOr<v1::CheckpointJobResponse> {
    ASSIGN_OR_RETURN(job, jobs_->Get(request.job_id()));
    const int64_t step = job.committed_step();
    if (step < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job.job_id(), " has no committed step yet"));
    }
    const model::ParamLayout layout(model::ModelShape::FromSpec(job.spec().model()));
    // Which live store holds the newest committed copy of each weights blob.
    const Alive alive = Snapshot(*members_);
    struct Best {
      int64_t version = -1;
      std::string store;
    };
    std::map<std::tuple<int, int, std::string>, Best> best;
    for (const auto& [id, store] : alive.stores) {
      absl::StatusOr<std::vector<v1::BlobInfo>> listed =
          stores_->ListGroup(store, job.job_id(), /*layer=*/-2, 0);
      if (!listed.ok()) {
        LOG(WARNING) << "checkpoint of " << job.job_id() << ": " << listed.status();
        continue;
      }
      for (const v1::BlobInfo& b : *listed) {
        if (b.key().kind() != v1::BLOB_KIND_WEIGHTS || b.version() > step) continue;
        const auto key =
            std::make_tuple(b.key().layer(), b.key().layer() < 0 ? 0 : b.key().expert(),
                            b.key().layer() < 0 ? b.key().tensor() : std::string());
        Best& slot = best[key];
        if (b.version() > slot.version) slot = {b.version(), id};
      }
    }
    std::vector<float> host(layout.total_floats());
    std::map<std::string, std::vector<StoreControl::Read>> reads;  // by store
    std::set<std::pair<int, int>> experts;
    for (const model::ParamTensor& t : layout.tensors()) {
      v1::BlobKey key;
      key.set_job_id(job.job_id());
      key.set_kind(v1::BLOB_KIND_WEIGHTS);
      int64_t offset = t.offset, floats = t.numel;
      if (t.layer < 0) {
        key.set_layer(-1);
        key.set_tensor(t.name);
      } else {
        if (!experts.insert({t.layer, t.expert}).second) continue;  // one blob per expert
        key.set_layer(t.layer);
        key.set_expert(t.expert);
        floats = layout.shape().expert_floats();
      }
      auto it = best.find(std::make_tuple(key.layer(), key.expert(), key.tensor()));
      if (it == best.end()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "job ", job.job_id(), ": no live store holds the weights of ",
            t.layer < 0 ? t.name : absl::StrCat("layer ", t.layer, " expert ", t.expert)));
      }
      StoreControl::Read read;
      read.key = key;
      read.version = it->second.version;
      read.buffer = host.data() + offset;
      read.capacity = static_cast<size_t>(floats) * sizeof(float);
      reads[it->second.store].push_back(std::move(read));
    }
    for (auto& [store, batch] : reads) {
      RETURN_IF_ERROR(stores_->Fetch(alive.stores.at(store), batch));
      for (const StoreControl::Read& r : batch) {
        if (r.info.version() != r.version) {
          return absl::AbortedError(
              absl::StrCat("a blob of layer ", r.key.layer(),
                           " changed version during the checkpoint; try again"));
        }
        if (r.info.size_bytes() != r.capacity) {
          return absl::DataLossError(absl::StrCat("blob of layer ", r.key.layer(), " (",
                                                  r.key.tensor(), ") has ", r.info.size_bytes(),
                                                  " bytes, the model wants ", r.capacity));
        }
      }
    }
    std::error_code ec;
    std::filesystem::create_directories(request.output_dir(), ec);
    if (ec) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot create ", request.output_dir(), ": ", ec.message()));
    }
    const std::string path =
        absl::StrCat(request.output_dir(), "/", model::CheckpointFileName(job.job_id(), step));
    std::string spec_json;
    google::protobuf::util::JsonPrintOptions json_options;
    json_options.preserve_proto_field_names = true;
    (void)google::protobuf::util::MessageToJsonString(job.spec(), &spec_json, json_options);
    RETURN_IF_ERROR(
        model::SaveHostWeights(layout, host.data(), path, {{model::kSpecMetadataKey, spec_json}}));
    v1::CheckpointJobResponse response;
    response.set_step(step);
    response.set_weights_path(path);
    response.set_bytes(std::filesystem::file_size(path, ec));
    return response;
  }();
  release();
  return out;
}

}  // namespace pith::coordinator
