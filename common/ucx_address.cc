#include "common/ucx_address.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"

namespace pith {
namespace {

constexpr char kMagic[4] = {'P', 'U', 'C', 'X'};
constexpr size_t kHeader = 12;  // magic, length, crc (little-endian u32s)
constexpr size_t kMinRaw = 9;   // UCX's header byte and 64-bit uuid at least
constexpr size_t kMaxRaw = 1 << 20;

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

}  // namespace

std::string WrapUcxAddress(absl::string_view raw) {
  std::string out(kMagic, sizeof(kMagic));
  PutU32(out, static_cast<uint32_t>(raw.size()));
  PutU32(out, Crc32c(raw.data(), raw.size()));
  out.append(raw.data(), raw.size());
  return out;
}

absl::StatusOr<absl::string_view> UnwrapUcxAddress(absl::string_view wrapped) {
  if (wrapped.size() < kHeader + kMinRaw ||
      std::memcmp(wrapped.data(), kMagic, sizeof(kMagic)) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a Pith UCX address (", wrapped.size(), " bytes)"));
  }
  const uint32_t length = GetU32(wrapped.data() + 4);
  const absl::string_view raw = wrapped.substr(kHeader);
  if (length != raw.size() || length > kMaxRaw) {
    return absl::InvalidArgumentError(
        absl::StrCat("UCX address of ", raw.size(), " bytes says it has ", length));
  }
  if (GetU32(wrapped.data() + 8) != Crc32c(raw.data(), raw.size())) {
    return absl::InvalidArgumentError("UCX address damaged (checksum mismatch)");
  }
  return raw;
}

}  // namespace pith
