// CertificateStage: the private copy of a server process's TLS directory that its gRPC
// credentials read, so that only checked certificates are ever put in use. At start, and on
// each Reload (SIGHUP), the operator's directory is checked (CheckTlsDir: the key the
// certificate's, signed by the CA, valid now) and must name the same identity; only then
// are its files copied into a new generation of the stage, and `current` (a symlink) is
// swapped to it in one rename. gRPC's file watcher (kTlsRefresh) picks the generation up;
// files that fail the check never reach it, and the certificate in use stays.
//
// The stage lives under $TMPDIR (or /tmp) in a 0700 directory of its own,
// pith-tls-HOST-PID-XXXXXX, files 0600, and is removed with the object. A process killed
// with -9 leaves its stage behind; the next stage made on the host removes those whose
// process is gone.
//
// Thread safety: Reload is thread-safe; Watch is called once, by the stage's maker; dir()
// is immutable.
#ifndef PITH_SECURITY_CERT_STAGE_H_
#define PITH_SECURITY_CERT_STAGE_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "security/identity.h"

namespace pith::security {

class CertificateStage {
 public:
  // Stages `source`, which must hold `identity` (TransportSecurityFromFlags checked it).
  static absl::StatusOr<std::unique_ptr<CertificateStage>> Create(std::string source,
                                                                  Identity identity);
  ~CertificateStage();
  CertificateStage(const CertificateStage&) = delete;
  CertificateStage& operator=(const CertificateStage&) = delete;

  // What the credentials read: ca.pem, cert.pem and key.pem of the current generation.
  const std::string& dir() const { return current_; }
  const std::string& source() const { return source_; }

  // Checks the source again and, when its files are valid and name the same identity,
  // stages them (in use within kTlsRefresh). The error names what is wrong; nothing
  // changes then.
  absl::Status Reload() ABSL_LOCKS_EXCLUDED(mu_);

  // Looks at the source every `period` and, when its files changed since the last look or
  // Reload (their inode, size or time: a replaced file, or a Kubernetes Secret's files
  // swapped by the kubelet), reloads and hands the outcome to `report`, on a thread of the
  // stage's own that stops with the stage; a failed reload is tried again every sixth
  // look. Call it once, from the thread that made the stage.
  void Watch(absl::Duration period, std::function<void(const absl::Status&)> report)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  CertificateStage(std::string source, Identity identity, std::string root)
      : source_(std::move(source)),
        identity_(std::move(identity)),
        root_(std::move(root)),
        current_(root_ + "/current") {}
  // Copies the source's files into generation `n` and points `current` at it; on success
  // the generation before the one that was current goes, on failure generation `n` does.
  absl::Status StageLocked(int n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The source files' inodes, sizes and times, as one string.
  std::string Fingerprint() const;

  const std::string source_;
  const Identity identity_;
  const std::string root_;     // the private directory
  const std::string current_;  // root_/current
  absl::Mutex mu_;
  int generation_ ABSL_GUARDED_BY(mu_) = 0;       // the last one made
  int live_ ABSL_GUARDED_BY(mu_) = 0;             // the one `current` points at
  int previous_ ABSL_GUARDED_BY(mu_) = 0;         // the one before (kept for readers mid-way)
  std::string fingerprint_ ABSL_GUARDED_BY(mu_);  // of the source at the last look
  absl::Notification stop_;
  std::thread watcher_;
};

}  // namespace pith::security

#endif  // PITH_SECURITY_CERT_STAGE_H_
