// ScratchDir: an e2e test's folder, made empty at the start and removed at the end when the
// test passed (kept for a look when it failed). Declare it before the processes that use it,
// so that they stop first.
#ifndef PITH_TESTS_E2E_SCRATCH_DIR_H_
#define PITH_TESTS_E2E_SCRATCH_DIR_H_

#include <filesystem>
#include <string>
#include <system_error>

#include "gtest/gtest.h"

namespace pith::testing {

struct ScratchDir {
  explicit ScratchDir(std::string path) : dir(std::move(path)) {
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string dir;
};

}  // namespace pith::testing

#endif  // PITH_TESTS_E2E_SCRATCH_DIR_H_
