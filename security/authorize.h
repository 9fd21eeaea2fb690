// Who may call what: each Pith server names, in one table (a Policy), the roles that may
// call each of its methods, and every handler asks the policy first. A method missing
// from the table is refused (fail closed).
//
// Refusals: UNAUTHENTICATED for a caller without a verified certificate naming a pith://
// identity, PERMISSION_DENIED for a role the method does not admit; each with one line
// naming the method, the caller and what is missing. Without TLS (--insecure, loopback
// only) every caller is admitted.
//
// Thread safety: a Policy is immutable once made; Check may run on any gRPC thread.
#ifndef PITH_SECURITY_AUTHORIZE_H_
#define PITH_SECURITY_AUTHORIZE_H_

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"
#include "security/client_limits.h"
#include "security/identity.h"

namespace pith::security {

// The verified identity of an RPC's peer: its certificate's pith:// URI. UNAUTHENTICATED
// when the peer presented no certificate or one without such a name.
absl::StatusOr<Identity> PeerIdentity(const grpc::ServerContext& context);

class Policy {
 public:
  // The identity of a bearer token: UNAUTHENTICATED, saying why, when it is not a valid
  // one (security/tokens.h).
  using TokenLookup = std::function<absl::StatusOr<Identity>(const std::string& token)>;

  // `enforce` false (a server without TLS): every call is admitted and Check returns no
  // identity. `rules`: method name -> the roles admitted. `tokens`, when set: a caller
  // without a client certificate may present "authorization: Bearer TOKEN" instead.
  // `limits`, when set: each admitted call takes one request of its client's rate
  // (client_limits.h), refused RESOURCE_EXHAUSTED past it.
  Policy(bool enforce, std::map<std::string, std::set<Role>> rules, TokenLookup tokens = nullptr,
         std::shared_ptr<ClientLimits> limits = nullptr);

  // The caller's identity when `method` admits it (nullopt when not enforcing); otherwise
  // the refusal as a grpc::Status, for the handler to return.
  absl::StatusOr<std::optional<Identity>> Check(const grpc::ServerContext& context,
                                                const std::string& method) const;

  // Check as a handler's answer: OK (and the caller in `*caller` when given) or the
  // refusal. The form every handler starts with:
  //   if (grpc::Status denied = policy_.Admit(*ctx, "Method"); !denied.ok()) return denied;
  grpc::Status Admit(const grpc::ServerContext& context, const std::string& method,
                     std::optional<Identity>* caller = nullptr) const;

  // One of the caller's streams (held while the slot lives); RESOURCE_EXHAUSTED past its
  // limit. `caller`: what Admit found.
  absl::StatusOr<ClientLimits::StreamSlot> OpenStream(const grpc::ServerContext& context,
                                                      const std::optional<Identity>& caller) const;

  bool enforce() const { return enforce_; }
  const std::map<std::string, std::set<Role>>& rules() const { return rules_; }

 private:
  bool enforce_;
  std::map<std::string, std::set<Role>> rules_;
  TokenLookup tokens_;
  std::shared_ptr<ClientLimits> limits_;
  // Who the limits count a call against: its identity, else its peer's host.
  std::string ClientKey(const grpc::ServerContext& context,
                        const std::optional<Identity>& caller) const;
};

}  // namespace pith::security

#endif  // PITH_SECURITY_AUTHORIZE_H_
