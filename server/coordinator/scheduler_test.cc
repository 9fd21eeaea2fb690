// The scheduler's logic with an in-memory seam for the stores and one fake clock for the
// membership's leases and the scheduler's time: scheduling, the step-commit protocol,
// step timing, aborts, lease expiry and reassignment, a restart's grace period, store
// loss, job end, cancellation, and a restart in the middle of a commit.
#include "server/coordinator/scheduler.h"

#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "common/job_spec_testing.h"
#include "common/param_layout.h"
#include "common/safetensors.h"
#include "common/ucx_address.h"
#include "gmock/gmock.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "server/coordinator/placement_table.h"

namespace pith::coordinator {
namespace {

// Records every call; CommitStep fails while `fail_commits` is set (or for the stores in
// `failing`), and answers the blob counts of `blobs_answered` (else plenty). PrepareStep
// fails for the stores in `failing_prepares` and answers the counts of `prepared_answered`.
class FakeStores final : public StoreControl {
 public:
  absl::StatusOr<uint64_t> PrepareStep(const v1::MemberInfo& store, const std::string& job_id,
                                       int64_t step, int64_t attempt) override {
    absl::MutexLock lock(&mu_);
    prepares.push_back(absl::StrCat(store.member_id(), ":", job_id, ":", step));
    prepare_attempts.push_back(attempt);
    auto failure = failing_prepares.find(store.member_id());
    if (failure != failing_prepares.end()) return failure->second;
    auto n = prepared_answered.find(store.member_id());
    return n != prepared_answered.end() ? n->second : 1000000;
  }
  absl::StatusOr<v1::CommitStepResponse> CommitStep(const v1::MemberInfo& store,
                                                    const std::string& job_id, int64_t step,
                                                    int64_t attempt) override {
    absl::MutexLock lock(&mu_);
    commit_attempts.push_back(attempt);
    auto failure = failing.find(store.member_id());
    if (failure != failing.end()) return failure->second;
    if (fail_commits) return absl::UnavailableError("store down");
    commits.push_back(absl::StrCat(store.member_id(), ":", job_id, ":", step));
    v1::CommitStepResponse r;
    r.set_committed_step(step);
    auto n = blobs_answered.find(store.member_id());
    r.set_blobs_committed(n != blobs_answered.end() ? n->second : 1000000);
    return r;
  }
  absl::Status AbortStep(const v1::MemberInfo& store, const std::string& job_id, int64_t step,
                         int64_t) override {
    absl::MutexLock lock(&mu_);
    aborts.push_back(absl::StrCat(store.member_id(), ":", job_id, ":", step));
    return absl::OkStatus();
  }
  // The store's `contents_on` or else `contents` when set (layer -2: all of it), else one
  // weights blob per group of 100 bytes.
  absl::StatusOr<std::vector<v1::BlobInfo>> ListGroup(const v1::MemberInfo& store,
                                                      const std::string& job_id, int layer,
                                                      int expert) override {
    absl::MutexLock lock(&mu_);
    const auto on = contents_on.find(store.member_id());
    if (on != contents_on.end() || !contents.empty()) {
      std::vector<v1::BlobInfo> out;
      for (const v1::BlobInfo& b : on != contents_on.end() ? on->second : contents) {
        if (layer == -2 || (b.key().layer() == layer && (layer < 0 || b.key().expert() == expert)))
          out.push_back(b);
      }
      return out;
    }
    v1::BlobInfo b;
    b.mutable_key()->set_job_id(job_id);
    b.mutable_key()->set_layer(layer);
    b.mutable_key()->set_expert(expert);
    b.set_size_bytes(100);
    return std::vector<v1::BlobInfo>{b};
  }
  absl::StatusOr<std::vector<v1::BlobInfo>> Pull(const v1::MemberInfo& target,
                                                 const v1::MemberInfo& source,
                                                 const std::vector<v1::BlobKey>& keys,
                                                 uint64_t) override {
    absl::MutexLock lock(&mu_);
    if (failing_pulls) return absl::UnavailableError("pull failed");
    std::vector<v1::BlobInfo> out;
    for (const v1::BlobKey& k : keys) {
      pulls.push_back(absl::StrCat(source.member_id(), "->", target.member_id(), ":", k.layer(),
                                   "/", k.expert()));
      v1::BlobInfo b;
      *b.mutable_key() = k;
      b.set_size_bytes(100);
      out.push_back(b);
    }
    return out;
  }
  // Fills each buffer with the float layer * 1000 + expert (dense: -1 - tensor name length).
  absl::Status Fetch(const v1::MemberInfo&, std::vector<Read>& reads) override {
    if (during_fetch) std::exchange(during_fetch, nullptr)();  // once
    for (Read& r : reads) {
      const float value = r.key.layer() < 0 ? -1.0f - static_cast<float>(r.key.tensor().size())
                                            : r.key.layer() * 1000.0f + r.key.expert();
      float* out = static_cast<float*>(r.buffer);
      for (size_t i = 0; i < r.capacity / sizeof(float); ++i) out[i] = value;
      *r.info.mutable_key() = r.key;
      r.info.set_version(r.version < 0 ? 0 : r.version);
      r.info.set_size_bytes(r.capacity);
    }
    return absl::OkStatus();
  }
  // What each store holds, by store id (ListJobs); DeleteJob records the call and keeps
  // the counts as they were (a test changes them).
  absl::StatusOr<std::vector<v1::StoreJob>> ListJobs(const v1::MemberInfo& store) override {
    absl::MutexLock lock(&mu_);
    return held[store.member_id()];
  }
  absl::Status DeleteJob(const v1::MemberInfo& store,
                         const v1::DeleteJobRequest& request) override {
    if (during_delete) std::exchange(during_delete, nullptr)(store, request);  // once
    absl::MutexLock lock(&mu_);
    deletes.push_back(absl::StrCat(
        store.member_id(), ":", request.job_id(),
        request.has_layer() ? absl::StrCat(":", request.layer(), "/", request.expert()) : "",
        request.keep_weights() ? ":keep" : ""));
    return absl::OkStatus();
  }
  absl::Mutex mu_;
  std::map<std::string, std::vector<v1::StoreJob>> held;
  std::vector<std::string> deletes;
  std::vector<v1::BlobInfo> contents;
  std::map<std::string, std::vector<v1::BlobInfo>> contents_on;  // by store id
  bool fail_commits = false;
  bool failing_pulls = false;
  std::map<std::string, absl::Status> failing;
  std::map<std::string, uint64_t> blobs_answered;
  std::map<std::string, absl::Status> failing_prepares;
  std::map<std::string, uint64_t> prepared_answered;
  std::vector<std::string> prepares, commits, aborts, pulls;
  std::vector<int64_t> prepare_attempts, commit_attempts;
  std::function<void()> during_fetch;  // runs inside the next Fetch, once
  // Runs (without the lock) inside the next DeleteJob, before it is recorded.
  std::function<void(const v1::MemberInfo&, const v1::DeleteJobRequest&)> during_delete;
};

// A placement's compute plan: (layer, expert) -> its owners' (rank, token share).
using RankPlan = std::map<std::pair<int, int>, std::vector<std::pair<int, double>>>;
RankPlan PlanByRank(const v1::PlacementTable& t) {
  RankPlan out;
  for (const v1::ExpertPlacement& e : t.experts()) {
    for (const v1::ComputeOwner& o : e.owners()) {
      out[{e.layer(), e.expert()}].emplace_back(o.rank(), o.token_share());
    }
  }
  return out;
}

// A job of two workers on one store that committed step 0, its first plan, and heat
// under which a fresh plan would differ from it (SchedulerTest::StartTwoWorkerJob).
struct TwoWorkerJob {
  v1::Job job;
  std::string s0, w0, w1;
  RankPlan plan;
};

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/sched_" + std::to_string(getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(dir_);
    Open();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // (Re)starts the coordinator's state: registry from disk, empty membership.
  void Open() {
    scheduler_.reset();
    jobs_.reset();
    members_ = std::make_unique<Membership>(absl::Seconds(3), [this] { return now_; });
    heat_ = std::make_unique<HeatRegistry>();
    auto jobs = JobRegistry::Open(dir_);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    jobs_ = std::move(*jobs);
    SchedulerOptions options;
    options.clock = [this] { return now_; };  // the membership's fake clock
    scheduler_ = std::make_unique<Scheduler>(jobs_.get(), members_.get(), heat_.get(), &stores_,
                                             &metrics_, options);
    ASSERT_TRUE(scheduler_->Recover().ok());
  }

  std::string Join(v1::MemberRole role, const std::string& id = "",
                   v1::Backend backend = v1::BACKEND_CPU) {
    v1::MemberInfo m;
    m.set_member_id(id);
    m.set_role(role);
    m.set_backend(backend);
    m.set_grpc_address("127.0.0.1:1");
    auto got = members_->Register(m);
    EXPECT_TRUE(got.ok()) << got.status();
    return *got;
  }

  // A store's membership state (UNSPECIFIED: none such).
  v1::MemberState StoreState(const std::string& id) {
    for (const v1::MemberInfo& m : members_->Members(v1::MEMBER_ROLE_STORE)) {
      if (m.member_id() == id) return m.state();
    }
    return v1::MEMBER_STATE_UNSPECIFIED;
  }

  v1::Job Submit(int workers = 2, int steps = 300, int replicas = 2,
                 const std::string& compute_dtype = "") {
    v1::JobSpec spec;
    EXPECT_TRUE(
        google::protobuf::util::JsonStringToMessage(pith::testing::kDesignExampleSpecJson, &spec)
            .ok());
    spec.mutable_model()->set_compute_dtype(compute_dtype);
    spec.mutable_cluster()->set_workers(workers);
    spec.mutable_cluster()->set_store_replicas(replicas);
    spec.mutable_train()->set_steps(steps);
    auto job = jobs_->Submit(spec);
    EXPECT_TRUE(job.ok()) << job.status();
    return *job;
  }

  v1::Job Job(const std::string& id) { return *jobs_->Get(id); }

  absl::StatusOr<v1::StepStatus> Report(const std::string& job, const std::string& worker,
                                        int64_t step, bool ok = true, double loss = 0,
                                        int dense_blobs_written = 0) {
    v1::StepWrittenRequest r;
    for (int i = 0; i < dense_blobs_written; ++i) {
      v1::BlobInfo* b = r.add_written();
      b->mutable_key()->set_job_id(job);
      b->mutable_key()->set_layer(-1);
      b->mutable_key()->set_tensor(absl::StrCat("tensor", i));
      b->set_version(step);
    }
    r.set_job_id(job);
    r.set_worker_id(worker);
    r.set_step(step);
    r.set_ok(ok);
    r.set_loss(loss);
    r.set_tokens(512);
    r.set_cache_hits(3);
    r.set_cache_misses(1);
    r.set_assignment_version(scheduler_->AssignmentVersion(worker));
    if (!ok) r.set_failure("out of memory");
    return scheduler_->ReportStepWritten(r);
  }

  // WaitStep for `step` of `job` under assignment version `version`.
  absl::StatusOr<v1::StepStatus> Wait(const std::string& job, int64_t step, int64_t version,
                                      absl::Duration timeout) {
    v1::WaitStepRequest wait;
    wait.set_job_id(job);
    wait.set_step(step);
    wait.set_assignment_version(version);
    return scheduler_->WaitStep(wait, timeout);
  }

  // Every worker of the job reports `step` written.
  void CommitStep(const std::string& job, int64_t step, const std::vector<std::string>& workers) {
    for (const std::string& w : workers) ASSERT_TRUE(Report(job, w, step, true, 5.0 - step).ok());
    ASSERT_EQ(Job(job).committed_step(), step);
  }

  // `worker`'s report that the step in flight failed with `failure`, under its assignment.
  v1::StepWrittenRequest FailedInFlight(const std::string& job, const std::string& worker,
                                        const std::string& failure) {
    v1::StepWrittenRequest r;
    r.set_job_id(job);
    r.set_worker_id(worker);
    r.set_step(Job(job).committed_step() + 1);
    r.set_ok(false);
    r.set_failure(failure);
    r.set_assignment_version(scheduler_->AssignmentVersion(worker));
    return r;
  }

  // `worker` reports the step in flight failed: its put to `store` was refused for want
  // of disk.
  absl::StatusOr<v1::StepStatus> RefusedForDisk(const std::string& job, const std::string& worker,
                                                const std::string& store) {
    v1::StepWrittenRequest r =
        FailedInFlight(job, worker, "store " + store + ": the disk under /data is full");
    r.set_full_store_id(store);
    return scheduler_->ReportStepWritten(r);
  }

  // `worker` reports the step in flight failed: it could not reach `peer` (a worker of the
  // job whose endpoint failed, or that fell silent).
  absl::StatusOr<v1::StepStatus> PeerFailed(const std::string& job, const std::string& worker,
                                            const std::string& peer) {
    v1::StepWrittenRequest r = FailedInFlight(job, worker, "dispatch of layer 0: peer 1 failed");
    r.set_unreachable_worker_id(peer);
    return scheduler_->ReportStepWritten(r);
  }

  // The stores the job's placement names (complete or joining copies).
  std::set<std::string> Placed(const std::string& job) {
    std::set<std::string> out;
    const absl::StatusOr<v1::PlacementTable> p = scheduler_->GetPlacement(job);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return out;
    for (const v1::ExpertPlacement& e : p->experts()) {
      out.insert(e.store_ids().begin(), e.store_ids().end());
      out.insert(e.joining_store_ids().begin(), e.joining_store_ids().end());
    }
    return out;
  }

  // Heat reported for `step` by `worker` under which a fresh compute plan differs from
  // the job's first (one expert of each layer takes nearly every token).
  void SkewHeat(const std::string& job_id, const std::string& worker, int64_t step) {
    const v1::Job job = Job(job_id);
    const v1::ModelConfig& m = job.spec().model();
    v1::HeatReport report;
    report.set_job_id(job_id);
    report.set_worker_id(worker);
    report.set_step(step);
    for (int l = 0; l < m.n_layer(); ++l) {
      v1::LayerRouting* routing = report.add_layers();
      routing->set_layer(l);
      for (int e = 0; e < m.n_expert(); ++e) routing->add_tokens_per_expert(e == l ? 900 : 1);
    }
    ASSERT_TRUE(heat_->Report(job, report).ok());
    ASSERT_NE(PlanJobCompute(job, 2, heat_->Snapshot(job_id)), PlanJobCompute(job, 2, {}));
  }

  void StartTwoWorkerJob(TwoWorkerJob& t) {
    t.job = Submit(2);
    t.s0 = Join(v1::MEMBER_ROLE_STORE);
    t.w0 = Join(v1::MEMBER_ROLE_WORKER);
    t.w1 = Join(v1::MEMBER_ROLE_WORKER);
    scheduler_->Tick();
    t.plan = PlanByRank(scheduler_->GetAssignment(t.w0)->placement());
    CommitStep(t.job.job_id(), 0, {t.w0, t.w1});
    ASSERT_NO_FATAL_FAILURE(SkewHeat(t.job.job_id(), t.w0, 0));
  }

