#include "security/cert_stage.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "security/tls.h"

namespace pith::security {
namespace {

absl::StatusOr<std::string> ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  return out.str();
}

absl::Status WriteFile(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("cannot create ", path, ": ", std::strerror(errno)));
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (done != bytes.size()) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CertificateStage>> CertificateStage::Create(std::string source,
                                                                           Identity identity) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern =
      absl::StrCat(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp", "/pith-tls-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {  // 0700
    return absl::InternalError(absl::StrCat("cannot make a directory for the certificates in use (",
                                            pattern, "): ", std::strerror(errno)));
  }
  std::unique_ptr<CertificateStage> stage(
      new CertificateStage(std::move(source), std::move(identity), pattern));
  absl::MutexLock lock(&stage->mu_);
  RETURN_IF_ERROR(stage->StageLocked(++stage->generation_));
  return stage;
}

CertificateStage::~CertificateStage() {
  std::error_code ec;
  std::filesystem::remove_all(root_, ec);
}

absl::Status CertificateStage::Reload() {
  ASSIGN_OR_RETURN(Identity now, CheckTlsDir(source_));
  if (!(now == identity_)) {
    return absl::InvalidArgumentError(
        absl::StrCat(source_, " now holds the certificate of ", DebugString(now), ", not of ",
                     DebugString(identity_), ": a process keeps its identity"));
  }
  absl::MutexLock lock(&mu_);
  return StageLocked(++generation_);
}

absl::Status CertificateStage::StageLocked(int n) {
  const std::string generation = absl::StrCat("gen-", n);
  const std::string dir = absl::StrCat(root_, "/", generation);
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  if (::mkdir(dir.c_str(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", std::strerror(errno)));
  }
  for (const char* file : {kCaCertFile, kCertFile, kKeyFile}) {
    ASSIGN_OR_RETURN(std::string bytes, ReadAll(absl::StrCat(source_, "/", file)));
    RETURN_IF_ERROR(WriteFile(absl::StrCat(dir, "/", file), bytes));
  }
  // What was copied is what goes in use: checked again (the source may have changed
  // between its check and the copy).
  absl::StatusOr<Identity> copied = CheckTlsDir(dir);
  if (!copied.ok() || !(*copied == identity_)) {
    std::filesystem::remove_all(dir, ec);
    return absl::UnavailableError(
        absl::StrCat(source_, " changed while it was being read: try again"));
  }
  // `current` moves in one rename; the generation before stays for a reader mid-way.
  const std::string link = absl::StrCat(root_, "/current.new");
  ::unlink(link.c_str());
  if (::symlink(generation.c_str(), link.c_str()) != 0 ||
      ::rename(link.c_str(), current_.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot switch ", current_, " to ", dir, ": ", std::strerror(errno)));
  }
  std::filesystem::remove_all(absl::StrCat(root_, "/gen-", n - 2), ec);
  return absl::OkStatus();
}

}  // namespace pith::security
