// Renaming a finished file onto its name, with or without replacing what is there. Header
// only: the job-API SDK (which links no Pith library but its own) uses it as well as
// common/file.cc.
//
// Thread safety: a free function on paths; safe from any thread.
#ifndef PITH_COMMON_RENAME_ONTO_H_
#define PITH_COMMON_RENAME_ONTO_H_

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace pith {

// Renames `from` onto `to`: 0, or -1 with errno set. Without `replace` it never replaces an
// existing `to` (EEXIST): renameat2's RENAME_NOREPLACE, else, on file systems without it
// (NFS, some FUSE), link() and unlink(), as link() never replaces either.
inline int RenameOnto(const char* from, const char* to, bool replace) {
  if (replace) return ::rename(from, to);
  int rc = ::renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE);
  if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
    rc = ::link(from, to);
    if (rc == 0) ::unlink(from);
  }
  return rc;
}

// Whether a file may be renamed onto `path`: nothing is there, or a regular file. Never a
// directory, a device, a pipe, a socket or a symlink (renaming onto /dev/null replaces the
// device; onto a link, the link, not what it names).
inline bool RegularOrMissing(const char* path) {
  struct stat st;
  return ::lstat(path, &st) != 0 ? errno == ENOENT : S_ISREG(st.st_mode);
}

}  // namespace pith

#endif  // PITH_COMMON_RENAME_ONTO_H_
