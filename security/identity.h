// Who a Pith process or user is, as its certificate says: a role and a name. The role
// decides what the process may call (authorize.h); the name is what a member's id is
// bound to. Certificates carry both as one URI subject alternative name,
// "pith://ROLE/NAME" (and, for people reading them, as OU=ROLE and CN=NAME).
//
// Thread safety: values and free functions.
#ifndef PITH_SECURITY_IDENTITY_H_
#define PITH_SECURITY_IDENTITY_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pith::security {

enum class Role {
  // Stores and workers: register, heartbeat, assignments, step reports.
  kMember,
  // The coordinator: store control (commit, abort, pull, delete, checkpoint).
  kCoordinator,
  // Operators: drain and the other cluster operations, and everything a user may do.
  kAdmin,
  // The job API: submit, watch, cancel, checkpoint, status.
  kUser,
};

// "member", "coordinator", "admin", "user".
absl::string_view RoleName(Role role);
// INVALID_ARGUMENT for anything but the four names.
absl::StatusOr<Role> ParseRole(absl::string_view name);

struct Identity {
  Role role = Role::kUser;
  std::string name;
  bool operator==(const Identity&) const = default;
};

// 1 to 64 characters of [A-Za-z0-9._-], not starting with '.' (names become file names
// and URI paths); INVALID_ARGUMENT naming the problem otherwise.
absl::Status ValidateName(absl::string_view name);

// "pith://ROLE/NAME".
std::string IdentityUri(const Identity& identity);
// The identity of a "pith://ROLE/NAME" URI; INVALID_ARGUMENT for anything else.
absl::StatusOr<Identity> ParseIdentityUri(absl::string_view uri);

// "NAME (ROLE)", for messages.
std::string DebugString(const Identity& identity);

}  // namespace pith::security

#endif  // PITH_SECURITY_IDENTITY_H_
