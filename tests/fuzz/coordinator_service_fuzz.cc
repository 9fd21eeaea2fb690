// libFuzzer target: the coordinator's gRPC handlers, the job API (JobServiceImpl) and the
// members' service (CoordinatorServiceImpl), called as the server calls them, on a fresh
// coordinator per input (its job registry in RocksDB under /tmp, a clock of its own, stores
// that accept every commit: store_control_testing.h). An input is a sequence of up to 24
// operations: a handler with a request of the fuzzer's bytes merged over a valid one (ids
// drawn from the jobs submitted and members registered so far), or time passing with a
// scheduler tick. Every answer is OK or a named error (rpc_fuzz.h); a job a submit
// accepted can be read back, and a member a registration accepted can heartbeat.
//
// Not here: WaitStep, WatchJob and DownloadCheckpoint (they wait or stream; their
// arguments are checked as GetJob's and CheckpointJob's are), and the mutual-TLS policy
// (security/authorize_test).
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/job_spec_testing.h"
#include "common/ucx_address.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "rpc_fuzz.h"
#include "server/coordinator/coordinator_service.h"
#include "server/coordinator/job_service.h"
#include "server/coordinator/store_control_testing.h"

namespace {

using pith::fuzz::CheckAnswer;
using pith::fuzz::Request;
using pith::fuzz::Require;
namespace v1 = pith::v1;
namespace co = pith::coordinator;

// Removed at exit (the string is never destroyed: the exit handler reads it).
const std::string& Dir() {
  static const std::string* const path = [] {
    // On tmpfs where there is one: RocksDB's syncs cost nothing there.
    const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    auto* p =
        new std::string(std::string(base) + "/pith_coordinator_fuzz." + std::to_string(getpid()));
    std::atexit([] { std::filesystem::remove_all(Dir()); });
    return p;
  }();
  return *path;
}

const v1::JobSpec& BaseSpec() {
  static const v1::JobSpec spec = [] {
    v1::JobSpec s;
    Require(
        google::protobuf::util::JsonStringToMessage(pith::testing::kDesignExampleSpecJson, &s).ok(),
        "the example spec parses");
    return s;
  }();
  return spec;
}

struct World {
  absl::Time now = absl::FromUnixSeconds(1000);
  co::Membership members{absl::Seconds(3), [this] { return now; }};
  co::HeatRegistry heat;
  co::testing::NoStores stores;
  std::unique_ptr<co::JobRegistry> jobs;
  std::unique_ptr<co::Scheduler> scheduler;
  std::unique_ptr<co::JobServiceImpl> job_api;
  std::unique_ptr<co::CoordinatorServiceImpl> member_api;
  std::vector<std::string> job_ids{"job-none"};
  std::vector<std::string> member_ids{"store-none"};

