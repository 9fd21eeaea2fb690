// NcclGroup: one NCCL communicator among the GPU workers of a job (DESIGN §2), for the
// dense all-reduce and the grouped point-to-point exchange of token rows, on the caller's
// stream. Made per placement epoch: rank 0 makes an id (NewId), the job's peer group
// carries it to the others (PeerGroup::Broadcast), and every rank Joins.
//
// Never a hang: the communicator is non-blocking, and every call waits for its work with
// a deadline (which also covers the work queued on the stream before it). A deadline that passes,
// an asynchronous NCCL error, or RequestAbort() aborts the communicator (ncclCommAbort, which also
// ends the kernels in flight): the call returns DEADLINE_EXCEEDED, INTERNAL or ABORTED, and the
// group refuses every later call (FAILED_PRECONDITION); the job makes a new one for its next
// attempt. After a failed call the caller synchronizes its stream before it frees the call's
// buffers.
//
// Thread safety: one thread at a time, except RequestAbort(), which any thread may call
// (a step's abort watch): the waiting thread sees it and aborts.
#ifndef PITH_WORKER_CUDA_NCCL_GROUP_H_
#define PITH_WORKER_CUDA_NCCL_GROUP_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "worker/compute/backend.h"

struct CUstream_st;
struct ncclComm;

namespace pith::cuda {

class NcclGroup {
 public:
  // A new communicator id (128 bytes), made once per group by its rank 0.
  static absl::StatusOr<std::string> NewId();
  // Joins the group `id` as `rank` of `world` on CUDA device `device`; waits until every
  // rank has joined, at most `timeout`, or until `*abandon` (when given) is set: ABORTED.
  static absl::StatusOr<std::unique_ptr<NcclGroup>> Join(
      const std::string& id, int rank, int world, int device, absl::Duration timeout,
      const std::atomic<bool>* abandon = nullptr);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool aborted() const { return aborted_; }

  // Sums `n` floats of device memory across the group, in place, on `stream`; returns once
  // the sum is there.
  absl::Status AllReduceSum(float* data, size_t n, CUstream_st* stream, absl::Duration timeout);

  // One grouped exchange: each send goes to its peer, each receive comes from its peer
  // (device memory; a peer may be this rank). Empty transfers are skipped, so pairs with
  // nothing to say cost nothing; both sides must agree on every non-empty pair's size.
  using Transfer = compute::DeviceTransfer;
  absl::Status Exchange(absl::Span<const Transfer> sends, absl::Span<const Transfer> recvs,
                        CUstream_st* stream, absl::Duration timeout);

  // Asks the thread inside a call to abort the communicator now, or the next call to
  // abort it before it issues anything (any thread). A Join in progress ends at its
  // deadline or its `abandon`.
  void RequestAbort() { abort_requested_ = true; }

 private:
  NcclGroup(ncclComm* comm, int rank, int world, int device)
      : comm_(comm), rank_(rank), world_(world), device_(device) {}
  // FAILED_PRECONDITION once aborted; binds the device.
  absl::Status Usable(const char* op);
  // An NCCL call's result: OK for success and in-progress, else the error naming `op`.
  absl::Status Error(int result, const char* op);
  // Error(), aborting the communicator on an error (never between ncclGroupStart and End).
  absl::Status Check(int result, const char* op);
  // The communicator's state: an error (aborting), or OK with whether it is in progress.
  absl::Status Poll(const char* op, bool* in_progress);
  // A wait's end when it is due: an abort was asked for, or `deadline` passed (aborting
  // either way); else OK.
  absl::Status StopIfDue(const char* op, absl::Time deadline);
  // Waits until the communicator is no longer in progress (non-blocking calls return
  // before they are done), at most until `deadline`.
  absl::Status WaitReady(const char* op, absl::Time deadline);
  // Waits for the work issued so far on `stream`, watching the communicator's errors.
  absl::Status WaitStream(CUstream_st* stream, const char* op, absl::Time deadline);
  // Aborts the communicator and returns `why`.
  absl::Status AbortWith(absl::Status why);

  ncclComm* comm_;
  int rank_, world_, device_;
  bool aborted_ = false;
  std::atomic<bool> abort_requested_{false};
  const std::atomic<bool>* join_abandon_ = nullptr;  // during Join only
};

// The CUDA backend's compute::DeviceGroup: `group`'s sums and exchanges on `stream` (the
// backend's).
std::unique_ptr<compute::DeviceGroup> AsDeviceGroup(std::unique_ptr<NcclGroup> group,
                                                    CUstream_st* stream);

}  // namespace pith::cuda

#endif  // PITH_WORKER_CUDA_NCCL_GROUP_H_
