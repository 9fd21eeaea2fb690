// Token files and the DESIGN §3 data order. A token file is a flat array of token ids:
// uint8 when the vocabulary is 256, little-endian uint16 otherwise. Global step s with
// global batch B takes row i from tokens [(s*B+i)*T, (s*B+i)*T + T + 1) modulo the file
// length: the first T are the inputs, the last T the targets.
//
// Thread safety: an opened TokenDataset is immutable; Row() may run concurrently.
#ifndef PITH_WORKER_DATA_TOKEN_DATASET_H_
#define PITH_WORKER_DATA_TOKEN_DATASET_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/buffer.h"

namespace pith::data {

class TokenDataset {
 public:
  // Reads and checks the whole file: NOT_FOUND when missing, INVALID_ARGUMENT when it
  // holds fewer than 2 tokens, an odd byte count for uint16, or an id >= vocab.
  static absl::StatusOr<TokenDataset> Open(const std::string& path, int vocab);

  int64_t size() const { return size_; }
  // The file as read: its size in bytes and CRC32C (what pins a job's data, Job.data).
  uint64_t file_bytes() const { return bytes_.size(); }
  uint32_t file_crc32c() const { return crc32c_; }
  int32_t token(int64_t i) const;

  // Fills inputs[T] and targets[T] for global row `row` (= s*B + i).
  void Row(int64_t row, int seq, int32_t* inputs, int32_t* targets) const;

 private:
  Buffer bytes_;
  bool wide_ = false;
  int64_t size_ = 0;
  uint32_t crc32c_ = 0;
};

// Concatenates text files byte by byte into a vocab-256 token file (atomic write). Returns
// the number of tokens. INVALID_ARGUMENT for a vocabulary other than 256 (Pith has no
// tokenizer beyond bytes) or no input.
absl::StatusOr<int64_t> PrepareByteTokens(const std::vector<std::string>& inputs,
                                          const std::string& output, int vocab);

}  // namespace pith::data

#endif  // PITH_WORKER_DATA_TOKEN_DATASET_H_
