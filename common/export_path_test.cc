// ExportPath: exports stay under the export root, never go through `..` or a symlink, never
// replace a file; without a root they are off.
#include "common/export_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith {
namespace {

using ::testing::HasSubstr;

class ExportPathTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = std::filesystem::path(::testing::TempDir() + "/export_path_" + std::to_string(getpid()))
                .lexically_normal()
                .string();
    std::filesystem::remove_all(base_);
    root_ = base_ + "/root";
    std::filesystem::create_directories(root_);
    std::filesystem::create_directories(base_ + "/elsewhere");
  }
  void TearDown() override { std::filesystem::remove_all(base_); }
  std::string base_, root_;
};

TEST_F(ExportPathTest, ExportsLandUnderTheRootAndReplaceNothing) {
  absl::StatusOr<ExportPath> dir = ExportPath::Directory(root_, "a/b");
  ASSERT_TRUE(dir.ok()) << dir.status();
  EXPECT_EQ(dir->shown(), root_ + "/a/b");
  EXPECT_TRUE(std::filesystem::is_directory(root_ + "/a/b"));
  // Written through the opened directory: it lands under the root.
  ASSERT_TRUE(WriteFileAtomically(dir->path() + "/f", [](int) { return absl::OkStatus(); }).ok());
  EXPECT_TRUE(std::filesystem::exists(root_ + "/a/b/f"));
  // The root itself, named absolutely, is a directory to export into.
  EXPECT_TRUE(ExportPath::Directory(root_, root_).ok());
  // Absolute under the root is the same place; a new entry must not exist.
  absl::StatusOr<ExportPath> file = ExportPath::NewEntry(root_, root_ + "/a/./b//f");
  EXPECT_EQ(file.status().code(), absl::StatusCode::kAlreadyExists) << file.status();
  file = ExportPath::NewEntry(root_, "a/b/g");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->shown(), root_ + "/a/b/g");
  // A file that appears between the check and the write is not replaced either.
  std::ofstream(root_ + "/a/b/g") << "mine";
  const absl::Status late = WriteFileAtomically(
      file->path(), [](int) { return absl::OkStatus(); }, /*replace=*/false);
  EXPECT_EQ(late.code(), absl::StatusCode::kAlreadyExists) << late;
  std::string kept;
  std::getline(std::ifstream(root_ + "/a/b/g"), kept);
  EXPECT_EQ(kept, "mine");
}

