// For tests: a small tmpfs mounted for the test's life (a disk that fills up). Mounting
// needs root; where it cannot, mounted() is false and why() says so (the test skips).
#ifndef PITH_COMMON_TMPFS_TESTING_H_
#define PITH_COMMON_TMPFS_TESTING_H_

#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

namespace pith::testing {

class ScopedTmpfs {
 public:
  // Mounts a tmpfs of `size` (mount's option, e.g. "24m") at `path`, made if missing.
  ScopedTmpfs(std::string path, const std::string& size) : path_(std::move(path)) {
    std::filesystem::create_directories(path_);
    mounted_ = ::mount("tmpfs", path_.c_str(), "tmpfs", 0, ("size=" + size).c_str()) == 0;
    if (!mounted_)
      why_ = std::string("cannot mount a small tmpfs here (needs root): ") + std::strerror(errno);
  }
  ~ScopedTmpfs() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
  }
  ScopedTmpfs(const ScopedTmpfs&) = delete;
  ScopedTmpfs& operator=(const ScopedTmpfs&) = delete;

  bool mounted() const { return mounted_; }
  const std::string& why() const { return why_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool mounted_ = false;
  std::string why_;
};

}  // namespace pith::testing

#endif  // PITH_COMMON_TMPFS_TESTING_H_