  // 4 s pass with only `alive` heartbeating (at 2 s): every other member's lease runs out,
  // and the tick at the end loses them.
  void OnlyTheseLive(const std::vector<std::string>& alive) {
    now_ += absl::Seconds(2);
    for (const std::string& id : alive) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
    now_ += absl::Seconds(2);
    scheduler_->Tick();
  }

  std::string dir_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
  FakeStores stores_;
  MetricsRegistry metrics_;
  std::unique_ptr<Membership> members_;
  std::unique_ptr<HeatRegistry> heat_;
  std::unique_ptr<JobRegistry> jobs_;
  std::unique_ptr<Scheduler> scheduler_;
};

// A job's data is pinned by its first report: a worker that reads other bytes (the file
// changed since, or its host has another copy) fails the job, naming both, and nothing it
// trained is committed.
TEST_F(SchedulerTest, AWorkerReadingOtherDataFailsTheJobWithBothFigures) {
  const v1::Job job = Submit(/*workers=*/2);
  Join(v1::MEMBER_ROLE_STORE);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  auto report = [&](const std::string& worker, int64_t step, uint64_t bytes, uint32_t crc) {
    v1::StepWrittenRequest r;
    r.set_job_id(job.job_id());
    r.set_worker_id(worker);
    r.set_step(step);
    r.set_ok(true);
    r.set_assignment_version(scheduler_->AssignmentVersion(worker));
    r.mutable_data()->set_bytes(bytes);
    r.mutable_data()->set_crc32c(crc);
    return scheduler_->ReportStepWritten(r);
  };
  // A member outside the job pins nothing (nor would a stale attempt's report).
  const std::string stranger = Join(v1::MEMBER_ROLE_WORKER);
  EXPECT_EQ(report(stranger, 0, 99, 0x99).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(Job(job.job_id()).has_data());
  ASSERT_TRUE(report(w0, 0, 303456, 0xabcdef01).ok());
  ASSERT_TRUE(report(w1, 0, 303456, 0xabcdef01).ok());
  ASSERT_EQ(Job(job.job_id()).committed_step(), 0);
  EXPECT_EQ(Job(job.job_id()).data().bytes(), 303456u);
  EXPECT_EQ(Job(job.job_id()).data().worker_id(), w0);
  ASSERT_TRUE(report(w0, 1, 303456, 0xabcdef01).ok());
  absl::StatusOr<v1::StepStatus> other = report(w1, 1, 1000, 0x12345678);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_TRUE(other->aborted());
  const v1::Job failed = Job(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(failed.committed_step(), 0);
  EXPECT_NE(failed.failure_reason().find(
                absl::StrCat("worker ", w1,
                             ": train.data_path: this worker read 1000 bytes (CRC32C 12345678), "
                             "but the job has trained on 303456 bytes (CRC32C abcdef01, as worker ",
                             w0, " read it)")),
            std::string::npos)
      << failed.failure_reason();
}

// A job's heat and replica series live while it runs: an ended job, finished or
// cancelled, leaves none behind.
TEST_F(SchedulerTest, AJobsExpertSeriesGoWithIt) {
  const v1::Job done = Submit(/*workers=*/1, /*steps=*/1), cancelled = Submit(1, 300);
  Join(v1::MEMBER_ROLE_STORE);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  auto series = [&](const v1::Job& job) {
    const std::string text = metrics_.Serialize();
    const std::string label = absl::StrCat("job=\"", job.job_id(), "\"");
    int n = 0;
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      n += absl::StartsWith(line, "pith_coordinator_replicas{") && absl::StrContains(line, label);
    }
    return n;
  };
  EXPECT_EQ(series(done), 2 * 4 * 16);  // store and compute copies of each expert
  EXPECT_EQ(series(cancelled), 2 * 4 * 16);
  const std::string w_done = scheduler_->GetAssignment(w0)->job_id() == done.job_id() ? w0 : w1;
  CommitStep(done.job_id(), 0, {w_done});
  CommitStep(done.job_id(), 1, {w_done});
  EXPECT_EQ(Job(done.job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(series(done), 0);
  ASSERT_TRUE(jobs_->Cancel(cancelled.job_id(), "enough").ok());
  scheduler_->Tick();
  EXPECT_EQ(series(cancelled), 0);
}

TEST_F(SchedulerTest, AJobWaitsForItsWorkersThenGetsRanksAndAPlacement) {
  const v1::Job job = Submit(/*workers=*/2);
  EXPECT_EQ(job.committed_step(), -1);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_PENDING);  // nobody there
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_PENDING);  // one worker of two
  const std::string w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  const v1::Job running = Job(job.job_id());
  EXPECT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(running.workers(), 2);
  EXPECT_EQ(running.placement_epoch(), 1);

  auto a0 = scheduler_->GetAssignment(w0);
  auto a1 = scheduler_->GetAssignment(w1);
  ASSERT_TRUE(a0.ok() && a1.ok());
  EXPECT_EQ(a0->job_id(), job.job_id());
  EXPECT_EQ(a0->world(), 2);
  EXPECT_NE(a0->rank(), a1->rank());
  EXPECT_EQ(a0->committed_step(), -1);
  EXPECT_EQ(a0->stores_size(), 2);
  EXPECT_EQ(a0->peers(a0->rank()).member_id(), w0);
  EXPECT_GT(a0->assignment_version(), 0);
  EXPECT_EQ(a0->assignment_version(), scheduler_->AssignmentVersion(w0));
  const v1::PlacementTable& p = a0->placement();
  EXPECT_EQ(p.epoch(), 1);
  EXPECT_EQ(p.effective_step(), 0);
  ASSERT_EQ(p.experts_size(), 1 + 4 * 16);  // the dense group and every expert
  EXPECT_EQ(p.experts(0).layer(), -1);
  int owned[2] = {0, 0};
  for (const v1::ExpertPlacement& e : p.experts()) {
    EXPECT_EQ(e.store_ids_size(), 2);  // R = 2 of 2 stores
    if (e.layer() < 0) continue;
    ASSERT_EQ(e.owners_size(), 1);
    EXPECT_DOUBLE_EQ(e.owners(0).token_share(), 1.0);
    ++owned[e.owners(0).rank()];
  }
  EXPECT_EQ(owned[0], 32);  // balanced with no heat yet
  EXPECT_EQ(owned[1], 32);
  (void)s0;
  (void)s1;
}

TEST_F(SchedulerTest, AJobNeverMixesBackends) {
  const v1::Job job = Submit(2);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string cpu = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CPU);
  const std::string gpu0 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_PENDING);  // two workers, two backends
  const std::string gpu1 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(scheduler_->GetAssignment(cpu)->job_id(), "");
  EXPECT_EQ(scheduler_->GetAssignment(gpu0)->job_id(), job.job_id());
  EXPECT_EQ(scheduler_->GetAssignment(gpu1)->job_id(), job.job_id());
}

// A bf16 job takes CUDA workers only, however many CPU workers are idle.
TEST_F(SchedulerTest, ABf16JobTakesCudaWorkersOnly) {
  const v1::Job job = Submit(1, 300, 2, "bf16");
  Join(v1::MEMBER_ROLE_STORE);
  const std::string cpu0 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CPU);
  const std::string cpu1 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CPU);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_PENDING);
  const std::string gpu = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(scheduler_->GetAssignment(gpu)->job_id(), job.job_id());
  EXPECT_EQ(scheduler_->GetAssignment(cpu0)->job_id(), "");
  EXPECT_EQ(scheduler_->GetAssignment(cpu1)->job_id(), "");
}

