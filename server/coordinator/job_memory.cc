#include "server/coordinator/job_memory.h"

#include <algorithm>

#include "common/step_protocol.h"

namespace pith::coordinator {
namespace {

// Measured (job_memory_test prints them against the allocator) and rounded up.
constexpr uint64_t kJobBytes = 2 << 20;     // records, spec, the dense group, store writes
constexpr uint64_t kGroupBytes = 1152;      // placement entry, heat, written-blob keys
constexpr uint64_t kGroupCopyBytes = 160;   // each store copy of a group
constexpr uint64_t kGroupReportBytes = 48;  // each worker's count for a group
constexpr uint64_t kPairBytes = 48;         // a co-activated pair's weight
constexpr uint64_t kPairReportBytes = 16;   // each worker's count for a pair

}  // namespace

uint64_t JobStateBytes(const v1::JobSpec& spec) {
  const uint64_t layers = static_cast<uint64_t>(std::max(0, spec.model().n_layer()));
  const uint64_t experts = static_cast<uint64_t>(std::max(0, spec.model().n_expert()));
  // Hot experts may hold up to max_store_replicas copies.
  const uint64_t copies = static_cast<uint64_t>(std::max(
      {1, spec.cluster().store_replicas(), spec.cluster().replication().max_store_replicas()}));
  const uint64_t workers = static_cast<uint64_t>(std::max(1, spec.cluster().workers()));
  const uint64_t groups = layers * experts + 1;
  uint64_t bytes =
      kJobBytes + groups * (kGroupBytes + copies * kGroupCopyBytes + workers * kGroupReportBytes);
  if (experts <= static_cast<uint64_t>(kMaxCoactivationExperts) && experts > 1) {
    const uint64_t pairs = layers * experts * (experts - 1) / 2;
    bytes += pairs * (kPairBytes + workers * kPairReportBytes);
  }
  return bytes;
}

}  // namespace pith::coordinator
