// safetensors reader and writer (DESIGN §3 checkpoint format): an 8-byte little-endian
// header length N, N bytes of JSON header, then the raw little-endian tensor data.
//
// The reader trusts nothing in the file: a bad header length, invalid JSON, an unknown
// dtype, a shape that does not match its byte range, overlapping, out-of-range or
// non-contiguous offsets and truncated or trailing data are each an INVALID_ARGUMENT (or
// DATA_LOSS for truncation) naming what is wrong, never a crash.
//
// Thread safety: a parsed SafetensorsFile is immutable and safe to read from many
// threads. A SafetensorsWriter is not thread-safe.
#ifndef PITH_COMMON_SAFETENSORS_H_
#define PITH_COMMON_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/buffer.h"
#include "common/tensor.h"

namespace pith {

// Largest JSON header accepted (the reference implementation uses the same bound).
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// The metadata key under which optimizer files record their step.
inline constexpr absl::string_view kSafetensorsStepKey = "step";

// One tensor's entry in the header. Offsets are relative to the start of the data.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;
  uint64_t end = 0;
};

// The header length of a file of `file_size` bytes from its first 8 bytes, checked
// against the limit and the file's size.
absl::StatusOr<uint64_t> SafetensorsHeaderLength(absl::Span<const uint8_t> first8,
                                                 uint64_t file_size);
// Parses and validates a JSON header whose data section has `data_size` bytes: every
// entry (sorted by name) and the metadata.
absl::Status ParseSafetensorsHeader(absl::string_view header, uint64_t data_size,
                                    std::vector<SafetensorsEntry>* entries,
                                    std::map<std::string, std::string>* metadata);

// A parsed, validated safetensors file held in memory.
class SafetensorsFile {
 public:
  // Validates and takes ownership of the file's bytes.
  static absl::StatusOr<SafetensorsFile> Parse(Buffer file);
  // Reads and validates `path`; errors name the file.
  static absl::StatusOr<SafetensorsFile> Read(const std::string& path);

  // Entries sorted by name.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // The `__metadata__` map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  bool Contains(absl::string_view name) const;
  // The named tensor, viewing this file's bytes. NOT_FOUND for an unknown name.
  absl::StatusOr<TensorView> Get(absl::string_view name) const;

 private:
  Buffer file_;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Collects tensors and metadata, then writes one safetensors file.
class SafetensorsWriter {
 public:
  // Adds a tensor. The bytes are borrowed until Write/Serialize returns. ALREADY_EXISTS
  // for a repeated name, INVALID_ARGUMENT when the bytes do not match dtype and shape or
  // the name is empty or "__metadata__".
  absl::Status Add(std::string name, TensorView tensor);
  // Sets a `__metadata__` entry.
  void SetMetadata(std::string key, std::string value);

  // The whole file in memory.
  std::string Serialize() const;
  // Writes the file atomically (temporary file, fsync, rename; with `replace` false an
  // existing file is left alone: ALREADY_EXISTS).
  absl::Status Write(const std::string& path, bool replace = true) const;
  // The same for a file larger than memory: the tensors were added with spans of their
  // size whose data may be null, and `fill` writes each one's bytes (pwrite) at its offset
  // in the file, in any order, before the file is synced and renamed into place.
  using Fill = std::function<absl::Status(int fd, const std::map<std::string, uint64_t>& offsets)>;
  absl::Status WriteWith(const std::string& path, const Fill& fill, bool replace = true) const;

 private:
  // The header JSON padded to a multiple of 8 bytes, and the tensors in data order.
  std::string BuildHeader(
      std::vector<const std::pair<const std::string, TensorView>*>* order) const;

  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace pith

#endif  // PITH_COMMON_SAFETENSORS_H_
