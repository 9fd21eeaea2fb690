#include "security/certs.h"

#include <arpa/inet.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file.h"
#include "common/status.h"
#include "security/openssl_util.h"

namespace pith::security {
namespace {

using internal::Bio;
using internal::Cert;
using internal::Key;
using internal::LoadCert;
using internal::LoadKey;
using Free = internal::OpenSslFree;

absl::Status Failed(absl::string_view what) { return internal::OpenSslFailure(what); }

// Writes what `write` puts into a memory BIO to `path`, created new (0600 for keys).
absl::Status WritePem(const std::string& path, bool secret, const std::function<int(BIO*)>& write) {
  Bio bio(BIO_new(BIO_s_mem()));
  if (bio == nullptr || write(bio.get()) != 1) return Failed("PEM encoding");
  char* data = nullptr;
  const long size = BIO_get_mem_data(bio.get(), &data);
  return WriteFileAtomically(
      path,
      [&](int fd) -> absl::Status {
        if (secret && ::fchmod(fd, 0600) != 0) {
          return absl::InternalError(absl::StrCat("chmod ", path, ": ", std::strerror(errno)));
        }
        return WriteAll(fd,
                        absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(data),
                                                  static_cast<size_t>(size)),
                        path);
      },
      /*replace=*/false);
}

absl::Status AddExtension(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  std::unique_ptr<X509_EXTENSION, Free> ext(X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str()));
  if (ext == nullptr || X509_add_ext(cert, ext.get(), -1) != 1) {
    return Failed(absl::StrCat("certificate extension ", OBJ_nid2sn(nid), " = ", value));
  }
  return absl::OkStatus();
}

// A certificate for `key` named O=Pith, OU=ou, CN=cn, valid from an hour ago (clock skew)
// for `validity`; `issuer` null for a self-signed one. Extensions are added by the caller
// before Sign.
absl::StatusOr<Cert> NewCert(EVP_PKEY* key, X509* issuer, const std::string& ou,
                             const std::string& cn, absl::Duration validity) {
  Cert cert(X509_new());
  std::unique_ptr<BIGNUM, Free> serial(BN_new());
  if (cert == nullptr || serial == nullptr || X509_set_version(cert.get(), 2) != 1 ||
      BN_rand(serial.get(), 127, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) != 1 ||
      BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get())) == nullptr ||
      X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) == nullptr ||
      X509_gmtime_adj(X509_getm_notAfter(cert.get()), absl::ToInt64Seconds(validity)) == nullptr ||
      X509_set_pubkey(cert.get(), key) != 1) {
    return Failed("new certificate");
  }
  X509_NAME* name = X509_get_subject_name(cert.get());
  for (const auto& [field, value] :
       {std::pair<const char*, std::string>{"O", "Pith"}, {"OU", ou}, {"CN", cn}}) {
    if (X509_NAME_add_entry_by_txt(name, field, MBSTRING_UTF8,
                                   reinterpret_cast<const unsigned char*>(value.c_str()), -1, -1,
                                   0) != 1) {
      return Failed("certificate subject");
    }
  }
  if (X509_set_issuer_name(cert.get(),
                           X509_get_subject_name(issuer != nullptr ? issuer : cert.get())) != 1) {
    return Failed("certificate issuer");
  }
  return cert;
}

absl::Status Sign(X509* cert, EVP_PKEY* key) {
  if (X509_sign(cert, key, EVP_sha256()) <= 0) return Failed("signing a certificate");
  return absl::OkStatus();
}

absl::StatusOr<std::string> SubjectAltNames(const Identity& identity,
                                            const std::vector<std::string>& hosts) {
  std::vector<std::string> names = {"URI:" + IdentityUri(identity)};
  for (const std::string& host : hosts) {
    unsigned char addr[sizeof(in6_addr)];
    if (inet_pton(AF_INET, host.c_str(), addr) == 1 ||
        inet_pton(AF_INET6, host.c_str(), addr) == 1) {
      names.push_back("IP:" + host);
      continue;
    }
    if (host.empty() ||
        host.find_first_not_of("abcdefghijklmnopqrstuvwxyz"
                               "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-*") != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("\"", host, "\" is neither a host name nor an IP address"));
    }
    names.push_back("DNS:" + host);
  }
  return absl::StrJoin(names, ",");
}

}  // namespace

std::vector<std::string> DefaultHosts() {
  std::vector<std::string> hosts = {"localhost", "127.0.0.1", "::1"};
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0' &&
      std::string(name) != "localhost") {
    hosts.emplace_back(name);
  }
  return hosts;
}

