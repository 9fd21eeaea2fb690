// libFuzzer target: any byte string handed to the safetensors parser must come back as a
// file or a Status, never a crash, a leak or an out-of-bounds read (ASan + UBSan).
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<pith::Buffer> bytes = pith::Buffer::CopyOf({data, size});
  if (!bytes.ok()) return 0;
  absl::StatusOr<pith::SafetensorsFile> file = pith::SafetensorsFile::Parse(std::move(*bytes));
  if (!file.ok()) return 0;
  // Every tensor of an accepted file must be readable in full.
  uint64_t checksum = 0;
  for (const pith::SafetensorsEntry& entry : file->entries()) {
    absl::StatusOr<pith::TensorView> view = file->Get(entry.name);
    if (!view.ok()) __builtin_trap();
    for (uint8_t b : view->bytes) checksum += b;
  }
  // Round trip: an accepted file must serialize to something the parser accepts again.
  pith::SafetensorsWriter writer;
  for (const pith::SafetensorsEntry& entry : file->entries()) {
    if (!writer.Add(entry.name, *file->Get(entry.name)).ok()) __builtin_trap();
  }
  for (const auto& [k, v] : file->metadata()) writer.SetMetadata(k, v);
  std::string again = writer.Serialize();
  absl::StatusOr<pith::Buffer> again_bytes =
      pith::Buffer::CopyOf({reinterpret_cast<const uint8_t*>(again.data()), again.size()});
  if (!again_bytes.ok()) return 0;
  absl::StatusOr<pith::SafetensorsFile> reparsed =
      pith::SafetensorsFile::Parse(std::move(*again_bytes));
  if (!reparsed.ok() || reparsed->entries().size() != file->entries().size()) __builtin_trap();
  return static_cast<int>(checksum & 0);
}
