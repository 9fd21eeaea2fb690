#include "common/process.h"

#include <sys/resource.h>

#include <filesystem>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pith {
namespace {

size_t OpenFds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    ++n;
  }
  return n;
}

// A process near its open-file limit is told so, with both figures and what to raise (a
// worker's heartbeat carries it: it takes no jobs it would fail).
TEST(FdHeadroomTest, NamesTheLimitWhenTooFewAreFree) {
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  rlimit low = saved;
  low.rlim_cur = OpenFds() + 8;
  ASSERT_LE(low.rlim_cur, saved.rlim_max);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
  const absl::Status short_of = CheckFdHeadroom(16);
  const absl::Status enough = CheckFdHeadroom(4);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  EXPECT_EQ(short_of.code(), absl::StatusCode::kResourceExhausted) << short_of;
  EXPECT_THAT(std::string(short_of.message()),
              ::testing::HasSubstr("of RLIMIT_NOFILE " + std::to_string(low.rlim_cur)));
  EXPECT_THAT(std::string(short_of.message()), ::testing::HasSubstr("ulimit -n"));
  EXPECT_TRUE(enough.ok()) << enough;
  EXPECT_TRUE(CheckFdHeadroom(16).ok());
}

}  // namespace
}  // namespace pith
