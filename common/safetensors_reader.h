// SafetensorsReader: a safetensors file read one tensor at a time (pread), never whole, for
// files larger than memory (a job's init weights on a worker that holds a few experts).
// The header is validated as SafetensorsFile::Parse validates it; tensor bytes are read
// only when asked for.
//
// Thread safety: immutable after Open; Read may be called from many threads (pread).
#ifndef PITH_COMMON_SAFETENSORS_READER_H_
#define PITH_COMMON_SAFETENSORS_READER_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/file.h"
#include "common/safetensors.h"

namespace pith {

class SafetensorsReader {
 public:
  // Opens `path` and validates its header; errors name the file.
  static absl::StatusOr<SafetensorsReader> Open(const std::string& path);

  // Entries sorted by name.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The named entry. NOT_FOUND for an unknown name.
  absl::StatusOr<const SafetensorsEntry*> Find(absl::string_view name) const;
  // Reads the named tensor's bytes into `out`, which must be exactly their size
  // (INVALID_ARGUMENT otherwise).
  absl::Status Read(absl::string_view name, absl::Span<uint8_t> out) const;

 private:
  SafetensorsReader() = default;
  std::string path_;
  UniqueFd fd_;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace pith

#endif  // PITH_COMMON_SAFETENSORS_READER_H_
