#include "common/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "common/file.h"
#include "common/safetensors_reader.h"
#include "common/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith {
namespace {

using ::testing::HasSubstr;

Buffer ToBuffer(const std::string& s) {
  return *Buffer::CopyOf({reinterpret_cast<const uint8_t*>(s.data()), s.size()});
}

// A file with `header` as its JSON header and `data_bytes` bytes of data.
std::string RawFile(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out += header;
  out.append(data_bytes, '\x01');
  return out;
}

absl::Status ParseStatus(const std::string& file) {
  return SafetensorsFile::Parse(ToBuffer(file)).status();
}

TEST(SafetensorsTest, RoundTripKeepsEveryByteAndTheMetadata) {
  Tensor a = *Tensor::Zeros(DType::kF32, {3, 5});
  for (int i = 0; i < 15; ++i) a.data<float>()[i] = 0.5f * i - 3.0f;
  Tensor b = *Tensor::Zeros(DType::kBF16, {7});
  for (int i = 0; i < 7; ++i) b.data<uint16_t>()[i] = static_cast<uint16_t>(0x3f80 + i);
  Tensor c = *Tensor::Zeros(DType::kU8, {0, 4});  // empty tensors are legal
  Tensor d = *Tensor::Zeros(DType::kI64, {});     // a scalar
  d.data<int64_t>()[0] = -42;

  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("h.0.attn.qkv.w", a.view()).ok());
  ASSERT_TRUE(writer.Add("odd \"name\"\n", b.view()).ok());
  ASSERT_TRUE(writer.Add("empty", c.view()).ok());
  ASSERT_TRUE(writer.Add("scalar", d.view()).ok());
  writer.SetMetadata("step", "17");

  const std::string path = testing::TempDir() + "/roundtrip.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Read(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->entries().size(), 4u);
  EXPECT_EQ(file->metadata().at("step"), "17");
  for (const auto& [name, t] : {std::pair<std::string, const Tensor*>{"h.0.attn.qkv.w", &a},
                                {"odd \"name\"\n", &b},
                                {"empty", &c},
                                {"scalar", &d}}) {
    absl::StatusOr<TensorView> v = file->Get(name);
    ASSERT_TRUE(v.ok()) << name;
    EXPECT_EQ(v->dtype, t->dtype());
    EXPECT_EQ(v->shape, t->shape());
    ASSERT_EQ(v->bytes.size(), t->nbytes());
    EXPECT_EQ(std::memcmp(v->bytes.data(), t->bytes().data(), t->nbytes()), 0) << name;
  }
  EXPECT_EQ(file->Get("missing").status().code(), absl::StatusCode::kNotFound);