// A bf16 job waiting for CUDA workers holds them back, not the CPU workers: a later fp32
// job runs on those meanwhile.
TEST_F(SchedulerTest, AWaitingBf16JobDoesNotHoldBackTheCpuWorkers) {
  const v1::Job bf16 = Submit(2, 300, 2, "bf16");
  const v1::Job fp32 = Submit(2);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string cpu0 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CPU);
  const std::string cpu1 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CPU);
  const std::string gpu0 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  scheduler_->Tick();
  EXPECT_EQ(Job(bf16.job_id()).state(), v1::JOB_STATE_PENDING);  // one CUDA worker of two
  EXPECT_EQ(Job(fp32.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(scheduler_->GetAssignment(cpu0)->job_id(), fp32.job_id());
  EXPECT_EQ(scheduler_->GetAssignment(gpu0)->job_id(), "");  // kept for the bf16 job
  const std::string gpu1 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  scheduler_->Tick();
  EXPECT_EQ(Job(bf16.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(scheduler_->GetAssignment(gpu1)->job_id(), bf16.job_id());
  (void)cpu1;
}

// First come, first served, except that a job wanting more workers than are alive
// cannot run until more join, so it holds back no later job. Each waiting job says why.
TEST_F(SchedulerTest, AJobTooBigForTheClusterHoldsBackNoLaterJobAndEachSaysWhyItWaits) {
  const v1::Job big = Submit(3), small = Submit(1);
  scheduler_->Tick();
  EXPECT_EQ(Job(small.job_id()).pending_reason(), "waiting for a store (none is alive)");
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  ASSERT_TRUE(members_->Drain(s0).ok());
  scheduler_->Tick();
  EXPECT_EQ(Job(small.job_id()).pending_reason(), "waiting for a store that is not draining");
  Join(v1::MEMBER_ROLE_STORE);
  Join(v1::MEMBER_ROLE_WORKER);
  Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  EXPECT_EQ(Job(big.job_id()).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(big.job_id()).pending_reason(),
            "waiting for 3 workers (2 alive); jobs that fit start before it");
  EXPECT_EQ(Job(small.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(small.job_id()).pending_reason(), "");
  const v1::Job pair = Submit(2), last = Submit(1);
  scheduler_->Tick();
  EXPECT_EQ(Job(pair.job_id()).pending_reason(),
            "waiting for 2 idle workers (1 idle; the others train jobs)");
  EXPECT_EQ(Job(last.job_id()).state(), v1::JOB_STATE_PENDING);  // first come, first served
  EXPECT_EQ(Job(last.job_id()).pending_reason(), "queued behind " + pair.job_id());
  Join(v1::MEMBER_ROLE_WORKER);  // now the oldest fits the cluster: it is first in line
  scheduler_->Tick();
  EXPECT_EQ(Job(big.job_id()).pending_reason(),
            "waiting for 3 idle workers (2 idle; the others train jobs)");
  EXPECT_EQ(Job(pair.job_id()).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(pair.job_id()).pending_reason(), "queued behind " + big.job_id());
}

TEST_F(SchedulerTest, AStepCommitsOnEveryStoreOnceEveryWorkerReported) {
  const v1::Job job = Submit(2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();

  auto first = Report(job.job_id(), w0, 0);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->committed_step(), -1);
  EXPECT_TRUE(stores_.commits.empty());
  auto again = Report(job.job_id(), w0, 0);  // a retried report changes nothing
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(stores_.commits.empty());
  auto last = Report(job.job_id(), w1, 0);
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->committed_step(), 0);
  EXPECT_THAT(stores_.commits, ::testing::UnorderedElementsAre(s0 + ":" + job.job_id() + ":0",
                                                               s1 + ":" + job.job_id() + ":0"));
  EXPECT_EQ(Job(job.job_id()).committed_step(), 0);

  // Bad reports: a step that is not in flight, a worker not in the job, a finished step.
  EXPECT_EQ(Report(job.job_id(), w0, 5).status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string stranger = Join(v1::MEMBER_ROLE_WORKER);
  EXPECT_EQ(Report(job.job_id(), stranger, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(Report("no-such-job", w0, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  auto old = Report(job.job_id(), w0, 0);
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->committed_step(), 0);

  // A training step: rank 0's loss becomes the job's, throughput and cache figures add up.
  now_ += absl::Seconds(1);
  const std::string rank0 = scheduler_->GetAssignment(w0)->rank() == 0 ? w0 : w1;
  const std::string rank1 = rank0 == w0 ? w1 : w0;
  ASSERT_TRUE(Report(job.job_id(), rank1, 1, true, 9.0).ok());
  ASSERT_TRUE(Report(job.job_id(), rank0, 1, true, 4.5).ok());
  const v1::Job j = Job(job.job_id());
  EXPECT_EQ(j.committed_step(), 1);
  EXPECT_DOUBLE_EQ(j.last_loss(), 4.5);
  EXPECT_DOUBLE_EQ(j.cache_hit_rate(), 0.75);
  EXPECT_GT(j.tokens_per_second(), 0);
}

// The job's stores prepare a step (its versions survive their crash) before the commit is
// decided: a group with no copy that prepared it is redone, and counts as a failed attempt
// when its store answered wrongly.
TEST_F(SchedulerTest, AStepIsPreparedOnItsStoresBeforeItsCommitIsDecided) {
  const v1::Job job = Submit(1, 300, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  const std::string at = s0 + ":" + job.job_id() + ":";
  EXPECT_EQ(stores_.prepares, std::vector<std::string>{at + "0"});
  EXPECT_EQ(stores_.commits, std::vector<std::string>{at + "0"});

  stores_.failing_prepares[s0] = absl::InternalError("disk stopped");
  auto report = Report(job.job_id(), w0, 1);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->aborted());
  EXPECT_THAT(report->abort_reason(), ::testing::HasSubstr("step 1 was prepared on no copy of"));
  EXPECT_THAT(report->abort_reason(), ::testing::HasSubstr("store " + s0 + ": disk stopped"));
  EXPECT_EQ(stores_.commits.size(), 1u);
  EXPECT_THAT(stores_.aborts, ::testing::Contains(at + "1"));
  // The store lost versions written to it: the same, before anything is decided.
  stores_.failing_prepares.clear();
  stores_.prepared_answered[s0] = 2;
  report = Report(job.job_id(), w0, 1, true, 4.0, /*dense_blobs_written=*/3);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->aborted());
  EXPECT_THAT(report->abort_reason(), ::testing::HasSubstr("it holds 2 of the 3 blobs"));
  EXPECT_EQ(Job(job.job_id()).committed_step(), 0);
  stores_.prepared_answered.clear();
  CommitStep(job.job_id(), 1, {w0});
  EXPECT_EQ(stores_.commits.back(), at + "1");

  // A store that never prepares fails the job once the step's attempts are spent.
  stores_.failing_prepares[s0] = absl::InternalError("disk stopped");
  for (int i = 0; i < SchedulerOptions().step_attempts; ++i) {
    ASSERT_TRUE(Report(job.job_id(), w0, 2).ok());
  }
  const v1::Job failed = Job(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("step 2 failed 8 attempts in a row"));
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("disk stopped"));
}

// A store that does not answer its prepares is not counted against the step's attempts
// (it may be dying: the membership judges that); after three leases of it the job loses
// the store, as for commits, and with its only copy the job fails naming why.
TEST_F(SchedulerTest, AStoreSilentOnPreparesIsLostAfterThreeLeases) {
  const v1::Job job = Submit(1, 300, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  // The attempt the workers wrote is the one prepared and committed.
  EXPECT_EQ(stores_.prepare_attempts.back(), stores_.commit_attempts.back());
  stores_.failing_prepares[s0] = absl::DeadlineExceededError("no answer");
  for (int i = 0; i < SchedulerOptions().step_attempts + 2; ++i) {
    auto report = Report(job.job_id(), w0, 1);
    ASSERT_TRUE(report.ok()) << report.status();
    EXPECT_TRUE(report->aborted());
  }
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  for (int i = 0; i < 5; ++i) {
    now_ += absl::Seconds(2);
    for (const std::string& m : {s0, w0}) ASSERT_TRUE(members_->Heartbeat(m, {}).ok());
    ASSERT_TRUE(Report(job.job_id(), w0, 1).ok());
    scheduler_->Tick();
  }
  const v1::Job failed = Job(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("failed the job's prepares for"));
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("no answer"));
}

// With two copies, a store that cannot prepare does not hold the step back: the other copy
// did, and the commit goes to both (the one that answers wrongly then is lost to the job).
TEST_F(SchedulerTest, AStepPreparedOnOneCopyOfEveryGroupIsDecided) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  stores_.failing_prepares[s1] = absl::UnavailableError("no answer");
  CommitStep(job.job_id(), 1, {w0});
  EXPECT_THAT(stores_.commits, ::testing::IsSupersetOf({s0 + ":" + job.job_id() + ":1",
                                                        s1 + ":" + job.job_id() + ":1"}));
}

// A step that fails every attempt (a data file no worker can read, a put every store
// refuses) fails the job with the last reason once its attempts are spent; a step that
// fails now and then does not.
TEST_F(SchedulerTest, AStepThatKeepsFailingFailsTheJobWithItsReason) {
  const v1::Job job = Submit(2);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  for (int i = 0; i < SchedulerOptions().step_attempts - 1; ++i) {
    ASSERT_TRUE(Report(job.job_id(), i % 2 ? w0 : w1, 0, /*ok=*/false).ok());
  }
  CommitStep(job.job_id(), 0, {w0, w1});  // it went through in the end: the count restarts
  for (int i = 0; i < SchedulerOptions().step_attempts - 1; ++i) {
    ASSERT_TRUE(Report(job.job_id(), w0, 1, /*ok=*/false).ok());
  }
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  ASSERT_TRUE(Report(job.job_id(), w1, 1, /*ok=*/false).ok());
  const v1::Job failed = Job(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(failed.failure_reason().find("step 1 failed 8 attempts in a row"), std::string::npos)
      << failed.failure_reason();
  EXPECT_NE(failed.failure_reason().find("out of memory"), std::string::npos);
  scheduler_->Tick();  // releases the workers
  EXPECT_EQ(scheduler_->GetAssignment(w0)->job_id(), "");
}

TEST_F(SchedulerTest, AFailedReportAbortsTheStepEverywhereAndItIsRedone) {
  const v1::Job job = Submit(2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});

  const int64_t before = scheduler_->AssignmentVersion(w0);
  v1::StepWrittenRequest stale;
  stale.set_job_id(job.job_id());
  stale.set_worker_id(w0);
  stale.set_step(1);
  stale.set_ok(true);
  stale.set_assignment_version(before);
  ASSERT_TRUE(scheduler_->ReportStepWritten(stale).ok());  // w0 wrote step 1
  auto failed = Report(job.job_id(), w1, 1, /*ok=*/false);
  ASSERT_TRUE(failed.ok());
  EXPECT_TRUE(failed->aborted());
  EXPECT_NE(failed->abort_reason().find("out of memory"), std::string::npos);
  EXPECT_EQ(stores_.aborts, (std::vector<std::string>{s0 + ":" + job.job_id() + ":1"}));
  EXPECT_NE(scheduler_->AssignmentVersion(w0), before);
  // The old attempt is void: its reports are refused, waiting on it returns at once.
  EXPECT_EQ(scheduler_->ReportStepWritten(stale).status().code(), absl::StatusCode::kAborted);
  auto waited = Wait(job.job_id(), 1, before, absl::Seconds(10));
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited->aborted());
  EXPECT_EQ(waited->committed_step(), 0);
  // Redone under the new version, it commits.
  CommitStep(job.job_id(), 1, {w0, w1});
}

TEST_F(SchedulerTest, WaitStepReturnsWhenTheStepCommits) {
  const v1::Job job = Submit(2);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  ASSERT_TRUE(Report(job.job_id(), w0, 0).ok());
  const int64_t version = scheduler_->AssignmentVersion(w0);
  std::thread other([&] {
    absl::SleepFor(absl::Milliseconds(100));
    ASSERT_TRUE(Report(job.job_id(), w1, 0).ok());
  });
  const absl::Time start = absl::Now();
  auto waited = Wait(job.job_id(), 0, version, absl::Seconds(20));
  other.join();
  ASSERT_TRUE(waited.ok());
  EXPECT_FALSE(waited->aborted());
  EXPECT_EQ(waited->committed_step(), 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

// A worker killed and started again within its lease (so the job never saw it die) asks
// for its assignment: never while a step commits (its peers already compute the next one),
// and then it voids the attempt its predecessor began, so that every worker starts the next
// one together; the same process asking again changes nothing.
TEST_F(SchedulerTest, AWorkerRestartedWithinItsLeaseVoidsTheAttemptInFlight) {
  const v1::Job job = Submit(2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  auto join_at = [&](const std::string& id, const std::string& ucx) {
    v1::MemberInfo m;
    m.set_member_id(id);
    m.set_role(v1::MEMBER_ROLE_WORKER);
    m.set_backend(v1::BACKEND_CPU);
    m.set_grpc_address("127.0.0.1:1");
    m.set_ucx_address(WrapUcxAddress(ucx));
    auto got = members_->Register(m);
    EXPECT_TRUE(got.ok()) << got.status();
    return *got;
  };
  const std::string w0 = join_at("", "process a"), w1 = join_at("", "process b");
  scheduler_->Tick();
  ASSERT_TRUE(scheduler_->GetAssignment(w0).ok());
  ASSERT_TRUE(scheduler_->GetAssignment(w1).ok());
  CommitStep(job.job_id(), 0, {w0, w1});
  const int64_t version = scheduler_->AssignmentVersion(w0);
  ASSERT_EQ(scheduler_->GetAssignment(w1)->assignment_version(), version);  // same process
  stores_.fail_commits = true;  // step 1 is decided; its commit waits for the store
  ASSERT_TRUE(Report(job.job_id(), w0, 1).ok());
  ASSERT_TRUE(Report(job.job_id(), w1, 1).ok());
  ASSERT_EQ(Job(job.job_id()).committed_step(), 0);

  join_at(w1, "process c");  // w1 again, a new process
  auto committing = scheduler_->GetAssignment(w1);
  EXPECT_EQ(committing.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(committing.status().message(), ::testing::HasSubstr("is committing step 1"));
  EXPECT_EQ(scheduler_->AssignmentVersion(w0), version);  // no abort mid-commit
  stores_.fail_commits = false;
  scheduler_->Tick();  // the commit finishes
  ASSERT_EQ(Job(job.job_id()).committed_step(), 1);
  stores_.aborts.clear();

  auto a = scheduler_->GetAssignment(w1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_GT(a->assignment_version(), version);
  EXPECT_EQ(a->committed_step(), 1);
  EXPECT_EQ(stores_.aborts, (std::vector<std::string>{s0 + ":" + job.job_id() + ":2"}));
  auto waited = Wait(job.job_id(), 2, version, absl::Seconds(1));  // w0's, on step 2
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited->aborted());
  EXPECT_EQ(waited->abort_reason(), "worker " + w1 + " restarted");
  EXPECT_EQ(scheduler_->GetAssignment(w0)->assignment_version(), a->assignment_version());
  EXPECT_EQ(scheduler_->GetAssignment(w1)->assignment_version(), a->assignment_version());

  // The next attempt: w0 takes it first, told to connect to w1's process c; then w1 is
  // restarted again, and its new process d asks for that attempt: void too.
  ASSERT_TRUE(Report(job.job_id(), w0, 2, /*ok=*/false).ok());
  const int64_t told = scheduler_->GetAssignment(w0)->assignment_version();
  EXPECT_GT(told, a->assignment_version());
  join_at(w1, "process d");
  auto d = scheduler_->GetAssignment(w1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_GT(d->assignment_version(), told);
  EXPECT_EQ(scheduler_->GetAssignment(w0)->assignment_version(), d->assignment_version());
  CommitStep(job.job_id(), 2, {w0, w1});
}

TEST_F(SchedulerTest, AWorkerWhoseLeaseRunsOutIsReplacedAndTheStepRedone) {
  const v1::Job job = Submit(2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});
  const std::string spare = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->AssignmentVersion(spare), 0);  // idle: the job has its two
  ASSERT_TRUE(Report(job.job_id(), w0, 1).ok());

  // w1 goes silent; the others heartbeat.
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0, spare, s0}));
  EXPECT_EQ(stores_.aborts, (std::vector<std::string>{s0 + ":" + job.job_id() + ":1"}));
  auto a = scheduler_->GetAssignment(spare);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->job_id(), job.job_id());
  EXPECT_EQ(a->world(), 2);
  EXPECT_EQ(a->committed_step(), 0);  // resumes from the last commit
  EXPECT_EQ(a->placement().epoch(), 2);
  EXPECT_EQ(a->placement().effective_step(), 1);
  for (const v1::ExpertPlacement& e : a->placement().experts()) {
    for (const v1::ComputeOwner& o : e.owners()) EXPECT_NE(o.worker_id(), w1);
  }
  EXPECT_EQ(scheduler_->GetAssignment(w1).status().code(), absl::StatusCode::kNotFound);
  CommitStep(job.job_id(), 1, {w0, spare});
}

// A worker's endpoints fail at once when it dies, its lease seconds later: the report of
// a survivor that could not reach it does not count against the job (it would fail with a
// long lease); the job waits until the lease lapses, and a spare takes the dead rank.
TEST_F(SchedulerTest, AReportOfAnUnreachablePeerWaitsForItsFateUncounted) {
  TwoWorkerJob t;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(t));
  const v1::Job& job = t.job;
  const std::string &s0 = t.s0, &w0 = t.w0, &w1 = t.w1;
  const std::string spare = Join(v1::MEMBER_ROLE_WORKER);
  for (int i = 0; i < SchedulerOptions().step_attempts - 1; ++i) {
    ASSERT_TRUE(Report(job.job_id(), w0, 1, /*ok=*/false).ok());
  }
  stores_.aborts.clear();
  auto failed = PeerFailed(job.job_id(), w0, w1);  // w1 was killed
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_TRUE(failed->aborted());
  EXPECT_EQ(stores_.aborts, (std::vector<std::string>{s0 + ":" + job.job_id() + ":1"}));
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);  // the 8th did not count
  EXPECT_NE(Job(job.job_id()).pending_reason().find("to learn whether worker " + w1),
            std::string::npos)
      << Job(job.job_id()).pending_reason();
  // Assignments and reports wait meanwhile: the attempt would fail on the same peer.
  EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(Report(job.job_id(), w0, 1, /*ok=*/false).status().code(),
            absl::StatusCode::kUnavailable);
  scheduler_->Tick();  // no heartbeat since the report, no lapse: it waits on
  EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable);

  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0, spare, s0}));  // w1's lease lapses
  auto a = scheduler_->GetAssignment(spare);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->job_id(), job.job_id());
  EXPECT_EQ(a->rank(), 1);
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  CommitStep(job.job_id(), 1, {w0, spare});
}

// A worker killed while the others wait on its part of the step: nothing reports it, and
// its lease decides; until then the job names it, and when its lease lapses, in its pending
// reason (pith status). A heartbeat takes the words away.
TEST_F(SchedulerTest, AWorkerSilentForTwoThirdsOfALeaseIsNamedInThePendingReason) {
  TwoWorkerJob t;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(t));
  const std::string job = t.job.job_id();
  const auto pass = [&](absl::Duration by, const std::vector<std::string>& heartbeat) {
    now_ += by;
    for (const std::string& id : heartbeat) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
    scheduler_->Tick();
  };
  ASSERT_NO_FATAL_FAILURE(pass(absl::Seconds(1), {t.s0, t.w0, t.w1}));
  ASSERT_NO_FATAL_FAILURE(pass(absl::Seconds(1), {t.s0, t.w0}));  // w1 silent 1 s of 3
  ASSERT_NO_FATAL_FAILURE(pass(absl::Seconds(1), {t.s0, t.w0}));  // 2 s: a heartbeat missed
  EXPECT_EQ(Job(job).pending_reason(), "");
  ASSERT_NO_FATAL_FAILURE(pass(absl::Milliseconds(200), {t.s0, t.w0}));  // two
  const std::string lapses =
      absl::FormatTime("%H:%M:%S UTC", now_ + absl::Milliseconds(800), absl::UTCTimeZone());
  EXPECT_THAT(Job(job).pending_reason(),
              ::testing::AllOf(::testing::StartsWith("waiting for worker " + t.w1 + " (rank 1)"),
                               ::testing::HasSubstr("its lease lapses at " + lapses)));
  EXPECT_EQ(Job(job).state(), v1::JOB_STATE_RUNNING);
  ASSERT_NO_FATAL_FAILURE(pass(absl::Milliseconds(500), {t.s0, t.w0, t.w1}));  // it was slow
  EXPECT_EQ(Job(job).pending_reason(), "");
}

// The peer a report names is restarted (a new process takes its id, as `pith up` does):
// the one the report named died, and the attempt does not count.
TEST_F(SchedulerTest, AReportOfAPeerRestartedSinceDoesNotCount) {
  TwoWorkerJob t;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(t));
  for (int i = 0; i < SchedulerOptions().step_attempts - 1; ++i) {
    ASSERT_TRUE(Report(t.job.job_id(), t.w0, 1, /*ok=*/false).ok());
  }
  ASSERT_TRUE(PeerFailed(t.job.job_id(), t.w0, t.w1).ok());
  v1::MemberInfo again;
  again.set_member_id(t.w1);
  again.set_role(v1::MEMBER_ROLE_WORKER);
  again.set_backend(v1::BACKEND_CPU);
  again.set_grpc_address("127.0.0.1:1");
  again.set_ucx_address(WrapUcxAddress("the new process"));
  const auto registered = members_->Register(again);
  ASSERT_TRUE(registered.ok()) << registered.status();
  scheduler_->Tick();
  EXPECT_EQ(Job(t.job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(t.job.job_id()).pending_reason(), "");
  EXPECT_TRUE(scheduler_->GetAssignment(t.w0).ok());
}

