#include "client/local_record.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "common/file.h"
#include "gtest/gtest.h"

namespace pith::cli {
namespace {

std::string TempDir() {
  std::string tmpl = ::testing::TempDir() + "/local_record_XXXXXX";
  return ::mkdtemp(tmpl.data());
}

TEST(LocalRecordTest, MembersRoundTrip) {
  const std::string dir = TempDir();
  EXPECT_TRUE(absl::IsNotFound(ReadMembers(dir).status()));
  const std::vector<LocalMember> members = {{"coordinator", 11, 1234, 40001, 40002},
                                            {"worker0", 12, 5678, 0, 40003}};
  ASSERT_TRUE(WriteMembers(dir, members).ok());
  absl::StatusOr<std::vector<LocalMember>> read = ReadMembers(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0].name, "coordinator");
  EXPECT_EQ((*read)[0].start, 1234u);
  EXPECT_EQ((*read)[0].grpc_port, 40001);
  EXPECT_EQ((*read)[1].pid, 12);
  EXPECT_EQ((*read)[1].metrics_port, 40003);
  std::filesystem::remove_all(dir);
}

TEST(LocalRecordTest, AnOlderRecordReadsWithoutStartTimes) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/pids") << "coordinator " << ::getpid() << "\nstore0 77\n";
  absl::StatusOr<std::vector<LocalMember>> read = ReadMembers(dir);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 2u);
  EXPECT_EQ((*read)[0].start, 0u);
  EXPECT_TRUE(Alive((*read)[0], ""));  // no start time recorded, no mark: the pid alone
  std::filesystem::remove_all(dir);
}

TEST(LocalRecordTest, AReusedPidIsNotTheMember) {
  const std::optional<uint64_t> start = ProcessStart(::getpid());
  ASSERT_TRUE(start.has_value());
  EXPECT_TRUE(Alive({"me", ::getpid(), *start, 0, 0}, ""));
  // The same pid with another start time: a process that took the member's pid.
  EXPECT_FALSE(Alive({"me", ::getpid(), *start + 1, 0, 0}, ""));
}

TEST(LocalRecordTest, OnlyAProcessWithTheMembersMarkIsTheMember) {
  // A process with the member's --tls_dir among its arguments, and one without.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setpgid(0, 0);  // its own group: the kill below takes the shell's sleep too
    ::execl("/bin/sh", "sh", "-c", "sleep 30; true", "sh", "--tls_dir=/x/tls/store0", nullptr);
    ::_exit(127);
  }
  std::optional<uint64_t> start;
  bool execed = false;
  for (int i = 0; i < 500 && !execed; ++i) {
    std::ifstream in("/proc/" + std::to_string(child) + "/cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    execed = cmdline.find("--tls_dir") != std::string::npos;
    if (!execed) ::usleep(10000);
  }
  ASSERT_TRUE(execed);
  start = ProcessStart(child);
  ASSERT_TRUE(start.has_value());
  const LocalMember m{"store0", child, *start, 0, 0};
  EXPECT_TRUE(Alive(m, "--tls_dir=/x/tls/store0"));
  EXPECT_FALSE(Alive(m, "--tls_dir=/x/tls/store1"));
  EXPECT_FALSE(Alive(m, "--tls_dir=/x/tls/store"));  // a whole argument, not a prefix
  // An older record (no start time) of a pid some other program now holds.
  EXPECT_FALSE(Alive({"coordinator", ::getpid(), 0, 0, 0}, "--tls_dir=/x/tls/coordinator"));
  ::kill(-child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
}

TEST(LocalRecordTest, AnExitedOrZombieProcessIsNotAlive) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  // Until it is reaped the child is a zombie: not running.
  for (int i = 0; i < 200 && ProcessStart(child).has_value(); ++i) ::usleep(10000);
  EXPECT_FALSE(ProcessStart(child).has_value());
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(Alive({"gone", child, 0, 0, 0}, ""));
  EXPECT_FALSE(Alive({"none", 0, 0, 0, 0}, ""));
}

TEST(LocalRecordTest, FlagsAndCoordinatorPortRoundTrip) {
  const std::string dir = TempDir();
  EXPECT_TRUE(ReadUpFlags(dir).empty());
  EXPECT_EQ(ReadCoordinatorPort(dir), 0);
  ASSERT_TRUE(
      WriteUpFlags(
          dir,
          {{"--stores", "3"}, {"--backend", "cpu"}, {"--data_root", ""}, {"--memory_bytes", "0"}})
          .ok());
  ASSERT_TRUE(WriteCoordinatorPort(dir, 40123).ok());
  const std::map<std::string, std::string> flags = ReadUpFlags(dir);
  EXPECT_EQ(flags.size(), 4u);
  EXPECT_EQ(flags.at("--stores"), "3");
  EXPECT_EQ(flags.at("--data_root"), "");  // an empty value takes no other flag's
  EXPECT_EQ(flags.at("--memory_bytes"), "0");
  EXPECT_EQ(ReadCoordinatorPort(dir), 40123);
  std::ofstream(dir + "/coordinator.port") << "99999\n";
  EXPECT_EQ(ReadCoordinatorPort(dir), 0);  // not a port
  std::filesystem::remove_all(dir);
}

TEST(LocalRecordTest, APortWithAListenerIsNotFree) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(fd.valid());
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd.get(), 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const int port = ntohs(addr.sin_port);
  EXPECT_FALSE(LoopbackPortFree(port));
  ASSERT_TRUE(fd.Close().ok());
  EXPECT_TRUE(LoopbackPortFree(port));
}

}  // namespace
}  // namespace pith::cli