  // Serialize() and Write() produce the same bytes, and the data starts 8-byte aligned.
  absl::StatusOr<Buffer> on_disk = ReadFile(path);
  ASSERT_TRUE(on_disk.ok());
  const std::string in_memory = writer.Serialize();
  ASSERT_EQ(in_memory.size(), on_disk->size());
  EXPECT_EQ(std::memcmp(in_memory.data(), on_disk->data(), in_memory.size()), 0);
  uint64_t header_len;
  std::memcpy(&header_len, in_memory.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
}

TEST(SafetensorsTest, WriterRejectsBadInput) {
  Tensor a = *Tensor::Zeros(DType::kF32, {2});
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a", a.view()).ok());
  EXPECT_EQ(writer.Add("a", a.view()).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(writer.Add("", a.view()).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("__metadata__", a.view()).code(), absl::StatusCode::kInvalidArgument);
  TensorView wrong{DType::kF32, {3}, a.bytes()};
  EXPECT_EQ(writer.Add("b", wrong).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, ReadsAFileWrittenByTheReferenceLayout) {
  // Exactly what the reference implementation writes for {"x": F32 [2] = {1, 2}}.
  const std::string header = R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string file = RawFile(header, 0);
  const float values[2] = {1.0f, 2.0f};
  file.append(reinterpret_cast<const char*>(values), 8);
  absl::StatusOr<SafetensorsFile> parsed = SafetensorsFile::Parse(ToBuffer(file));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  absl::StatusOr<TensorView> x = parsed->Get("x");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(x->data<float>()[1], 2.0f);
}

TEST(SafetensorsTest, RejectsABadHeaderLength) {
  EXPECT_THAT(std::string(ParseStatus("abc").message()), HasSubstr("no 8-byte header length"));
  std::string too_long = RawFile("{}", 0);
  const uint64_t n = 1000;
  std::memcpy(too_long.data(), &n, 8);
  EXPECT_THAT(std::string(ParseStatus(too_long).message()),
              HasSubstr("header length (its first 8 bytes) exceeds"));
  const uint64_t huge = ~uint64_t{0};
  std::memcpy(too_long.data(), &huge, 8);
  EXPECT_THAT(std::string(ParseStatus(too_long).message()), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsTest, RejectsMalformedJson) {
  EXPECT_THAT(std::string(ParseStatus(RawFile("{\"x\": ", 0)).message()),
              HasSubstr("not valid JSON"));
  EXPECT_THAT(std::string(ParseStatus(RawFile("[1, 2]", 0)).message()),
              HasSubstr("not a JSON object"));
  EXPECT_THAT(std::string(ParseStatus(RawFile("", 0)).message()), HasSubstr("not a JSON object"));
  EXPECT_THAT(std::string(ParseStatus(RawFile(R"({"x": 3})", 0)).message()),
              HasSubstr("not an object"));
  EXPECT_THAT(std::string(ParseStatus(RawFile(R"({"__metadata__": {"step": 3}})", 0)).message()),
              HasSubstr("is not a string"));
}

TEST(SafetensorsTest, RejectsAnUnknownDtype) {
  const std::string h = R"({"x":{"dtype":"F33","shape":[2],"data_offsets":[0,8]}})";
  absl::Status s = ParseStatus(RawFile(h, 8));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("unknown dtype \"F33\""));
}

TEST(SafetensorsTest, RejectsBadShapesAndOffsets) {
  struct Case {
    std::string header;
    size_t data;
    std::string want;
  };
  const Case cases[] = {
      {R"({"x":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, "non-negative integer"},
      {R"({"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8, "non-negative integer"},
      {R"({"x":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8, "no list \"shape\""},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8, "data_offsets\" pair"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8, "end before they begin"},
      {R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "needs 12"},
      {R"({"x":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
       "too large"},
      {R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"extra":1}})", 8,
       "unknown field \"extra\""},
      {R"({"x":{"shape":[2],"data_offsets":[0,8]}})", 8, "no string \"dtype\""},
  };
  for (const Case& c : cases) {
    absl::Status s = ParseStatus(RawFile(c.header, c.data));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want)) << c.header;
  }
}

TEST(SafetensorsTest, RejectsOverlapGapsTruncationAndTrailingBytes) {
  const std::string overlap = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  EXPECT_THAT(std::string(ParseStatus(RawFile(overlap, 12)).message()), HasSubstr("overlap"));

  const std::string gap = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  EXPECT_THAT(std::string(ParseStatus(RawFile(gap, 12)).message()),
              HasSubstr("belong to no tensor"));

  const std::string late = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  EXPECT_THAT(std::string(ParseStatus(RawFile(late, 8)).message()), HasSubstr("bytes [0, 4)"));

  const std::string whole = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  absl::Status truncated = ParseStatus(RawFile(whole, 10));
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(truncated.message()), HasSubstr("truncated"));

  const std::string far = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                          R"("b":{"dtype":"U8","shape":[1],"data_offsets":[1,4000000000]}})";
  EXPECT_THAT(std::string(ParseStatus(RawFile(far, 2)).message()), HasSubstr("needs 1"));

  EXPECT_THAT(std::string(ParseStatus(RawFile(whole, 20)).message()),
              HasSubstr("4 trailing bytes"));
}

