// The RocksDB tier with a sync interval: commits survive kill -9 before any sync point,
// a sync point puts them on disk, a version dropped before it leaves no bytes to write,
// and a restart refuses (DATA_LOSS) committed versions whose bytes never reached the disk.
// On a full disk (a small tmpfs, where the test may mount one) puts are refused before
// RocksDB meets it, commits go on, and a start says so in one line.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/crc32c.h"
#include "common/file.h"
#include "common/status.h"
#include "common/tmpfs_testing.h"
#include "gtest/gtest.h"
#include "server/store/cold_tier.h"

namespace pith::store {
namespace {

constexpr uint64_t kBlob = 20000;  // bytes per version: several 4 KiB blocks
const std::vector<std::string> kKeys = {"a", "b", "c"};

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

RocksColdTierOptions Interval(absl::Duration interval) {
  RocksColdTierOptions o;
  o.log_file_bytes = 1 << 20;  // every version of a test in one file
  o.sync_interval = interval;
  return o;
}

// One step as a store does it: the new versions' bytes, their records (with their CRCs)
// in one synced batch, then the old versions dropped.
void Step(ColdTier& tier, const std::vector<std::string>& keys, int64_t step) {
  ColdBatch commit;
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::vector<uint8_t> bytes = Bytes(kBlob, step * 100 + i);
    ASSERT_TRUE(tier.PutData(keys[i], step, bytes).ok());
    commit.set_records.push_back({keys[i], {step, kBlob, Crc32c(bytes.data(), bytes.size())}});
  }
  commit.set_job_steps["job"] = step;
  ASSERT_TRUE(tier.Apply(commit, /*sync=*/true).ok());
  ColdBatch cleanup;
  for (const auto& k : keys) cleanup.delete_data.push_back({k, step - 1});
  ASSERT_TRUE(tier.Apply(cleanup, /*sync=*/false).ok());
}

// Kills this (child) process as `kill -9` would, with everything it holds still open.
void Die() {
  if (::testing::Test::HasFailure()) _exit(9);  // an assertion in the child failed
  kill(getpid(), SIGKILL);
}

// Runs `body` in a child process; the body ends with Die() (before the tier it opened
// closes: a clean close is a sync point).
void RunAndKill(const std::function<void()>& body) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    body();
    _exit(8);  // the body did not die
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "child failed: " << status;
}

// A store's tier in `dir` that commits steps 1..`steps`, waits `linger`, and is killed.
void CommitStepsAndKill(const std::string& dir, absl::Duration interval, int64_t steps,
                        absl::Duration linger = absl::ZeroDuration()) {
  std::filesystem::remove_all(dir);
  RunAndKill([&] {
    auto tier = OpenRocksColdTier(dir, Interval(interval));
    if (!tier.ok()) _exit(1);
    for (int64_t step = 1; step <= steps; ++step) Step(**tier, kKeys, step);
    std::this_thread::sleep_for(absl::ToChronoMilliseconds(linger));
    Die();
  });
}

std::vector<std::string> LogFiles(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir + "/blobs")) {
    if (e.is_regular_file()) out.push_back(e.path().string());
  }
  return out;
}

// What a disk that never got the pages reads back after the machine stopped.
void ZeroLogFiles(const std::string& dir) {
  for (const std::string& path : LogFiles(dir)) {
    const uint64_t size = std::filesystem::file_size(path);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0) << path;
    const std::vector<uint8_t> zeros(size, 0);
    ASSERT_EQ(::pwrite(fd, zeros.data(), size, 0), static_cast<ssize_t>(size));
    ::close(fd);
  }
}

void ExpectStep(ColdTier& tier, const std::vector<std::string>& keys, int64_t step) {
  auto contents = tier.Load();
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(contents->job_steps.at("job"), step);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(contents->records.at(keys[i]).version, step);
    std::vector<uint8_t> got(kBlob);
    ASSERT_TRUE(tier.ReadData(keys[i], step, absl::MakeSpan(got)).ok()) << keys[i];
    EXPECT_EQ(got, Bytes(kBlob, step * 100 + i)) << keys[i];
  }
}

TEST(RocksColdTierSyncTest, CommitsSurviveKillBeforeAnySyncPoint) {
  const std::string dir = ::testing::TempDir() + "/rocks_sync_kill";
  CommitStepsAndKill(dir, absl::Hours(1), 8);  // no sync point comes
  auto tier = OpenRocksColdTier(dir, Interval(absl::Hours(1)));
  ASSERT_TRUE(tier.ok()) << tier.status();
  ExpectStep(**tier, kKeys, 8);
}

