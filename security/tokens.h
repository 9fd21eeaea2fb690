// Bearer tokens: how a person or program without a client certificate proves who it is to
// the job API. `pith token` makes a token (shown once) and records only its SHA-256 with
// the name and role in a tokens file the coordinator reads (--tokens_file); a client
// presents it as "authorization: Bearer TOKEN" over TLS (the server's certificate still
// checked against the cluster CA). Tokens carry the user or admin role only: members and
// the coordinator always use certificates.
//
// File format: one "NAME ROLE SHA256HEX [expires=RFC3339]" line per token; '#' starts a
// comment. A token past its expiry is refused (with that reason) as if it were not there.
//
// Thread safety: a TokenTable is thread-safe; it re-reads its file when the file changes
// (checked at most once a second), so tokens added or removed need no restart. After the
// start a malformed line is left out (logged) and the others apply, so a removal beside a
// bad edit still revokes; a file that cannot be read admits no token.
#ifndef PITH_SECURITY_TOKENS_H_
#define PITH_SECURITY_TOKENS_H_

#include <sys/types.h>

#include <ctime>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "security/identity.h"

namespace pith::security {

// A new random token for `identity` (user or admin role; INVALID_ARGUMENT otherwise), its
// hash written to `path` (created 0600 when missing) in place of the name's earlier
// tokens, which stop working (`replaced`, when given: how many). The file is rewritten
// whole and renamed over the old one, with its owner, group and mode (group-read at
// most), one rewrite at a time (a lock on `path`.lock); a symlink is refused. The token
// stops working at `expires` (whole seconds; InfiniteFuture: never). Returns the token.
absl::StatusOr<std::string> AddToken(const std::string& path, const Identity& identity,
                                     int* replaced = nullptr,
                                     absl::Time expires = absl::InfiniteFuture());
// Removes every token of `name` from `path` (they stop working); how many. NOT_FOUND when
// the file or the name's tokens are not there.
absl::StatusOr<int> RevokeTokens(const std::string& path, const std::string& name);

// One line of a tokens file: whom the token names, and when it stops working.
struct TokenRecord {
  Identity identity;
  absl::Time expires = absl::InfiniteFuture();
};

// SHA-256 of `token`, lowercase hex.
std::string TokenHash(const std::string& token);

class TokenTable {
 public:
  // The tokens of `path`; a missing file is an empty table (until it appears). A file
  // that cannot be parsed: INVALID_ARGUMENT naming the line; one that cannot be read:
  // PERMISSION_DENIED; one that others than its owner may write (group or world):
  // FAILED_PRECONDITION (anyone who may write it could add an admin). Later versions of the file
  // are judged the same way, except that their malformed lines are left out (the rest apply) and a
  // file others may write leaves no token valid until it is fixed.
  static absl::StatusOr<std::unique_ptr<TokenTable>> Open(const std::string& path);

  // The identity a token was made for, if it is in the file now and has not expired:
  // UNAUTHENTICATED otherwise, saying which (an expired token names its owner and when).
  absl::StatusOr<Identity> Lookup(const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  explicit TokenTable(std::string path) : path_(std::move(path)) {}
  // Re-reads the file if it changed (contents or mode) since the last read (OK when it is
  // missing). Each version's error is returned once; a read error again each time.
  absl::Status RefreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  std::map<std::string, TokenRecord> by_hash_ ABSL_GUARDED_BY(mu_);
  bool opened_ ABSL_GUARDED_BY(mu_) = false;         // Open's read done: later ones are lenient
  struct timespec ctime_ ABSL_GUARDED_BY(mu_) = {};  // changes with a write and a chmod
  ino_t inode_ ABSL_GUARDED_BY(mu_) = 0;
  off_t size_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time checked_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace pith::security

#endif  // PITH_SECURITY_TOKENS_H_