TEST(SafetensorsTest, ReadNamesTheFile) {
  const std::string path = testing::TempDir() + "/garbage.safetensors";
  ASSERT_TRUE(WriteFileAtomically(path, [](int fd) {
                return WriteAll(fd, {reinterpret_cast<const uint8_t*>("xyz"), 3}, "garbage");
              }).ok());
  absl::Status s = SafetensorsFile::Read(path).status();
  EXPECT_THAT(std::string(s.message()), HasSubstr(path));
  EXPECT_EQ(SafetensorsFile::Read(path + ".missing").status().code(), absl::StatusCode::kNotFound);
}

// The reader gives what the in-memory file gives, tensor by tensor, and a streamed write
// (WriteWith) the same file as Write.
TEST(SafetensorsTest, ReaderAndStreamedWriteMatchTheWholeFile) {
  Tensor a = *Tensor::Zeros(DType::kF32, {3, 5});
  for (int i = 0; i < 15; ++i) a.data<float>()[i] = 0.25f * i;
  Tensor b = *Tensor::Zeros(DType::kF32, {7});
  for (int i = 0; i < 7; ++i) b.data<float>()[i] = -1.0f * i;
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a", a.view()).ok());
  ASSERT_TRUE(writer.Add("b", b.view()).ok());
  writer.SetMetadata("k", "v");
  const std::string path = testing::TempDir() + "/reader.safetensors";
  ASSERT_TRUE(writer.Write(path).ok());

  SafetensorsWriter streamed;
  ASSERT_TRUE(streamed.Add("a", TensorView{DType::kF32, {3, 5}, {nullptr, 60}}).ok());
  ASSERT_TRUE(streamed.Add("b", TensorView{DType::kF32, {7}, {nullptr, 28}}).ok());
  streamed.SetMetadata("k", "v");
  const std::string streamed_path = testing::TempDir() + "/streamed.safetensors";
  ASSERT_TRUE(streamed
                  .WriteWith(streamed_path,
                             [&](int fd, const std::map<std::string, uint64_t>& at) {
                               RETURN_IF_ERROR(PwriteAll(fd, b.bytes(), at.at("b"), "streamed"));
                               return PwriteAll(fd, a.bytes(), at.at("a"), "streamed");
                             })
                  .ok());
  EXPECT_EQ(ReadFile(path)->size(), ReadFile(streamed_path)->size());
  EXPECT_EQ(
      std::memcmp(ReadFile(path)->data(), ReadFile(streamed_path)->data(), ReadFile(path)->size()),
      0);

  absl::StatusOr<SafetensorsReader> reader = SafetensorsReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status();
  EXPECT_EQ(reader->entries().size(), 2u);
  EXPECT_EQ(reader->metadata().at("k"), "v");
  std::vector<uint8_t> got(60);
  ASSERT_TRUE(reader->Read("a", absl::MakeSpan(got)).ok());
  EXPECT_EQ(std::memcmp(got.data(), a.bytes().data(), 60), 0);
  EXPECT_EQ((*reader->Find("b"))->shape, std::vector<int64_t>({7}));
  EXPECT_EQ(reader->Read("a", absl::MakeSpan(got).subspan(1)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->Find("c").status().code(), absl::StatusCode::kNotFound);

  // Its header checks are the in-memory file's.
  const std::string bad = testing::TempDir() + "/bad_header.safetensors";
  const std::string raw = RawFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 10);
  ASSERT_TRUE(
      WriteFileAtomically(bad, [&](int fd) {
        return WriteAll(fd, {reinterpret_cast<const uint8_t*>(raw.data()), raw.size()}, bad);
      }).ok());
  absl::Status truncated = SafetensorsReader::Open(bad).status();
  EXPECT_EQ(truncated.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(truncated.message()), HasSubstr(bad));
  EXPECT_EQ(SafetensorsReader::Open(bad + ".missing").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pith