// The peer a report names heartbeats after it: alive, the failure was real (a network
// between the two), and the attempt counts; the job fails once step_attempts did.
TEST_F(SchedulerTest, AReportOfAPeerThatIsAliveCountsOnceItHeartbeats) {
  TwoWorkerJob t;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(t));
  const v1::Job& job = t.job;
  const std::string &s0 = t.s0, &w0 = t.w0, &w1 = t.w1;
  for (int i = 0; i < SchedulerOptions().step_attempts - 2; ++i) {
    ASSERT_TRUE(Report(job.job_id(), w0, 1, /*ok=*/false).ok());
  }
  const auto heartbeat_all = [&] {
    now_ += absl::Seconds(1);
    for (const std::string& id : {s0, w0, w1}) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
    scheduler_->Tick();
  };
  ASSERT_TRUE(PeerFailed(job.job_id(), w0, w1).ok());
  EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable);
  ASSERT_NO_FATAL_FAILURE(heartbeat_all());  // alive: the 7th attempt counts, the job goes on
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  ASSERT_TRUE(scheduler_->GetAssignment(w0).ok());

  ASSERT_TRUE(PeerFailed(job.job_id(), w1, w0).ok());
  ASSERT_NO_FATAL_FAILURE(heartbeat_all());  // the 8th
  const v1::Job ended = Job(job.job_id());
  EXPECT_EQ(ended.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(ended.failure_reason().find("step 1 failed 8 attempts in a row"), std::string::npos)
      << ended.failure_reason();
  EXPECT_NE(ended.failure_reason().find("peer 1 failed"), std::string::npos);
}

// A worker none could replace leaves the job with one; another joins before any step
// trained on one: the job takes its plan for two again, whatever a fresh plan would be.
TEST_F(SchedulerTest, AJobBackToItsWorkerCountBeforeAStepKeepsItsPlan) {
  TwoWorkerJob t;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(t));
  const v1::Job& job = t.job;
  const std::string &s0 = t.s0, &w0 = t.w0;
  const auto& plan = t.plan;
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0, s0}));
  ASSERT_EQ(scheduler_->GetAssignment(w0)->world(), 1);
  const std::string w2 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  auto a = scheduler_->GetAssignment(w2);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->world(), 2);
  EXPECT_EQ(PlanByRank(a->placement()), plan);
  CommitStep(job.job_id(), 1, {w0, w2});
  // Once a step commits on fewer workers, growing back plans afresh.
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0, s0}));
  CommitStep(job.job_id(), 2, {w0});
  const std::string w3 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  a = scheduler_->GetAssignment(w3);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->world(), 2);
  EXPECT_NE(PlanByRank(a->placement()), plan);
}

// A spare takes a dead worker's rank and its experts (the survivor keeps its own), and
// with every worker gone the plan waits for the next ones: the job computes what an
// undisturbed run would, whatever heat a fresh plan would follow.
TEST_F(SchedulerTest, ASpareTakesADeadWorkersRankAndThePlanIsKept) {
  TwoWorkerJob t;
  ASSERT_NO_FATAL_FAILURE(StartTwoWorkerJob(t));
  const v1::Job& job = t.job;
  const std::string &s0 = t.s0, &w1 = t.w1;
  const auto& plan = t.plan;

  const std::string spare = Join(v1::MEMBER_ROLE_WORKER);
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w1, spare, s0}));  // rank 0 dies
  auto a = scheduler_->GetAssignment(spare);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->rank(), 0);
  EXPECT_EQ(scheduler_->GetAssignment(w1)->rank(), 1);
  EXPECT_EQ(PlanByRank(a->placement()), plan);
  CommitStep(job.job_id(), 1, {spare, w1});

  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0}));  // both die: the plan waits with the job
  const std::string w3 = Join(v1::MEMBER_ROLE_WORKER), w4 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  a = scheduler_->GetAssignment(w3);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->world(), 2);
  EXPECT_EQ(PlanByRank(a->placement()), plan);
  for (const v1::ExpertPlacement& e : a->placement().experts()) {
    for (const v1::ComputeOwner& o : e.owners()) {
      EXPECT_EQ(o.worker_id(), a->peers(o.rank()).member_id());
    }
  }
  CommitStep(job.job_id(), 2, {w3, w4});
}

// Every worker of a job dies and none is free: the job waits, and says so, until one joins.
TEST_F(SchedulerTest, AJobWhoseWorkersAllDiedSaysItWaitsForOne) {
  const v1::Job job = Submit(1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0}));
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Job(job.job_id()).pending_reason(),
              ::testing::StartsWith("waiting for a worker: worker " + w0 + " died"));
  const std::string w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  auto a = scheduler_->GetAssignment(w1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->job_id(), job.job_id());
  CommitStep(job.job_id(), 1, {w1});
}

// A job down to fewer workers than it asked for, whose share no longer fits a survivor's
// --memory_bytes (needs_more_workers), is not failed: it frees its workers and waits for
// as many as it had, then goes on from its last step. With every worker it asked for, the
// same report fails it.
TEST_F(SchedulerTest, AJobThatFitsOnlyMoreWorkersWaitsForThem) {
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  const std::string w1 = Join(v1::MEMBER_ROLE_WORKER);
  const v1::Job job = Submit(2);
  scheduler_->Tick();
  const v1::Job busy = Submit(1);  // another job's worker
  const std::string w3 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  ASSERT_EQ(scheduler_->GetAssignment(w3)->job_id(), busy.job_id());
  CommitStep(job.job_id(), 0, {w0, w1});
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0, w0, w3}));
  ASSERT_EQ(scheduler_->GetAssignment(w0)->world(), 1);
  auto short_of = [&](const std::string& w) {
    v1::StepWrittenRequest r;
    r.set_job_id(job.job_id());
    r.set_worker_id(w);
    r.set_step(1);
    r.set_ok(false);
    r.set_needs_more_workers(true);
    r.set_failure("the job does not fit this worker's --memory_bytes=37748736");
    r.set_assignment_version(scheduler_->AssignmentVersion(w));
    return scheduler_->ReportStepWritten(r);
  };
  auto st = short_of(w0);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->aborted());
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(job.job_id()).pending_reason(),
            "waiting for 2 workers (with 1 of its 2 workers, worker " + w0 +
                ": the job does not fit this worker's --memory_bytes=37748736); the job goes on "
                "from its last step when they are free");
  EXPECT_EQ(scheduler_->GetAssignment(w0)->job_id(), "");  // freed
  // One idle worker is not enough; nor does a job submitted since take it: with two
  // workers in the cluster, the waiting job comes first.
  const v1::Job later = Submit(1);
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->GetAssignment(w0)->job_id(), "");
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Job(later.job_id()).pending_reason(), "queued behind " + job.job_id());

  ASSERT_TRUE(jobs_->Cancel(busy.job_id(), "done").ok());  // its worker is freed
  scheduler_->Tick();
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  auto a = scheduler_->GetAssignment(w3);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->job_id(), job.job_id());
  EXPECT_EQ(a->world(), 2);
  EXPECT_EQ(a->committed_step(), 0);
  CommitStep(job.job_id(), 1, {w0, w3});

  ASSERT_TRUE(short_of(w3).ok());  // with both of its workers: it cannot fit
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(Job(job.job_id()).failure_reason(),
              ::testing::HasSubstr("worker " + w3 + ": the job does not fit"));
}

// The same wait across a coordinator restart: the reloaded job says again that it waits.
TEST_F(SchedulerTest, AJobWaitingForAWorkerSaysSoAfterARestart) {
  const v1::Job job = Submit(1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0}));
  ASSERT_THAT(Job(job.job_id()).pending_reason(), ::testing::StartsWith("waiting for a worker"));

  Open();  // the coordinator restarts; its store is back, no worker is
  Join(v1::MEMBER_ROLE_STORE, s0);
  for (int seconds = 2; seconds <= 12; seconds += 2) {
    now_ += absl::Seconds(2);
    ASSERT_TRUE(members_->Heartbeat(s0, {}).ok());
    scheduler_->Tick();
  }
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  EXPECT_THAT(Job(job.job_id()).pending_reason(), ::testing::StartsWith("waiting for a worker"));
  const std::string w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  EXPECT_EQ(scheduler_->GetAssignment(w1)->job_id(), job.job_id());
}

// A wait for more workers (needs_more_workers) outlasts a coordinator restart: one idle
// worker still does not take the job (it would not fit again), and the job says why it
// waits; with two, it goes on.
TEST_F(SchedulerTest, AJobWaitingForMoreWorkersStillWaitsAfterARestart) {
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  const v1::Job job = Submit(2);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0, w0}));  // w1 dies
  v1::StepWrittenRequest r;
  r.set_job_id(job.job_id());
  r.set_worker_id(w0);
  r.set_step(1);
  r.set_ok(false);
  r.set_needs_more_workers(true);
  r.set_failure("the job does not fit this worker's --memory_bytes=37748736");
  r.set_assignment_version(scheduler_->AssignmentVersion(w0));
  ASSERT_TRUE(scheduler_->ReportStepWritten(r).ok());
  const std::string waiting = Job(job.job_id()).pending_reason();
  ASSERT_THAT(waiting, ::testing::StartsWith("waiting for 2 workers"));

  Open();  // the coordinator restarts; its store and the idle worker are back
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_WORKER, w0);
  for (int seconds = 2; seconds <= 12; seconds += 2) {
    now_ += absl::Seconds(2);
    ASSERT_TRUE(members_->Heartbeat(s0, {}).ok());
    ASSERT_TRUE(members_->Heartbeat(w0, {}).ok());
    scheduler_->Tick();
    EXPECT_EQ(scheduler_->GetAssignment(w0)->job_id(), "") << seconds << " s";
    EXPECT_EQ(Job(job.job_id()).pending_reason(), waiting) << seconds << " s";
  }
  const std::string w2 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  auto a = scheduler_->GetAssignment(w0);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->job_id(), job.job_id());
  EXPECT_EQ(a->world(), 2);
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
}

TEST_F(SchedulerTest, ALostStoreLeavesThePlacementAndLosingEveryCopyFailsTheJob) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  // s1 dies: one copy of everything is left on s0.
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0, s0}));
  auto placement = scheduler_->GetPlacement(job.job_id());
  ASSERT_TRUE(placement.ok());
  EXPECT_EQ(placement->epoch(), 2);
  for (const v1::ExpertPlacement& e : placement->experts()) {
    EXPECT_EQ(std::vector<std::string>(e.store_ids().begin(), e.store_ids().end()),
              std::vector<std::string>{s0});
  }
  CommitStep(job.job_id(), 1, {w0});
  // s0 dies too: the job waits kStoreRestartGrace for it (StoreLapseTest), then fails.
  for (absl::Duration t = absl::Seconds(4); t <= kStoreRestartGrace + absl::Seconds(8);
       t += absl::Seconds(4)) {
    now_ += absl::Seconds(4);
    ASSERT_TRUE(members_->Heartbeat(w0, {}).ok());
    scheduler_->Tick();
    if (t <= kStoreRestartGrace - absl::Seconds(4)) {
      ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING) << "after " << t;
    }
  }
  const v1::Job failed = Job(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(failed.failure_reason().find("every store copy"), std::string::npos);
  EXPECT_NE(failed.failure_reason().find("(held by " + s0 + ", which is gone)"), std::string::npos)
      << failed.failure_reason();
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->AssignmentVersion(w0), 0);  // released
}

// A worker's put refused for want of disk names the store (full_store_id): a job whose
// other stores with room hold every group stops using it at once, without counting the
// attempt, and its groups are copied to a store with room, never to a full one; with room
// again, the dropped store takes copies again. Refused by a store that holds a group's
// only copy with room, the job waits for room (AJobWhoseOnlyCopyIsOnAFullDiskWaitsForRoom).
TEST_F(SchedulerTest, AFullStoreIsDroppedFromAJobWithOtherCopies) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  v1::MemberInfo full;
  full.set_disk_reserve_bytes(64 << 20);
  full.set_disk_free_bytes(1 << 20);
  ASSERT_TRUE(members_->Heartbeat(s1, full).ok());
  const std::string s2 = Join(v1::MEMBER_ROLE_STORE);
  ASSERT_TRUE(members_->Heartbeat(s2, full).ok());
  auto refused = [&](const std::string& store) { return RefusedForDisk(job.job_id(), w0, store); };
  auto placed = [&]() { return Placed(job.job_id()); };
  auto steps = [&](int n) {  // n steps commit, copies joining and pulled between them
    for (int i = 0; i < n; ++i) {
      while (scheduler_->ReplicateOnce() > 0) {
      }
      CommitStep(job.job_id(), Job(job.job_id()).committed_step() + 1, {w0});
    }
  };
  for (int i = 0; i < SchedulerOptions().step_attempts + 1; ++i) {  // none counts
    auto st = refused(s1);
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_TRUE(st->aborted());
  }
  scheduler_->Tick();
  ASSERT_NO_FATAL_FAILURE(steps(2));
  EXPECT_EQ(placed(), std::set<std::string>{s0}) << "the full s2 took copies";
  const std::string s3 = Join(v1::MEMBER_ROLE_STORE);  // with room
  scheduler_->Tick();
  ASSERT_NO_FATAL_FAILURE(steps(2));
  EXPECT_EQ(placed(), (std::set<std::string>{s0, s3}));
  // A full store's copies do not count as holders: s0 is not dropped for a full s3.
  ASSERT_TRUE(members_->Heartbeat(s3, full).ok());
  ASSERT_TRUE(refused(s0).ok());
  scheduler_->Tick();
  EXPECT_EQ(placed(), (std::set<std::string>{s0, s3}));
  ASSERT_TRUE(members_->Heartbeat(s3, {}).ok());  // room again: s0 goes
  ASSERT_TRUE(members_->Heartbeat(s0, full).ok());
  ASSERT_TRUE(refused(s0).ok());
  scheduler_->Tick();
  EXPECT_EQ(placed(), std::set<std::string>{s3});
  // s1, dropped for its full disk, has room again: it takes copies of the job again, once
  // kFullStoreCooldown has passed since it was dropped (not at once: a store that fills
  // again with the job's copies would cycle in and out).
  ASSERT_TRUE(members_->Heartbeat(s1, {}).ok());
  ASSERT_NO_FATAL_FAILURE(steps(2));
  EXPECT_EQ(placed(), std::set<std::string>{s3});
  for (absl::Duration t; t < kFullStoreCooldown; t += absl::Seconds(2)) {
    now_ += absl::Seconds(2);
    for (const std::string& m : {s1, s3, w0}) ASSERT_TRUE(members_->Heartbeat(m, {}).ok());
    for (const std::string& m : {s0, s2}) ASSERT_TRUE(members_->Heartbeat(m, full).ok());
    scheduler_->Tick();
  }
  ASSERT_NO_FATAL_FAILURE(steps(2));
  EXPECT_EQ(placed(), (std::set<std::string>{s1, s3}));
  ASSERT_TRUE(members_->Heartbeat(s1, full).ok());  // full again: s3 holds the only copies
  ASSERT_TRUE(members_->Heartbeat(s3, full).ok());
  ASSERT_TRUE(refused(s3).ok());
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);  // it waits for room
  EXPECT_THAT(Job(job.job_id()).pending_reason(), ::testing::HasSubstr("disk room on store " + s3));
}

