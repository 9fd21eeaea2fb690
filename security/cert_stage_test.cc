// CertificateStage: stages a checked copy, refuses a reload that changes the identity,
// removes its directory when it goes, sweeps the stages of dead processes (only those of
// this host and this user whose process is gone), and its watcher stages replaced files.
#include "security/cert_stage.h"

#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "security/certs.h"
#include "security/tls.h"

namespace pith::security {
namespace {

namespace fs = std::filesystem;

pid_t DeadPid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

std::string Host() {
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  for (char* c = name; *c != '\0'; ++c) {
    if (*c == '/' || *c == '-') *c = '_';
  }
  return name;
}

TEST(CertificateStageTest, StagesReloadsSweepsAndCleansUp) {
  const std::string dir = ::testing::TempDir() + "/cert_stage_test";
  fs::remove_all(dir);
  ASSERT_TRUE(EnsureCa(dir).ok());
  ASSERT_TRUE(Issue(dir, {Role::kMember, "store-0"}).ok());
  ASSERT_TRUE(Issue(dir, {Role::kMember, "store-1"}).ok());
  const std::string tmp = dir + "/tmp";
  fs::create_directories(tmp);
  ::setenv("TMPDIR", tmp.c_str(), 1);
  const std::string dead = absl::StrCat(tmp, "/pith-tls-", Host(), "-", DeadPid(), "-aaaaaa");
  const std::string live = absl::StrCat(tmp, "/pith-tls-", Host(), "-", ::getppid(), "-bbbbbb");
  const std::string other = absl::StrCat(tmp, "/pith-tls-elsewhere-", DeadPid(), "-cccccc");
  // An earlier process with this pid (PID 1 of a restarted container) left this one.
  const std::string mine = absl::StrCat(tmp, "/pith-tls-", Host(), "-", ::getpid(), "-dddddd");
  for (const std::string& d : {dead, live, other, mine}) fs::create_directories(d + "/gen-1");

  auto identity = CheckTlsDir(dir + "/store-0");
  ASSERT_TRUE(identity.ok()) << identity.status();
  auto stage = CertificateStage::Create(dir + "/store-0", *identity);
  ::unsetenv("TMPDIR");
  ASSERT_TRUE(stage.ok()) << stage.status();
  EXPECT_FALSE(fs::exists(dead)) << "a dead process's stage stays";
  EXPECT_FALSE(fs::exists(mine)) << "an earlier process's stage under this pid stays";
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  auto staged = CheckTlsDir((*stage)->dir());
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(*staged == *identity);

  EXPECT_TRUE((*stage)->Reload().ok());
  // Another identity's files in the source: refused, and the stage keeps what it had.
  for (const char* f : {kCertFile, kKeyFile}) {
    fs::copy_file(absl::StrCat(dir, "/store-1/", f), absl::StrCat(dir, "/store-0/", f),
                  fs::copy_options::overwrite_existing);
  }
  EXPECT_EQ((*stage)->Reload().code(), absl::StatusCode::kInvalidArgument);
  staged = CheckTlsDir((*stage)->dir());
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(*staged == *identity);

  const fs::path root = fs::path((*stage)->dir()).parent_path();
  stage->reset();
  EXPECT_FALSE(fs::exists(root));
  fs::remove_all(dir);
}

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(CertificateStageTest, TheWatcherStagesReplacedFiles) {
  const std::string dir = ::testing::TempDir() + "/cert_stage_watch";
  fs::remove_all(dir);
  ASSERT_TRUE(EnsureCa(dir).ok());
  ASSERT_TRUE(Issue(dir, {Role::kMember, "store-0"}).ok());
  // The same identity again, from the same CA, in another directory: the rotation.
  const std::string next = dir + "/next";
  fs::create_directories(next);
  for (const char* f : {kCaCertFile, kCaKeyFile}) {
    fs::copy_file(absl::StrCat(dir, "/", f), absl::StrCat(next, "/", f));
  }
  ASSERT_TRUE(Issue(next, {Role::kMember, "store-0"}).ok());
  auto identity = CheckTlsDir(dir + "/store-0");
  ASSERT_TRUE(identity.ok()) << identity.status();
  absl::Notification reloaded;  // outlives the stage, whose watcher notifies it
  ::setenv("TMPDIR", ::testing::TempDir().c_str(), 1);
  auto stage = CertificateStage::Create(dir + "/store-0", *identity);
  ::unsetenv("TMPDIR");
  ASSERT_TRUE(stage.ok()) << stage.status();
  (*stage)->Watch(absl::Milliseconds(20), [&](const absl::Status&) {
    if (!reloaded.HasBeenNotified()) reloaded.Notify();
  });
  absl::SleepFor(absl::Milliseconds(100));  // unchanged files: nothing happens
  EXPECT_FALSE(reloaded.HasBeenNotified());
  // Replaced as a tool would: new files renamed over the old ones.
  for (const char* f : {kKeyFile, kCertFile}) {
    fs::copy_file(absl::StrCat(next, "/store-0/", f), absl::StrCat(dir, "/store-0/", f, ".new"));
    fs::rename(absl::StrCat(dir, "/store-0/", f, ".new"), absl::StrCat(dir, "/store-0/", f));
  }
  ASSERT_TRUE(reloaded.WaitForNotificationWithTimeout(absl::Seconds(10)));
  // The watcher may have looked between the two renames (a key that is not the
  // certificate's: refused); it looks again once the second lands.
  for (int i = 0; i < 100 && Read((*stage)->dir() + "/cert.pem") !=
                                 Read(absl::StrCat(next, "/store-0/", kCertFile));
       ++i) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(Read((*stage)->dir() + "/cert.pem"), Read(absl::StrCat(next, "/store-0/", kCertFile)));
  stage->reset();  // stops the watcher
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pith::security
