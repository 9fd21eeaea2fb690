#include "worker/data/token_dataset.h"

#include <string>
#include <vector>

#include "common/file.h"
#include "gtest/gtest.h"

namespace pith::data {
namespace {

std::string Write(const std::string& name, const std::string& bytes) {
  const std::string path = testing::TempDir() + "/" + name;
  EXPECT_TRUE(
      WriteFileAtomically(path, [&](int fd) {
        return WriteAll(fd, {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, path);
      }).ok());
  return path;
}

TEST(TokenDatasetTest, RowsFollowTheDesignOrderWithWrapAround) {
  // Tokens 0..9; T = 4: row r takes [(r*4) .. (r*4)+4] modulo 10.
  std::string bytes;
  for (int i = 0; i < 10; ++i) bytes.push_back(static_cast<char>(i));
  auto ds = TokenDataset::Open(Write("ten.bin", bytes), 256);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->size(), 10);
  std::vector<int32_t> in(4), tgt(4);
  ds->Row(0, 4, in.data(), tgt.data());
  EXPECT_EQ(in, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{1, 2, 3, 4}));
  ds->Row(2, 4, in.data(), tgt.data());  // starts at 8
  EXPECT_EQ(in, (std::vector<int32_t>{8, 9, 0, 1}));
  EXPECT_EQ(tgt, (std::vector<int32_t>{9, 0, 1, 2}));
  ds->Row(1000000000007, 4, in.data(), tgt.data());  // (r*4) mod 10 = 8
  EXPECT_EQ(in[0], 8);
}

TEST(TokenDatasetTest, WideTokensAreLittleEndianUint16) {
  std::string bytes = {'\x01', '\x00', '\x00', '\x01', '\xff', '\x00'};  // 1, 256, 255
  auto ds = TokenDataset::Open(Write("wide.bin", bytes), 300);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->size(), 3);
  EXPECT_EQ(ds->token(1), 256);
  EXPECT_EQ(TokenDataset::Open(Write("wide_bad.bin", bytes), 256).status().code(),
            absl::StatusCode::kOk);  // as bytes: 6 tokens, all < 256
  EXPECT_EQ(TokenDataset::Open(Write("wide_big.bin", bytes), 200).status().code(),
            absl::StatusCode::kInvalidArgument);  // 256 >= 200
  // A byte-level file (pith data prepare's) under another vocab: the error says why.
  absl::Status odd = TokenDataset::Open(Write("odd.bin", "abc"), 300).status();
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(odd.message().find("vocab_size 300 reads little-endian uint16"),
            absl::string_view::npos)
      << odd;
}

TEST(TokenDatasetTest, BadFilesAreClearErrors) {
  auto missing = TokenDataset::Open("/nonexistent/tokens.bin", 256);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("/nonexistent/tokens.bin"), absl::string_view::npos);
  EXPECT_EQ(TokenDataset::Open(Write("one.bin", "a"), 256).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenDatasetTest, PrepareConcatenatesBytes) {
  const std::string a = Write("a.txt", "hello "), b = Write("b.txt", "world");
  const std::string out = testing::TempDir() + "/tokens.bin";
  auto n = PrepareByteTokens({a, b}, out, 256);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 11);
  auto ds = TokenDataset::Open(out, 256);
  ASSERT_TRUE(ds.ok());
  EXPECT_EQ(ds->token(6), 'w');
  EXPECT_EQ(PrepareByteTokens({a}, out, 50000).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrepareByteTokens({}, out, 256).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PrepareByteTokens({"/nonexistent.txt"}, out, 256).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pith::data
