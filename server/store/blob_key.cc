#include "server/store/blob_key.h"

#include <cstdint>

#include "absl/strings/str_cat.h"

namespace pith::store {
namespace {

void PutBigEndian32(std::string* out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8)
    out->push_back(static_cast<char>((v >> shift) & 0xff));
}

uint32_t GetBigEndian32(absl::string_view in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | static_cast<uint8_t>(in[i]);
  return v;
}

absl::string_view KindName(v1::BlobKind kind) {
  switch (kind) {
    case v1::BLOB_KIND_WEIGHTS:
      return "weights";
    case v1::BLOB_KIND_MASTER:
      return "master";
    case v1::BLOB_KIND_ADAM_M:
      return "adam_m";
    case v1::BLOB_KIND_ADAM_V:
      return "adam_v";
    case v1::BLOB_KIND_STATE:
      return "state";
    default:
      return "unknown";
  }
}

}  // namespace

absl::Status ValidateBlobKey(const v1::BlobKey& key) {
  if (key.job_id().empty() || key.job_id().size() > kMaxJobIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key.job_id must have 1 to ", kMaxJobIdBytes, " bytes"));
  }
  if (key.kind() < v1::BLOB_KIND_WEIGHTS || key.kind() > v1::BLOB_KIND_STATE) {
    return absl::InvalidArgumentError(absl::StrCat("key.kind ", key.kind(), " is not a blob kind"));
  }
  if (key.layer() < -1) {
    return absl::InvalidArgumentError(absl::StrCat("key.layer must be >= -1, got ", key.layer()));
  }
  if (key.layer() == -1) {
    if (key.tensor().empty() || key.tensor().size() > kMaxTensorNameBytes) {
      return absl::InvalidArgumentError("key.tensor must name the dense tensor (layer -1)");
    }
  } else if (key.expert() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("key.expert must be >= 0, got ", key.expert()));
  }
  return absl::OkStatus();
}

std::string JobKeyPrefix(absl::string_view job_id) {
  std::string out;
  out.push_back(static_cast<char>(job_id.size()));
  out.append(job_id.data(), job_id.size());
  return out;
}

std::string EncodeBlobKey(const v1::BlobKey& key) {
  std::string out = JobKeyPrefix(key.job_id());
  // Biased so that layer -1 (dense) sorts first and the byte order is the numeric order.
  PutBigEndian32(&out, static_cast<uint32_t>(key.layer()) ^ 0x80000000u);
  PutBigEndian32(&out, static_cast<uint32_t>(key.layer() == -1 ? 0 : key.expert()) ^ 0x80000000u);
  out.push_back(static_cast<char>(key.kind()));
  if (key.layer() == -1) out.append(key.tensor());
  return out;
}

absl::StatusOr<v1::BlobKey> DecodeBlobKey(absl::string_view in) {
  if (in.empty() || in.size() < 1 + static_cast<size_t>(static_cast<uint8_t>(in[0])) + 9) {
    return absl::InvalidArgumentError("malformed blob key");
  }
  const size_t job_len = static_cast<uint8_t>(in[0]);
  v1::BlobKey key;
  key.set_job_id(std::string(in.substr(1, job_len)));
  in.remove_prefix(1 + job_len);
  key.set_layer(static_cast<int32_t>(GetBigEndian32(in) ^ 0x80000000u));
  const int32_t expert = static_cast<int32_t>(GetBigEndian32(in.substr(4)) ^ 0x80000000u);
  key.set_kind(static_cast<v1::BlobKind>(static_cast<uint8_t>(in[8])));
  in.remove_prefix(9);
  if (key.layer() == -1) {
    key.set_tensor(std::string(in));
  } else {
    key.set_expert(expert);
  }
  if (absl::Status s = ValidateBlobKey(key); !s.ok()) return s;
  return key;
}

std::string BlobKeyDebugString(const v1::BlobKey& key) {
  const std::string name =
      key.layer() == -1 ? key.tensor() : absl::StrCat("h.", key.layer(), ".moe.e", key.expert());
  return absl::StrCat(key.job_id(), "/", name, "/", KindName(key.kind()));
}

}  // namespace pith::store