// Before the first commit there is nothing to keep: a full store leaves the job at once,
// and its groups start again on a store with room.
TEST_F(SchedulerTest, AFullStoreBeforeTheFirstCommitLeavesTheJob) {
  const v1::Job job = Submit(1, 300, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  ASSERT_EQ(Placed(job.job_id()), (std::set<std::string>{s0, s1}));
  v1::MemberInfo full;
  full.set_disk_reserve_bytes(64 << 20);
  full.set_disk_free_bytes(1 << 20);
  ASSERT_TRUE(members_->Heartbeat(s0, full).ok());
  auto st = RefusedForDisk(job.job_id(), w0, s0);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->aborted());
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  EXPECT_EQ(Placed(job.job_id()), std::set<std::string>{s1});
  CommitStep(job.job_id(), 0, {w0});
}

// A put refused for want of disk by the store holding a group's only copy: the attempt is
// voided without counting and the job trains no step (assignments and reports wait),
// saying why, until the store has room again, or until its copies moved to a store with
// room (pulled while the job waits, they join as readers and the full store leaves); with
// neither for kRoomWait it fails with the refusal.
TEST_F(SchedulerTest, AJobWhoseOnlyCopyIsOnAFullDiskWaitsForRoom) {
  const v1::Job job = Submit(1, 300, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  ASSERT_EQ(Placed(job.job_id()), (std::set<std::string>{s0, s1}));  // each some groups
  v1::MemberInfo full;
  full.set_disk_reserve_bytes(64 << 20);
  full.set_disk_free_bytes(1 << 20);
  const auto heartbeats = [&](const std::set<std::string>& full_ones) {
    for (const std::string& m : {s0, s1, w0}) {
      ASSERT_TRUE(members_->Heartbeat(m, full_ones.count(m) ? full : v1::MemberInfo()).ok());
    }
  };
  const auto waits = [&]() {
    EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
    EXPECT_THAT(Job(job.job_id()).pending_reason(),
                ::testing::HasSubstr("for disk room on store " + s0 +
                                     ", which holds the only "
                                     "copy of "));
    EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable);
  };

  // A refusal by a store not judged low on disk (its heartbeat has not told yet, or the
  // put is bigger than its reserve) counts as any failed attempt.
  auto st = RefusedForDisk(job.job_id(), w0, s0);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->aborted());
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  ASSERT_TRUE(scheduler_->GetAssignment(w0).ok());

  // Room again on the store.
  ASSERT_NO_FATAL_FAILURE(heartbeats({s0}));
  st = RefusedForDisk(job.job_id(), w0, s0);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->aborted());
  ASSERT_NO_FATAL_FAILURE(waits());
  EXPECT_EQ(RefusedForDisk(job.job_id(), w0, s0).status().code(), absl::StatusCode::kUnavailable);
  scheduler_->Tick();
  ASSERT_NO_FATAL_FAILURE(waits());
  ASSERT_NO_FATAL_FAILURE(heartbeats({}));
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  ASSERT_TRUE(scheduler_->GetAssignment(w0).ok());
  CommitStep(job.job_id(), 1, {w0});

  // Its copies move to a store with room while the job waits.
  ASSERT_NO_FATAL_FAILURE(heartbeats({s0}));
  ASSERT_TRUE(RefusedForDisk(job.job_id(), w0, s0).ok());
  for (int i = 0; i < 4 && Placed(job.job_id()).count(s0); ++i) {
    ASSERT_NO_FATAL_FAILURE(waits());
    while (scheduler_->ReplicateOnce() > 0) {
    }
    scheduler_->Tick();
  }
  EXPECT_EQ(Placed(job.job_id()), std::set<std::string>{s1});
  EXPECT_EQ(Job(job.job_id()).pending_reason(), "");
  ASSERT_TRUE(scheduler_->GetAssignment(w0).ok());
  CommitStep(job.job_id(), 2, {w0});

  // Neither: after kRoomWait the job fails with the refusal; none of its attempts counted.
  ASSERT_NO_FATAL_FAILURE(heartbeats({s0, s1}));
  ASSERT_TRUE(RefusedForDisk(job.job_id(), w0, s1).ok());
  for (absl::Duration t; t < kRoomWait; t += absl::Seconds(2)) {
    EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
    now_ += absl::Seconds(2);
    ASSERT_NO_FATAL_FAILURE(heartbeats({s0, s1}));
    scheduler_->Tick();
  }
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(Job(job.job_id()).failure_reason(),
              ::testing::HasSubstr("step 3: worker " + w0 + ": store " + s1 +
                                   ": the disk under /data is full (no room for 10m"));
}

// Item: commits go to the job's stores only, and each answer is checked. A store that
// commits fewer blobs than were written to it (it lost pending versions) or refuses the
// step is lost to the job at once: the step commits on the other copies and the group is
// re-placed. One that does not answer holds the commit for three leases, then is lost.
TEST_F(SchedulerTest, CommitsGoToTheJobsStoresAndWrongAnswersLoseTheStore) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  const std::string s2 = Join(v1::MEMBER_ROLE_STORE);  // holds nothing of the job
  CommitStep(job.job_id(), 0, {w0});
  EXPECT_THAT(stores_.commits, ::testing::UnorderedElementsAre(s0 + ":" + job.job_id() + ":0",
                                                               s1 + ":" + job.job_id() + ":0"));
  // s1 lost one of the three dense blobs written to it.
  stores_.blobs_answered[s1] = 2;
  ASSERT_TRUE(Report(job.job_id(), w0, 1, true, 4.0, /*dense_blobs_written=*/3).ok());
  EXPECT_EQ(Job(job.job_id()).committed_step(), 1);  // on s0
  scheduler_->Tick();  // the job re-places s1's copies (on s2) from the next step
  auto placement = scheduler_->GetPlacement(job.job_id());
  ASSERT_TRUE(placement.ok());
  for (const v1::ExpertPlacement& e : placement->experts()) {
    for (const auto* ids : {&e.store_ids(), &e.joining_store_ids()}) {
      EXPECT_THAT(*ids, ::testing::Not(::testing::Contains(s1)));
    }
  }
  // s2 now refuses commits outright (its copy is past the job's step): lost at once.
  stores_.failing[s2] =
      absl::FailedPreconditionError("job is at step 1000 on this store, past the commit");
  stores_.commits.clear();
  ASSERT_TRUE(Report(job.job_id(), w0, 2, true, 4.0, 3).ok());
  EXPECT_EQ(Job(job.job_id()).committed_step(), 2);
  EXPECT_THAT(stores_.commits, ::testing::ElementsAre(s0 + ":" + job.job_id() + ":2"));
  // s0, the last copy, stops answering: the commit waits three leases, then the job fails
  // naming the store and why.
  scheduler_->Tick();
  stores_.failing[s0] = absl::DeadlineExceededError("no answer");
  ASSERT_TRUE(Report(job.job_id(), w0, 3, true, 4.0, 3).ok());
  for (int i = 0; i < 6 && Job(job.job_id()).state() == v1::JOB_STATE_RUNNING; ++i) {
    EXPECT_EQ(Job(job.job_id()).committed_step(), 2);
    now_ += absl::Seconds(2);
    for (const std::string& m : {s0, s1, s2, w0}) ASSERT_TRUE(members_->Heartbeat(m, {}).ok());
    scheduler_->Tick();
  }
  const v1::Job failed = Job(job.job_id());
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("store " + s0));
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("no answer"));
}

// Garbage: a group a store left is deleted there once a step committed without it, even
// across a coordinator restart; an ended job's blobs go from every store but its
// committed weights; a running or unknown job's stay.
TEST_F(SchedulerTest, StoresLoseTheGroupsTheyLeftAndEndedJobsBlobs) {
  const v1::Job job = Submit(1, /*steps=*/3, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  std::set<std::string> on_s1;  // the groups placed on s1
  const absl::StatusOr<v1::PlacementTable> first = scheduler_->GetPlacement(job.job_id());
  ASSERT_TRUE(first.ok());
  for (const v1::ExpertPlacement& e : first->experts()) {
    if (std::count(e.store_ids().begin(), e.store_ids().end(), s1)) {
      on_s1.insert(absl::StrCat(e.layer(), "/", e.layer() < 0 ? 0 : e.expert()));
    }
  }
  ASSERT_FALSE(on_s1.empty());
  CommitStep(job.job_id(), 0, {w0});
  // s1 refuses step 1: the job drops it, and its copies are left from step 2.
  stores_.failing[s1] = absl::FailedPreconditionError("job is at step 9 here");
  CommitStep(job.job_id(), 1, {w0});
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 0);  // step 2 may still read s1
  CommitStep(job.job_id(), 2, {w0});
  // The coordinator restarts before collecting: what is left to delete was saved.
  Open();
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_STORE, s1);
  Join(v1::MEMBER_ROLE_WORKER, w0);
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), static_cast<int>(on_s1.size()));
  std::set<std::string> deleted;
  for (const std::string& d : stores_.deletes) {
    ASSERT_EQ(d.rfind(s1 + ":" + job.job_id() + ":", 0), 0u) << d;
    deleted.insert(d.substr(d.rfind(':') + 1));
  }
  EXPECT_EQ(deleted, on_s1);
  stores_.deletes.clear();
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 0);  // done once

  // The job ends: its optimizer state goes from every store, its weights stay.
  const v1::Job other = Submit(1);  // pending: not ended
  v1::StoreJob held;
  held.set_job_id(job.job_id());
  held.set_blobs(10);
  held.set_blobs_besides_weights(6);
  v1::StoreJob unknown = held, pending = held;
  unknown.set_job_id("not-a-job-of-this-coordinator");
  pending.set_job_id(other.job_id());
  stores_.held[s0] = {held, unknown, pending};
  stores_.held[s1] = {held};
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 0);  // still running
  CommitStep(job.job_id(), 3, {w0});
  ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 2);
  EXPECT_THAT(stores_.deletes, ::testing::UnorderedElementsAre(s0 + ":" + job.job_id() + ":keep",
                                                               s1 + ":" + job.job_id() + ":keep"));
  held.set_blobs_besides_weights(0);  // what the stores hold now
  stores_.held[s0] = {held};
  stores_.held[s1] = {held};
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 0);
  // Removed, it keeps nothing: its weights go too, from a store that was away when it is
  // back (and after a coordinator restart), and never again once they are gone.
  ASSERT_TRUE(scheduler_->Remove(job.job_id()).ok());
  stores_.deletes.clear();
  stores_.held[s1] = {};
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 1);
  EXPECT_THAT(stores_.deletes, ::testing::ElementsAre(s0 + ":" + job.job_id()));
  Open();
  now_ += absl::Seconds(1);
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_STORE, s1);
  stores_.deletes.clear();
  stores_.held[s0] = {};
  stores_.held[s1] = {held};
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 1);
  EXPECT_THAT(stores_.deletes, ::testing::ElementsAre(s1 + ":" + job.job_id()));
  stores_.held[s1] = {};
  EXPECT_EQ(scheduler_->CollectGarbageOnce(), 0);
}

// A store declared dead comes back: the groups it left are deleted there, while the
// placement wants some of them on it again. It neither joins such a group nor gets a copy
// of it until the group's delete returned (writes or a pull landing first would be
// deleted with the stale blobs).
TEST_F(SchedulerTest, AGroupIsNotCopiedToAStoreWhileItIsBeingDeletedThere) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE),
                    s2 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0, s2, w0}));  // s1's lease lapses
  for (int step = 1; step <= 3; ++step) {
    CommitStep(job.job_id(), step, {w0});
    while (scheduler_->ReplicateOnce() > 0) {
    }
  }
  Join(v1::MEMBER_ROLE_STORE, s1);  // back, with the groups it left still on its disk
  scheduler_->Tick();
  std::vector<std::string> pulled_meanwhile;  // while the first delete was in flight
  std::vector<std::string> joined_meanwhile;  // "store:job:layer/expert" joining then
  stores_.during_delete = [&](const v1::MemberInfo&, const v1::DeleteJobRequest&) {
    // Meanwhile the replicator asks for s1 on its share, a step boundary places it there
    // (joining) and the replicator runs again.
    while (scheduler_->ReplicateOnce() > 0) {
    }
    CommitStep(job.job_id(), 4, {w0});
    const absl::StatusOr<v1::PlacementTable> placed = scheduler_->GetPlacement(job.job_id());
    ASSERT_TRUE(placed.ok()) << placed.status();
    for (const v1::ExpertPlacement& e : placed->experts()) {
      for (const std::string& id : e.joining_store_ids()) {
        joined_meanwhile.push_back(absl::StrCat(id, ":", job.job_id(), ":", e.layer(), "/",
                                                e.layer() < 0 ? 0 : e.expert()));
      }
    }
    const size_t before = stores_.pulls.size();
    while (scheduler_->ReplicateOnce() > 0) {
    }
    pulled_meanwhile.assign(stores_.pulls.begin() + before, stores_.pulls.end());
  };
  ASSERT_GT(scheduler_->CollectGarbageOnce(), 0);
  std::set<std::string> deleted;  // "store:job:layer/expert" of the groups deleted
  for (const std::string& d : stores_.deletes) deleted.insert(d);
  // "source->target:layer/expert" of the pulls into a group being deleted there
  auto into_deleted = [&](const std::string& pull) {
    const std::string target = pull.substr(pull.find("->") + 2);
    const std::string store = target.substr(0, target.find(':'));
    return deleted.count(store + ":" + job.job_id() + target.substr(target.find(':'))) > 0;
  };
  for (const std::string& p : pulled_meanwhile) {
    EXPECT_FALSE(into_deleted(p)) << p << " landed while the group was being deleted there";
  }
  for (const std::string& j : joined_meanwhile) {
    EXPECT_FALSE(deleted.count(j)) << j << " joined while the group was being deleted there";
  }
  const size_t before = stores_.pulls.size();  // the deletes returned: s1 joins, is copied
  while (scheduler_->ReplicateOnce() > 0) {
  }
  CommitStep(job.job_id(), 5, {w0});
  while (scheduler_->ReplicateOnce() > 0) {
  }
  const auto after =
      std::count_if(stores_.pulls.begin() + before, stores_.pulls.end(), into_deleted);
  EXPECT_GT(after, 0) << "the scenario placed none of the deleted groups back on " << s1;
}

