// NcclGroup on the devices this machine has: a group of one (the all-reduce, a send to
// itself, empty pairs skipped), the deadlines (a join the other rank never makes, a
// receive nobody sends), an abort asked for from another thread, and, with two or more
// devices, a group across them. Every call that could hang runs under a watchdog, so a
// hang fails the test instead of stalling the suite. Skipped without a CUDA device (the
// argument checks run everywhere).
#include "worker/cuda/nccl_group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace pith::cuda {
namespace {

int Devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// Runs `fn` on a thread of its own and waits at most `limit`: a call that hangs past it
// fails the test (its thread is left behind; the process ends it).
template <typename T>
std::optional<T> Within(absl::Duration limit, std::function<T()> fn) {
  auto task = std::make_shared<std::packaged_task<T()>>(std::move(fn));
  std::future<T> result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(absl::ToChronoSeconds(limit)) != std::future_status::ready) {
    ADD_FAILURE() << "did not return within " << limit;
    return std::nullopt;
  }
  return result.get();
}

// Device floats, freed on destruction.
struct DeviceFloats {
  explicit DeviceFloats(size_t n) : n(n) {
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(float)), cudaSuccess);
  }
  ~DeviceFloats() { cudaFree(p); }
  void Set(const std::vector<float>& v) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<float> Get() const {
    std::vector<float> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  float* p = nullptr;
  size_t n;
};

class NcclGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (Devices() < 1) GTEST_SKIP() << "no CUDA device here";
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  // A group of one on device 0.
  std::unique_ptr<NcclGroup> Alone() {
    absl::StatusOr<std::string> id = NcclGroup::NewId();
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) return nullptr;
    absl::StatusOr<std::unique_ptr<NcclGroup>> g = NcclGroup::Join(*id, 0, 1, 0, absl::Seconds(60));
    EXPECT_TRUE(g.ok()) << g.status();
    return g.ok() ? std::move(*g) : nullptr;
  }
  cudaStream_t stream_ = nullptr;
};

TEST(NcclGroupArgumentsTest, BadIdsAndRanksAreRefused) {
  EXPECT_EQ(NcclGroup::Join("short", 0, 1, 0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclGroup::Join(std::string(128, '\0'), 2, 2, 0, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(NcclGroupTest, AGroupOfOneSumsAndSendsToItself) {
  std::unique_ptr<NcclGroup> g = Alone();
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->rank(), 0);
  EXPECT_EQ(g->world(), 1);
  std::vector<float> v(1000);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5f * i;
  DeviceFloats a(v.size()), b(v.size());
  a.Set(v);
  ASSERT_TRUE(g->AllReduceSum(a.p, a.n, stream_, absl::Seconds(30)).ok());
  EXPECT_EQ(a.Get(), v);
  const size_t bytes = v.size() * sizeof(float);
  absl::Status st = g->Exchange({{0, a.p, bytes}}, {{0, b.p, bytes}}, stream_, absl::Seconds(30));
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(b.Get(), v);
  // Empty pairs cost nothing; a peer outside the group is refused.
  EXPECT_TRUE(g->Exchange({{0, a.p, 0}}, {{0, b.p, 0}}, stream_, absl::Seconds(30)).ok());
  EXPECT_EQ(g->Exchange({{1, a.p, bytes}}, {}, stream_, absl::Seconds(30)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(g->aborted());
}

// Rank 0 of two, and rank 1 never comes: the join ends at its deadline.
TEST_F(NcclGroupTest, AJoinTheOthersNeverMakeEndsAtItsDeadline) {
  absl::StatusOr<std::string> id = NcclGroup::NewId();
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time start = absl::Now();
  std::optional<absl::StatusCode> code = Within<absl::StatusCode>(absl::Seconds(30), [&] {
    return NcclGroup::Join(*id, 0, 2, 0, absl::Seconds(2)).status().code();
  });
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Seconds(2));
}

// A receive that nothing matches: the exchange fails by its deadline (or at once, where
// NCCL refuses it), the group is aborted, and it refuses every later call.
TEST_F(NcclGroupTest, AReceiveNobodySendsEndsByItsDeadlineAndAbortsTheGroup) {
  std::unique_ptr<NcclGroup> g = Alone();
  ASSERT_NE(g, nullptr);
  DeviceFloats b(256);
  const absl::Time start = absl::Now();
  std::optional<absl::Status> st = Within<absl::Status>(absl::Seconds(30), [&] {
    return g->Exchange({}, {{0, b.p, b.n * sizeof(float)}}, stream_, absl::Seconds(2));
  });
  ASSERT_TRUE(st.has_value());
  EXPECT_FALSE(st->ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_TRUE(g->aborted()) << *st;
  EXPECT_EQ(g->AllReduceSum(b.p, b.n, stream_, absl::Seconds(1)).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(Within<bool>(absl::Seconds(30), [&] {
                return cudaStreamSynchronize(stream_) == cudaSuccess;
              }).has_value());  // the aborted kernels ended
}

TEST_F(NcclGroupTest, AnAbortAskedForByAnotherThreadEndsTheWait) {
  std::unique_ptr<NcclGroup> g = Alone();
  ASSERT_NE(g, nullptr);
  DeviceFloats b(256);
  std::thread watch([&] {
    absl::SleepFor(absl::Milliseconds(300));
    g->RequestAbort();
  });
  const absl::Time start = absl::Now();
  std::optional<absl::Status> st = Within<absl::Status>(absl::Seconds(30), [&] {
    return g->Exchange({}, {{0, b.p, b.n * sizeof(float)}}, stream_, absl::Seconds(60));
  });
  watch.join();
  ASSERT_TRUE(st.has_value());
  EXPECT_FALSE(st->ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_TRUE(g->aborted());
  Within<bool>(absl::Seconds(30), [&] { return cudaStreamSynchronize(stream_) == cudaSuccess; });
}

// Every device of the machine in one group: the sum, and a ring of sends.
TEST_F(NcclGroupTest, AGroupAcrossTheDevicesSumsAndPassesARing) {
  const int world = std::min(Devices(), 8);
  if (world < 2) GTEST_SKIP() << "one CUDA device here: a group across devices needs two";
  absl::StatusOr<std::string> id = NcclGroup::NewId();
  ASSERT_TRUE(id.ok()) << id.status();
  constexpr size_t kN = 4096;
  std::vector<std::string> failures(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      auto g = NcclGroup::Join(*id, r, world, r, absl::Seconds(60));
      if (!g.ok()) {
        failures[r] = g.status().ToString();
        return;
      }
      cudaStream_t stream;
      cudaStreamCreate(&stream);
      DeviceFloats sum(kN), out(kN), in(kN);
      sum.Set(std::vector<float>(kN, r + 1.0f));
      out.Set(std::vector<float>(kN, 100.0f + r));
      absl::Status st = (*g)->AllReduceSum(sum.p, kN, stream, absl::Seconds(30));
      if (st.ok()) {
        st = (*g)->Exchange({{(r + 1) % world, out.p, kN * sizeof(float)}},
                            {{(r + world - 1) % world, in.p, kN * sizeof(float)}}, stream,
                            absl::Seconds(30));
      }
      if (!st.ok()) {
        failures[r] = st.ToString();
      } else if (sum.Get() != std::vector<float>(kN, world * (world + 1) / 2.0f)) {
        failures[r] = "wrong sum";
      } else if (in.Get() != std::vector<float>(kN, 100.0f + (r + world - 1) % world)) {
        failures[r] = "wrong ring neighbour's rows";
      }
      cudaStreamDestroy(stream);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

}  // namespace
}  // namespace pith::cuda
