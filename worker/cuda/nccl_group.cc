#include "worker/cuda/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pith::cuda {
namespace {

// How often a wait looks at its work, and how long a group's teardown may take.
constexpr absl::Duration kPoll = absl::Microseconds(20);
constexpr absl::Duration kFinalizeTimeout = absl::Seconds(10);

std::string NcclError(ncclResult_t r) { return ncclGetErrorString(r); }

// The event a wait polls, destroyed with it (an event still pending is released by CUDA
// once it completes).
class Event {
 public:
  Event() { created_ = cudaEventCreateWithFlags(&event_, cudaEventDisableTiming) == cudaSuccess; }
  ~Event() {
    if (created_) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  bool created() const { return created_; }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
  bool created_ = false;
};

}  // namespace

absl::StatusOr<std::string> NcclGroup::NewId() {
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
    return absl::UnavailableError(absl::StrCat("nccl: cannot make a group id: ", NcclError(r)));
  }
  return std::string(id.internal, sizeof(id.internal));
}

absl::StatusOr<std::unique_ptr<NcclGroup>> NcclGroup::Join(const std::string& id, int rank,
                                                           int world, int device,
                                                           absl::Duration timeout,
                                                           const std::atomic<bool>* abandon) {
  const absl::Time deadline = absl::Now() + timeout;
  ncclUniqueId uid;
  if (id.size() != sizeof(uid.internal)) {
    return absl::InvalidArgumentError(
        absl::StrCat("nccl: a group id has ", sizeof(uid.internal), " bytes, got ", id.size()));
  }
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: rank ", rank, " of a group of ", world));
  }
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("nccl: CUDA device ", device, ": ", cudaGetErrorString(err)));
  }
  std::memcpy(uid.internal, id.data(), sizeof(uid.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world, uid, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    return absl::UnavailableError(
        absl::StrCat("nccl: rank ", rank, " of ", world, " cannot join: ", NcclError(r)));
  }
  std::unique_ptr<NcclGroup> group(new NcclGroup(comm, rank, world, device));
  group->join_abandon_ = abandon;  // an aborted attempt's join ends at once
  if (absl::Status ready = group->WaitReady("join", deadline); !ready.ok()) return ready;
  group->join_abandon_ = nullptr;
  return group;
}

NcclGroup::~NcclGroup() {
  if (aborted_ || comm_ == nullptr) return;
  cudaSetDevice(device_);
  if (abort_requested_) {
    ncclCommAbort(comm_);
    return;
  }
  // Flush and free; a teardown that fails or cannot finish in time aborts instead.
  ncclResult_t state = ncclCommFinalize(comm_);
  const absl::Time deadline = absl::Now() + kFinalizeTimeout;
  while ((state == ncclSuccess || state == ncclInProgress) && absl::Now() < deadline) {
    if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) break;
    if (state == ncclSuccess) {
      ncclCommDestroy(comm_);
      return;
    }
    absl::SleepFor(kPoll);
  }
  ncclCommAbort(comm_);
}

absl::Status NcclGroup::Usable(const char* op) {
  if (aborted_) {
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: ", op, ": the group was aborted; make a new one"));
  }
  if (abort_requested_) {
    return AbortWith(absl::AbortedError(absl::StrCat("nccl: ", op, ": aborted on request")));
  }
  if (cudaError_t err = cudaSetDevice(device_); err != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("nccl: ", op, ": ", cudaGetErrorString(err)));
  }
  return absl::OkStatus();
}

absl::Status NcclGroup::AbortWith(absl::Status why) {
  if (!aborted_) {
    ncclCommAbort(comm_);
    aborted_ = true;
  }
  return why;
}

absl::Status NcclGroup::Error(int result, const char* op) {
  const auto r = static_cast<ncclResult_t>(result);
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  const char* last = ncclGetLastError(comm_);
  const bool detail = last != nullptr && *last != '\0';
  return absl::InternalError(
      absl::StrCat("nccl: ", op, ": ", NcclError(r), detail ? ": " : "", detail ? last : ""));
}

absl::Status NcclGroup::Check(int result, const char* op) {
  absl::Status st = Error(result, op);
  return st.ok() ? st : AbortWith(std::move(st));
}

absl::Status NcclGroup::Poll(const char* op, bool* in_progress) {
  ncclResult_t state = ncclSuccess;
  if (ncclResult_t r = ncclCommGetAsyncError(comm_, &state); r != ncclSuccess) {
    return Check(r, op);
  }
  *in_progress = state == ncclInProgress;
  return state == ncclSuccess || *in_progress ? absl::OkStatus() : Check(state, op);
}

absl::Status NcclGroup::StopIfDue(const char* op, absl::Time deadline) {
  if (abort_requested_ || (join_abandon_ != nullptr && join_abandon_->load())) {
    return AbortWith(absl::AbortedError(absl::StrCat("nccl: ", op, ": aborted on request")));
  }
  if (absl::Now() >= deadline) {
    return AbortWith(absl::DeadlineExceededError(
        absl::StrCat("nccl: ", op, ": not done by its deadline; the group was aborted")));
  }
  return absl::OkStatus();
}

