// DeviceSlots: see device_slots.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "worker/cuda/device_slots.h"

namespace pith::cuda {
namespace {

absl::Status Check(cudaError_t err, const char* op) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // the failures here are not sticky: clear them
  const std::string what = absl::StrCat("device slots: ", op, ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(what);
  if (err == cudaErrorInvalidValue) return absl::InvalidArgumentError(what);
  return absl::InternalError(what);
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceSlots>> DeviceSlots::Create(int device, size_t slot_bytes,
                                                                 int slots) {
  if (slots < 1 || slot_bytes == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device slots: ", slots, " slots of ", slot_bytes, " bytes"));
  }
  if (absl::Status st = Check(cudaSetDevice(device), "cudaSetDevice"); !st.ok()) return st;
  void* arena = nullptr;
  if (absl::Status st =
          Check(cudaMalloc(&arena, slot_bytes * slots),
                absl::StrCat("cudaMalloc(", slots, " x ", slot_bytes, " bytes)").c_str());
      !st.ok()) {
    return st;
  }
  cudaStream_t copy = nullptr;
  std::vector<CUevent_st*> events;
  absl::Status made =
      Check(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int i = 0; made.ok() && i < 2 * slots; ++i) {  // each slot's upload and release
    cudaEvent_t e = nullptr;
    made.Update(Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate"));
    if (made.ok()) events.push_back(e);
  }
  if (!made.ok()) {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (copy != nullptr) cudaStreamDestroy(copy);
    cudaFree(arena);
    return made;
  }
  return std::unique_ptr<DeviceSlots>(
      new DeviceSlots(device, slot_bytes, arena, copy, std::move(events)));
}

DeviceSlots::DeviceSlots(int device, size_t slot_bytes, void* arena, CUstream_st* copy,
                         std::vector<CUevent_st*> events)
    : device_(device),
      slot_bytes_(slot_bytes),
      arena_(arena),
      copy_(copy),
      events_(std::move(events)) {}

DeviceSlots::~DeviceSlots() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(copy_);
  for (void* host : registered_) cudaHostUnregister(host);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  cudaStreamDestroy(copy_);
  cudaFree(arena_);
}

absl::Status DeviceSlots::RegisterStaging(void* host, size_t bytes) {
  if (absl::Status st = Check(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
  if (absl::Status st =
          Check(cudaHostRegister(host, bytes, cudaHostRegisterDefault), "cudaHostRegister");
      !st.ok()) {
    return st;
  }
  registered_.push_back(host);
  return absl::OkStatus();
}

absl::Status DeviceSlots::Upload(int i, const void* host, size_t bytes) {
  return Copy(i, bytes, /*up=*/true, const_cast<void*>(host));
}

absl::Status DeviceSlots::Download(int i, void* host, size_t bytes) {
  return Copy(i, bytes, /*up=*/false, host);
}

absl::Status DeviceSlots::Copy(int i, size_t bytes, bool up, void* host) {
  const char* op = up ? "Upload" : "Download";
  if (i < 0 || i >= slots() || bytes > slot_bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("device slots: ", op, " of ", bytes,
                                                   " bytes, slot ", i, " of ", slots(),
                                                   " slots of ", slot_bytes_, " bytes"));
  }
  if (absl::Status st = Check(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
  // Not before the compute that last touched the slot is done (a no-op before any
  // Release).
  if (absl::Status st = Check(cudaStreamWaitEvent(copy_, events_[slots() + i], 0),
                              absl::StrCat(op, " (cudaStreamWaitEvent)").c_str());
      !st.ok()) {
    return st;
  }
  const cudaError_t copied =
      up ? cudaMemcpyAsync(slot(i), host, bytes, cudaMemcpyHostToDevice, copy_)
         : cudaMemcpyAsync(host, slot(i), bytes, cudaMemcpyDeviceToHost, copy_);
  if (absl::Status st = Check(copied, absl::StrCat(op, " (cudaMemcpyAsync)").c_str()); !st.ok()) {
    return st;
  }
  return Check(cudaEventRecord(events_[i], copy_), absl::StrCat(op, " (cudaEventRecord)").c_str());
}

absl::Status DeviceSlots::WaitSlot(int i) {
  if (i < 0 || i >= slots()) {
    return absl::InvalidArgumentError(absl::StrCat("device slots: no slot ", i));
  }
  if (absl::Status st = Check(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
  return Check(cudaEventSynchronize(events_[i]), "WaitSlot (cudaEventSynchronize)");
}

absl::Status DeviceSlots::MakeVisible(int i, CUstream_st* compute) {
  if (i < 0 || i >= slots()) {
    return absl::InvalidArgumentError(absl::StrCat("device slots: no slot ", i));
  }
  if (absl::Status st = Check(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
  return Check(cudaStreamWaitEvent(compute, events_[i], 0), "MakeVisible (cudaStreamWaitEvent)");
}

absl::Status DeviceSlots::Release(int i, CUstream_st* compute) {
  if (i < 0 || i >= slots()) {
    return absl::InvalidArgumentError(absl::StrCat("device slots: no slot ", i));
  }
  if (absl::Status st = Check(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
  return Check(cudaEventRecord(events_[slots() + i], compute), "Release (cudaEventRecord)");
}

namespace {

class CudaSlotMirror final : public compute::SlotMirror {
 public:
  CudaSlotMirror(std::unique_ptr<DeviceSlots> slots, CUstream_st* compute,
                 std::shared_ptr<std::atomic<uint64_t>> held)
      : slots_(std::move(slots)), compute_(compute), held_(std::move(held)) {
    *held_ += bytes();
  }
  ~CudaSlotMirror() override { *held_ -= bytes(); }
  absl::Status Upload(int i, const void* host, size_t bytes) override {
    ++uploads_;
    return slots_->Upload(i, host, bytes);
  }
  absl::Status Download(int i, void* host, size_t bytes) override {
    ++downloads_;
    return slots_->Download(i, host, bytes);
  }
  absl::StatusOr<void*> Use(int i) override {
    if (absl::Status st = slots_->MakeVisible(i, compute_); !st.ok()) return st;
    return slots_->slot(i);
  }
  absl::Status Release(int i) override { return slots_->Release(i, compute_); }
  absl::Status WaitSlot(int i) override { return slots_->WaitSlot(i); }
  absl::Status WaitCopies() override { return slots_->Wait(); }
  uint64_t uploads() const override { return uploads_; }
  uint64_t downloads() const override { return downloads_; }
  int slots() const override { return slots_->slots(); }

 private:
  uint64_t bytes() const { return uint64_t{slots_->slot_bytes()} * slots_->slots(); }

  std::unique_ptr<DeviceSlots> slots_;
  CUstream_st* compute_;
  std::shared_ptr<std::atomic<uint64_t>> held_;
  uint64_t uploads_ = 0, downloads_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<compute::SlotMirror>> MakeCudaSlotMirror(
    int device, CUstream_st* compute, size_t slot_bytes, int slots, void* host, size_t host_bytes,
    std::shared_ptr<std::atomic<uint64_t>> held) {
  // At most half the device's free memory (the rest for activations and scratch), and at
  // least 2 slots (else the error says the device is full).
  if (absl::Status st = Check(cudaSetDevice(device), "cudaSetDevice"); !st.ok()) return st;
  size_t free_bytes = 0, total_bytes = 0;
  if (absl::Status st = Check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      !st.ok()) {
    return st;
  }
  const size_t room = free_bytes / 2 / std::max<size_t>(slot_bytes, 1);
  slots = static_cast<int>(std::max<size_t>(2, std::min<size_t>(slots, room)));
  absl::StatusOr<std::unique_ptr<DeviceSlots>> made =
      DeviceSlots::Create(device, slot_bytes, slots);
  if (!made.ok()) return made.status();
  if (absl::Status st = (*made)->RegisterStaging(host, host_bytes); !st.ok()) {
    // No glog in the GPU-only build: one line on stderr, as glog's warnings go there too.
    std::fprintf(stderr,
                 "W slot mirror: the host memory stays pageable for the device copies: %s\n",
                 st.ToString().c_str());
  }
  return std::unique_ptr<compute::SlotMirror>(
      new CudaSlotMirror(std::move(*made), compute, std::move(held)));
}

absl::Status DeviceSlots::Wait() {
  if (absl::Status st = Check(cudaSetDevice(device_), "cudaSetDevice"); !st.ok()) return st;
  return Check(cudaStreamSynchronize(copy_), "Wait (cudaStreamSynchronize)");
}

}  // namespace pith::cuda
