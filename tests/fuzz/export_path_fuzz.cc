// libFuzzer target: the path a Checkpoint/CheckpointJob caller names (common/export_path.h).
// Whatever the bytes, an export the server accepts lies under its export root: the
// directory it is written through resolves inside the root (no "..", no symlink out, here
// a link to "/"), a NUL is refused, and an existing file is never named as a new entry.
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/export_path.h"

namespace {

std::string g_root;       // the export root, as given
std::string g_real_root;  // its realpath

// A fresh root (the one before removed): the directories accepted exports create pile
// up, so every kRunsPerRoot runs start over.
constexpr int kRunsPerRoot = 1000;
int g_runs = 0;

void MakeRoot() {
  static const bool cleanup = [] {
    std::atexit([] { std::filesystem::remove_all(g_root); });
    return true;
  }();
  (void)cleanup;
  if (!g_root.empty()) std::filesystem::remove_all(g_root);
  char templ[] = "/tmp/pith_export_fuzz.XXXXXX";
  g_root = mkdtemp(templ);
  g_real_root = std::filesystem::canonical(g_root).string();
  std::filesystem::create_directories(g_root + "/a/b");
  std::ofstream(g_root + "/a/file") << "x";
  std::filesystem::create_directory_symlink("/", g_root + "/a/out");
  std::filesystem::create_symlink(g_root + "/a/file", g_root + "/a/filelink");
}

// The directory `path` (/proc/self/fd/N or /proc/self/fd/N/name) is written through.
std::string Resolved(const std::string& path) {
  const size_t fd_end = path.find('/', std::string("/proc/self/fd/").size());
  std::error_code ec;
  return std::filesystem::read_symlink(path.substr(0, fd_end), ec).string();
}

bool Inside(const std::string& dir) {
  return dir == g_real_root || dir.rfind(g_real_root + "/", 0) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (g_runs++ % kRunsPerRoot == 0) MakeRoot();
  if (size > 96) return 0;  // deep trees cost disk, not coverage
  std::string requested(reinterpret_cast<const char*>(data), size);
  if (!requested.empty() && requested[0] == '@') requested = g_root + "/" + requested.substr(1);
  auto dir = pith::ExportPath::Directory(g_root, requested);
  if (dir.ok() && !Inside(Resolved(dir->path()))) __builtin_trap();
  if (dir.ok() && requested.find('\0') != std::string::npos) __builtin_trap();
  auto entry = pith::ExportPath::NewEntry(g_root, requested);
  if (entry.ok()) {
    if (!Inside(Resolved(entry->path()))) __builtin_trap();
    if (requested.find('\0') != std::string::npos) __builtin_trap();
    std::error_code ec;
    if (std::filesystem::exists(std::filesystem::symlink_status(entry->path(), ec))) {
      __builtin_trap();  // a new entry names nothing that exists
    }
  }
  return 0;
}
