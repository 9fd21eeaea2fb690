// BlobLog on its own (no RocksDB): appends and reads, file roll-over, punches of dropped
// unsynced bytes, sync points and their marker, recovery's view of spans, copy-forward,
// and a stopped log.
#include "server/store/blob_log.h"

#include <sys/stat.h>

#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pith::store {
namespace {

std::vector<uint8_t> Bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

std::string FreshDir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/blob_log_" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

std::unique_ptr<BlobLog> OpenLog(const std::string& dir, uint64_t file_bytes = 1 << 20) {
  auto log = std::make_unique<BlobLog>(BlobLog::Options{dir, file_bytes, false});
  EXPECT_TRUE(log->OpenFiles().ok());
  EXPECT_TRUE(log->SetSynced(nullptr).ok());
  return log;
}

// Appends `bytes` as `entry`, the way the tier does: write, count it, end the append.
LogSpan Put(BlobLog& log, const LogEntry& entry, const std::vector<uint8_t>& bytes) {
  absl::StatusOr<BlobLog::Appended> a = log.Append(bytes.data(), bytes.size());
  EXPECT_TRUE(a.ok()) << a.status();
  if (!a.ok()) return {};
  EXPECT_TRUE(a->written.ok()) << a->written;
  EXPECT_TRUE(log.Ref(entry, a->span).ok());
  log.EndAppend(*a);
  return a->span;
}

std::vector<uint8_t> ReadBack(BlobLog& log, const LogSpan& span) {
  std::vector<uint8_t> out(span.size);
  absl::StatusOr<LogPin> pin = log.Pin(span.file);
  EXPECT_TRUE(pin.ok()) << pin.status();
  if (!pin.ok()) return {};
  EXPECT_TRUE(log.Read(*pin, span, absl::MakeSpan(out)).ok());
  return out;
}

// A whole sync point as the tier runs one (the marker is the tier's to write); returns
// the marker.
std::string SyncPoint(BlobLog& log) {
  LogSyncPoint p = log.TakeSyncPoint();
  EXPECT_TRUE(log.Sync(p).ok());
  std::string marker = log.MarkSynced(p);
  log.FinishSyncPoint(p);
  log.Dispose(std::move(p));
  return marker;
}

uint64_t AllocatedBytes(const std::string& path) {
  struct stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

TEST(BlobLogTest, AppendsReadBackByPreadAndInPlace) {
  auto log = OpenLog(FreshDir("append"));
  const auto a = Bytes(5000, 1), b = Bytes(7000, 2);
  const LogSpan sa = Put(*log, {"a", 1}, a), sb = Put(*log, {"b", 1}, b);
  EXPECT_EQ(sa.file, sb.file);
  EXPECT_EQ(sb.offset, sa.offset + sa.size);
  EXPECT_EQ(ReadBack(*log, sa), a);
  EXPECT_EQ(ReadBack(*log, sb), b);
  absl::StatusOr<ColdRead> mapped = log->Map(*log->Pin(sb.file), sb);
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  EXPECT_EQ(std::vector<uint8_t>(mapped->data, mapped->data + mapped->size), b);
  EXPECT_EQ(log->Pin(sb.file + 1).status().code(), absl::StatusCode::kDataLoss);
}

TEST(BlobLogTest, StartsANewFileOnceTheOpenOneIsFull) {
  auto log = OpenLog(FreshDir("rollover"), /*file_bytes=*/8000);
  const LogSpan s1 = Put(*log, {"a", 1}, Bytes(6000, 1));
  const LogSpan s2 = Put(*log, {"a", 2}, Bytes(6000, 2));  // the first file is not full yet
  const LogSpan s3 = Put(*log, {"a", 3}, Bytes(6000, 3));
  EXPECT_EQ(s1.file, s2.file);
  EXPECT_NE(s3.file, s1.file);
  EXPECT_EQ(s3.offset, 0u);
  EXPECT_EQ(log->Paths().size(), 2u);
  EXPECT_EQ(ReadBack(*log, s2), Bytes(6000, 2));
}

TEST(BlobLogTest, PunchesTheUnsyncedBytesOfAVersionNothingNames) {
  const std::string dir = FreshDir("punch");
  auto log = OpenLog(dir);
  const auto bytes = Bytes(256 << 10, 1);
  const LogSpan shared = Put(*log, {"weights", 1}, bytes);
  ASSERT_TRUE(log->Ref({"master", 1}, shared).ok());  // LinkData: the same bytes twice
  std::vector<LogPunch> punches;
  log->Unref({"weights", 1}, shared, &punches);
  EXPECT_TRUE(punches.empty()) << "the master copy still names them";
  log->Unref({"master", 1}, shared, &punches);
  ASSERT_EQ(punches.size(), 1u);
  EXPECT_EQ(punches[0].from, shared.offset);
  EXPECT_EQ(punches[0].to, shared.offset + shared.size);
  log->Dispose(std::move(punches));
  const std::string path = log->Paths().at(0);
  log.reset();  // the disposer punches before it stops
  EXPECT_LT(AllocatedBytes(path), bytes.size() / 2);
  EXPECT_EQ(std::filesystem::file_size(path), bytes.size());
}

TEST(BlobLogTest, BytesASyncPointCoveredAreNotPunched) {
  auto log = OpenLog(FreshDir("nopunch"));
  const LogSpan span = Put(*log, {"a", 1}, Bytes(9000, 1));
  SyncPoint(*log);
  std::vector<LogPunch> punches;
  log->Unref({"a", 1}, span, &punches);
  EXPECT_TRUE(punches.empty());
}

TEST(BlobLogTest, ASyncPointMarksWhatIsOnDiskAndDeletesEmptiedFiles) {
  const std::string dir = FreshDir("sync");
  auto log = OpenLog(dir, /*file_bytes=*/8000);
  const LogSpan old = Put(*log, {"a", 1}, Bytes(9000, 1));
  const LogSpan kept = Put(*log, {"a", 2}, Bytes(3000, 2));  // in a second file
  ASSERT_NE(old.file, kept.file);
  const std::string old_path = log->Paths().at(0);
  log->Unref({"a", 1}, old);  // the first file is empty now, deleted at the sync point
  EXPECT_TRUE(std::filesystem::exists(old_path));
  const std::string marker = SyncPoint(*log);
  EXPECT_FALSE(std::filesystem::exists(old_path));
  ASSERT_EQ(marker.size(), 16u);  // (file number, bytes on disk) of the one file left
  uint64_t number, bytes;
  std::memcpy(&number, marker.data(), 8);
  std::memcpy(&bytes, marker.data() + 8, 8);
  EXPECT_EQ(number, kept.file);
  EXPECT_EQ(bytes, kept.offset + kept.size);

  // Bytes appended after the marker are unsynced to the next start; bytes past the end of
  // the file are missing.
  const LogSpan later = Put(*log, {"a", 3}, Bytes(1000, 3));
  log.reset();
  BlobLog reopened(BlobLog::Options{dir, 8000, false});
  ASSERT_TRUE(reopened.OpenFiles().ok());
  ASSERT_TRUE(reopened.SetSynced(&marker).ok());
  EXPECT_EQ(reopened.Check(kept), BlobLog::SpanState::kOnDisk);
  EXPECT_EQ(reopened.Check(later), BlobLog::SpanState::kUnsynced);
  EXPECT_EQ(reopened.Check({later.file, later.offset, later.size + 1}),
            BlobLog::SpanState::kMissing);
  EXPECT_EQ(reopened.Check(old), BlobLog::SpanState::kMissing);
  const std::string bad = "short";
  EXPECT_EQ(reopened.SetSynced(&bad).code(), absl::StatusCode::kDataLoss);
  // A file no version is found in goes at recovery.
  ASSERT_TRUE(reopened.DropUnused().ok());
  EXPECT_TRUE(reopened.Paths().empty());
}

// Under half live (here 45%) a closed file is copied forward: the disk holds at most about
// twice the live bytes (a store whose files sat at a quarter held four times).
TEST(BlobLogTest, CopiesForwardTheLiveBytesOfAMostlyDeadFile) {
  auto log = OpenLog(FreshDir("copy"), /*file_bytes=*/4000);
  const auto live = Bytes(1800, 1);
  const LogSpan from = Put(*log, {"live", 1}, live);
  const LogSpan dead = Put(*log, {"dead", 1}, Bytes(2200, 2));
  log->Unref({"dead", 1}, dead);
  Put(*log, {"new", 1}, Bytes(100, 3));  // opens the second file: the first is closed
  const auto relocate_into = [&](LogSpan* to) {
    return [&log, to](const LogEntry& entry, const LogSpan& f, const LogSpan& t) {
      log->Unref(entry, f);
      ASSERT_TRUE(log->Ref(entry, t, /*shared=*/false).ok());
      *to = t;
    };
  };
  LogSpan to;
  // Too young: versions of recent steps go away by themselves.
  EXPECT_FALSE(*log->CopyForward(relocate_into(&to)));
  for (int i = 0; i < 16; ++i) SyncPoint(*log);
  absl::StatusOr<bool> copied = log->CopyForward(relocate_into(&to));
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_TRUE(*copied);
  EXPECT_NE(to.file, from.file);
  EXPECT_EQ(to.size, from.size);
  EXPECT_EQ(ReadBack(*log, to), live);
  SyncPoint(*log);  // the emptied file goes
  EXPECT_EQ(log->Paths().size(), 1u);
  EXPECT_FALSE(*log->CopyForward(relocate_into(&to)));
}

// On a full disk (`room`: the bytes above the reserve), age does not matter: the closed
// file under half live with the fewest live bytes that fit is copied first.
TEST(BlobLogTest, ANearlyFullDiskCopiesForwardYoungFilesToo) {
  auto log = OpenLog(FreshDir("copy-full"), /*file_bytes=*/4000);
  const LogSpan a = Put(*log, {"a", 1}, Bytes(1500, 1));  // file 1: 1500 of 4000 live
  log->Unref({"a-dead", 1}, Put(*log, {"a-dead", 1}, Bytes(2500, 2)));
  const LogSpan b = Put(*log, {"b", 1}, Bytes(900, 3));  // file 2: 900 of 4000 live
  log->Unref({"b-dead", 1}, Put(*log, {"b-dead", 1}, Bytes(3100, 4)));
  Put(*log, {"new", 1}, Bytes(100, 5));  // file 3, open
  std::vector<LogSpan> moved;
  const auto relocate = [&](const LogEntry& entry, const LogSpan& f, const LogSpan& t) {
    log->Unref(entry, f);
    ASSERT_TRUE(log->Ref(entry, t, /*shared=*/false).ok());
    moved.push_back(f);
  };
  EXPECT_FALSE(*log->CopyForward(relocate));  // young: left alone with room on the disk
  EXPECT_FALSE(*log->CopyForward(relocate, /*room=*/800));  // neither fits in 800 bytes
  ASSERT_TRUE(*log->CopyForward(relocate, /*room=*/10000));
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved[0].file, b.file);  // the fewest live bytes first
  ASSERT_TRUE(*log->CopyForward(relocate, /*room=*/10000));
  ASSERT_EQ(moved.size(), 2u);
  EXPECT_EQ(moved[1].file, a.file);
}

// On a full disk with no closed file to copy, the open one's dead bytes count too (a
// removed job's synced versions would otherwise stay until it fills): it is closed, its
// live bytes copied forward, and it goes at the next sync point.
TEST(BlobLogTest, ANearlyFullDiskCopiesForwardTheOpenFileOnceMostlyDead) {
  const std::string dir = FreshDir("copy-open");
  auto log = OpenLog(dir, /*file_bytes=*/4000);
  const auto live = Bytes(300, 1);
  const LogSpan kept = Put(*log, {"kept", 1}, live);
  const LogSpan removed = Put(*log, {"removed", 1}, Bytes(900, 2));
  SyncPoint(*log);  // on disk: no punch frees the removed job's bytes
  log->Unref({"removed", 1}, removed);
  std::vector<LogSpan> to;
  const auto relocate = [&](const LogEntry& entry, const LogSpan& f, const LogSpan& t) {
    log->Unref(entry, f);
    ASSERT_TRUE(log->Ref(entry, t, /*shared=*/false).ok());
    to.push_back(t);
  };
  EXPECT_FALSE(*log->CopyForward(relocate));  // room on the disk: it waits to fill
  // Under a quarter of a file dead (900 of 4000): not worth a file.
  EXPECT_FALSE(*log->CopyForward(relocate, /*room=*/10000));
  log->Unref({"more", 1}, Put(*log, {"more", 1}, Bytes(200, 3)));
  SyncPoint(*log);
  EXPECT_FALSE(*log->CopyForward(relocate, /*room=*/200));  // its 300 live bytes do not fit
  ASSERT_TRUE(*log->CopyForward(relocate, /*room=*/10000));
  ASSERT_EQ(to.size(), 1u);
  EXPECT_NE(to[0].file, kept.file);
  EXPECT_EQ(ReadBack(*log, to[0]), live);
  SyncPoint(*log);
  const std::vector<std::string> paths = log->Paths();
  ASSERT_EQ(paths.size(), 1u);
  EXPECT_EQ(std::filesystem::file_size(paths[0]), 300u);  // only the live bytes are left
  EXPECT_FALSE(*log->CopyForward(relocate, /*room=*/10000));
}

TEST(BlobLogTest, LeavesAFileThatIsStillMostlyLive) {
  auto log = OpenLog(FreshDir("copy-live"), /*file_bytes=*/4000);
  Put(*log, {"live", 1}, Bytes(2100, 1));
  const LogSpan dead = Put(*log, {"dead", 1}, Bytes(1900, 2));
  log->Unref({"dead", 1}, dead);
  Put(*log, {"new", 1}, Bytes(100, 3));
  for (int i = 0; i < 17; ++i) SyncPoint(*log);
  absl::StatusOr<bool> copied =
      log->CopyForward([](const LogEntry&, const LogSpan&, const LogSpan&) { FAIL(); });
  ASSERT_TRUE(copied.ok()) << copied.status();
  EXPECT_FALSE(*copied);
  EXPECT_EQ(log->Paths().size(), 2u);
}

TEST(BlobLogTest, AStoppedLogTakesNoMoreBytes) {
  auto log = OpenLog(FreshDir("stop"));
  EXPECT_TRUE(log->Stop(absl::OkStatus()).ok());
  EXPECT_TRUE(log->Stopped().ok());
  const absl::Status stopped = log->Stop(absl::ResourceExhaustedError("disk full"));
  EXPECT_EQ(stopped.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(stopped.message().find("disk full"), std::string::npos);
  const auto bytes = Bytes(10, 1);
  EXPECT_EQ(log->Append(bytes.data(), bytes.size()).status(), stopped);
  // The first failure is the one reported.
  EXPECT_EQ(log->Stop(absl::InternalError("later")), stopped);
}

}  // namespace
}  // namespace pith::store