absl::StatusOr<bool> EnsureCa(const std::string& dir) {
  const std::string cert_path = dir + "/" + kCaCertFile;
  std::error_code ec;
  if (std::filesystem::exists(cert_path, ec)) return false;
  if (std::filesystem::exists(dir + "/" + kCaKeyFile, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " holds ca.key but no ca.pem (a run stopped midway): remove ca.key to start over"));
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  Key key(EVP_EC_gen("P-256"));
  if (key == nullptr) return Failed("CA key");
  ASSIGN_OR_RETURN(
      Cert cert, NewCert(key.get(), nullptr, "ca", "Pith cluster CA", absl::Hours(24 * 365 * 10)));
  RETURN_IF_ERROR(
      AddExtension(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
  RETURN_IF_ERROR(
      AddExtension(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign"));
  RETURN_IF_ERROR(AddExtension(cert.get(), cert.get(), NID_subject_key_identifier, "hash"));
  RETURN_IF_ERROR(Sign(cert.get(), key.get()));
  // The key first: a CA certificate without its key would block every later Issue.
  RETURN_IF_ERROR(WritePem(dir + "/" + kCaKeyFile, true, [&](BIO* b) {
    return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  }));
  RETURN_IF_ERROR(
      WritePem(cert_path, false, [&](BIO* b) { return PEM_write_bio_X509(b, cert.get()); }));
  return true;
}

absl::Status Issue(const std::string& dir, const Identity& identity, const CertOptions& options) {
  RETURN_IF_ERROR(ValidateName(identity.name));
  const std::string out = dir + "/" + identity.name;
  std::error_code ec;
  if (std::filesystem::exists(out + "/" + kCertFile, ec)) {
    return absl::AlreadyExistsError(absl::StrCat(out, " already holds a certificate"));
  }
  if (std::filesystem::exists(out + "/" + kKeyFile, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(out, " holds a key but no certificate (an issue stopped midway): remove ", out,
                     " and issue again"));
  }
  if (!std::filesystem::exists(dir + "/" + kCaCertFile, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " holds no CA (", kCaCertFile, ")"));
  }
  if (std::filesystem::exists(out, ec) && !std::filesystem::is_directory(out, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(out, " is a file, not a certificate's folder: pick another name"));
  }
  // People's certificates only dial: no server names, no server use, so that none can
  // pose as the coordinator or a store (clients also check the server's role: tls.h).
  const bool person = identity.role == Role::kUser || identity.role == Role::kAdmin;
  if (person && !options.hosts.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(identity.role == Role::kAdmin ? "an admin" : "a user",
                     "'s certificate names no hosts (it serves nothing): no --hosts"));
  }
  ASSIGN_OR_RETURN(Cert ca, LoadCert(dir + "/" + kCaCertFile));
  ASSIGN_OR_RETURN(Key ca_key, LoadKey(dir + "/" + kCaKeyFile));
  std::vector<std::string> hosts;
  if (!person) {
    hosts = DefaultHosts();  // the given ones come beside these
    hosts.insert(hosts.end(), options.hosts.begin(), options.hosts.end());
  }
  ASSIGN_OR_RETURN(std::string sans, SubjectAltNames(identity, hosts));
  Key key(EVP_EC_gen("P-256"));
  if (key == nullptr) return Failed("key");
  ASSIGN_OR_RETURN(Cert cert, NewCert(key.get(), ca.get(), std::string(RoleName(identity.role)),
                                      identity.name, options.validity));
  RETURN_IF_ERROR(AddExtension(cert.get(), ca.get(), NID_basic_constraints, "critical,CA:FALSE"));
  RETURN_IF_ERROR(
      AddExtension(cert.get(), ca.get(), NID_key_usage, "critical,digitalSignature,keyAgreement"));
  RETURN_IF_ERROR(AddExtension(cert.get(), ca.get(), NID_ext_key_usage,
                               person ? "clientAuth" : "serverAuth,clientAuth"));
  RETURN_IF_ERROR(AddExtension(cert.get(), ca.get(), NID_authority_key_identifier, "keyid"));
  RETURN_IF_ERROR(AddExtension(cert.get(), ca.get(), NID_subject_alt_name, sans));
  RETURN_IF_ERROR(Sign(cert.get(), ca_key.get()));

  std::filesystem::create_directories(out, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out, ": ", ec.message()));
  RETURN_IF_ERROR(WritePem(out + "/" + kKeyFile, true, [&](BIO* b) {
    return PEM_write_bio_PrivateKey(b, key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  }));
  RETURN_IF_ERROR(WritePem(out + "/" + kCaCertFile, false,
                           [&](BIO* b) { return PEM_write_bio_X509(b, ca.get()); }));
  // The certificate last: its presence marks the directory complete.
  return WritePem(out + "/" + kCertFile, false,
                  [&](BIO* b) { return PEM_write_bio_X509(b, cert.get()); });
}

}  // namespace pith::security
