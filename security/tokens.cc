#include "security/tokens.h"

#include <fcntl.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/file.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pith::security {
namespace {

constexpr char kExpires[] = "expires=";

// The expiry of a line's optional fourth field ("expires=RFC3339").
std::optional<absl::Time> ParseExpiry(absl::string_view field) {
  absl::Time t;
  std::string error;
  if (!absl::ConsumePrefix(&field, kExpires) ||
      !absl::ParseTime(absl::RFC3339_full, field, &t, &error)) {
    return std::nullopt;
  }
  return t;
}

// The tokens of `text`; a line that is not "NAME user|admin SHA256HEX [expires=T]" is an
// error, or, with `skipped` given, is listed there (its number) and left out (the other lines still
// count: a token removed beside a bad edit is revoked all the same).
absl::StatusOr<std::map<std::string, TokenRecord>> Parse(const std::string& path,
                                                         const std::string& text,
                                                         std::vector<int>* skipped = nullptr) {
  std::map<std::string, TokenRecord> out;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    line = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
    if (line.empty()) continue;
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    const bool sized = fields.size() == 3 || fields.size() == 4;
    absl::StatusOr<Role> role = sized ? ParseRole(fields[1]) : absl::InvalidArgumentError("");
    const std::optional<absl::Time> expires =
        fields.size() == 4 ? ParseExpiry(fields[3]) : absl::InfiniteFuture();
    if (!sized || !ValidateName(fields[0]).ok() || !role.ok() ||
        (*role != Role::kUser && *role != Role::kAdmin) || fields[2].size() != 64 ||
        fields[2].find_first_not_of("0123456789abcdef") != std::string::npos || !expires) {
      if (skipped != nullptr) {
        skipped->push_back(number);
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat(path, " line ", number,
                       ": want NAME user|admin SHA256HEX [expires=RFC3339] (as pith token "
                       "writes)"));
    }
    out[fields[2]] = TokenRecord{Identity{*role, fields[0]}, *expires};
  }
  return out;
}

// Rewrites `path` (atomically, 0600) without the token lines of `name`, with `add` (a
// whole line, or empty) after the rest; returns how many lines of `name` went.
absl::StatusOr<int> RewriteWithout(const std::string& path, const std::string& name,
                                   const std::string& add) {
  // One rewrite at a time (two at once would each drop the other's line): a lock file
  // beside it, as the file itself is replaced.
  const UniqueFd lock(
      ::open((path + ".lock").c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600));
  if (lock.get() < 0 || ::flock(lock.get(), LOCK_EX) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot lock ", path, ".lock: ", std::strerror(errno)));
  }
  // The new file keeps the old one's owner, group and mode (group-readable at most): the
  // coordinator's user must still read it after an administrator rotated a token.
  struct stat st {};
  const bool existed = ::lstat(path.c_str(), &st) == 0;
  if (existed && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file (a symlink?)"));
  }
  std::string kept;
  int dropped = 0;
  if (existed) {
    ASSIGN_OR_RETURN(Buffer old, ReadFile(path));
    const absl::string_view text(reinterpret_cast<const char*>(old.data()), old.size());
    // Only a token file is rewritten (a mistyped --file must not take a token line, nor
    // lose its mode): one with no token record but other lines is not one. A bad line
    // beside token records is kept as it is (a revocation must not wait for its fix).
    std::vector<int> skipped;
    ASSIGN_OR_RETURN(const auto records, Parse(path, std::string(text), &skipped));
    if (records.empty() && !skipped.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " has no line NAME user|admin SHA256HEX: not a token file, left as it was"));
    }
    std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
    if (!lines.empty() && lines.back().empty()) lines.pop_back();  // the last line's end
    for (absl::string_view line : lines) {
      const absl::string_view body = absl::StripAsciiWhitespace(line.substr(0, line.find('#')));
      const std::vector<absl::string_view> fields = absl::StrSplit(body, ' ', absl::SkipEmpty());
      if (!fields.empty() && fields[0] == name) {
        ++dropped;
        continue;
      }
      absl::StrAppend(&kept, line, "\n");
    }
  }
  if (dropped == 0 && add.empty()) return 0;  // nothing to change
  kept += add;
  const mode_t mode = existed ? (st.st_mode & 0640) : 0600;
  RETURN_IF_ERROR(WriteFileAtomically(path, [&](int fd) -> absl::Status {
    if ((existed && ::fchown(fd, st.st_uid, st.st_gid) != 0) || ::fchmod(fd, mode) != 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          "cannot give the new ", path, " the old one's owner and mode: ", std::strerror(errno)));
    }
    return WriteAll(fd, {reinterpret_cast<const uint8_t*>(kept.data()), kept.size()}, path);
  }));
  return dropped;
}

}  // namespace

std::string TokenHash(const std::string& token) {
  unsigned char digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(digest), sizeof(digest)));
}

