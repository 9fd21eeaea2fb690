// NcclGroup on the devices this machine has: a group of one (the all-reduce, a send to
// itself, empty pairs skipped; and as the backend's device group, on its stream), the deadlines (a
// join the other rank never makes, a call whose stream is held back), an abort asked for from
// another thread, an unmatched receive, and, with two or more devices, a group across them. The
// calls that could hang run under a watchdog that ends the binary with a failure instead of
// stalling the suite. Skipped without a CUDA device (the argument checks run everywhere).
#include "worker/cuda/nccl_group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "worker/cuda/cuda_backend.h"

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
// ends the test binary with a failure (its thread still holds the test's objects).
template <typename T>
T Within(absl::Duration limit, std::function<T()> fn) {
  auto task = std::make_shared<std::packaged_task<T()>>(std::move(fn));
  std::future<T> result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(absl::ToChronoSeconds(limit)) != std::future_status::ready) {
    std::fprintf(stderr, "FAILED: a call did not return within %s\n",
                 absl::FormatDuration(limit).c_str());
    std::_Exit(1);
  }
  return result.get();
}

// Holds a stream back (a host function on it waits for Open(), at most 30 s), so that work
// queued behind it stays pending.
class Gate {
 public:
  void Close(cudaStream_t stream) {
    ASSERT_EQ(cudaLaunchHostFunc(stream, &Gate::Wait, this), cudaSuccess);
  }
  void Open() { open_ = true; }
  // Opens after `delay`, from a thread of its own (joined by the destructor).
  void OpenAfter(absl::Duration delay) {
    opener_ = std::thread([this, delay] {
      absl::SleepFor(delay);
      Open();
    });
  }
  ~Gate() {
    if (opener_.joinable()) opener_.join();
  }

 private:
  static void CUDART_CB Wait(void* self) {
    auto* gate = static_cast<Gate*>(self);
    const absl::Time until = absl::Now() + absl::Seconds(30);
    while (!gate->open_ && absl::Now() < until) absl::SleepFor(absl::Milliseconds(1));
  }
  std::atomic<bool> open_{false};
  std::thread opener_;
};

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

// The backend's device group, as a cluster worker's dispatch uses it (a group of one
// through CudaBackend::NewGroupId and JoinGroup): its sum and its exchange run on the
// backend's stream, after the backend's own ops, and returned rows go in place.
TEST_F(NcclGroupTest, TheBackendsGroupSumsAndExchangesOnItsStream) {
  absl::StatusOr<std::unique_ptr<CudaBackend>> backend = CudaBackend::Create(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  CudaBackend& b = **backend;
  absl::StatusOr<std::string> id = b.NewGroupId();
  ASSERT_TRUE(id.ok()) << id.status();
  absl::StatusOr<std::unique_ptr<compute::DeviceGroup>> group =
      b.JoinGroup(*id, 0, 1, absl::Seconds(60), std::atomic<bool>{false});
  ASSERT_TRUE(group.ok()) << group.status();
  constexpr int kRows = 64, kC = 48;
  constexpr size_t kBytes = sizeof(float) * kRows * kC;
  std::vector<float> v(kRows * kC);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.25f * static_cast<float>(i);
  std::vector<int32_t> reversed(kRows);
  for (int r = 0; r < kRows; ++r) reversed[r] = kRows - 1 - r;
  auto a = b.Allocate(kBytes), got = b.Allocate(kBytes), placed = b.Allocate(kBytes);
  auto rows = b.Allocate(sizeof(int32_t) * kRows);
  ASSERT_TRUE(a.ok() && got.ok() && placed.ok() && rows.ok());
  ASSERT_TRUE(b.CopyToDevice(a->data(), v.data(), kBytes).ok());
  ASSERT_TRUE(b.CopyToDevice(rows->data(), reversed.data(), sizeof(int32_t) * kRows).ok());
  b.Scale(a->f32(), 2.0f, kRows * kC);  // queued before the group's calls
  ASSERT_TRUE(Within<absl::Status>(absl::Seconds(60), [&] {
                return (*group)->AllReduceSum(a->f32(), kRows * kC, absl::Seconds(30));
              }).ok());
  const absl::Status st = Within<absl::Status>(absl::Seconds(60), [&] {
    return (*group)->Exchange({{0, a->data(), kBytes}}, {{0, got->data(), kBytes}},
                              absl::Seconds(30));
  });
  ASSERT_TRUE(st.ok()) << st;
  b.ScatterRows(placed->f32(), got->f32(), static_cast<const int32_t*>(rows->data()), kRows, kC);
  std::vector<float> out(kRows * kC);
  ASSERT_TRUE(b.CopyToHost(out.data(), placed->data(), kBytes).ok());
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kC; ++c) {
      ASSERT_EQ(out[r * kC + c], 2.0f * v[(kRows - 1 - r) * kC + c]) << r << "," << c;
    }
  }
}