  const std::string& Pick(const std::vector<std::string>& ids, FuzzedDataProvider& in) {
    return ids[in.ConsumeIntegralInRange<size_t>(0, ids.size() - 1)];
  }
};

std::unique_ptr<World> NewWorld() {
  std::filesystem::remove_all(Dir());
  std::filesystem::create_directories(Dir() + "/exports");
  auto w = std::make_unique<World>();
  auto jobs = co::JobRegistry::Open(Dir() + "/registry");
  Require(jobs.ok(), "a fresh job registry opens");
  w->jobs = *std::move(jobs);
  co::SchedulerOptions options;
  options.clock = [world = w.get()] { return world->now; };
  w->scheduler = std::make_unique<co::Scheduler>(w->jobs.get(), &w->members, &w->heat, &w->stores,
                                                 nullptr, options);
  w->job_api =
      std::make_unique<co::JobServiceImpl>(w->jobs.get(), &w->members, &w->heat, w->scheduler.get(),
                                           Dir() + "/staging", Dir() + "/exports");
  w->member_api = std::make_unique<co::CoordinatorServiceImpl>(&w->members, w->jobs.get(), &w->heat,
                                                               w->scheduler.get());
  return w;
}

// The job API: submit, get, list, cancel, remove, checkpoint, cluster status, expert heat.
void JobOp(World& w, int op, FuzzedDataProvider& in) {
  grpc::ServerContext ctx;
  co::JobServiceImpl& api = *w.job_api;
  if (op == 0) {
    v1::SubmitJobRequest base;
    *base.mutable_spec() = BaseSpec();
    v1::SubmitJobRequest req = Request(base, in);
    v1::SubmitJobResponse reply;
    grpc::Status s = api.SubmitJob(&ctx, &req, &reply);
    CheckAnswer("SubmitJob", s);
    if (!s.ok()) return;
    w.job_ids.push_back(reply.job().job_id());
    grpc::ServerContext get_ctx;
    v1::GetJobRequest get;
    get.set_job_id(reply.job().job_id());
    v1::Job job;
    Require(api.GetJob(&get_ctx, &get, &job).ok(), "a submitted job can be read back");
    return;
  }
  v1::Job job_reply;
  if (op == 1) {
    v1::GetJobRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    v1::GetJobRequest req = Request(base, in);
    CheckAnswer("GetJob", api.GetJob(&ctx, &req, &job_reply));
  } else if (op == 2) {
    v1::ListJobsRequest req = Request(v1::ListJobsRequest(), in);
    v1::ListJobsResponse reply;
    CheckAnswer("ListJobs", api.ListJobs(&ctx, &req, &reply));
  } else if (op == 3 && in.ConsumeBool()) {
    v1::CancelJobRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    v1::CancelJobRequest req = Request(base, in);
    CheckAnswer("CancelJob", api.CancelJob(&ctx, &req, &job_reply));
  } else if (op == 3) {
    v1::RemoveJobRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    v1::RemoveJobRequest req = Request(base, in);
    CheckAnswer("RemoveJob", api.RemoveJob(&ctx, &req, &job_reply));
  } else if (op == 4) {
    v1::CheckpointJobRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    base.set_output_dir("out");
    v1::CheckpointJobRequest req = Request(base, in);
    v1::CheckpointJobResponse reply;
    CheckAnswer("CheckpointJob", api.CheckpointJob(&ctx, &req, &reply));
  } else if (op == 5) {
    v1::ClusterStatusRequest req;
    v1::ClusterStatusResponse reply;
    CheckAnswer("ClusterStatus", api.ClusterStatus(&ctx, &req, &reply));
  } else {
    v1::ExpertHeatRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    v1::ExpertHeatRequest req = Request(base, in);
    v1::ExpertHeatResponse reply;
    CheckAnswer("ExpertHeat", api.ExpertHeat(&ctx, &req, &reply));
  }
}

// Registration: a store or a worker with a valid address, the fuzzer's bytes over it.
void RegisterOp(World& w, FuzzedDataProvider& in) {
  grpc::ServerContext ctx;
  v1::RegisterRequest base;
  v1::MemberInfo* m = base.mutable_member();
  m->set_role(in.ConsumeBool() ? v1::MEMBER_ROLE_STORE : v1::MEMBER_ROLE_WORKER);
  m->set_grpc_address("127.0.0.1:7000");
  m->set_ucx_address(pith::WrapUcxAddress("ucx"));
  m->set_capacity_bytes(1 << 30);
  m->set_max_blob_bytes(64 << 20);
  m->set_backend(v1::BACKEND_CPU);
  v1::RegisterRequest req = Request(base, in);
  v1::RegisterResponse reply;
  grpc::Status s = w.member_api->Register(&ctx, &req, &reply);
  CheckAnswer("Register", s);
  if (!s.ok()) return;
  w.member_ids.push_back(reply.member_id());
  grpc::ServerContext beat_ctx;
  v1::HeartbeatRequest beat;
  beat.set_member_id(reply.member_id());
  v1::HeartbeatResponse beat_reply;
  Require(w.member_api->Heartbeat(&beat_ctx, &beat, &beat_reply).ok() && !beat_reply.reregister(),
          "a member just registered can heartbeat");
}

// The members' service past registration.
void MemberOp(World& w, int op, FuzzedDataProvider& in) {
  grpc::ServerContext ctx;
  co::CoordinatorServiceImpl& api = *w.member_api;
  if (op == 0) {
    v1::HeartbeatRequest base;
    base.set_member_id(w.Pick(w.member_ids, in));
    v1::HeartbeatRequest req = Request(base, in);
    v1::HeartbeatResponse reply;
    CheckAnswer("Heartbeat", api.Heartbeat(&ctx, &req, &reply));
  } else if (op == 1) {
    v1::DeregisterRequest base;
    base.set_member_id(w.Pick(w.member_ids, in));
    v1::DeregisterRequest req = Request(base, in);
    v1::DeregisterResponse reply;
    CheckAnswer("Deregister", api.Deregister(&ctx, &req, &reply));
  } else if (op == 2) {
    v1::HeatReport base;
    base.set_job_id(w.Pick(w.job_ids, in));
    base.set_worker_id(w.Pick(w.member_ids, in));
    v1::HeatReport req = Request(base, in);
    v1::HeatReportResponse reply;
    CheckAnswer("ReportHeat", api.ReportHeat(&ctx, &req, &reply));
  } else if (op == 3) {
    v1::GetAssignmentRequest base;
    base.set_worker_id(w.Pick(w.member_ids, in));
    v1::GetAssignmentRequest req = Request(base, in);
    v1::Assignment reply;
    CheckAnswer("GetAssignment", api.GetAssignment(&ctx, &req, &reply));
  } else if (op == 4) {
    v1::GetPlacementRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    v1::GetPlacementRequest req = Request(base, in);
    v1::PlacementTable reply;
    CheckAnswer("GetPlacement", api.GetPlacement(&ctx, &req, &reply));
  } else if (op == 5) {
    v1::StepWrittenRequest base;
    base.set_job_id(w.Pick(w.job_ids, in));
    base.set_worker_id(w.Pick(w.member_ids, in));
    base.set_step(in.ConsumeIntegralInRange<int64_t>(0, 4));
    base.set_ok(true);
    v1::StepWrittenRequest req = Request(base, in);
    v1::StepWrittenResponse reply;
    CheckAnswer("ReportStepWritten", api.ReportStepWritten(&ctx, &req, &reply));
  } else {
    v1::DrainStoreRequest base;
    base.set_store_id(w.Pick(w.member_ids, in));
    v1::DrainStoreRequest req = Request(base, in);
    v1::DrainStoreResponse reply;
    CheckAnswer("DrainStore", api.DrainStore(&ctx, &req, &reply));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pith::fuzz::QuietProtobuf();
  FLAGS_minloglevel = 3;  // the coordinator logs what it refuses; the checks here judge it
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  std::unique_ptr<World> world = NewWorld();
  for (int op = 0; op < 24 && in.remaining_bytes() > 0; ++op) {
    const int which = in.ConsumeIntegralInRange(0, 15);
    if (which < 7) {
      JobOp(*world, which, in);
    } else if (which == 7) {
      RegisterOp(*world, in);
    } else if (which < 15) {
      MemberOp(*world, which - 8, in);
    } else {  // time passes (leases lapse) and the scheduler places, commits and repairs
      world->now += absl::Milliseconds(in.ConsumeIntegralInRange(0, 5000));
      world->scheduler->Tick();
    }
  }
  return 0;
}
