// Blob keys (DESIGN §4): (job, layer, expert, kind) for expert blobs, (job, -1, tensor
// name, kind) for dense ones, encoded as byte strings that sort by job first, so that one
// job's blobs form one contiguous range in every index and in RocksDB.
//
// Thread safety: free functions.
#ifndef PITH_SERVER_STORE_BLOB_KEY_H_
#define PITH_SERVER_STORE_BLOB_KEY_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pith/v1/common.pb.h"

namespace pith::store {

// Longest job id and dense tensor name a key may hold.
inline constexpr size_t kMaxJobIdBytes = 128;
inline constexpr size_t kMaxTensorNameBytes = 256;

// INVALID_ARGUMENT naming the bad field: empty or long job id, unknown kind, layer < -1,
// negative expert, or a dense key without a tensor name.
absl::Status ValidateBlobKey(const v1::BlobKey& key);

// The encoding of a valid key; Decode(Encode(k)) == k (expert is 0 for dense keys).
std::string EncodeBlobKey(const v1::BlobKey& key);
absl::StatusOr<v1::BlobKey> DecodeBlobKey(absl::string_view encoded);

// The prefix every encoded key of `job_id` starts with.
std::string JobKeyPrefix(absl::string_view job_id);

// "job/h.3.moe.e5/weights" or "job/wte/master": for logs and errors.
std::string BlobKeyDebugString(const v1::BlobKey& key);

}  // namespace pith::store

#endif  // PITH_SERVER_STORE_BLOB_KEY_H_
