#include "security/tls.h"

#include <arpa/inet.h>
#include <openssl/err.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "security/openssl_util.h"

namespace pith::security {
namespace {

std::shared_ptr<grpc::experimental::FileWatcherCertificateProvider> Provider(
    const std::string& dir) {
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      dir + "/" + kKeyFile, dir + "/" + kCertFile, dir + "/" + kCaCertFile,
      static_cast<unsigned int>(absl::ToInt64Seconds(kTlsRefresh)));
}

// A client's check of the server's certificate once the handshake verified its chain
// against the CA: the name dialled (gRPC's own hostname check), then the role its
// pith:// identity names. Synchronous, and stateless beyond the role: any thread.
class ServerRoleVerifier final : public grpc::experimental::ExternalCertificateVerifier {
 public:
  explicit ServerRoleVerifier(Role want) : want_(want) {}

  bool Verify(grpc::experimental::TlsCustomVerificationCheckRequest* request,
              std::function<void(grpc::Status)> /*callback*/, grpc::Status* sync_status) override {
    grpc::Status named;
    if (!hostname_.Verify(
            request, [](grpc::Status) {}, &named)) {
      named = grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "the hostname check did not end");
    }
    if (!named.ok()) {
      *sync_status = named;
      return true;
    }
    std::string found = "no pith:// identity";
    for (const grpc::string_ref& uri : request->uri_names()) {
      absl::StatusOr<Identity> id = ParseIdentityUri(absl::string_view(uri.data(), uri.size()));
      if (!id.ok()) continue;
      if (id->role == want_) {
        *sync_status = grpc::Status::OK;
        return true;
      }
      found = DebugString(*id);
    }
    // gRPC logs it with the failed handshake (this library links no logging: the SDK's).
    *sync_status = grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        absl::StrCat("the server's certificate names ", found, ", not a ", RoleName(want_)));
    return true;
  }
  void Cancel(grpc::experimental::TlsCustomVerificationCheckRequest*) override {}

 private:
  const Role want_;
  grpc::experimental::HostNameCertificateVerifier hostname_;
};

// The host of "host:port", "[v6]:port" or a bare host.
std::string HostOf(const std::string& address) {
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || address.find(':') != colon) return address;
  return address.substr(0, colon);
}

}  // namespace

absl::StatusOr<Identity> CheckTlsDir(const std::string& dir) {
  const std::string cert_path = dir + "/" + kCertFile;
  ASSIGN_OR_RETURN(internal::Cert ca, internal::LoadCert(dir + "/" + kCaCertFile));
  ASSIGN_OR_RETURN(internal::Cert cert, internal::LoadCert(cert_path));
  ASSIGN_OR_RETURN(internal::Key key, internal::LoadKey(dir + "/" + kKeyFile));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/", kKeyFile, " is not the key of ", cert_path));
  }
  std::unique_ptr<X509_STORE, internal::OpenSslFree> store(X509_STORE_new());
  std::unique_ptr<X509_STORE_CTX, internal::OpenSslFree> ctx(X509_STORE_CTX_new());
  if (store == nullptr || ctx == nullptr || X509_STORE_add_cert(store.get(), ca.get()) != 1 ||
      X509_STORE_CTX_init(ctx.get(), store.get(), cert.get(), nullptr) != 1) {
    return internal::OpenSslFailure("certificate check");
  }
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(cert_path, " does not verify against ", dir, "/",
                                                   kCaCertFile, ": ",
                                                   X509_verify_cert_error_string(err)));
  }
  return internal::CertIdentity(cert.get(), cert_path);
}

