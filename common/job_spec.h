// JobSpec loading: protobuf's JSON mapping of pith.v1.JobSpec (snake_case names, DESIGN
// §3), defaults for absent fields, and validation that names the bad field.
//
// Thread safety: free functions without shared state.
#ifndef PITH_COMMON_JOB_SPEC_H_
#define PITH_COMMON_JOB_SPEC_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "pith/v1/spec.pb.h"

namespace pith {

// Parses JSON into a JobSpec, fills in defaults and validates it. Errors are
// INVALID_ARGUMENT and start with the offending field ("model.n_head: ...") or, for
// malformed JSON, say where parsing failed.
absl::StatusOr<v1::JobSpec> ParseJobSpec(absl::string_view json);

// ParseJobSpec on the contents of `path`; errors name the file.
absl::StatusOr<v1::JobSpec> LoadJobSpec(const std::string& path);

// Fills in the documented defaults of absent or zero fields (see spec.proto).
void ApplyJobSpecDefaults(v1::JobSpec* spec);

// Checks every field of a spec that already has its defaults. The error names the first
// bad field of each part (name, model, train, cluster), joined by "; ".
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

// The spec as JSON (snake_case names, defaults included), the form ParseJobSpec reads.
std::string JobSpecToJson(const v1::JobSpec& spec);

// A character a spec's name may hold (and so a job id, the name and a number): a letter, a
// digit, '-', '_' or '.'.
bool IsNameChar(char c);
// Whether `text` holds a control character (below 0x20, or 0x7f): text that is logged or
// shown to others must not, as a newline forges log lines and escapes drive terminals.
bool HasControlCharacter(absl::string_view text);

}  // namespace pith

#endif  // PITH_COMMON_JOB_SPEC_H_
