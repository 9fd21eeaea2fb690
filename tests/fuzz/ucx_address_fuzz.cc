// libFuzzer target: any bytes a peer gives as its UCX address (a hello, a PullBlobs source,
// a registration) are unwrapped to the address they carry or refused with
// INVALID_ARGUMENT, before UCX ever reads them; an accepted envelope is canonical
// (wrapping what it carries gives it back), and any payload wrapped unwraps to itself.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"
#include "common/ucx_address.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view in(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<absl::string_view> raw = pith::UnwrapUcxAddress(in);
  if (raw.ok()) {
    if (pith::WrapUcxAddress(*raw) != in) __builtin_trap();
  } else if (raw.status().code() != absl::StatusCode::kInvalidArgument) {
    __builtin_trap();
  }
  const std::string wrapped = pith::WrapUcxAddress(in);
  absl::StatusOr<absl::string_view> back = pith::UnwrapUcxAddress(wrapped);
  // Payloads shorter than UCX's header and uuid are refused, all others come back whole.
  if (size >= 9 && (!back.ok() || *back != in)) __builtin_trap();
  return 0;
}