TEST_F(SchedulerTest, TheLastStepEndsTheJobAndCancellingReleasesTheWorkers) {
  const v1::Job job = Submit(1, /*steps=*/2);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  for (int step = 0; step <= 2; ++step) CommitStep(job.job_id(), step, {w0});
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(scheduler_->AssignmentVersion(w0), 0);
  auto waited = Wait(job.job_id(), 3, /*version=*/0, absl::Seconds(5));
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited->job_ended());

  const v1::Job next = Submit(1);
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->GetAssignment(w0)->job_id(), next.job_id());
  ASSERT_TRUE(jobs_->Cancel(next.job_id(), "enough").ok());
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->AssignmentVersion(w0), 0);
  EXPECT_TRUE(scheduler_->GetAssignment(w0)->job_id().empty());
  // A worker still waiting on the ended job is told why it ended (what it logs).
  waited = Wait(next.job_id(), 0, /*version=*/0, absl::Seconds(5));
  ASSERT_TRUE(waited.ok());
  EXPECT_TRUE(waited->job_ended());
  EXPECT_NE(waited->abort_reason().find("the job ended (cancelled)"), std::string::npos)
      << waited->abort_reason();
  EXPECT_EQ(stores_.aborts.size(), 1u);  // the attempt in flight
}

TEST_F(SchedulerTest, ARestartMidCommitFinishesTheCommitAndKeepsTheSchedule) {
  const v1::Job job = Submit(2, 300);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});
  const int64_t version = scheduler_->AssignmentVersion(w0);
  const int64_t epoch = scheduler_->GetPlacement(job.job_id())->epoch();
  stores_.fail_commits = true;  // every worker reported step 1; no store answers
  ASSERT_TRUE(Report(job.job_id(), w0, 1).ok());
  ASSERT_TRUE(Report(job.job_id(), w1, 1).ok());
  EXPECT_EQ(Job(job.job_id()).committed_step(), 0);

  Open();  // the coordinator restarts; its members register again with their ids
  stores_.fail_commits = false;
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_WORKER, w0);
  EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable);
  Join(v1::MEMBER_ROLE_WORKER, w1);
  scheduler_->Tick();  // finishes the commit
  EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable);
  scheduler_->Tick();  // every member is back: the attempt in flight is voided
  const v1::Job j = Job(job.job_id());
  EXPECT_EQ(j.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(j.committed_step(), 1);  // the decided commit was finished
  EXPECT_EQ(stores_.commits.back(), s0 + ":" + job.job_id() + ":1");
  auto a = scheduler_->GetAssignment(w0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->job_id(), job.job_id());
  EXPECT_GT(a->assignment_version(), version);  // old attempts are void
  EXPECT_EQ(a->placement().epoch(), epoch);
  CommitStep(job.job_id(), 2, {w0, w1});
}

// The commit a restart finishes has no figures (its reports went to the process before):
// the job keeps those of its last step, not zeros that `pith watch` would show.
TEST_F(SchedulerTest, ACommitARestartFinishedKeepsTheJobsFigures) {
  const v1::Job job = Submit(1, 300);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  now_ += absl::Seconds(1);
  CommitStep(job.job_id(), 1, {w0});  // loss 4
  const v1::Job before = Job(job.job_id());
  ASSERT_EQ(before.last_loss(), 4.0);
  ASSERT_GT(before.tokens_per_second(), 0);
  stores_.fail_commits = true;
  ASSERT_TRUE(Report(job.job_id(), w0, 2, true, 3.0).ok());

  Open();
  stores_.fail_commits = false;
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_WORKER, w0);
  scheduler_->Tick();  // finishes the commit
  const v1::Job after = Job(job.job_id());
  EXPECT_EQ(after.committed_step(), 2);
  EXPECT_EQ(after.last_loss(), before.last_loss());
  EXPECT_EQ(after.tokens_per_second(), before.tokens_per_second());
}

// After a restart, a store that came back behind the job's committed step (it lost
// commits) would serve stale versions as current: the job loses it, and its groups stay
// on the other copies.
TEST_F(SchedulerTest, AStoreBackBehindTheCommittedStepIsLostToTheJob) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  for (int64_t step = 0; step <= 2; ++step) CommitStep(job.job_id(), step, {w0});
  v1::StoreJob ok, stale;
  ok.set_job_id(job.job_id());
  ok.set_committed_step(2);
  stale.set_job_id(job.job_id());
  stale.set_committed_step(1);
  stores_.held[s0] = {ok};
  stores_.held[s1] = {stale};

  Open();  // the coordinator restarts; every member registers again
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_STORE, s1);
  Join(v1::MEMBER_ROLE_WORKER, w0);
  scheduler_->Tick();  // back: the attempt is voided and the stores are checked
  scheduler_->Tick();  // the job re-places its groups without s1
  EXPECT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING);
  auto placement = scheduler_->GetPlacement(job.job_id());
  ASSERT_TRUE(placement.ok()) << placement.status();
  for (const v1::ExpertPlacement& e : placement->experts()) {
    EXPECT_EQ(std::vector<std::string>(e.store_ids().begin(), e.store_ids().end()),
              std::vector<std::string>{s0});
  }
  CommitStep(job.job_id(), 3, {w0});
  EXPECT_EQ(stores_.commits.back(), s0 + ":" + job.job_id() + ":3");
}

TEST_F(SchedulerTest, StepTimesAndTimestampsComeFromTheClock) {
  const v1::Job job = Submit(2);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  EXPECT_EQ(Job(job.job_id()).started_unix_ms(), absl::ToUnixMillis(now_));
  CommitStep(job.job_id(), 0, {w0, w1});
  now_ += absl::Seconds(2);
  CommitStep(job.job_id(), 1, {w0, w1});
  const v1::Job j = Job(job.job_id());
  EXPECT_DOUBLE_EQ(j.step_seconds(), 2.0);
  EXPECT_DOUBLE_EQ(j.tokens_per_second(), 2 * 512 / 2.0);  // two workers' tokens in 2 s
}

TEST_F(SchedulerTest, ARestartWaitsThreeLeasesForAMissingWorkerThenReplacesIt) {
  const v1::Job job = Submit(2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});

  Open();  // the coordinator restarts; w1 never registers again, a spare does
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_WORKER, w0);
  // A new id: an empty one would be given w1's, as the restarted membership numbers anew.
  const std::string spare = Join(v1::MEMBER_ROLE_WORKER, "worker-new");
  // Leases are 3 s: w1 may still come back until 3 leases (9 s) have passed.
  for (int seconds = 2; seconds <= 8; seconds += 2) {
    now_ += absl::Seconds(2);
    for (const std::string& id : {s0, w0, spare}) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
    scheduler_->Tick();
    EXPECT_EQ(scheduler_->GetAssignment(w0).status().code(), absl::StatusCode::kUnavailable)
        << "after " << seconds << " s";
    EXPECT_TRUE(scheduler_->GetAssignment(spare)->job_id().empty());
  }
  now_ += absl::Seconds(2);  // 10 s: the grace period is over, w1 is gone
  for (const std::string& id : {s0, w0, spare}) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
  scheduler_->Tick();
  auto a = scheduler_->GetAssignment(spare);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->job_id(), job.job_id());
  EXPECT_EQ(a->world(), 2);
  EXPECT_EQ(a->committed_step(), 0);
  EXPECT_TRUE(scheduler_->GetAssignment(w0).ok());
  for (const v1::ExpertPlacement& e : a->placement().experts()) {
    for (const v1::ComputeOwner& o : e.owners()) EXPECT_NE(o.worker_id(), w1);
  }
  CommitStep(job.job_id(), 1, {w0, spare});
}

// A job with one copy of its data, after a whole-cluster restart on a busy machine: its
// workers are back at once, its store only after 15 s. Taken for gone after 3 leases
// (9 s), the store would fail the job ("every store copy ... was lost"); a store is waited
// for kStoreRestartGrace (30 s), and the job goes on. So does one whose second worker
// never comes back: the repair waits for the store rather than take it for lost.
class StoreRestartTest : public SchedulerTest {
 protected:
  void StoreBackAfter15s(bool worker_lost) {
    const v1::Job job = Submit(2, 300, /*replicas=*/1);
    const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
    const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
    scheduler_->Tick();
    CommitStep(job.job_id(), 0, {w0, w1});

    Open();  // the coordinator restarts; the workers register again, the store not yet
    std::vector<std::string> back = {w0};
    if (!worker_lost) back.push_back(w1);
    for (const std::string& w : back) Join(v1::MEMBER_ROLE_WORKER, w);
    for (int seconds = 3; seconds <= 15; seconds += 3) {
      now_ += absl::Seconds(3);
      for (const std::string& w : back) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
      scheduler_->Tick();
      ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING)
          << "after " << seconds << " s: " << Job(job.job_id()).failure_reason();
    }
    Join(v1::MEMBER_ROLE_STORE, s0);  // at 15 s
    for (const std::string& w : back) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
    scheduler_->Tick();
    ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING)
        << Job(job.job_id()).failure_reason();
    auto a = scheduler_->GetAssignment(w0);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->world(), worker_lost ? 1 : 2);
    EXPECT_EQ(a->committed_step(), 0);
    CommitStep(job.job_id(), 1, back);
  }
};

TEST_F(StoreRestartTest, EveryWorkerBack) { StoreBackAfter15s(/*worker_lost=*/false); }
TEST_F(StoreRestartTest, AWorkerLostToo) { StoreBackAfter15s(/*worker_lost=*/true); }

// Nor does another store's loss end the wait for one still awaited: two copies, one store
// back and lost again (its lease lapses), the other back at 15 s; the job goes on from it.
TEST_F(StoreRestartTest, AnotherStoreLostWhileOneIsAwaited) {
  const v1::Job job = Submit(2, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});

  Open();
  for (const std::string& w : {w0, w1}) Join(v1::MEMBER_ROLE_WORKER, w);
  Join(v1::MEMBER_ROLE_STORE, s1);  // back, then silent: dead at the 6-s tick
  for (int seconds = 3; seconds <= 15; seconds += 3) {
    now_ += absl::Seconds(3);
    for (const std::string& w : {w0, w1}) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
    scheduler_->Tick();
    ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING)
        << "after " << seconds << " s: " << Job(job.job_id()).failure_reason();
  }
  Join(v1::MEMBER_ROLE_STORE, s0);
  for (const std::string& w : {w0, w1}) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
  scheduler_->Tick();
  ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING) << Job(job.job_id()).failure_reason();
  auto a = scheduler_->GetAssignment(w0);
  ASSERT_TRUE(a.ok()) << a.status();
  for (const v1::ExpertPlacement& e : a->placement().experts()) {
    EXPECT_EQ(std::vector<std::string>(e.store_ids().begin(), e.store_ids().end()),
              std::vector<std::string>{s0});
  }
  CommitStep(job.job_id(), 1, {w0, w1});
}

// A live cluster: a store's lease runs out (a crash, a reboot, a long stall) while it holds
// the only copy of a job's data. The job does not fail at once, since the store keeps its
// data on disk: it waits kStoreRestartGrace, its attempt voided and its workers told to
// retry (no failed attempt counts meanwhile), and goes on once the store is back; after
// the grace it fails naming the store. A job with another copy goes on without the store
// at once (ALostStoreLeavesThePlacement...).
class StoreLapseTest : public SchedulerTest {
 protected:
  // A job with one copy on s0_, steps 0 and 1 committed, `failures` failed attempts at
  // step 2 (as a dying store causes), then s0_ silent until it lapses.
  void StartAndLapse(int failures = 0) {
    Start();
    CommitStep(job_, 1, {w0_, w1_});
    for (int i = 0; i < failures; ++i) ASSERT_TRUE(Report(job_, w0_, 2, /*ok=*/false).ok());
    stores_.aborts.clear();
    ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0_, w1_}));  // 4 s: s0's 3-s lease ran out
  }
  // The job on s0_, w0_ and w1_, step 0 committed.
  void Start() {
    job_ = Submit(2, 300, /*replicas=*/1).job_id();
    s0_ = Join(v1::MEMBER_ROLE_STORE);
    w0_ = Join(v1::MEMBER_ROLE_WORKER);
    w1_ = Join(v1::MEMBER_ROLE_WORKER);
    scheduler_->Tick();
    CommitStep(job_, 0, {w0_, w1_});
  }
  // Advances the clock by `by`, with the workers heartbeating and a tick at the end.
  void Pass(absl::Duration by) {
    now_ += by;
    for (const std::string& w : {w0_, w1_}) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
    scheduler_->Tick();
  }
  // s0_ registers again (restarted on its data dir) and a second later the job is told so.
  void StoreBack() {
    Join(v1::MEMBER_ROLE_STORE, s0_);
    ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(1)));
  }
  std::string job_, s0_, w0_, w1_;
};

TEST_F(StoreLapseTest, TheJobWaitsForTheStoreAndGoesOnWhenItIsBack) {
  ASSERT_NO_FATAL_FAILURE(StartAndLapse(/*failures=*/5));
  for (int seconds = 0; seconds < 15; seconds += 3) {
    ASSERT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << Job(job_).failure_reason();
    EXPECT_EQ(Job(job_).pending_reason(),
              "waiting up to 30s for store " + s0_ +
                  ", which died holding data no live store has a copy of");  // pith status
    auto a = scheduler_->GetAssignment(w0_);
    EXPECT_EQ(a.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(std::string(a.status().message()), ::testing::HasSubstr(s0_));
    // A worker's failed attempt meanwhile is turned away, not counted.
    EXPECT_EQ(Report(job_, w0_, 2, /*ok=*/false).status().code(), absl::StatusCode::kUnavailable);
    ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(3)));
  }
  EXPECT_TRUE(stores_.aborts.empty());  // the only store is down
  ASSERT_NO_FATAL_FAILURE(StoreBack());
  ASSERT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << Job(job_).failure_reason();
  EXPECT_EQ(Job(job_).pending_reason(), "");
  // The attempt in flight is voided on the store that came back.
  EXPECT_EQ(stores_.aborts, (std::vector<std::string>{s0_ + ":" + job_ + ":2"}));
  auto a = scheduler_->GetAssignment(w0_);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->committed_step(), 1);
  EXPECT_EQ(a->world(), 2);
  for (const v1::ExpertPlacement& e : a->placement().experts()) {
    EXPECT_THAT(e.store_ids(), ::testing::ElementsAre(s0_));
  }
  // The 5 attempts that failed while the store was dying do not count.
  for (int i = 0; i < SchedulerOptions().step_attempts - 1; ++i) {
    ASSERT_TRUE(Report(job_, w1_, 2, /*ok=*/false).ok());
  }
  ASSERT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << Job(job_).failure_reason();
  CommitStep(job_, 2, {w0_, w1_});
}

