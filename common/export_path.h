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

#include "absl/status/statusor.h"
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

 private:
  static absl::StatusOr<ExportPath> Open(const std::string& root, const std::string& requested,
                                         bool new_entry);
  UniqueFd dir_;
  std::string path_, shown_;
};

}  // namespace pith

#endif  // PITH_COMMON_EXPORT_PATH_H_
