#include "security/flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/process.h"
#include "glog/logging.h"
#include "security/cert_stage.h"

ABSL_FLAG(std::string, tls_dir, "",
          "Mutual TLS: the directory `pith certs` made for this process (ca.pem, cert.pem, "
          "key.pem); to rotate, replace them: they are checked and in use within 12 s (2 s "
          "after a SIGHUP), no restart");
ABSL_FLAG(bool, insecure, false,
          "Plaintext gRPC instead of --tls_dir: every caller is trusted, so only loopback "
          "addresses are allowed");

namespace pith::security {
namespace {

// SIGHUP, or the watcher seeing the files change: the operator's files are checked and,
// valid and of the same identity, staged for use (in use within kTlsRefresh); otherwise the
// certificate in use stays.
void Report(const CertificateStage& stage, const char* cause, const absl::Status& s) {
  if (!s.ok()) {
    LOG(ERROR) << cause << ": " << s.message() << "; the certificate in use stays in use";
    return;
  }
  absl::StatusOr<Identity> now = CheckTlsDir(stage.dir());
  LOG(INFO) << cause << ": " << stage.source() << " holds a valid certificate of "
            << (now.ok() ? DebugString(*now) : "?") << "; new connections use it within "
            << absl::FormatDuration(kTlsRefresh);
}

}  // namespace

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
  if (!security.ok() || !security->tls()) return security;
  // The process's credentials read a checked copy, replaced only by a checked reload (a
  // SIGHUP, or the watcher seeing the files change). One per process, removed (with its
  // private copy and its watcher) at exit.
  static std::unique_ptr<CertificateStage> stage;
  absl::StatusOr<std::unique_ptr<CertificateStage>> staged =
      CertificateStage::Create(security->dir(), *security->identity());
  if (!staged.ok()) return staged.status();
  stage = *std::move(staged);
  OnReloadSignal([] {
    if (stage != nullptr) Report(*stage, "SIGHUP", stage->Reload());
  });
  stage->Watch(kTlsWatch,
               [](const absl::Status& s) { Report(*stage, "the certificate files changed", s); });
  return security->WithCredentialsDir(stage->dir());
}

}  // namespace pith::security
