#include "security/authorize.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pith::security {

absl::StatusOr<Identity> PeerIdentity(const grpc::ServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) {
    return absl::UnauthenticatedError("no client certificate");
  }
  std::vector<Identity> found;
  for (const grpc::string_ref& uri : auth->FindPropertyValues("peer_uri")) {
    auto id = ParseIdentityUri(absl::string_view(uri.data(), uri.size()));
    if (id.ok()) found.push_back(*id);
  }
  if (found.size() != 1) {
    return absl::UnauthenticatedError(
        absl::StrCat("the client certificate names ", found.size(),
                     " pith:// identities, not one (pith certs makes them)"));
  }
  return found[0];
}

Policy::Policy(bool enforce, std::map<std::string, std::set<Role>> rules)
    : enforce_(enforce), rules_(std::move(rules)) {}

absl::StatusOr<std::optional<Identity>> Policy::Check(const grpc::ServerContext& context,
                                                      const std::string& method) const {
  if (!enforce_) return std::optional<Identity>();
  auto rule = rules_.find(method);
  auto caller = PeerIdentity(context);
  if (!caller.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": ", caller.status().message(), "; connect with --tls_dir"));
  }
  if (rule == rules_.end() || !rule->second.count(caller->role)) {
    std::vector<std::string> roles;
    if (rule != rules_.end()) {
      for (Role r : rule->second) roles.emplace_back(RoleName(r));
    }
    return absl::PermissionDeniedError(
        absl::StrCat(method, " needs the ", roles.empty() ? "(no)" : absl::StrJoin(roles, " or "),
                     " role; the caller is ", DebugString(*caller)));
  }
  return std::optional<Identity>(*caller);
}

grpc::Status Policy::Admit(const grpc::ServerContext& context, const std::string& method,
                           std::optional<Identity>* caller) const {
  absl::StatusOr<std::optional<Identity>> checked = Check(context, method);
  if (!checked.ok()) {
    return grpc::Status(static_cast<grpc::StatusCode>(checked.status().code()),
                        std::string(checked.status().message()));
  }
  if (caller != nullptr) *caller = *std::move(checked);
  return grpc::Status::OK;
}

}  // namespace pith::security
