#include "security/openssl_util.h"

#include <openssl/err.h>
#include <openssl/pem.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace pith::security::internal {
namespace {

// A file opened for OpenSSL's PEM readers, with the errno of a failed open.
absl::StatusOr<Bio> OpenForReading(const std::string& path) {
  errno = 0;
  Bio bio(BIO_new_file(path.c_str(), "r"));
  if (bio == nullptr) {
    const int err = errno;
    ERR_clear_error();
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("no file ", path));
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", path, ": ", err != 0 ? std::strerror(err) : "unknown"));
  }
  return bio;
}

}  // namespace

std::string OpenSslError() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof(buf));
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out.empty() ? "unknown OpenSSL error" : out;
}

absl::Status OpenSslFailure(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", OpenSslError()));
}

absl::StatusOr<Cert> LoadCert(const std::string& path) {
  absl::StatusOr<Bio> bio = OpenForReading(path);
  if (!bio.ok()) return bio.status();
  Cert cert(PEM_read_bio_X509(bio->get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no PEM certificate"));
  }
  return cert;
}

absl::StatusOr<Key> LoadKey(const std::string& path) {
  absl::StatusOr<Bio> bio = OpenForReading(path);
  if (!bio.ok()) return bio.status();
  Key key(PEM_read_bio_PrivateKey(bio->get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no PEM private key"));
  }
  return key;
}

absl::StatusOr<Identity> CertIdentity(X509* cert, const std::string& path) {
  std::unique_ptr<GENERAL_NAMES, OpenSslFree> names(
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr)));
  std::vector<Identity> found;
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names.get()); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names.get(), i);
    if (name->type != GEN_URI) continue;
    const ASN1_STRING* uri = name->d.uniformResourceIdentifier;
    auto id = ParseIdentityUri(absl::string_view(
        reinterpret_cast<const char*>(ASN1_STRING_get0_data(uri)), ASN1_STRING_length(uri)));
    if (id.ok()) found.push_back(*id);
  }
  if (found.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, " names ", found.size(), " pith:// identities (one is needed; pith certs makes it)"));
  }
  return found[0];
}

}  // namespace pith::security::internal
