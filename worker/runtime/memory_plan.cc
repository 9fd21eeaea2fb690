#include "worker/runtime/memory_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pith::runtime {
namespace {

// The gradient pool beside a bounded cache of `slots` slots.
int GradBuffers(int slots) { return std::max(2, slots / 2); }

uint64_t SlotBytes(const MemoryInput& in) {
  return in.slot_bytes > 0 ? in.slot_bytes : in.expert_bytes;
}

// The bytes the pools take for a cache of `slots` slots (scratch moments: moment_kinds
// buffers per expert of each ring segment).
uint64_t PoolBytes(const MemoryInput& in, int slots) {
  const MomentPlan m = PlanMoments(slots, /*resident=*/false);
  return SlotBytes(in) * slots +
         in.expert_bytes * (GradBuffers(slots) + uint64_t(in.moment_kinds) * m.ring * m.batch);
}

MemoryPlan Finish(const MemoryInput& in, MemoryPlan p) {
  p.dense_bytes = in.dense_bytes;
  p.activation_bytes = in.activation_bytes;
  p.cache_bytes = SlotBytes(in) * p.cache_slots;
  p.gradient_bytes = in.expert_bytes * p.grad_buffers;
  p.moment_bytes = in.expert_bytes * in.moment_kinds * p.moments.Buffers(in.updated);
  return p;
}

}  // namespace

MemoryInput MemoryNeedsOf(const model::ModelShape& shape, uint64_t memory_bytes,
                          uint64_t cache_bytes, int64_t dense_floats, int64_t activation_bytes,
                          int owned, int updated) {
  MemoryInput in;
  in.memory_bytes = memory_bytes;
  in.cache_bytes = cache_bytes;
  in.dense_bytes = 4 * static_cast<uint64_t>(dense_floats) * sizeof(float);
  in.activation_bytes = static_cast<uint64_t>(activation_bytes);
  in.expert_bytes = static_cast<uint64_t>(shape.expert_floats()) * sizeof(float);
  in.slot_bytes = static_cast<uint64_t>(shape.expert_blob_bytes());
  in.moment_kinds = shape.compute_dtype == ComputeDtype::kBf16 ? 3 : 2;
  in.owned = owned;
  in.updated = updated;
  return in;
}

MomentPlan PlanMoments(int slots, bool resident) {
  MomentPlan m;
  m.resident = resident;
  m.batch = resident ? std::clamp(slots / 2, 1, 8) : std::clamp(slots / 8, 1, 4);
  m.ring = resident ? 1 : std::clamp(slots / 2 / m.batch, 2, 4);
  return m;
}

absl::StatusOr<MemoryPlan> PlanMemory(const MemoryInput& in) {
  const int all_slots = in.owned + 1;
  const uint64_t slot = std::max<uint64_t>(1, SlotBytes(in));
  // Everything resident: a slot and a gradient per expert computed (and one spare), the
  // moments of every expert updated.
  const uint64_t resident_bytes =
      (slot + in.expert_bytes) * static_cast<uint64_t>(all_slots) +
      in.expert_bytes * uint64_t(in.moment_kinds) * static_cast<uint64_t>(in.updated);
  MemoryPlan p;
  if (in.memory_bytes == 0 && in.cache_bytes == 0) {  // no budget: everything resident
    p.cache_slots = std::max(all_slots, 2);
    p.grad_buffers = p.cache_slots;
    p.moments = PlanMoments(p.cache_slots, true);
    return Finish(in, p);
  }
  if (in.memory_bytes == 0) {  // a cache budget
    const int64_t units = static_cast<int64_t>(in.cache_bytes / slot);
    p.cache_slots = static_cast<int>(std::max<int64_t>(2, std::min<int64_t>(all_slots, units)));
    p.grad_buffers = p.cache_slots;
    // The moments stay resident when the budget holds them beside the slots.
    const bool resident = in.cache_bytes >= slot * static_cast<uint64_t>(in.owned + 1) +
                                                in.expert_bytes * uint64_t(in.moment_kinds) *
                                                    static_cast<uint64_t>(in.updated);
    p.moments = PlanMoments(p.cache_slots, resident);
    return Finish(in, p);
  }
  const uint64_t fixed = in.dense_bytes + in.activation_bytes;
  const uint64_t smallest = PoolBytes(in, 2);
  if (in.memory_bytes < fixed + smallest) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job does not fit this worker's --memory_bytes=", in.memory_bytes,
        ": its dense state (", in.dense_bytes,
        " bytes: parameters, gradients and moments) and activations (", in.activation_bytes,
        " bytes) leave ", in.memory_bytes > fixed ? in.memory_bytes - fixed : 0,
        " bytes for experts, which need ", smallest, " at least (2 cache slots of ", slot,
        " bytes, gradients and moments of experts of ", in.expert_bytes, " bytes)"));
  }
  const uint64_t room = in.memory_bytes - fixed;
  // A cache budget as well (the worker's --cache_bytes, or the job's cluster.cache_bytes)
  // caps the slots within the memory budget.
  const int cap =
      in.cache_bytes == 0
          ? all_slots
          : static_cast<int>(std::clamp<int64_t>(static_cast<int64_t>(in.cache_bytes / slot), 2,
                                                 std::max(all_slots, 2)));
  if (room >= resident_bytes && cap >= all_slots) {
    p.cache_slots = std::max(all_slots, 2);
    p.grad_buffers = p.cache_slots;
    p.moments = PlanMoments(p.cache_slots, true);
    return Finish(in, p);
  }
  int slots = 2;
  while (slots < std::min(all_slots, cap) && PoolBytes(in, slots + 1) <= room) ++slots;
  p.cache_slots = slots;
  p.grad_buffers = GradBuffers(slots);
  // Resident moments where all of them fit, and where the cache has a slot for every
  // expert updated here and one more: their writes go with every updated slot held while
  // the next step computes (ExpertUpdater's kAll).
  p.moments = PlanMoments(slots, room >= resident_bytes && slots > in.updated);
  return Finish(in, p);
}

}  // namespace pith::runtime
