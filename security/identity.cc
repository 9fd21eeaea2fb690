#include "security/identity.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace pith::security {
namespace {

constexpr absl::string_view kScheme = "pith://";

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kMember:
      return "member";
    case Role::kCoordinator:
      return "coordinator";
    case Role::kAdmin:
      return "admin";
    case Role::kUser:
      return "user";
  }
  return "unknown";
}

absl::StatusOr<Role> ParseRole(absl::string_view name) {
  for (Role r : {Role::kMember, Role::kCoordinator, Role::kAdmin, Role::kUser}) {
    if (RoleName(r) == name) return r;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no role \"", name, "\" (member, coordinator, admin or user)"));
}

absl::Status ValidateName(absl::string_view name) {
  if (name.empty() || name.size() > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("a name has 1 to 64 characters, not ", name.size()));
  }
  if (name[0] == '.') {
    return absl::InvalidArgumentError(absl::StrCat("a name cannot start with '.': ", name));
  }
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("a name is made of letters, digits, '.', '_' and '-': ", name));
    }
  }
  return absl::OkStatus();
}

std::string IdentityUri(const Identity& identity) {
  return absl::StrCat(kScheme, RoleName(identity.role), "/", identity.name);
}

absl::StatusOr<Identity> ParseIdentityUri(absl::string_view uri) {
  if (!absl::ConsumePrefix(&uri, kScheme)) {
    return absl::InvalidArgumentError("not a pith:// identity");
  }
  const size_t slash = uri.find('/');
  if (slash == absl::string_view::npos) {
    return absl::InvalidArgumentError("a pith:// identity is pith://ROLE/NAME");
  }
  Identity out;
  auto role = ParseRole(uri.substr(0, slash));
  if (!role.ok()) return role.status();
  out.role = *role;
  out.name = std::string(uri.substr(slash + 1));
  if (absl::Status s = ValidateName(out.name); !s.ok()) return s;
  return out;
}

std::string DebugString(const Identity& identity) {
  return absl::StrCat(identity.name, " (", RoleName(identity.role), ")");
}

}  // namespace pith::security