bool IsLoopbackAddress(const std::string& address) {
  const std::string host = HostOf(address);
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

absl::StatusOr<TransportSecurity> TransportSecurity::Tls(const std::string& dir) {
  TransportSecurity out;
  out.tls_ = true;
  out.dir_ = dir;
  if (::access((dir + "/" + kCertFile).c_str(), F_OK) != 0) {
    // The CA alone: server-authenticated TLS, for a client with a bearer token.
    RETURN_IF_ERROR(internal::LoadCert(dir + "/" + kCaCertFile).status());
    return out;
  }
  ASSIGN_OR_RETURN(Identity identity, CheckTlsDir(dir));
  out.identity_ = std::move(identity);
  return out;
}

TransportSecurity TransportSecurity::Insecure() { return TransportSecurity(); }

absl::StatusOr<TransportSecurity> TransportSecurity::Choose(const std::string& tls_dir,
                                                            bool insecure,
                                                            const std::string& program) {
  if (!tls_dir.empty() && insecure) {
    return absl::InvalidArgumentError("give --tls_dir or --insecure, not both");
  }
  if (insecure) return Insecure();
  if (tls_dir.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        program, " needs --tls_dir (a directory `pith certs` made for it: mutual TLS) or ",
        "--insecure (plaintext, loopback addresses only)"));
  }
  auto tls = Tls(tls_dir);
  if (!tls.ok()) return Annotate(tls.status(), "--tls_dir");
  return tls;
}

std::shared_ptr<grpc::ServerCredentials> TransportSecurity::ServerCredentials() const {
  // NOTE: a directory without a certificate makes every handshake fail, never plaintext
  // (TransportSecurityFromFlags refuses it first).
  if (!tls()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(Provider(credentials_dir()));
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  // A client without a certificate may connect: the handlers answer it UNAUTHENTICATED
  // with a reason (authorize.h), rather than the handshake failing without one.
  options.set_cert_request_type(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(options);
}

std::shared_ptr<grpc::ChannelCredentials> TransportSecurity::ChannelCredentials(Role server) const {
  if (!tls()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  const bool present_certificate = identity_.has_value() && token_.empty();
  options.set_certificate_provider(
      present_certificate ? Provider(credentials_dir())
                          : std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
                                dir_ + "/" + kCaCertFile,
                                static_cast<unsigned int>(absl::ToInt64Seconds(kTlsRefresh))));
  options.watch_root_certs();
  if (present_certificate) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  options.set_certificate_verifier(
      grpc::experimental::ExternalCertificateVerifier::Create<ServerRoleVerifier>(server));
  std::shared_ptr<grpc::ChannelCredentials> channel = grpc::experimental::TlsCredentials(options);
  if (token_.empty()) return channel;
  return grpc::CompositeChannelCredentials(channel, grpc::AccessTokenCredentials(token_));
}

absl::Status TransportSecurity::CheckNames(const std::string& host) const {
  if (!tls() || !identity_) return absl::OkStatus();
  const std::string path = dir_ + "/" + kCertFile;
  ASSIGN_OR_RETURN(internal::Cert cert, internal::LoadCert(path));
  std::string bare = host;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  unsigned char addr[sizeof(in6_addr)];
  const bool ip =
      inet_pton(AF_INET, bare.c_str(), addr) == 1 || inet_pton(AF_INET6, bare.c_str(), addr) == 1;
  const int named = ip ? X509_check_ip_asc(cert.get(), bare.c_str(), 0)
                       : X509_check_host(cert.get(), bare.data(), bare.size(), 0, nullptr);
  ERR_clear_error();
  if (named == 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      path, " does not name ", bare, ", the address others dial this process at; issue it with ",
      "pith certs --hosts ", bare));
}

absl::Status TransportSecurity::CheckListen(const std::string& address) const {
  if (tls() || IsLoopbackAddress(address)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--insecure serves loopback addresses only, not ", address, " (use --tls_dir)"));
}

absl::Status TransportSecurity::CheckDial(const std::string& address) const {
  if (tls() || IsLoopbackAddress(address)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--insecure reaches loopback addresses only, not ",
                                                 address, " (use --tls_dir)"));
}

}  // namespace pith::security