TEST_F(ExportPathTest, EscapesAreRefused) {
  for (const std::string& bad : {base_ + "/elsewhere/x", std::string("../elsewhere/x"),
                                 std::string("a/../../elsewhere/x"), std::string("/etc/passwd")}) {
    absl::StatusOr<ExportPath> p = ExportPath::NewEntry(root_, bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << p.status();
  }
  // A NUL ends the name the kernel sees: "..\0" would pass as a name and open as "..".
  const std::string nul("..\0/..\0/x", 9);
  EXPECT_EQ(ExportPath::NewEntry(root_, nul).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExportPath::Directory(root_, nul).status().code(), absl::StatusCode::kInvalidArgument);
  // A symlink below the root, to a directory outside it, is not followed.
  std::filesystem::create_symlink(base_ + "/elsewhere", root_ + "/link");
  absl::StatusOr<ExportPath> through = ExportPath::NewEntry(root_, "link/x");
  EXPECT_EQ(through.status().code(), absl::StatusCode::kInvalidArgument) << through.status();
  EXPECT_THAT(std::string(through.status().message()), HasSubstr("symlink"));
  through = ExportPath::Directory(root_, "link");
  EXPECT_EQ(through.status().code(), absl::StatusCode::kInvalidArgument) << through.status();
  // A symlink as the final name is an existing entry: never replaced, never followed.
  std::filesystem::create_symlink(base_ + "/elsewhere/target", root_ + "/final");
  EXPECT_EQ(ExportPath::NewEntry(root_, "final").status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_FALSE(std::filesystem::exists(base_ + "/elsewhere/x"));
  EXPECT_FALSE(std::filesystem::exists(base_ + "/elsewhere/target"));
}

TEST_F(ExportPathTest, WithoutARootExportsAreOff) {
  absl::StatusOr<ExportPath> p = ExportPath::Directory("", "/tmp/x");
  EXPECT_EQ(p.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("--export_root"));
  EXPECT_EQ(ExportPath::NewEntry(root_, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ExportPath::NewEntry(root_, root_).status().code(), absl::StatusCode::kInvalidArgument);
}

// ReadPath: with roots, a file is read only from beneath them, whatever path leads to it.
TEST_F(ExportPathTest, ReadsStayBeneathTheReadRoots) {
  const std::string data = root_ + "/data.bin", outside = base_ + "/elsewhere/secret";
  std::ofstream(data) << "tokens";
  std::ofstream(outside) << "secret";
  std::filesystem::create_directories(root_ + "/sub");
  std::filesystem::create_directories(base_ + "/other");
  std::filesystem::create_symlink("../data.bin", root_ + "/sub/inside");  // stays beneath
  std::filesystem::create_symlink(outside, root_ + "/out");               // leads out
  ASSERT_EQ(::mkfifo((root_ + "/fifo").c_str(), 0600), 0);
  std::filesystem::create_symlink(root_ + "/data.bin", root_ + "/absolute");  // refused too
  const std::vector<std::string> roots = {base_ + "/other", root_, root_ + "/sub/"};
  auto read = [&](const std::string& path) -> absl::StatusOr<std::string> {
    absl::StatusOr<ReadPath> opened = ReadPath::Open(path, {.roots = roots}, "train.data_path");
    if (!opened.ok()) return opened.status();
    absl::StatusOr<Buffer> bytes = ReadFile(opened->path());
    if (!bytes.ok()) return opened->Named(bytes.status());
    return std::string(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  };
  EXPECT_EQ(read(data).value_or("?"), "tokens");  // absolute, under the second root
  EXPECT_EQ(read(root_ + "/./sub/../data.bin").value_or("?"), "tokens");
  EXPECT_EQ(read(root_ + "/sub/inside").value_or("?"), "tokens");
  for (const std::string& escape : {outside, root_ + "/../elsewhere/secret", root_ + "/out",
                                    root_ + "/absolute", std::string("/etc/passwd")}) {
    absl::StatusOr<std::string> got = read(escape);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied) << escape;
    EXPECT_THAT(got.status().message(), HasSubstr("train.data_path: ")) << got.status();
    EXPECT_THAT(got.status().message(), HasSubstr("--data_root")) << got.status();
  }
  EXPECT_EQ(read(root_ + "/fifo").status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(read(root_ + "/missing").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read(data + "/under-a-file").status().code(), absl::StatusCode::kNotFound);
  // A relative path lies under the first root (here one without the file).
  EXPECT_EQ(read("data.bin").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read("../root/data.bin").status().code(), absl::StatusCode::kPermissionDenied);
  // Without roots a path is read as given.
  absl::StatusOr<ReadPath> free = ReadPath::Open(outside, {}, "train.data_path");
  ASSERT_TRUE(free.ok()) << free.status();
  EXPECT_EQ(free->path(), outside);
  // A process's roots are checked at its start.
  EXPECT_TRUE(ReadPath::CheckRoots({root_}).ok());
  EXPECT_FALSE(ReadPath::CheckRoots({"relative/dir"}).ok());
  EXPECT_FALSE(ReadPath::CheckRoots({data}).ok());
}

// An excluded folder (a worker's keys, pith up's cluster with its CA key) is out of reach
// however the path gets there, with roots or without.
TEST_F(ExportPathTest, ExcludedFoldersAreOutOfReach) {
  const std::string keys = base_ + "/elsewhere/tls", key = keys + "/ca.key";
  std::filesystem::create_directories(keys);
  std::ofstream(key) << "secret";
  std::ofstream(root_ + "/data.bin") << "tokens";
  std::filesystem::create_symlink(key, base_ + "/elsewhere/innocent");
  const ReadRules anywhere = {.excluded = {base_ + "/elsewhere/./tls/"}};
  for (const std::string& path : {key, base_ + "/elsewhere/innocent", keys + "/../tls/ca.key"}) {
    absl::StatusOr<ReadPath> got = ReadPath::Open(path, anywhere, "train.init_path");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kPermissionDenied) << path;
    EXPECT_THAT(got.status().message(), HasSubstr("which this worker keeps from jobs"));
  }
  absl::StatusOr<ReadPath> fine = ReadPath::Open(root_ + "/data.bin", anywhere, "train.data_path");
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_NE(fine->path(), root_ + "/data.bin");  // read through its descriptor
  // Beneath a root too: the root lets it in, the exclusion keeps it out.
  const ReadRules both = {.roots = {base_}, .excluded = {keys}};
  EXPECT_EQ(ReadPath::Open(key, both, "train.data_path").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(ReadPath::Open(root_ + "/data.bin", both, "train.data_path").ok());
}

}  // namespace
}  // namespace pith
