// libFuzzer target: any byte string handed to the JobSpec loader must come back as a
// valid spec or an INVALID_ARGUMENT, never a crash; an accepted spec must survive a JSON
// round trip unchanged.
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "common/job_spec.h"
#include "google/protobuf/util/message_differencer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::StatusOr<pith::v1::JobSpec> spec =
      pith::ParseJobSpec(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!spec.ok()) {
    if (spec.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  absl::StatusOr<pith::v1::JobSpec> again = pith::ParseJobSpec(pith::JobSpecToJson(*spec));
  if (!again.ok() || !google::protobuf::util::MessageDifferencer::Equals(*spec, *again)) {
    __builtin_trap();
  }
  return 0;
}
