#include "worker/data/token_dataset.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/file.h"
#include "common/status.h"

namespace pith::data {

namespace {

// How the vocab decides the token width, for the errors a file of the other width meets.
std::string WidthHint(int vocab) {
  if (vocab == 256) return " (model.vocab_size 256 reads one byte per token)";
  return absl::StrCat(" (model.vocab_size ", vocab,
                      " reads little-endian uint16 tokens; pith data prepare writes byte-level "
                      "files, one byte per token, for vocab_size 256)");
}

}  // namespace

absl::StatusOr<TokenDataset> TokenDataset::Open(const std::string& path, int vocab) {
  TokenDataset ds;
  absl::StatusOr<Buffer> bytes = ReadFile(path);
  if (!bytes.ok()) return Annotate(bytes.status(), "token file");
  ds.bytes_ = std::move(*bytes);
  ds.crc32c_ = Crc32c(ds.bytes_.data(), ds.bytes_.size());
  ds.wide_ = vocab != 256;
  if (ds.wide_ && ds.bytes_.size() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("token file ", path, " has an odd size (",
                                                   ds.bytes_.size(), " bytes) for uint16 tokens",
                                                   WidthHint(vocab)));
  }
  ds.size_ = static_cast<int64_t>(ds.bytes_.size() / (ds.wide_ ? 2 : 1));
  if (ds.size_ < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("token file ", path, " holds ", ds.size_, " tokens; at least 2 are needed"));
  }
  for (int64_t i = 0; i < ds.size_; ++i) {
    if (ds.token(i) >= vocab) {
      // The token's value is not quoted: the file may be anything a job named.
      return absl::InvalidArgumentError(absl::StrCat("token file ", path, ": the token at index ",
                                                     i, " is outside vocab ", vocab,
                                                     WidthHint(vocab)));
    }
  }
  return ds;
}

int32_t TokenDataset::token(int64_t i) const {
  if (!wide_) return bytes_.data()[i];
  uint16_t v;
  std::memcpy(&v, bytes_.data() + 2 * i, 2);  // little-endian, as the host
  return v;
}

void TokenDataset::Row(int64_t row, int seq, int32_t* inputs, int32_t* targets) const {
  const auto start = static_cast<int64_t>(static_cast<__int128>(row) * seq % size_);
  int64_t pos = start;  // (row * T) mod n
  for (int j = 0; j <= seq; ++j) {
    const int32_t t = token(pos);
    if (j < seq) inputs[j] = t;
    if (j > 0) targets[j - 1] = t;
    if (++pos == size_) pos = 0;
  }
}

absl::StatusOr<int64_t> PrepareByteTokens(const std::vector<std::string>& inputs,
                                          const std::string& output, int vocab) {
  if (vocab != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vocab ", vocab, ": pith data prepare makes byte-level (vocab 256) token files only"));
  }
  if (inputs.empty()) return absl::InvalidArgumentError("no input text files given");
  std::vector<Buffer> texts;
  int64_t total = 0;
  for (const std::string& path : inputs) {
    ASSIGN_OR_RETURN(Buffer text, ReadFile(path));
    total += static_cast<int64_t>(text.size());
    texts.push_back(std::move(text));
  }
  if (total < 2) return absl::InvalidArgumentError("the input text holds fewer than 2 bytes");
  RETURN_IF_ERROR(WriteFileAtomically(output, [&](int fd) -> absl::Status {
    for (const Buffer& text : texts) RETURN_IF_ERROR(WriteAll(fd, text.span(), output));
    return absl::OkStatus();
  }));
  return total;
}

}  // namespace pith::data
