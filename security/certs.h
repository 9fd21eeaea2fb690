// A cluster's certificate authority and its processes' certificates: what `pith certs`
// writes, and the check every process runs on its own TLS directory at start.
//
// Layout: the CA in DIR/ca.pem and DIR/ca.key (0600); each identity in DIR/NAME/ as
// ca.pem (the CA certificate), cert.pem and key.pem (0600), the directory a process is
// given with --tls_dir. Keys are ECDSA P-256, signatures SHA-256; leaf certificates are
// for both TLS server and client use (a store serves the coordinator and calls it).
//
// Thread safety: free functions; concurrent calls on one DIR are not coordinated beyond
// each file being created atomically and never replaced.
#ifndef PITH_SECURITY_CERTS_H_
#define PITH_SECURITY_CERTS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "security/identity.h"
#include "security/tls.h"

namespace pith::security {

inline constexpr char kCaKeyFile[] = "ca.key";

struct CertOptions {
  // Host names and IP addresses the process is reached at besides DefaultHosts() (TLS
  // clients check the address they dial against these).
  std::vector<std::string> hosts;
  absl::Duration validity = absl::Hours(24 * 365);
};

// localhost, 127.0.0.1, ::1 and this machine's host name.
std::vector<std::string> DefaultHosts();

// Makes DIR's CA (DIR/ca.pem, DIR/ca.key; valid ten years) unless DIR/ca.pem exists.
// Returns true when it made one.
absl::StatusOr<bool> EnsureCa(const std::string& dir);

// Gives `identity` a new key and a certificate signed by DIR's CA, in DIR/NAME/: for the
// coordinator and members, server and client use and the names of DefaultHosts() and
// `options.hosts`; for users and admins, client use alone and no host names (INVALID_ARGUMENT
// with hosts). ALREADY_EXISTS when DIR/NAME/cert.pem exists (a key in use is never
// replaced); FAILED_PRECONDITION without a CA; INVALID_ARGUMENT for a bad name or host, or
// a NAME that is a file of DIR (ca.pem).
absl::Status Issue(const std::string& dir, const Identity& identity,
                   const CertOptions& options = {});

}  // namespace pith::security

#endif  // PITH_SECURITY_CERTS_H_