TEST(RocksColdTierSyncTest, AStopBeforeTheSyncPointIsRefusedNotServed) {
  const std::string dir = ::testing::TempDir() + "/rocks_sync_lost";
  CommitStepsAndKill(dir, absl::Hours(1), 3);
  // The records reached the disk, the log bytes did not: the restart says so.
  ZeroLogFiles(dir);
  auto tier = OpenRocksColdTier(dir, Interval(absl::Hours(1)));
  ASSERT_FALSE(tier.ok());
  EXPECT_EQ(tier.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(tier.status().message().find("fails its checksum"), std::string::npos) << tier.status();
  EXPECT_NE(tier.status().message().find("--sync_interval_ms"), std::string::npos) << tier.status();
  // And it stays refused: the failed open changed nothing on disk.
  EXPECT_EQ(OpenRocksColdTier(dir, Interval(absl::Hours(1))).status().code(),
            absl::StatusCode::kDataLoss);
}

TEST(RocksColdTierSyncTest, ASyncPointCoversEveryCommitBeforeIt) {
  const std::string dir = ::testing::TempDir() + "/rocks_sync_point";
  // The group sync runs within the half second.
  CommitStepsAndKill(dir, absl::Milliseconds(20), 4, absl::Milliseconds(500));
  // Every committed byte was on disk before the kill, as the marker says: nothing to
  // check at the start (the zeros are then the cold reads' CRC checks' to find).
  ZeroLogFiles(dir);
  auto tier = OpenRocksColdTier(dir, Interval(absl::Milliseconds(20)));
  EXPECT_TRUE(tier.ok()) << tier.status();
}

TEST(RocksColdTierSyncTest, AVersionDroppedBeforeTheSyncPointLeavesNoBytesToWrite) {
  const std::string dir = ::testing::TempDir() + "/rocks_sync_punch";
  std::filesystem::remove_all(dir);
  auto tier = OpenRocksColdTier(dir, Interval(absl::Hours(1)));
  ASSERT_TRUE(tier.ok()) << tier.status();
  for (int64_t step = 1; step <= 10; ++step) Step(**tier, kKeys, step);
  // Ten steps written into one file; nine of them were dropped and punched out.
  const std::vector<std::string> files = LogFiles(dir);
  ASSERT_EQ(files.size(), 1u);
  // The punches run on the tier's disposer thread: give it a few seconds to catch up.
  struct stat st;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (true) {
    ASSERT_EQ(::stat(files[0].c_str(), &st), 0);
    const bool punched = static_cast<uint64_t>(st.st_blocks) * 512 <= 4 * kKeys.size() * kBlob;
    if (punched || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 10 * kKeys.size() * kBlob);
  EXPECT_LE(static_cast<uint64_t>(st.st_blocks) * 512, 4 * kKeys.size() * kBlob)
      << "allocated bytes of " << st.st_size;
  ExpectStep(**tier, kKeys, 10);
  // A clean close is a sync point: the next start has nothing to check, and finds all.
  tier->reset();
  auto reopened = OpenRocksColdTier(dir, Interval(absl::Hours(1)));
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  ExpectStep(**reopened, kKeys, 10);
}

TEST(RocksColdTierSyncTest, EveryCommitSyncedWithAZeroInterval) {
  const std::string dir = ::testing::TempDir() + "/rocks_sync_zero";
  CommitStepsAndKill(dir, absl::ZeroDuration(), 3);
  ZeroLogFiles(dir);  // on disk at each commit: nothing left to check
  EXPECT_TRUE(OpenRocksColdTier(dir, Interval(absl::ZeroDuration())).ok());
}

TEST(RocksColdTierDiskTest, AFullDiskRefusesPutsKeepsCommitsAndIsNamedAtStart) {
  const std::string mnt = ::testing::TempDir() + "/rocks_full_" + std::to_string(getpid());
  const pith::testing::ScopedTmpfs tmpfs(mnt, "24m");
  if (!tmpfs.mounted()) GTEST_SKIP() << tmpfs.why();
  const std::string dir = mnt + "/store";
  RocksColdTierOptions options = Interval(absl::ZeroDuration());
  options.disk_reserve_bytes = 8 << 20;
  {
    auto tier = OpenRocksColdTier(dir, options);
    ASSERT_TRUE(tier.ok()) << tier.status();
    Step(**tier, kKeys, 1);
    // Puts fill the disk down to the reserve, then are refused with a clear reason.
    absl::Status put;
    const std::vector<uint8_t> big = Bytes(1 << 20, 7);
    for (int i = 0; i < 64 && put.ok(); ++i) put = (*tier)->PutData("filler", 100 + i, big);
    EXPECT_EQ(put.code(), absl::StatusCode::kResourceExhausted) << put;
    EXPECT_TRUE(IsDiskFull(put)) << put;  // told from other exhaustion
    EXPECT_NE(put.message().find("--disk_reserve_bytes"), std::string::npos) << put;
    // The index is still writable: a step commits, the tier is healthy.
    Step(**tier, kKeys, 2);
    EXPECT_TRUE((*tier)->Health().ok());
    ExpectStep(**tier, kKeys, 2);
  }
  // Something else fills the disk: the store refuses to start, in one line, and
  // starts again with every committed step once there is room.
  {
    const int fd = ::open((mnt + "/other").c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0);
    const std::vector<uint8_t> chunk(1 << 20, 1);
    while (::write(fd, chunk.data(), chunk.size()) > 0) {
    }
    ::close(fd);
  }
  auto full = OpenRocksColdTier(dir, options);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("is full"), std::string::npos) << full.status();
  std::filesystem::remove(mnt + "/other");
  auto again = OpenRocksColdTier(dir, options);
  ASSERT_TRUE(again.ok()) << again.status();
  ExpectStep(**again, kKeys, 2);
}

}  // namespace
}  // namespace pith::store
