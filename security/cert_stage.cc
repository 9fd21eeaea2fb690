#include "security/cert_stage.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"
#include "security/tls.h"

namespace pith::security {
namespace {

// Copies `from` into a new file `to`, owner-only (never over an existing file or link).
absl::Status CopyPrivate(const std::string& from, const std::string& to) {
  ASSIGN_OR_RETURN(Buffer bytes, ReadFile(from));
  UniqueFd fd(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (!fd.valid()) {
    return absl::InternalError(absl::StrCat("cannot create ", to, ": ", std::strerror(errno)));
  }
  RETURN_IF_ERROR(WriteAll(fd.get(), bytes.span(), to));
  return fd.Close();
}

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "host";
  for (char* c = name; *c != '\0'; ++c) {
    if (*c == '/' || *c == '-') *c = '_';  // keeps the name one path part, parsable
  }
  return name;
}

// The names of the stages this process made (so that its own sweep leaves them).
ABSL_CONST_INIT absl::Mutex g_made_mu(absl::kConstInit);
std::set<std::string>* MadeStages() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_made_mu) {
  static auto* made = new std::set<std::string>();
  return made;
}
bool MadeHere(const std::string& name) {
  absl::MutexLock lock(&g_made_mu);
  return MadeStages()->count(name) > 0;
}

// Removes the stages that processes of this host, now gone, left in `tmp` (killed with -9:
// no destructor ran): directories pith-tls-HOST-PID-* of this user whose PID is not alive.
// A stage of another host (a shared $TMPDIR) or of a live process stays.
void SweepDeadStages(const std::string& tmp, const std::string& host) {
  const std::string prefix = absl::StrCat("pith-tls-", host, "-");
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(tmp, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const char* digits = name.c_str() + prefix.size();
    char* end = nullptr;
    const long pid = std::strtol(digits, &end, 10);
    if (end == digits || *end != '-' || pid <= 0) continue;
    // Under this process's pid: ours if this process made it, else left by an earlier
    // process that had the pid (PID 1 of a restarted container, say), which is gone.
    const bool this_pid = pid == ::getpid();
    if (this_pid && MadeHere(name)) continue;
    struct stat st;
    if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISDIR(st.st_mode) ||
        st.st_uid != ::geteuid()) {
      continue;
    }
    if (this_pid || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)) {
      std::filesystem::remove_all(entry.path(), ec);
    }
  }
}

// Copies `source`'s files into `dir` (a new generation), checks the copy names `identity`,
// and points `current` at it in one rename.
absl::Status CopyAndSwitch(const std::string& source, const std::string& dir,
                           const std::string& generation, const std::string& current,
                           const Identity& identity) {
  if (::mkdir(dir.c_str(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", std::strerror(errno)));
  }
  for (const char* file : {kCaCertFile, kCertFile, kKeyFile}) {
    RETURN_IF_ERROR(CopyPrivate(absl::StrCat(source, "/", file), absl::StrCat(dir, "/", file)));
  }
  // What was copied is what goes in use: checked again (the source may have changed
  // between its check and the copy).
  absl::StatusOr<Identity> copied = CheckTlsDir(dir);
  if (!copied.ok() || !(*copied == identity)) {
    return absl::UnavailableError(
        absl::StrCat(source, " changed while it was being read: try again"));
  }
  const std::string link = absl::StrCat(current, ".new");
  ::unlink(link.c_str());
  if (::symlink(generation.c_str(), link.c_str()) != 0 ||
      ::rename(link.c_str(), current.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("cannot switch ", current, " to ", dir, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CertificateStage>> CertificateStage::Create(std::string source,
                                                                           Identity identity) {
  const char* env = std::getenv("TMPDIR");
  const std::string tmp = env != nullptr && *env != '\0' ? env : "/tmp";
  const std::string host = HostName();
  SweepDeadStages(tmp, host);
  std::string pattern = absl::StrCat(tmp, "/pith-tls-", host, "-", ::getpid(), "-XXXXXX");
  if (::mkdtemp(pattern.data()) == nullptr) {  // 0700
    return absl::InternalError(absl::StrCat("cannot make a directory for the certificates in use (",
                                            pattern, "): ", std::strerror(errno)));
  }
  {
    absl::MutexLock lock(&g_made_mu);
    MadeStages()->insert(std::filesystem::path(pattern).filename().string());
  }
  std::unique_ptr<CertificateStage> stage(
      new CertificateStage(std::move(source), std::move(identity), pattern));
  absl::MutexLock lock(&stage->mu_);
  stage->fingerprint_ = stage->Fingerprint();
  RETURN_IF_ERROR(stage->StageLocked(++stage->generation_));
  return stage;
}

CertificateStage::~CertificateStage() {
  stop_.Notify();
  if (watcher_.joinable()) watcher_.join();
  std::error_code ec;
  std::filesystem::remove_all(root_, ec);
}

std::string CertificateStage::Fingerprint() const {
  std::string out;
  for (const char* file : {kCaCertFile, kCertFile, kKeyFile}) {
    struct stat st;
    if (::stat(absl::StrCat(source_, "/", file).c_str(), &st) != 0) {
      absl::StrAppend(&out, "-;");
      continue;
    }
    absl::StrAppend(&out, st.st_ino, ",", st.st_size, ",", st.st_mtim.tv_sec, ".",
                    st.st_mtim.tv_nsec, ",", st.st_ctim.tv_sec, ".", st.st_ctim.tv_nsec, ";");
  }
  return out;
}

void CertificateStage::Watch(absl::Duration period,
                             std::function<void(const absl::Status&)> report) {
  if (watcher_.joinable()) return;
  watcher_ = std::thread([this, period, report = std::move(report)] {
    // A failed reload is tried again every kRetryLooks looks even with the files unchanged:
    // a certificate not valid yet, or a full $TMPDIR, get better with time.
    constexpr int kRetryLooks = 6;
    bool failed = false;
    int looks = 0;
    while (!stop_.WaitForNotificationWithTimeout(period)) {
      bool changed;
      {
        absl::MutexLock lock(&mu_);
        changed = Fingerprint() != fingerprint_;
      }
      if (!changed && !(failed && ++looks % kRetryLooks == 0)) continue;
      const absl::Status outcome = Reload();
      failed = !outcome.ok();
      report(outcome);
    }
  });
}

absl::Status CertificateStage::Reload() {
  {
    absl::MutexLock lock(&mu_);
    fingerprint_ = Fingerprint();  // this look, whatever it finds
  }
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
  absl::Status staged = CopyAndSwitch(source_, dir, generation, current_, identity_);
  std::error_code ec;
  if (!staged.ok()) {
    std::filesystem::remove_all(dir, ec);
    return staged;
  }
  // The generation before the one that was live goes; that one stays for a reader mid-way.
  if (previous_ > 0) std::filesystem::remove_all(absl::StrCat(root_, "/gen-", previous_), ec);
  previous_ = live_;
  live_ = n;
  return absl::OkStatus();
}

}  // namespace pith::security
