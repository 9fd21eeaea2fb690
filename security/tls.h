// Transport security of every Pith gRPC endpoint and channel: mutual TLS from a
// directory `pith certs` wrote (certs.h), or plaintext for loopback only (--insecure).
//
// With TLS, servers ask for a client certificate and verify any presented against the
// cluster CA (a caller without one still completes the handshake, so that the policy,
// authorize.h, can answer it UNAUTHENTICATED with the reason, or admit its bearer token);
// clients check the server's certificate against the CA, the address they dial and the role
// they expect (the coordinator's, or a member's). Certificate
// files are watched and re-read (every kTlsRefresh); server processes point the watch at a
// checked copy that a SIGHUP or a change of the files replaces (cert_stage.h), so rotating
// needs no restart.
//
// Thread safety: a TransportSecurity is immutable once made; copies share nothing
// mutable.
#ifndef PITH_SECURITY_TLS_H_
#define PITH_SECURITY_TLS_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "security/identity.h"

namespace pith::security {

// The files of a process's TLS directory (what `pith certs` writes: certs.h).
inline constexpr char kCaCertFile[] = "ca.pem";
inline constexpr char kCertFile[] = "cert.pem";
inline constexpr char kKeyFile[] = "key.pem";

// The identity a process's TLS directory holds, once checked: ca.pem, cert.pem and
// key.pem readable, the key the certificate's, the certificate signed by ca.pem, valid
// now, and naming one pith:// identity. The error names the file and what is wrong.
absl::StatusOr<Identity> CheckTlsDir(const std::string& dir);

// How often a process re-reads its certificate files (a server process: its checked copy,
// replaced on SIGHUP or when the watcher, every kTlsWatch, sees the files change:
// security/flags.h).
inline constexpr absl::Duration kTlsRefresh = absl::Seconds(2);
inline constexpr absl::Duration kTlsWatch = absl::Seconds(10);

class TransportSecurity {
 public:
  // Plaintext (the same as Insecure()).
  TransportSecurity() = default;
  // Mutual TLS from `dir` (ca.pem, cert.pem, key.pem), checked first (CheckTlsDir). A
  // directory with ca.pem alone gives a client TLS without an identity of its own, for a
  // bearer token (WithToken).
  static absl::StatusOr<TransportSecurity> Tls(const std::string& dir);
  // Plaintext, for loopback addresses only (CheckListen, CheckDial).
  static TransportSecurity Insecure();
  // The choice of a process's flags: exactly one of a TLS directory or insecure, with a
  // one-line error naming both flags otherwise. `program` names the binary in it.
  static absl::StatusOr<TransportSecurity> Choose(const std::string& tls_dir, bool insecure,
                                                  const std::string& program);

  // The same, presenting `token` ("authorization: Bearer TOKEN", tokens.h) instead of a
  // client certificate. TLS only.
  TransportSecurity WithToken(std::string token) const {
    TransportSecurity out = *this;
    out.token_ = std::move(token);
    return out;
  }

  // The same, its credentials read from `dir` (a CertificateStage's copy of dir()) rather
  // than from dir() itself.
  TransportSecurity WithCredentialsDir(std::string dir) const {
    TransportSecurity out = *this;
    out.credentials_dir_ = std::move(dir);
    return out;
  }

  bool tls() const { return tls_; }
  // This process's own identity (TLS with a certificate only).
  const std::optional<Identity>& identity() const { return identity_; }
  const std::string& dir() const { return dir_; }

  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // Credentials of a channel to a server of role `server` (the coordinator, or a member:
  // a store): with TLS, the server's certificate must be signed by the CA, name the address
  // dialled, and name a pith:// identity of that role. Any certificate of the CA would do
  // otherwise, a user's included, and its holder could pose as the coordinator and take
  // the bearer tokens and the cluster key callers send it.
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(Role server) const;

  // With a certificate: INVALID_ARGUMENT unless it names `host` (a DNS name or an IP
  // address), the name clients will dial this process at; OK otherwise and without TLS.
  absl::Status CheckNames(const std::string& host) const;

  // Insecure: INVALID_ARGUMENT unless `address` ("host:port") is a loopback address.
  absl::Status CheckListen(const std::string& address) const;
  absl::Status CheckDial(const std::string& address) const;

 private:
  const std::string& credentials_dir() const {
    return credentials_dir_.empty() ? dir_ : credentials_dir_;
  }

  bool tls_ = false;
  std::string dir_;
  std::string credentials_dir_;  // empty: dir_
  std::optional<Identity> identity_;
  std::string token_;
};

// Whether the host of "host:port" (or a bare host) is loopback: localhost, 127.0.0.0/8
// or ::1.
bool IsLoopbackAddress(const std::string& address);

}  // namespace pith::security

#endif  // PITH_SECURITY_TLS_H_