absl::Status NcclGroup::WaitReady(const char* op, absl::Time deadline) {
  while (true) {
    bool in_progress = false;
    if (absl::Status st = Poll(op, &in_progress); !st.ok() || !in_progress) return st;
    if (absl::Status st = StopIfDue(op, deadline); !st.ok()) return st;
    absl::SleepFor(kPoll);
  }
}

absl::Status NcclGroup::WaitStream(CUstream_st* stream, const char* op, absl::Time deadline) {
  Event done;
  if (!done.created() || cudaEventRecord(done.get(), stream) != cudaSuccess) {
    cudaGetLastError();
    return AbortWith(absl::InternalError(absl::StrCat("nccl: ", op, ": cannot record an event")));
  }
  while (true) {
    const cudaError_t q = cudaEventQuery(done.get());
    if (q == cudaSuccess) return WaitReady(op, deadline);
    if (q != cudaErrorNotReady) {
      return AbortWith(
          absl::InternalError(absl::StrCat("nccl: ", op, ": ", cudaGetErrorString(q))));
    }
    bool in_progress = false;
    if (absl::Status st = Poll(op, &in_progress); !st.ok()) return st;
    if (absl::Status st = StopIfDue(op, deadline); !st.ok()) return st;
    absl::SleepFor(kPoll);
  }
}

absl::Status NcclGroup::AllReduceSum(float* data, size_t n, CUstream_st* stream,
                                     absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  if (absl::Status usable = Usable("AllReduceSum"); !usable.ok()) return usable;
  if (n == 0) return absl::OkStatus();
  if (absl::Status st =
          Check(ncclAllReduce(data, data, n, ncclFloat32, ncclSum, comm_, stream), "AllReduceSum");
      !st.ok()) {
    return st;
  }
  if (absl::Status st = WaitReady("AllReduceSum", deadline); !st.ok()) return st;
  return WaitStream(stream, "AllReduceSum", deadline);
}

absl::Status NcclGroup::Exchange(absl::Span<const Transfer> sends, absl::Span<const Transfer> recvs,
                                 CUstream_st* stream, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  if (absl::Status usable = Usable("Exchange"); !usable.ok()) return usable;
  for (const auto* list : {&sends, &recvs}) {
    for (const Transfer& t : *list) {
      if (t.peer < 0 || t.peer >= world_) {
        return absl::InvalidArgumentError(
            absl::StrCat("nccl: Exchange: peer ", t.peer, " in a group of ", world_));
      }
    }
  }
  // Non-blocking: the calls inside the group only enqueue; ncclGroupEnd issues them. The
  // group is always closed before an error aborts the communicator.
  if (absl::Status st = Check(ncclGroupStart(), "Exchange"); !st.ok()) return st;
  absl::Status issued = absl::OkStatus();
  for (const Transfer& t : sends) {
    if (t.bytes > 0 && issued.ok()) {
      issued = Error(ncclSend(t.data, t.bytes, ncclUint8, t.peer, comm_, stream), "Exchange");
    }
  }
  for (const Transfer& t : recvs) {
    if (t.bytes > 0 && issued.ok()) {
      issued = Error(ncclRecv(t.data, t.bytes, ncclUint8, t.peer, comm_, stream), "Exchange");
    }
  }
  const ncclResult_t end = ncclGroupEnd();
  if (!issued.ok()) return AbortWith(std::move(issued));
  if (absl::Status st = Check(end, "Exchange"); !st.ok()) return st;
  if (absl::Status st = WaitReady("Exchange", deadline); !st.ok()) return st;
  return WaitStream(stream, "Exchange", deadline);
}

namespace {

class NcclDeviceGroup final : public compute::DeviceGroup {
 public:
  NcclDeviceGroup(std::unique_ptr<NcclGroup> group, CUstream_st* stream)
      : group_(std::move(group)), stream_(stream) {}
  absl::Status AllReduceSum(float* data, size_t n, absl::Duration timeout) override {
    return group_->AllReduceSum(data, n, stream_, timeout);
  }
  absl::Status Exchange(absl::Span<const compute::DeviceTransfer> sends,
                        absl::Span<const compute::DeviceTransfer> recvs,
                        absl::Duration timeout) override {
    return group_->Exchange(sends, recvs, stream_, timeout);
  }
  void RequestAbort() override { group_->RequestAbort(); }

 private:
  std::unique_ptr<NcclGroup> group_;
  CUstream_st* stream_;
};

}  // namespace

std::unique_ptr<compute::DeviceGroup> AsDeviceGroup(std::unique_ptr<NcclGroup> group,
                                                    CUstream_st* stream) {
  return std::make_unique<NcclDeviceGroup>(std::move(group), stream);
}

}  // namespace pith::cuda