// A store lost while the job waits on a peer's fate: the job says it waits for both, and
// the store's return takes only the store's words from its reason.
TEST_F(StoreLapseTest, AStoreLostDuringAPeerWaitLeavesThePeerWaitsWords) {
  ASSERT_NO_FATAL_FAILURE(Start());
  CommitStep(job_, 1, {w0_, w1_});
  now_ += absl::Seconds(2);
  for (const std::string& w : {w0_, w1_}) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
  ASSERT_TRUE(PeerFailed(job_, w0_, w1_).ok());  // w1_ silent from here on
  const std::string peer_words = "to learn whether worker " + w1_;
  const std::string store_words = "for store " + s0_;
  now_ += absl::Seconds(2);  // s0_'s lease lapses; w1_'s runs a second more
  ASSERT_TRUE(members_->Heartbeat(w0_, {}).ok());
  scheduler_->Tick();
  EXPECT_THAT(Job(job_).pending_reason(),
              ::testing::AllOf(::testing::HasSubstr(peer_words), ::testing::HasSubstr(store_words),
                               ::testing::HasSubstr("; and also ")));

  Join(v1::MEMBER_ROLE_STORE, s0_);
  now_ += absl::Milliseconds(500);
  ASSERT_TRUE(members_->Heartbeat(w0_, {}).ok());
  scheduler_->Tick();  // the store is back; the peer wait goes on
  EXPECT_THAT(Job(job_).pending_reason(),
              ::testing::AllOf(::testing::StartsWith("waiting up to 3s " + peer_words),
                               ::testing::Not(::testing::HasSubstr(store_words))));

  now_ += absl::Seconds(1);  // w1_'s lease lapses
  ASSERT_TRUE(members_->Heartbeat(w0_, {}).ok());
  ASSERT_TRUE(members_->Heartbeat(s0_, {}).ok());
  scheduler_->Tick();
  EXPECT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << Job(job_).failure_reason();
  EXPECT_THAT(Job(job_).pending_reason(), ::testing::Not(::testing::HasSubstr(peer_words)));
}

// The store back is asked for its step of the job, as after a restart: one that lost
// commits in its crash (behind the job's committed step) is lost, and with it the job.
TEST_F(StoreLapseTest, AStoreBackBehindTheJobIsLost) {
  ASSERT_NO_FATAL_FAILURE(StartAndLapse());
  ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(3)));
  v1::StoreJob behind;
  behind.set_job_id(job_);
  behind.set_committed_step(0);
  stores_.held[s0_] = {behind};
  ASSERT_NO_FATAL_FAILURE(StoreBack());
  ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(1)));
  const v1::Job failed = Job(job_);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(failed.failure_reason(), ::testing::HasSubstr("behind its committed step 1"));
}

TEST_F(StoreLapseTest, AStoreThatStaysDownFailsTheJobAfterTheGrace) {
  ASSERT_NO_FATAL_FAILURE(StartAndLapse());
  for (absl::Duration t = absl::Seconds(3); t < kStoreRestartGrace - absl::Seconds(3);
       t += absl::Seconds(3)) {
    ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(3)));
    ASSERT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << "after " << t;
  }
  ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(6)));
  const v1::Job failed = Job(job_);
  EXPECT_EQ(failed.state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(failed.failure_reason(),
              ::testing::HasSubstr("(held by " + s0_ + ", which is gone)"));
}

// A store that comes back and dies again and again does not hold the job for ever: the wait
// is bounded from its first start since the last commit.
TEST_F(StoreLapseTest, AStoreThatKeepsDyingEndsTheWait) {
  ASSERT_NO_FATAL_FAILURE(StartAndLapse());
  for (int round = 0; round < 4 && Job(job_).state() == v1::JOB_STATE_RUNNING; ++round) {
    ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(6)));
    ASSERT_NO_FATAL_FAILURE(StoreBack());                // back for a moment
    ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0_, w1_}));  // and down again
  }
  EXPECT_EQ(Job(job_).state(), v1::JOB_STATE_FAILED);
  EXPECT_LT(now_ - absl::FromUnixSeconds(1004), kStoreRestartGrace + absl::Seconds(12));
}

// A store that dies while the job's step is being committed on it holds the commit back,
// not fails it: the decided step commits once the store is back.
TEST_F(StoreLapseTest, ACommitInFlightWaitsForTheStore) {
  ASSERT_NO_FATAL_FAILURE(Start());
  stores_.failing[s0_] = absl::UnavailableError("connection refused");  // it is dying
  for (const std::string& w : {w0_, w1_}) ASSERT_TRUE(Report(job_, w, 1).ok());
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({w0_, w1_}));
  for (int seconds = 0; seconds < 21; seconds += 3) {
    ASSERT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << Job(job_).failure_reason();
    EXPECT_EQ(Job(job_).committed_step(), 0);
    ASSERT_NO_FATAL_FAILURE(Pass(absl::Seconds(3)));
  }
  stores_.failing.erase(s0_);
  ASSERT_NO_FATAL_FAILURE(StoreBack());
  ASSERT_EQ(Job(job_).state(), v1::JOB_STATE_RUNNING) << Job(job_).failure_reason();
  EXPECT_EQ(Job(job_).committed_step(), 1);
}

// The wait has an end: a store that never comes back is given up after the grace, and the
// job, whose only copy it held, fails naming it.
TEST_F(StoreRestartTest, AStoreThatNeverReturnsIsGivenUpAfterTheGrace) {
  const v1::Job job = Submit(2, 300, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER), w1 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0, w1});

  Open();
  for (const std::string& w : {w0, w1}) Join(v1::MEMBER_ROLE_WORKER, w);
  for (absl::Duration t = absl::Seconds(3); t <= kStoreRestartGrace + absl::Seconds(3);
       t += absl::Seconds(3)) {
    now_ += absl::Seconds(3);
    for (const std::string& w : {w0, w1}) ASSERT_TRUE(members_->Heartbeat(w, {}).ok());
    scheduler_->Tick();
    if (t <= kStoreRestartGrace) {
      ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_RUNNING) << "after " << t;
    }
  }
  const v1::Job ended = Job(job.job_id());
  EXPECT_EQ(ended.state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(ended.failure_reason().find("held by " + s0), std::string::npos)
      << ended.failure_reason();
}

// After a restart a CUDA job whose one worker died while the other has not registered
// again yet takes no idle CPU worker: its recorded backend holds until that worker is back.
TEST_F(SchedulerTest, ARestartedJobKeepsItsBackendBeforeItsWorkersReturn) {
  const v1::Job job = Submit(2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string g0 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  const std::string g1 = Join(v1::MEMBER_ROLE_WORKER, "", v1::BACKEND_CUDA);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {g0, g1});

  Open();  // the coordinator restarts: g1 registers again and dies; g0 is not back yet
  Join(v1::MEMBER_ROLE_STORE, s0);
  Join(v1::MEMBER_ROLE_WORKER, g1, v1::BACKEND_CUDA);
  const std::string cpu = Join(v1::MEMBER_ROLE_WORKER, "worker-cpu", v1::BACKEND_CPU);
  now_ += absl::Seconds(4);  // g1's lease (3 s) lapses; within the 9 s of grace for g0
  for (const std::string& id : {s0, cpu}) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
  scheduler_->Tick();
  EXPECT_TRUE(scheduler_->GetAssignment(cpu)->job_id().empty()) << "a CPU worker joined";
  // g0 comes back, and a CUDA worker takes g1's place.
  Join(v1::MEMBER_ROLE_WORKER, g0, v1::BACKEND_CUDA);
  const std::string g2 = Join(v1::MEMBER_ROLE_WORKER, "worker-g2", v1::BACKEND_CUDA);
  for (const std::string& id : {s0, cpu, g0, g2}) ASSERT_TRUE(members_->Heartbeat(id, {}).ok());
  scheduler_->Tick();
  EXPECT_EQ(scheduler_->GetAssignment(g2)->job_id(), job.job_id());
  EXPECT_TRUE(scheduler_->GetAssignment(cpu)->job_id().empty());
}

TEST_F(SchedulerTest, HeatSurvivesARestart) {
  v1::JobSpec spec;
  const v1::Job job = Submit(1, 300);
  ASSERT_TRUE(
      jobs_
          ->Update(job.job_id(),
                   [](v1::Job& j) {
                     j.mutable_spec()->mutable_cluster()->mutable_replication()->set_replan_every(
                         1);
                     return absl::OkStatus();
                   })
          .ok());
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  v1::HeatReport report;
  report.set_job_id(job.job_id());
  report.set_worker_id(w0);
  report.set_step(1);
  v1::LayerRouting* l = report.add_layers();
  l->set_layer(2);
  for (int e = 0; e < 16; ++e) l->add_tokens_per_expert(e == 5 ? 900 : 10);
  ASSERT_TRUE(heat_->Report(Job(job.job_id()), report).ok());
  CommitStep(job.job_id(), 1, {w0});  // a re-plan boundary: heat is saved
  Open();
  auto heat = heat_->Heat(job.job_id(), 2);
  ASSERT_TRUE(heat.ok()) << heat.status();
  EXPECT_DOUBLE_EQ(heat->experts(5).heat(), 900);
  // An ended job's heat survives the next restart too.
  ASSERT_TRUE(jobs_->Cancel(job.job_id(), "done looking").ok());
  scheduler_->Tick();
  Open();
  heat = heat_->Heat(job.job_id(), 2);
  ASSERT_TRUE(heat.ok()) << heat.status();
  EXPECT_DOUBLE_EQ(heat->experts(5).heat(), 900);
  // A removed job's heat goes, now and for good.
  ASSERT_TRUE(scheduler_->Remove(job.job_id()).ok());
  EXPECT_FALSE(heat_->Heat(job.job_id(), 2).ok());
  auto saved = jobs_->Records(absl::StrCat("heat/", job.job_id()));  // the scheduler's key
  ASSERT_TRUE(saved.ok());
  EXPECT_TRUE(saved->empty());
  Open();
  EXPECT_FALSE(heat_->Heat(job.job_id(), 2).ok());
}

// Every group's store list.
std::map<std::pair<int, int>, std::vector<std::string>> Copies(const v1::PlacementTable& t) {
  std::map<std::pair<int, int>, std::vector<std::string>> out;
  for (const v1::ExpertPlacement& e : t.experts()) {
    out[{e.layer(), e.expert()}] = {e.store_ids().begin(), e.store_ids().end()};
  }
  return out;
}

TEST_F(SchedulerTest, ALostStoreIsReReplicatedToTheReplicaCount) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE),
                    s2 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0, s2, w0}));  // s1 dies
  v1::ClusterStatusResponse status;
  scheduler_->ReplicationStatus(&status);
  EXPECT_GT(status.replica_deficit(), 0u);
  while (scheduler_->ReplicateOnce() > 0) {
  }
  EXPECT_TRUE(stores_.pulls.empty());  // s2 joins the groups at the next boundary first
  CommitStep(job.job_id(), 1, {w0});
  while (scheduler_->ReplicateOnce() > 0) {
  }
  EXPECT_FALSE(stores_.pulls.empty());
  CommitStep(job.job_id(), 2, {w0});  // the complete copies are read from now on
  const v1::PlacementTable p = *scheduler_->GetPlacement(job.job_id());
  EXPECT_EQ(p.effective_step(), 3);
  for (const auto& [group, ids] : Copies(p)) {
    EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()), (std::set<std::string>{s0, s2}))
        << group.first << "/" << group.second;
  }
  v1::ClusterStatusResponse after;
  scheduler_->ReplicationStatus(&after);
  EXPECT_EQ(after.replica_deficit(), 0u);
  EXPECT_EQ(after.blobs_moved(), stores_.pulls.size());
}

// With fewer stores alive than the copies wanted, the deficit says so (and stays): one more
// store loss would lose weights. It was capped at the stores alive, so it read 0.
TEST_F(SchedulerTest, TheDeficitCountsCopiesNoStoreIsLeftToHold) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  v1::ClusterStatusResponse before;
  scheduler_->ReplicationStatus(&before);
  EXPECT_EQ(before.replica_deficit(), 0u);
  const size_t groups = Copies(*scheduler_->GetPlacement(job.job_id())).size();
  ASSERT_NO_FATAL_FAILURE(OnlyTheseLive({s0, w0}));  // s1 dies; no store is left to copy to
  while (scheduler_->ReplicateOnce() > 0) {
  }
  CommitStep(job.job_id(), 1, {w0});
  v1::ClusterStatusResponse after;
  scheduler_->ReplicationStatus(&after);
  EXPECT_EQ(after.replica_deficit(), groups) << "one copy of each group is missing";
}

TEST_F(SchedulerTest, AJoiningStoreGetsTheWritesFirstAndIsReadOnlyOnceComplete) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  const std::string s1 = Join(v1::MEMBER_ROLE_STORE);  // every group wants a second copy
  EXPECT_EQ(scheduler_->ReplicateOnce(), 0);           // nothing is pulled yet
  CommitStep(job.job_id(), 1, {w0});
  // From step 2 on, writers send every group to s1 too; readers still use s0 alone.
  const v1::PlacementTable joined = *scheduler_->GetPlacement(job.job_id());
  EXPECT_EQ(joined.effective_step(), 2);
  for (const v1::ExpertPlacement& e : joined.experts()) {
    EXPECT_EQ(std::vector<std::string>(e.store_ids().begin(), e.store_ids().end()),
              std::vector<std::string>{s0});
    EXPECT_EQ(std::vector<std::string>(e.joining_store_ids().begin(), e.joining_store_ids().end()),
              std::vector<std::string>{s1});
  }
  const absl::StatusOr<v1::Assignment> assignment = scheduler_->GetAssignment(w0);
  ASSERT_TRUE(assignment.ok()) << assignment.status();
  EXPECT_EQ(assignment->placement().experts(0).joining_store_ids_size(), 1);
  // The pulls run while step 2 writes (the dense group, here): the copies stay good, since
  // s1 gets the writes too.
  int pulled = 0;
  for (int n; (n = scheduler_->ReplicateOnce()) > 0;) pulled += n;
  EXPECT_EQ(pulled, static_cast<int>(joined.experts_size()));
  v1::StepWrittenRequest r;
  r.set_job_id(job.job_id());
  r.set_worker_id(w0);
  r.set_step(2);
  r.set_ok(true);
  r.set_assignment_version(scheduler_->AssignmentVersion(w0));
  r.add_written()->mutable_key()->set_layer(-1);
  ASSERT_TRUE(scheduler_->ReportStepWritten(r).ok());
  const absl::StatusOr<v1::PlacementTable> read = scheduler_->GetPlacement(job.job_id());
  ASSERT_TRUE(read.ok()) << read.status();
  for (const v1::ExpertPlacement& e : read->experts()) {
    EXPECT_EQ(std::set<std::string>(e.store_ids().begin(), e.store_ids().end()),
              (std::set<std::string>{s0, s1}));
    EXPECT_EQ(e.joining_store_ids_size(), 0);
  }
}