// Rank 0 of two, and rank 1 never comes: the join ends at its deadline.
TEST_F(NcclGroupTest, AJoinTheOthersNeverMakeEndsAtItsDeadline) {
  absl::StatusOr<std::string> id = NcclGroup::NewId();
  ASSERT_TRUE(id.ok()) << id.status();
  const absl::Time start = absl::Now();
  const absl::StatusCode code = Within<absl::StatusCode>(absl::Seconds(60), [&] {
    return NcclGroup::Join(*id, 0, 2, 0, absl::Seconds(2)).status().code();
  });
  EXPECT_EQ(code, absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, absl::Seconds(2));
}

// The same join abandoned from another thread (its attempt was aborted): it ends then.
TEST_F(NcclGroupTest, AnAbandonedJoinEndsAtOnce) {
  absl::StatusOr<std::string> id = NcclGroup::NewId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::atomic<bool> abandon{false};
  std::thread abandoner([&] {
    absl::SleepFor(absl::Milliseconds(300));
    abandon = true;
  });
  const absl::Time start = absl::Now();
  const absl::StatusCode code = Within<absl::StatusCode>(absl::Seconds(60), [&] {
    return NcclGroup::Join(*id, 0, 2, 0, absl::Seconds(30), &abandon).status().code();
  });
  abandoner.join();
  EXPECT_EQ(code, absl::StatusCode::kAborted);
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

// Work the group waits for that does not come (a stream held back): the call ends at its
// deadline, the group is aborted, and it refuses every later call.
TEST_F(NcclGroupTest, APendingCallEndsAtItsDeadlineAndAbortsTheGroup) {
  std::unique_ptr<NcclGroup> g = Alone();
  ASSERT_NE(g, nullptr);
  DeviceFloats b(256);
  Gate gate;
  gate.Close(stream_);
  gate.OpenAfter(absl::Seconds(5));  // after the deadline, whatever the abort waits for
  const absl::Time start = absl::Now();
  const absl::Status st = Within<absl::Status>(
      absl::Seconds(60), [&] { return g->AllReduceSum(b.p, b.n, stream_, absl::Seconds(2)); });
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_GE(absl::Now() - start, absl::Seconds(2));
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_TRUE(g->aborted());
  EXPECT_EQ(g->AllReduceSum(b.p, b.n, stream_, absl::Seconds(1)).code(),
            absl::StatusCode::kFailedPrecondition);
  gate.Open();
  EXPECT_TRUE(Within<bool>(absl::Seconds(60),
                           [&] { return cudaStreamSynchronize(stream_) == cudaSuccess; }));
}

// The step's abort watch, from another thread, ends a call long before its deadline.
TEST_F(NcclGroupTest, AnAbortAskedForByAnotherThreadEndsTheWait) {
  std::unique_ptr<NcclGroup> g = Alone();
  ASSERT_NE(g, nullptr);
  DeviceFloats b(256);
  Gate gate;
  gate.Close(stream_);
  gate.OpenAfter(absl::Seconds(5));
  std::thread watch([&] {
    absl::SleepFor(absl::Milliseconds(300));
    g->RequestAbort();
  });
  const absl::Time start = absl::Now();
  const absl::Status st = Within<absl::Status>(
      absl::Seconds(60), [&] { return g->AllReduceSum(b.p, b.n, stream_, absl::Seconds(60)); });
  watch.join();
  EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
  EXPECT_TRUE(g->aborted());
  gate.Open();
  EXPECT_TRUE(Within<bool>(absl::Seconds(60),
                           [&] { return cudaStreamSynchronize(stream_) == cudaSuccess; }));
}

// A receive from itself with no matching send is refused by NCCL: an error, not a hang,
// and the group is aborted.
TEST_F(NcclGroupTest, AnUnmatchedReceiveIsAnErrorNotAHang) {
  std::unique_ptr<NcclGroup> g = Alone();
  ASSERT_NE(g, nullptr);
  DeviceFloats b(256);
  const absl::Status st = Within<absl::Status>(absl::Seconds(60), [&] {
    return g->Exchange({}, {{0, b.p, b.n * sizeof(float)}}, stream_, absl::Seconds(5));
  });
  EXPECT_FALSE(st.ok());
  EXPECT_TRUE(g->aborted()) << st;
  EXPECT_TRUE(Within<bool>(absl::Seconds(60),
                           [&] { return cudaStreamSynchronize(stream_) == cudaSuccess; }));
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
