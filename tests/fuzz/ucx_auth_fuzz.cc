// libFuzzer target: the data plane's message tag (common/ucx_auth.h), checked on every
// UCX message before any handler parses it. With a key set, bytes from a peer without
// the key must never pass (a pass would be a forged HMAC), a tagged message must pass
// whole and come back as its header, and a tag on another message id must not.
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/ucx_auth.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool keyed = [] {
    pith::ucx::SetDataPlaneKey(std::string(pith::ucx::kDataPlaneKeyBytes, 'k'));
    return true;
  }();
  (void)keyed;
  if (size < 2) return 0;
  const uint16_t id = static_cast<uint16_t>(data[0] | (data[1] << 8));
  const std::string header(reinterpret_cast<const char*>(data) + 2, size - 2);
  // A stranger's bytes: dropped.
  if (pith::ucx::internal::Check(id, header).has_value()) __builtin_trap();
  // The same bytes tagged by a holder of the key: taken, the header intact.
  const std::string tagged = pith::ucx::internal::Tag(id, header);
  const std::optional<size_t> body = pith::ucx::internal::Check(id, tagged);
  if (!body || *body != header.size() || tagged.compare(0, *body, header) != 0) __builtin_trap();
  // Its tag does not fit another message id, nor the header with one byte changed.
  if (pith::ucx::internal::Check(static_cast<uint16_t>(id + 1), tagged)) __builtin_trap();
  if (!header.empty()) {
    std::string changed = tagged;
    changed[0] = static_cast<char>(changed[0] ^ 1);
    if (pith::ucx::internal::Check(id, changed)) __builtin_trap();
  }
  return 0;
}
