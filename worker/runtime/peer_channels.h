// Every message channel between the workers of one job (DESIGN §6), in one place. A
// PeerGroup message is tagged with 64 bits, unique within an attempt; the step owns the
// high 32, one channel bit (or none) and a channel's own index share the low 32:
//
//   bits 63..32  the step
//   bit  31      Dispatch's all-reduces of routing statistics; bits 15..0: their sequence
//   bit  30      the dense gradients' all-reduce; tag | 1: the global grad norm's
//   bit  29      a replica expert's gradient to its primary; low bits: layer * E + expert
//   bit  28      the barrier before a step reads replica experts from the stores
//   none         Dispatch's token exchange; bits 27..8: the layer, 7..0: the phase
//
// Messages of a job run's setup, before any step, take the step 2^32 - 1, which no step
// reaches: the device group's id (low bits 1) and every rank's word on its join (2).
//
// A new channel takes a bit of its own here, so no two tags of one step can meet.
//
// Thread safety: constants and pure functions only.
#ifndef PITH_WORKER_RUNTIME_PEER_CHANNELS_H_
#define PITH_WORKER_RUNTIME_PEER_CHANNELS_H_

#include <cstdint>

namespace pith::runtime::channels {

inline constexpr uint64_t kDispatchReduceBit = 1ull << 31;
inline constexpr uint64_t kDispatchReduceSeqMask = 0xffff;
inline constexpr uint64_t kDenseGradientBit = 1ull << 30;
inline constexpr uint64_t kGradNormIndex = 1;  // on the dense gradients' channel
inline constexpr uint64_t kReplicaGradientBit = 1ull << 29;
inline constexpr uint64_t kReplicaBarrierBit = 1ull << 28;
inline constexpr int kDispatchLayerShift = 8;

// The step's share of every tag.
constexpr uint64_t StepBits(int64_t step) { return static_cast<uint64_t>(step) << 32; }

// Dispatch: the token rows of `layer` in `phase` (Dispatch's phases, below 256).
constexpr uint64_t DispatchExchange(int64_t step, int layer, int phase) {
  return StepBits(step) | (static_cast<uint64_t>(layer) << kDispatchLayerShift) |
         static_cast<uint64_t>(phase);
}
// Dispatch: the step's `seq`-th all-reduce of routing statistics.
constexpr uint64_t DispatchReduce(int64_t step, uint64_t seq) {
  return StepBits(step) | kDispatchReduceBit | (seq & kDispatchReduceSeqMask);
}
// The sum of the dense gradients of step `step`.
constexpr uint64_t DenseGradients(int64_t step) { return StepBits(step) | kDenseGradientBit; }
// The sum of the squared gradients (the global grad norm) of step `step`.
constexpr uint64_t GradNorm(int64_t step) { return DenseGradients(step) | kGradNormIndex; }
// A replica's gradient of expert `index` (layer * E + expert) to its primary owner.
constexpr uint64_t ReplicaGradient(int64_t step, int64_t index) {
  return StepBits(step) | kReplicaGradientBit | static_cast<uint64_t>(index);
}
// Every worker's writes of the step before `step` are in the stores.
constexpr uint64_t ReplicaBarrier(int64_t step) { return StepBits(step) | kReplicaBarrierBit; }
// Setup: rank 0's device group id, then the count of ranks that joined it.
inline constexpr uint64_t kSetupBits = 0xffffffffull << 32;
constexpr uint64_t DeviceGroupId() { return kSetupBits | 1; }
constexpr uint64_t DeviceGroupJoined() { return kSetupBits | 2; }

// The tags as they were spelled before this header (the wire protocol did not change).
static_assert(DispatchExchange(5, 3, 2) == ((5ull << 32) | (3ull << 8) | 2));
static_assert(DispatchReduce(5, 0x1ffff) == ((5ull << 32) | (1ull << 31) | 0xffff));
static_assert(GradNorm(5) == ((5ull << 32) | (1ull << 30) | 1));
static_assert(ReplicaGradient(5, 7) == ((5ull << 32) | (1ull << 29) | 7));
static_assert(ReplicaBarrier(5) == ((5ull << 32) | (1ull << 28)));

}  // namespace pith::runtime::channels

#endif  // PITH_WORKER_RUNTIME_PEER_CHANNELS_H_