TEST_F(SchedulerTest, AJoiningStoreTakesOnlyItsShare) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  std::vector<std::string> stores = {Join(v1::MEMBER_ROLE_STORE), Join(v1::MEMBER_ROLE_STORE)};
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  const auto before = Copies(*scheduler_->GetPlacement(job.job_id()));
  stores.push_back(Join(v1::MEMBER_ROLE_STORE));
  for (int64_t step = 1; step <= 2; ++step) {  // join, then read
    while (scheduler_->ReplicateOnce() > 0) {
    }
    CommitStep(job.job_id(), step, {w0});
  }
  const auto after = Copies(*scheduler_->GetPlacement(job.job_id()));
  int moved = 0, total = 0;
  for (const auto& [group, ids] : after) {
    EXPECT_EQ(ids, RendezvousStores(group.first < 0 ? job.job_id() + "/dense"
                                                    : absl::StrCat(job.job_id(), "/", group.first,
                                                                   "/", group.second),
                                    stores, 2));
    const std::set<std::string> had(before.at(group).begin(), before.at(group).end());
    for (const std::string& id : ids) moved += !had.count(id);
    total += ids.size();
  }
  // Each group has 2 of 3 stores: a third of the copies move, all to the new store.
  EXPECT_GT(moved, 0);
  EXPECT_LE(static_cast<double>(moved) / total, 1.2 / 3);
}

TEST_F(SchedulerTest, ACheckpointIsTheCommittedWeightsUnderTheirDesignNames) {
  const v1::Job job = Submit(1, 300, 1);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  v1::CheckpointJobRequest request;
  request.set_job_id(job.job_id());
  request.set_output_dir(dir_ + "/export");
  EXPECT_EQ(scheduler_->Checkpoint(request).status().code(),
            absl::StatusCode::kFailedPrecondition);  // nothing committed yet
  CommitStep(job.job_id(), 0, {w0});
  // The store holds every weights blob at version 0, and an optimizer blob to ignore.
  const model::ParamLayout layout(model::ModelShape::FromSpec(Job(job.job_id()).spec().model()));
  std::set<std::pair<int, int>> experts;
  for (const model::ParamTensor& t : layout.tensors()) {
    v1::BlobInfo b;
    b.mutable_key()->set_job_id(job.job_id());
    b.mutable_key()->set_kind(v1::BLOB_KIND_WEIGHTS);
    b.mutable_key()->set_layer(t.layer < 0 ? -1 : t.layer);
    if (t.layer < 0) {
      b.mutable_key()->set_tensor(t.name);
    } else {
      if (!experts.insert({t.layer, t.expert}).second) continue;
      b.mutable_key()->set_expert(t.expert);
    }
    stores_.contents.push_back(b);
  }
  v1::BlobInfo moment = stores_.contents.back();
  moment.mutable_key()->set_kind(v1::BLOB_KIND_ADAM_M);
  stores_.contents.push_back(moment);

  auto done = scheduler_->Checkpoint(request);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->step(), 0);
  auto file = SafetensorsFile::Read(done->weights_path());
  ASSERT_TRUE(file.ok()) << file.status();
  auto w1 = file->Get("h.2.moe.e7.w2");
  ASSERT_TRUE(w1.ok());
  EXPECT_EQ(reinterpret_cast<const float*>(w1->bytes.data())[5], 2007.0f);
  auto qkv = file->Get("h.1.attn.qkv.w");
  ASSERT_TRUE(qkv.ok());
  EXPECT_EQ(reinterpret_cast<const float*>(qkv->bytes.data())[0], -1.0f - 14);  // its name length
  EXPECT_EQ(file->entries().size(), layout.tensors().size());

  // Ended, the job cannot be removed while a checkpoint reads its blobs.
  ASSERT_TRUE(jobs_->Cancel(job.job_id(), "enough").ok());
  scheduler_->Tick();  // its run is released
  absl::StatusOr<v1::Job> removed;
  stores_.during_fetch = [&] { removed = scheduler_->Remove(job.job_id()); };
  request.set_output_dir(dir_ + "/export-ended");
  const auto exported = scheduler_->Checkpoint(request);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(removed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(removed.status().message(), ::testing::HasSubstr("is being exported"));

  // A blob on no store is a clear error, not a file with holes.
  stores_.contents.erase(stores_.contents.begin());
  EXPECT_EQ(scheduler_->Checkpoint(request).status().code(), absl::StatusCode::kFailedPrecondition);
  request.set_include_optimizer(true);
  EXPECT_EQ(scheduler_->Checkpoint(request).status().code(), absl::StatusCode::kUnimplemented);
  // Once no export reads it, it goes; an export after that finds no job.
  ASSERT_TRUE(scheduler_->Remove(job.job_id()).ok());
  request.set_include_optimizer(false);
  request.set_output_dir(dir_ + "/export-removed");
  EXPECT_EQ(scheduler_->Checkpoint(request).status().code(), absl::StatusCode::kNotFound);
}

// A job cancelled while it runs is removed once the scheduler has released its run (its
// workers then hear that it ended); a running one is refused at once.
TEST_F(SchedulerTest, ACancelledJobIsRemovedOnceItsRunIsReleased) {
  const v1::Job job = Submit(1, 300, 1);
  Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  const absl::Time start = absl::Now();
  EXPECT_EQ(scheduler_->Remove(job.job_id()).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_TRUE(jobs_->Cancel(job.job_id(), "enough").ok());
  absl::StatusOr<v1::Job> removed;
  std::thread remover([&] { removed = scheduler_->Remove(job.job_id()); });
  absl::SleepFor(absl::Milliseconds(200));
  scheduler_->Tick();
  remover.join();
  ASSERT_TRUE(removed.ok()) << removed.status();
  EXPECT_EQ(removed->state(), v1::JOB_STATE_CANCELLED);
  v1::WaitStepRequest wait;
  wait.set_job_id(job.job_id());
  wait.set_step(1);
  absl::StatusOr<v1::StepStatus> status = scheduler_->WaitStep(wait, absl::Seconds(1));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(status->job_ended());
  absl::StatusOr<v1::Assignment> idle = scheduler_->GetAssignment(w0);
  ASSERT_TRUE(idle.ok()) << idle.status();
  EXPECT_TRUE(idle->job_id().empty());
}

TEST_F(SchedulerTest, ADrainedStoreHoldsNothingAndEveryGroupKeepsItsCopies) {
  const v1::Job job = Submit(1, 300, /*replicas=*/2);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  CommitStep(job.job_id(), 0, {w0});
  // Two stores for two copies: draining one would lose the replica count.
  auto refused = scheduler_->Drain(s0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_EQ(scheduler_->Drain("store-9").status().code(), absl::StatusCode::kNotFound);
  const std::string s2 = Join(v1::MEMBER_ROLE_STORE);
  auto drain = scheduler_->Drain(s0);
  ASSERT_TRUE(drain.ok()) << drain.status();
  const int groups = Copies(*scheduler_->GetPlacement(job.job_id())).size();
  EXPECT_EQ(drain->groups_to_move(), static_cast<uint64_t>(groups));  // s0 held all of them
  EXPECT_TRUE(scheduler_->Drain(s0).ok());                            // again: no change
  int64_t step = 1;
  for (; step < 10; ++step) {
    while (scheduler_->ReplicateOnce() > 0) {
    }
    CommitStep(job.job_id(), step, {w0});
    for (const auto& [group, ids] : Copies(*scheduler_->GetPlacement(job.job_id()))) {
      ASSERT_GE(ids.size(), 2u) << "a group lost a copy during the drain";
    }
    bool on_s0 = false;
    for (const auto& [group, ids] : Copies(*scheduler_->GetPlacement(job.job_id()))) {
      on_s0 |= std::count(ids.begin(), ids.end(), s0) > 0;
    }
    if (!on_s0) break;
  }
  ASSERT_LT(step, 10) << "the drain did not finish";
  for (const auto& [group, ids] : Copies(*scheduler_->GetPlacement(job.job_id()))) {
    EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()), (std::set<std::string>{s1, s2}));
  }
  scheduler_->Tick();
  EXPECT_EQ(StoreState(s0), v1::MEMBER_STATE_DRAINING);  // no collection yet
  (void)scheduler_->CollectGarbageOnce();                // no ended job's weights on it
  scheduler_->Tick();
  v1::ClusterStatusResponse status;
  scheduler_->ReplicationStatus(&status);
  ASSERT_EQ(status.drains_size(), 1);
  EXPECT_EQ(status.drains(0).store_id(), s0);
  EXPECT_EQ(status.drains(0).groups_total(), static_cast<uint64_t>(groups));
  EXPECT_EQ(status.drains(0).groups_left(), 0u);
  EXPECT_TRUE(status.drains(0).can_stop());
  EXPECT_EQ(status.replica_deficit(), 0u);
  for (const v1::MemberInfo& m : members_->Members(v1::MEMBER_ROLE_STORE)) {
    EXPECT_EQ(m.state(), m.member_id() == s0 ? v1::MEMBER_STATE_DRAINED : v1::MEMBER_STATE_ALIVE);
  }
  // The drain is durable: after a restart the store registers as draining, and holding
  // nothing, is drained again.
  Open();
  const std::string fresh = Join(v1::MEMBER_ROLE_STORE);  // a new store: never the drained id
  EXPECT_NE(fresh, s0);
  Join(v1::MEMBER_ROLE_STORE, s0);
  for (const v1::MemberInfo& m : members_->Members(v1::MEMBER_ROLE_STORE)) {
    EXPECT_EQ(m.state(), m.member_id() == s0 ? v1::MEMBER_STATE_DRAINING : v1::MEMBER_STATE_ALIVE);
  }
  (void)scheduler_->CollectGarbageOnce();
  scheduler_->Tick();
  for (const v1::MemberInfo& m : members_->Members(v1::MEMBER_ROLE_STORE)) {
    EXPECT_EQ(m.state(), m.member_id() == s0 ? v1::MEMBER_STATE_DRAINED : v1::MEMBER_STATE_ALIVE);
  }
}

// An ended job keeps its weights on the stores (pith checkpoint reads them), and a drained
// store is stopped: weights and masters no store that stays holds are copied to one first
// (its optimizer state is not), and the store is drained only once a pass found none left.
TEST_F(SchedulerTest, ADrainCopiesTheEndedJobsWeightsOnlyTheStoreHolds) {
  const v1::Job job = Submit(1, /*steps=*/1, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE), s1 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  for (int step = 0; step <= 1; ++step) CommitStep(job.job_id(), step, {w0});
  ASSERT_EQ(Job(job.job_id()).state(), v1::JOB_STATE_SUCCEEDED);
  const auto blob = [&](int layer, int expert, v1::BlobKind kind, int64_t version) {
    v1::BlobInfo b;
    b.mutable_key()->set_job_id(job.job_id());
    b.mutable_key()->set_layer(layer);
    b.mutable_key()->set_expert(layer < 0 ? 0 : expert);
    if (layer < 0) b.mutable_key()->set_tensor("emb");
    b.mutable_key()->set_kind(kind);
    b.set_version(version);
    return b;
  };
  v1::StoreJob held;
  held.set_job_id(job.job_id());
  held.set_blobs(4);
  stores_.held[s0] = {held};
  stores_.contents_on[s0] = {
      blob(-1, 0, v1::BLOB_KIND_WEIGHTS, 1), blob(0, 1, v1::BLOB_KIND_WEIGHTS, 1),
      blob(0, 2, v1::BLOB_KIND_MASTER, 1), blob(0, 2, v1::BLOB_KIND_STATE, 1)};
  stores_.contents_on[s1] = {blob(0, 1, v1::BLOB_KIND_WEIGHTS, 1),  // homed
                             blob(0, 2, v1::BLOB_KIND_MASTER, 0)};  // older: not
  ASSERT_TRUE(scheduler_->Drain(s0).ok());
  scheduler_->Tick();
  EXPECT_EQ(StoreState(s0), v1::MEMBER_STATE_DRAINING);  // no pass has looked yet
  stores_.failing_pulls = true;                          // s1 cannot take them now
  (void)scheduler_->CollectGarbageOnce();
  scheduler_->Tick();
  EXPECT_EQ(StoreState(s0), v1::MEMBER_STATE_DRAINING);
  stores_.failing_pulls = false;
  stores_.pulls.clear();
  (void)scheduler_->CollectGarbageOnce();
  EXPECT_THAT(stores_.pulls,
              ::testing::UnorderedElementsAre(s0 + "->" + s1 + ":-1/0", s0 + "->" + s1 + ":0/2"));
  scheduler_->Tick();
  EXPECT_EQ(StoreState(s0), v1::MEMBER_STATE_DRAINED);
}

// The only store that takes copies holds an ended job's weights: its drain could never
// end, and is refused with the reason; with another store it goes ahead. A job that used
// the store and ends while a pass runs voids what the pass found for the store (the pass
// took it for a running job, whose groups the drain moves).
TEST_F(SchedulerTest, ADrainWaitsForEveryEndedJobsWeightsToHaveAHome) {
  const v1::Job ended = Submit(1, /*steps=*/1, /*replicas=*/1);
  const std::string s0 = Join(v1::MEMBER_ROLE_STORE);
  const std::string w0 = Join(v1::MEMBER_ROLE_WORKER);
  scheduler_->Tick();
  for (int step = 0; step <= 1; ++step) CommitStep(ended.job_id(), step, {w0});
  v1::StoreJob held;
  held.set_job_id(ended.job_id());
  held.set_blobs(4);
  held.set_blobs_besides_weights(2);
  stores_.held[s0] = {held};
  auto refused = scheduler_->Drain(s0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("weights of ended job(s) " + ended.job_id()));
  const std::string s1 = Join(v1::MEMBER_ROLE_STORE);
  stores_.contents_on[s0] = {};                            // nothing left to copy
  const v1::Job running = Submit(1, 300, /*replicas=*/1);  // on s0 and s1
  scheduler_->Tick();
  ASSERT_EQ(Job(running.job_id()).state(), v1::JOB_STATE_RUNNING);
  CommitStep(running.job_id(), 0, {w0});
  ASSERT_TRUE(Placed(running.job_id()).count(s0));
  ASSERT_TRUE(scheduler_->Drain(s0).ok());
  v1::StoreJob blobs = held;  // the running job's blobs there
  blobs.set_job_id(running.job_id());
  stores_.held[s0] = {held, blobs};
  stores_.during_delete = [&](const v1::MemberInfo&, const v1::DeleteJobRequest&) {
    ASSERT_TRUE(jobs_->Cancel(running.job_id(), "enough").ok());
    scheduler_->Tick();  // the run is released: a job ended during the pass
  };
  (void)scheduler_->CollectGarbageOnce();
  scheduler_->Tick();
  EXPECT_EQ(StoreState(s0), v1::MEMBER_STATE_DRAINING);
  (void)scheduler_->CollectGarbageOnce();
  scheduler_->Tick();
  EXPECT_EQ(StoreState(s0), v1::MEMBER_STATE_DRAINED);
  EXPECT_EQ(StoreState(s1), v1::MEMBER_STATE_ALIVE);
}

}  // namespace
}  // namespace pith::coordinator