absl::StatusOr<std::string> AddToken(const std::string& path, const Identity& identity,
                                     int* replaced, absl::Time expires) {
  if (absl::Status s = ValidateName(identity.name); !s.ok()) return s;
  if (identity.role != Role::kUser && identity.role != Role::kAdmin) {
    return absl::InvalidArgumentError("tokens are for the user and admin roles only");
  }
  unsigned char random[32];
  if (RAND_bytes(random, sizeof(random)) != 1) {
    return absl::InternalError("cannot make a random token");
  }
  const std::string token =
      absl::StrCat("pith_", absl::BytesToHexString(absl::string_view(
                                reinterpret_cast<const char*>(random), sizeof(random))));
  std::string line =
      absl::StrCat(identity.name, " ", RoleName(identity.role), " ", TokenHash(token));
  if (expires != absl::InfiniteFuture()) {
    absl::StrAppend(&line, " ", kExpires,
                    absl::FormatTime(absl::RFC3339_sec, expires, absl::UTCTimeZone()));
  }
  line += "\n";
  ASSIGN_OR_RETURN(const int dropped, RewriteWithout(path, identity.name, line));
  if (replaced != nullptr) *replaced = dropped;
  return token;
}

absl::StatusOr<int> RevokeTokens(const std::string& path, const std::string& name) {
  if (absl::Status s = ValidateName(name); !s.ok()) return s;
  if (::access(path.c_str(), F_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("no tokens file ", path));
  }
  ASSIGN_OR_RETURN(const int dropped, RewriteWithout(path, name, ""));
  if (dropped == 0) return absl::NotFoundError(absl::StrCat(path, " has no token of ", name));
  return dropped;
}

absl::StatusOr<std::unique_ptr<TokenTable>> TokenTable::Open(const std::string& path) {
  std::unique_ptr<TokenTable> table(new TokenTable(path));
  absl::MutexLock lock(&table->mu_);
  if (absl::Status s = table->RefreshLocked(); !s.ok()) return s;
  return table;
}

absl::Status TokenTable::RefreshLocked() {
  checked_ = absl::Now();
  const bool strict = !opened_;  // Open's: a malformed file keeps the coordinator down
  opened_ = true;
  struct stat st;
  if (::stat(path_.c_str(), &st) != 0) {
    by_hash_.clear();  // removed: no token is valid any more
    ctime_ = {};
    return absl::OkStatus();
  }
  // A rewrite renames a new file over it: a new inode, whatever the clock's grain.
  if (st.st_ctim.tv_sec == ctime_.tv_sec && st.st_ctim.tv_nsec == ctime_.tv_nsec &&
      st.st_ino == inode_ && st.st_size == size_) {
    return absl::OkStatus();
  }
  const auto unreadable = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    by_hash_.clear();  // fail closed: no token counts while the file cannot be read
    ctime_ = {};       // read again at the next look
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read the tokens file ", path_, ": ", std::strerror(errno)));
  };
  // The version judged is the one read: mode and contents through one descriptor.
  const UniqueFd fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid() || ::fstat(fd.get(), &st) != 0) return unreadable();
  ctime_ = st.st_ctim;  // this version is judged once
  inode_ = st.st_ino;
  size_ = st.st_size;
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    by_hash_.clear();  // fail closed: whoever may write it could have added an admin
    return absl::FailedPreconditionError(absl::StrFormat(
        "the tokens file %s may be written by others than its owner (mode %04o): no token "
        "counts until it may not (chmod go-w)",
        path_, st.st_mode & 07777));
  }
  std::string text;
  char chunk[1 << 14];
  ssize_t n = 0;
  while ((n = ::read(fd.get(), chunk, sizeof(chunk))) > 0) text.append(chunk, n);
  if (n < 0) return unreadable();
  std::vector<int> skipped;
  absl::StatusOr<std::map<std::string, TokenRecord>> parsed =
      Parse(path_, text, strict ? nullptr : &skipped);
  if (!parsed.ok()) return parsed.status();
  by_hash_ = *std::move(parsed);
  if (!skipped.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": malformed line(s) ", absl::StrJoin(skipped, ", "),
                     " left out (want NAME user|admin SHA256HEX [expires=RFC3339])"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Identity> TokenTable::Lookup(const std::string& token) {
  const std::string hash = TokenHash(token);
  absl::MutexLock lock(&mu_);
  if (absl::Now() - checked_ >= absl::Seconds(1)) {
    // Malformed lines are left out, the rest apply: said once per change of the file (a
    // refresh parses a changed file once). A file that cannot be read fails every second:
    // said now and then.
    absl::Status s = RefreshLocked();
    if (absl::IsPermissionDenied(s)) {
      LOG_EVERY_N(WARNING, 60) << s.message();
    } else if (!s.ok()) {
      LOG(WARNING) << s.message();
    }
  }
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) {
    return absl::UnauthenticatedError(
        "the bearer token is not valid (one just made with pith token is taken within a few "
        "seconds)");
  }
  const TokenRecord& e = it->second;
  if (absl::Now() >= e.expires) {
    return absl::UnauthenticatedError(
        absl::StrCat("the bearer token of ", e.identity.name, " expired at ",
                     absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", e.expires, absl::UTCTimeZone()),
                     " (pith token --name ", e.identity.name, " makes a new one)"));
  }
  return e.identity;
}

}  // namespace pith::security
