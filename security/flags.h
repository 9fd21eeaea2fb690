// The transport-security flags every Pith server binary takes: --tls_dir (mutual TLS
// with the certificate directory `pith certs` made for the process) or --insecure
// (plaintext, loopback addresses only).
//
// Thread safety: call after the flags are parsed (InitProcess), from main.
#ifndef PITH_SECURITY_FLAGS_H_
#define PITH_SECURITY_FLAGS_H_

#include <string>

#include "absl/status/statusor.h"
#include "security/tls.h"

namespace pith::security {

// The flags' choice, checked (TransportSecurity::Choose), with a TLS certificate of
// `role` (a store's must be a member's, the coordinator's the coordinator's);
// `program` names the binary in the error.
absl::StatusOr<TransportSecurity> TransportSecurityFromFlags(const std::string& program, Role role);

}  // namespace pith::security

#endif  // PITH_SECURITY_FLAGS_H_
