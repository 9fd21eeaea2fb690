// DeviceSlots: the device side of the expert cache (DESIGN §2, "CUDA"): fixed slots of one
// expert blob each in one device allocation (no allocation per fetch), filled from host
// staging by cudaMemcpyAsync on a copy stream of their own, so that a fetch overlaps the
// compute stream's work. Each upload records an event; MakeVisible makes a compute stream
// wait for it on the device (cudaStreamWaitEvent), never on the host; Release makes the
// next upload into a slot wait for the compute that read it, on the device too.
//
// The staging is the host memory a fetch lands in: the worker's UCX-registered cache
// slots. RegisterStaging page-locks it for CUDA too (cudaHostRegister), so the copy is a
// DMA from it with no bounce through a driver buffer. Debian's UCX has no CUDA transport;
// a CUDA-aware UCX would put the bytes straight into the device slot instead (GPUDirect
// RDMA), and this staging step would go.
//
// Errors: every CUDA call's failure is a Status naming the op. Thread safety: one thread
// at a time (the worker's compute thread); not thread-safe.
#ifndef PITH_WORKER_CUDA_DEVICE_SLOTS_H_
#define PITH_WORKER_CUDA_DEVICE_SLOTS_H_

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/compute/backend.h"

struct CUstream_st;
struct CUevent_st;

namespace pith::cuda {

class DeviceSlots {
 public:
  // `slots` slots of `slot_bytes` on device `device` (one cudaMalloc). RESOURCE_EXHAUSTED
  // when the device cannot hold them; INVALID_ARGUMENT for no slots or empty ones.
  static absl::StatusOr<std::unique_ptr<DeviceSlots>> Create(int device, size_t slot_bytes,
                                                             int slots);
  ~DeviceSlots();  // waits for the uploads in flight, then frees the arena and staging
  DeviceSlots(const DeviceSlots&) = delete;
  DeviceSlots& operator=(const DeviceSlots&) = delete;

  int slots() const { return static_cast<int>(events_.size() / 2); }
  size_t slot_bytes() const { return slot_bytes_; }
  void* slot(int i) const { return static_cast<char*>(arena_) + slot_bytes_ * i; }

  // Page-locks [host, host + bytes) for CUDA until this object goes (the worker's
  // UCX-registered cache memory). Uploads from memory that is not registered still work,
  // through the driver's staging, slower.
  absl::Status RegisterStaging(void* host, size_t bytes);

  // Starts copying `bytes` (<= slot_bytes) from `host` into slot `i` on the copy stream.
  // `host` must stay unchanged until the upload is done (Wait, or an op that MakeVisible
  // ordered after it).
  absl::Status Upload(int i, const void* host, size_t bytes);
  // Starts copying `bytes` of slot `i` into `host` on the copy stream, once the compute
  // that Release marked as the slot's last is done. `host` holds them once the copy is
  // done (WaitSlot, Wait); the next writer of the slot waits for it (MakeVisible).
  absl::Status Download(int i, void* host, size_t bytes);
  // Orders `compute`'s later work after slot i's last copy (upload or download), on the
  // device.
  absl::Status MakeVisible(int i, CUstream_st* compute);
  // Marks the work issued on `compute` so far as the last to touch slot i: the next Upload
  // into it or Download from it waits for that work on the device, so a slot is never
  // refilled under a kernel still reading it, nor read before a kernel wrote it. Call it
  // after the last op that touches the slot, before its next copy.
  absl::Status Release(int i, CUstream_st* compute);
  // Waits on the host for slot i's last copy.
  absl::Status WaitSlot(int i);
  // Waits on the host for every copy issued so far.
  absl::Status Wait();

 private:
  DeviceSlots(int device, size_t slot_bytes, void* arena, CUstream_st* copy,
              std::vector<CUevent_st*> events);
  // Upload (`up`) or Download: `bytes` between slot i and `host` on the copy stream,
  // after the slot's Release, recording the slot's copy event.
  absl::Status Copy(int i, size_t bytes, bool up, void* host);

  int device_;
  size_t slot_bytes_;
  void* arena_;
  CUstream_st* copy_;
  std::vector<CUevent_st*> events_;  // [slot]: its last copy; [slots + slot]: its release
  std::vector<void*> registered_;    // host ranges this object page-locked
};

// The cluster worker's device copies of its cache slots, or device buffers for its
// gradient pool (compute::SlotMirror), on DeviceSlots: copies on the copy stream, made
// visible to and released after `compute` (the CUDA backend's stream): up to `slots` of
// them, as many as half the device's free memory holds, at least 2. The host memory is
// page-locked for the copies where CUDA allows it (else the copies go through the
// driver's staging, slower and synchronous, with a warning).
// `held` counts the slots' bytes while the mirror lives (the backend's device_bytes).
absl::StatusOr<std::unique_ptr<compute::SlotMirror>> MakeCudaSlotMirror(
    int device, CUstream_st* compute, size_t slot_bytes, int slots, void* host, size_t host_bytes,
    std::shared_ptr<std::atomic<uint64_t>> held);

}  // namespace pith::cuda

#endif  // PITH_WORKER_CUDA_DEVICE_SLOTS_H_
