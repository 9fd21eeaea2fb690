#include "security/flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, tls_dir, "",
          "Mutual TLS: the directory `pith certs` made for this process (ca.pem, cert.pem, "
          "key.pem; re-read every 10 s, so certificates rotate without a restart)");
ABSL_FLAG(bool, insecure, false,
          "Plaintext gRPC instead of --tls_dir: every caller is trusted, so only loopback "
          "addresses are allowed");

namespace pith::security {

absl::StatusOr<TransportSecurity> TransportSecurityFromFlags(const std::string& program,
                                                             Role role) {
  absl::StatusOr<TransportSecurity> security = TransportSecurity::Choose(
      absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_insecure), program);
  if (security.ok() && security->tls() && !security->identity()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_dir ", security->dir(), " holds no certificate (cert.pem); ", program,
                     " needs one with the ", RoleName(role), " role"));
  }
  if (security.ok() && security->tls() && security->identity()->role != role) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_dir ", security->dir(), " holds the certificate of ",
                     DebugString(*security->identity()), "; ", program, " needs one with the ",
                     RoleName(role), " role"));
  }
  return security;
}

}  // namespace pith::security
