#include "worker/runtime/memory_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pith::runtime {
namespace {

// The gradient pool beside a bounded cache of `slots` slots.
int GradBuffers(int slots) { return std::max(2, slots / 2); }

// Experts' worth of memory the pools take for a cache of `slots` slots (scratch moments:
// two buffers, m and v, per expert of each ring segment).
int64_t PoolUnits(int slots) {
  const MomentPlan m = PlanMoments(slots, /*resident=*/false);
  return slots + GradBuffers(slots) + 2 * int64_t{m.ring} * m.batch;
}

MemoryPlan Finish(const MemoryInput& in, MemoryPlan p) {
  p.dense_bytes = in.dense_bytes;
  p.activation_bytes = in.activation_bytes;
  p.cache_bytes = in.expert_bytes * p.cache_slots;
  p.gradient_bytes = in.expert_bytes * p.grad_buffers;
  p.moment_bytes = in.expert_bytes * 2 * p.moments.Buffers(in.updated);
  return p;
}

}  // namespace

MomentPlan PlanMoments(int slots, bool resident) {
  MomentPlan m;
  m.resident = resident;
  m.batch = resident ? std::clamp(slots / 2, 1, 8) : std::clamp(slots / 8, 1, 4);
  m.ring = resident ? 1 : std::clamp(slots / 2 / m.batch, 2, 4);
  return m;
}

absl::StatusOr<MemoryPlan> PlanMemory(const MemoryInput& in) {
  const int all_slots = in.owned + 1;
  const int64_t resident_units = int64_t{all_slots} * 2 + 2 * int64_t{in.updated};
  MemoryPlan p;
  if (in.memory_bytes == 0 && in.cache_bytes == 0) {  // no budget: everything resident
    p.cache_slots = std::max(all_slots, 2);
    p.grad_buffers = p.cache_slots;
    p.moments = PlanMoments(p.cache_slots, true);
    return Finish(in, p);
  }
  if (in.memory_bytes == 0) {  // a cache budget
    const int64_t units =
        static_cast<int64_t>(in.cache_bytes / std::max<uint64_t>(1, in.expert_bytes));
    p.cache_slots = static_cast<int>(std::max<int64_t>(2, std::min<int64_t>(all_slots, units)));
    p.grad_buffers = p.cache_slots;
    const bool resident =
        in.cache_bytes >= in.expert_bytes * static_cast<uint64_t>(in.owned + 1 + 2 * in.updated);
    p.moments = PlanMoments(p.cache_slots, resident);
    return Finish(in, p);
  }
  const uint64_t fixed = in.dense_bytes + in.activation_bytes;
  const uint64_t smallest = in.expert_bytes * static_cast<uint64_t>(PoolUnits(2));
  if (in.memory_bytes < fixed + smallest) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the job does not fit this worker's --memory_bytes=", in.memory_bytes,
        ": its dense state (", in.dense_bytes,
        " bytes: parameters, gradients and moments) and activations (", in.activation_bytes,
        " bytes) leave ", in.memory_bytes > fixed ? in.memory_bytes - fixed : 0,
        " bytes for experts, which need ", smallest, " at least (", PoolUnits(2), " experts of ",
        in.expert_bytes, " bytes)"));
  }
  const int64_t units = static_cast<int64_t>((in.memory_bytes - fixed) / in.expert_bytes);
  if (units >= resident_units) {
    p.cache_slots = std::max(all_slots, 2);
    p.grad_buffers = p.cache_slots;
    p.moments = PlanMoments(p.cache_slots, true);
    return Finish(in, p);
  }
  int slots = 2;
  while (slots < all_slots && PoolUnits(slots + 1) <= units) ++slots;
  p.cache_slots = slots;
  p.grad_buffers = GradBuffers(slots);
  p.moments = PlanMoments(slots, false);
  return Finish(in, p);
}

}  // namespace pith::runtime
