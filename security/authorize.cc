#include "security/authorize.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"

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

Policy::Policy(bool enforce, std::map<std::string, std::set<Role>> rules, TokenLookup tokens,
               std::shared_ptr<ClientLimits> limits)
    : enforce_(enforce),
      rules_(std::move(rules)),
      tokens_(std::move(tokens)),
      limits_(std::move(limits)) {}

std::string Policy::ClientKey(const grpc::ServerContext& context,
                              const std::optional<Identity>& caller) const {
  if (caller) return DebugString(*caller);
  // "ipv4:127.0.0.1:5678" -> "ipv4:127.0.0.1": a client's connections share one budget.
  const std::string peer = context.peer();
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < 5 ? peer : peer.substr(0, colon);
}

absl::StatusOr<ClientLimits::StreamSlot> Policy::OpenStream(
    const grpc::ServerContext& context, const std::optional<Identity>& caller) const {
  if (limits_ == nullptr) return ClientLimits::StreamSlot();
  return limits_->OpenStream(ClientKey(context, caller));
}

namespace {

// The caller's identity by its bearer token: UNAUTHENTICATED for a wrong one, nullopt
// when it presented none.
absl::StatusOr<std::optional<Identity>> TokenIdentity(const grpc::ServerContext& context,
                                                      const Policy::TokenLookup& tokens) {
  const auto& metadata = context.client_metadata();
  auto it = metadata.find("authorization");
  if (it == metadata.end()) return std::optional<Identity>();
  absl::string_view value(it->second.data(), it->second.size());
  if (!absl::ConsumePrefix(&value, "Bearer ")) {
    return absl::UnauthenticatedError("the authorization header is not \"Bearer TOKEN\"");
  }
  ASSIGN_OR_RETURN(Identity id, tokens(std::string(value)));
  return std::optional<Identity>(std::move(id));
}

}  // namespace

absl::StatusOr<std::optional<Identity>> Policy::Check(const grpc::ServerContext& context,
                                                      const std::string& method) const {
  if (!enforce_) return std::optional<Identity>();
  auto rule = rules_.find(method);
  auto caller = PeerIdentity(context);
  if (!caller.ok() && tokens_) {
    absl::StatusOr<std::optional<Identity>> by_token = TokenIdentity(context, tokens_);
    if (!by_token.ok()) {
      return absl::UnauthenticatedError(absl::StrCat(method, ": ", by_token.status().message()));
    }
    if (*by_token) caller = **by_token;
  }
  if (!caller.ok()) {
    return absl::UnauthenticatedError(
        absl::StrCat(method, ": ", caller.status().message(),
                     tokens_ ? "; present a certificate (--tls_dir) or a bearer token (--token)"
                             : "; connect with --tls_dir"));
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
  if (limits_ != nullptr) {
    if (absl::Status s = limits_->Admit(ClientKey(context, *checked)); !s.ok()) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat(method, ": ", s.message()));
    }
  }
  if (caller != nullptr) *caller = *std::move(checked);
  return grpc::Status::OK;
}

}  // namespace pith::security
