// A member's durable identity: a random 128-bit token (32 hex digits) in the file
// pith-member-identity of its data dir (RocksDB keeps its own IDENTITY there), made on
// the first start and read on every later one. The coordinator maps it to the member id
// (DESIGN §5.1), so the data, not the order of start-up, decides which store is which.
//
// Thread safety: a pure function of the file system.
#ifndef PITH_COMMON_MEMBER_IDENTITY_H_
#define PITH_COMMON_MEMBER_IDENTITY_H_

#include <string>

#include "absl/status/statusor.h"

namespace pith {

// 32 random hex digits (the kernel's entropy): a member identity, the cluster id.
std::string NewRandomId();

// The identity of `data_dir` (an existing directory), created if it has none. DATA_LOSS
// naming the file when it holds anything but an identity.
absl::StatusOr<std::string> LoadOrCreateIdentity(const std::string& data_dir);

// Keeps `cluster_id` (RegisterResponse.cluster_id) in pith-cluster-id of `data_dir` on
// the first registration, and on every later one checks it: FAILED_PRECONDITION, saying
// what to do, when the coordinator is of another cluster (its data replaced: it would give
// out the old jobs' ids again, over the blobs this store holds). OK for an empty id (a
// coordinator older than the check).
absl::Status KeepClusterId(const std::string& data_dir, const std::string& cluster_id);

// The file a store writes into its data dir when it stops drained (saying which store and
// when): pith-store refuses to start on that dir, and `pith up` starts that store no more.
inline std::string DrainedMarker(const std::string& data_dir) { return data_dir + "/DRAINED"; }

}  // namespace pith

#endif  // PITH_COMMON_MEMBER_IDENTITY_H_
