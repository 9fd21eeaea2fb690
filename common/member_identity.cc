#include "common/member_identity.h"

#include <unistd.h>

#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/file.h"
#include "common/status.h"

namespace pith {
namespace {

constexpr size_t kDigits = 32;

bool IsIdentity(const std::string& s) {
  if (s.size() != kDigits) return false;
  for (char c : s) {
    if (!absl::ascii_isxdigit(c) || absl::ascii_isupper(c)) return false;
  }
  return true;
}

// The one line of a small file of the data dir, without its whitespace.
absl::StatusOr<std::string> ReadLine(const std::string& path) {
  ASSIGN_OR_RETURN(Buffer kept, ReadFile(path));
  return std::string(absl::StripAsciiWhitespace(
      absl::string_view(reinterpret_cast<const char*>(kept.data()), kept.size())));
}

absl::Status WriteLine(const std::string& path, const std::string& text) {
  const std::string line = text + "\n";
  return WriteFileAtomically(path, [&](int fd) {
    return WriteAll(fd, {reinterpret_cast<const uint8_t*>(line.data()), line.size()}, path);
  });
}

}  // namespace

std::string NewRandomId() {
  std::random_device random;  // the kernel's entropy
  std::string id;
  constexpr char kHex[] = "0123456789abcdef";
  while (id.size() < kDigits) {
    const uint32_t bits = random();
    for (int i = 0; i < 8 && id.size() < kDigits; ++i) id.push_back(kHex[(bits >> (4 * i)) & 15]);
  }
  return id;
}

absl::StatusOr<std::string> LoadOrCreateIdentity(const std::string& data_dir) {
  const std::string path = data_dir + "/pith-member-identity";
  absl::StatusOr<std::string> existing = ReadLine(path);
  if (existing.ok()) {
    if (!IsIdentity(*existing)) {
      return absl::DataLossError(absl::StrCat(path, ": not a member identity (32 hex digits)"));
    }
    return existing;
  }
  if (!absl::IsNotFound(existing.status())) return existing.status();
  const std::string id = NewRandomId();
  RETURN_IF_ERROR(WriteLine(path, id));
  return id;
}

absl::Status KeepClusterId(const std::string& data_dir, const std::string& cluster_id) {
  if (cluster_id.empty()) return absl::OkStatus();
  const std::string path = data_dir + "/pith-cluster-id";
  absl::StatusOr<std::string> kept = ReadLine(path);
  if (absl::IsNotFound(kept.status())) return WriteLine(path, cluster_id);
  if (!kept.ok()) return kept.status();
  if (*kept == cluster_id) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("the data in ", data_dir, " belongs to cluster ", *kept,
                   ", and this coordinator's is ", cluster_id,
                   " (its data was replaced?): point the store at its own cluster's "
                   "coordinator, or give it an empty --data_dir to join this one"));
}

}  // namespace pith
