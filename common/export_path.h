// ExportPath and ReadPath: paths a caller names for a process to write or read, confined
// to the directories its operator allows.
//
// ExportPath: where a server writes a file or directory a caller named (a checkpoint
// export), confined to the server's export root (--export_root). The caller's path is
// relative to the root, or absolute under it; `..` is refused, and so is a symlink at
// any step below the root (each directory is opened with O_NOFOLLOW, created where
// missing, and the export is written through the last one's descriptor,
// /proc/self/fd/N/..., so a symlink swapped in after the check changes nothing). An
// export never replaces an existing file (ALREADY_EXISTS; writers rename with
// RENAME_NOREPLACE). Without an export root, server-side exports are off.
//
// Thread safety: an ExportPath is a value; distinct ones may be used from any thread.
#ifndef PITH_COMMON_EXPORT_PATH_H_
#define PITH_COMMON_EXPORT_PATH_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/file.h"

namespace pith {

class ExportPath {
 public:
  // The directory `requested` names under `root`, created with its parents where missing.
  static absl::StatusOr<ExportPath> Directory(const std::string& root,
                                              const std::string& requested);
  // A new entry (a file or a directory the writer creates) `requested` names under
  // `root`: its parents are created where missing; it must not exist.
  static absl::StatusOr<ExportPath> NewEntry(const std::string& root, const std::string& requested);

  // Where to write: through the opened directory (/proc/self/fd/N, or /proc/self/fd/N/name
  // for a new entry). Valid while this object lives.
  const std::string& path() const { return path_; }
  // What to tell the caller: the root joined with the relative path.
  const std::string& shown() const { return shown_; }
  // `status` with path() written as shown(): for errors of the writer that used path().
  absl::Status Named(const absl::Status& status) const;

 private:
  static absl::StatusOr<ExportPath> Open(const std::string& root, const std::string& requested,
                                         bool new_entry);
  UniqueFd dir_;
  std::string path_, shown_;
};

// ReadPath: a file a caller named for a process to read (a job's train.data_path or
// train.init_path, which a worker reads), confined to the process's read roots
// (pith-worker --data_root). An absolute path must lie under one of the roots (tried from
// the deepest it lies under), a relative one is taken under the first. It is opened from its root
// with openat2(RESOLVE_BENEATH): `..` or a symlink that leads out of the root is refused,
// and so is any absolute symlink (relative ones that stay beneath it are followed); it is
// read through the opened descriptor (/proc/self/fd/N), so a path
// swapped after the check changes nothing. Only a regular file is opened. Without roots
// the path is opened as given. A file that resolves into an excluded folder (a worker's
// own --tls_dir, pith up's cluster folder with its CA key: --data_exclude) is refused,
// roots or not. With neither, the path is read as given.
//
// Thread safety: as ExportPath.
struct ReadRules {
  std::vector<std::string> roots;     // --data_root
  std::vector<std::string> excluded;  // --data_exclude and the worker's --tls_dir
};

class ReadPath {
 public:
  // PERMISSION_DENIED (naming `field`) for a path outside every root, in an excluded
  // folder, or not a regular file; NOT_FOUND for a missing one; FAILED_PRECONDITION where the
  // kernel lacks openat2 (Linux 5.6).
  static absl::StatusOr<ReadPath> Open(const std::string& requested, const ReadRules& rules,
                                       absl::string_view field);
  // Checks a process's roots at its start: each an existing directory, given absolutely.
  static absl::Status CheckRoots(const std::vector<std::string>& roots);

  // What to open. Valid while this object lives.
  const std::string& path() const { return path_; }
  // `status` with this object's path() written as the caller named it: for errors of the
  // reader that opened path().
  absl::Status Named(const absl::Status& status) const;

 private:
  UniqueFd file_;
  std::string path_, requested_;
};

}  // namespace pith

#endif  // PITH_COMMON_EXPORT_PATH_H_
