// OpenSSL behind RAII, for the certificate code of security/ (private to it).
//
// Thread safety: free functions; OpenSSL's error queue is per thread.
#ifndef PITH_SECURITY_OPENSSL_UTIL_H_
#define PITH_SECURITY_OPENSSL_UTIL_H_

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "security/identity.h"

namespace pith::security::internal {

struct OpenSslFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
  void operator()(X509* p) const { X509_free(p); }
  void operator()(BIO* p) const { BIO_free(p); }
  void operator()(BIGNUM* p) const { BN_free(p); }
  void operator()(X509_EXTENSION* p) const { X509_EXTENSION_free(p); }
  void operator()(X509_STORE* p) const { X509_STORE_free(p); }
  void operator()(X509_STORE_CTX* p) const { X509_STORE_CTX_free(p); }
  void operator()(GENERAL_NAMES* p) const { GENERAL_NAMES_free(p); }
};
using Key = std::unique_ptr<EVP_PKEY, OpenSslFree>;
using Cert = std::unique_ptr<X509, OpenSslFree>;
using Bio = std::unique_ptr<BIO, OpenSslFree>;

// The reason OpenSSL gave for the last failure (its error queue, emptied).
std::string OpenSslError();
// INTERNAL: "what: <OpenSSL's reason>".
absl::Status OpenSslFailure(absl::string_view what);

// The first PEM certificate / private key of a file; NOT_FOUND or INVALID_ARGUMENT
// naming the file.
absl::StatusOr<Cert> LoadCert(const std::string& path);
absl::StatusOr<Key> LoadKey(const std::string& path);

// The one pith:// URI among the certificate's subject alternative names; INVALID_ARGUMENT
// naming `path` otherwise.
absl::StatusOr<Identity> CertIdentity(X509* cert, const std::string& path);

}  // namespace pith::security::internal

#endif  // PITH_SECURITY_OPENSSL_UTIL_H_
