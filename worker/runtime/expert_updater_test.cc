#include "worker/runtime/expert_updater.h"

#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/param_layout.h"
#include "common/ucx.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/model/optimizer.h"

namespace pith::runtime {
namespace {

using Expert = ExpertCache::Expert;
constexpr int kInitialCount = 3;

// The stores of one group, in memory: blobs by (kind, layer, expert, version); version 0
// is the committed one.
class FakeBlobIo : public BlobIo {
 public:
  explicit FakeBlobIo(ucx::Worker* worker) : worker_(worker) {}
  using BlobId = std::tuple<int, int, int, int64_t>;

  std::vector<std::string> ReadStores(StoreGroup) override { return {"s0"}; }
  std::vector<std::string> WriteStores(StoreGroup) override { return {"s0", "s1"}; }
  absl::Status Fetch(const std::vector<std::string>&,
                     std::vector<store::StoreClient::FetchItem>& items) override {
    absl::MutexLock lock(&mu_);
    absl::Status first;
    for (store::StoreClient::FetchItem& item : items) {
      const v1::BlobKey& k = item.key;
      const int64_t version = item.version < 0 ? 0 : item.version;
      auto it = blobs_.find({k.kind(), k.layer(), k.expert(), version});
      item.status = it == blobs_.end() || k.kind() == fail_kind_
                        ? absl::NotFoundError("no such blob")
                        : absl::OkStatus();
      if (item.status.ok()) {
        std::memcpy(item.buffer, it->second.data(), it->second.size());
        item.info.set_size_bytes(it->second.size());
      }
      first.Update(item.status);
    }
    return first;
  }
  absl::Status Put(const std::vector<std::string>& stores, const v1::BlobKey& key, int64_t version,
                   const void* data, size_t bytes, PutQueue& queue) override {
    for (const std::string& id : stores) {
      store::StoreClient::PutItem item;
      item.key = key;
      item.version = version;
      item.data = data;
      item.size = bytes;
      queue.items.push_back(item);
      queue.primary.push_back(id == stores.front());
    }
    return absl::OkStatus();
  }
  absl::Status Flush(PutQueue& queue,
                     const std::function<void(const absl::Status&)>& buffers_free) override {
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < queue.items.size(); ++i) {
        const store::StoreClient::PutItem& item = queue.items[i];
        const auto* p = static_cast<const uint8_t*>(item.data);
        const BlobId id{item.key.kind(), item.key.layer(), item.key.expert(), item.version};
        blobs_[id].assign(p, p + item.size);
        if (queue.primary[i]) ++primary_puts_;
      }
      ++flushes_;
    }
    if (buffers_free) buffers_free(absl::OkStatus());
    queue.clear();
    return absl::OkStatus();
  }
  int64_t PendingVersion(StoreGroup) override { return -1; }
  absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> AllocateBuffer(size_t bytes) override {
    return worker_->Allocate(bytes);
  }
  void SetRegion(Region, const uint8_t*, size_t, ucp_mem_h) override {}

  void Set(v1::BlobKind kind, int l, int e, int64_t version, const void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    const auto* p = static_cast<const uint8_t*>(data);
    blobs_[{kind, l, e, version}].assign(p, p + bytes);
  }
  std::vector<uint8_t> Get(v1::BlobKind kind, int l, int e, int64_t version) {
    absl::MutexLock lock(&mu_);
    auto it = blobs_.find({kind, l, e, version});
    return it == blobs_.end() ? std::vector<uint8_t>{} : it->second;
  }
  void FailFetches(v1::BlobKind kind) {
    absl::MutexLock lock(&mu_);
    fail_kind_ = kind;
  }
  int primary_puts() {
    absl::MutexLock lock(&mu_);
    return primary_puts_;
  }

 private:
  ucx::Worker* const worker_;
  absl::Mutex mu_;
  std::map<BlobId, std::vector<uint8_t>> blobs_ ABSL_GUARDED_BY(mu_);
  int fail_kind_ ABSL_GUARDED_BY(mu_) = -1;
  int primary_puts_ ABSL_GUARDED_BY(mu_) = 0;
  int flushes_ ABSL_GUARDED_BY(mu_) = 0;
};

model::ModelShape Shape() {
  model::ModelShape s;
  s.vocab = 16;
  s.seq = 4;
  s.channels = 4;
  s.layers = 2;
  s.heads = 2;
  s.experts = 2;
  s.top_k = 1;
  s.hidden = 8;
  return s;
}

std::vector<float> AsFloats(const std::vector<uint8_t>& bytes) {
  std::vector<float> f(bytes.size() / sizeof(float));
  std::memcpy(f.data(), bytes.data(), bytes.size());
  return f;
}

struct Mode {
  uint64_t budget;  // 0: resident moments (kAll); 1 byte: scratch (kBatches)
  bool shared;      // an expert with two owners: kNone
  bool early;       // the backward's early fetch of the first batches' moments
  ExpertUpdater::Overlap want;
  bool bf16 = false;  // a bf16 job: bf16 weights blobs in the slots, the master fetched
};

class ExpertUpdaterTest : public ::testing::TestWithParam<Mode> {
 protected:
  void SetUp() override {
    const ::testing::TestInfo* test = ::testing::UnitTest::GetInstance()->current_test_info();
    if (test->value_param() != nullptr && GetParam().bf16) {
      shape_.compute_dtype = ComputeDtype::kBf16;
    }
    layout_ = std::make_unique<model::ParamLayout>(shape_);
    blob_bytes_ = static_cast<size_t>(shape_.expert_blob_bytes());
    worker_ = *ucx::Worker::Create();
    io_ = std::make_unique<FakeBlobIo>(worker_.get());
    config_.lr = 0.01;
    config_.steps = 10;
    config_.weight_decay = 0.1;
    config_.grad_clip = 1.0;
    floats_ = shape_.expert_floats();
    const size_t bytes = floats_ * sizeof(float);
    params_.assign(layout_->total_floats(), 0.0f);
    grads_.assign(layout_->total_floats(), 0.0f);
    for (int64_t i = 0; i < layout_->total_floats(); ++i) {
      params_[i] = 0.01f * static_cast<float>(i % 37) - 0.1f;
      grads_[i] = 0.02f * static_cast<float>(i % 11) - 0.1f;
    }
    original_grads_ = grads_;
    // The experts' gradients in a pool of 3 buffers (fewer than the experts: some spill),
    // as a backward leaves them.
    auto pool = GradPool::Create(floats_, 3, ::testing::TempDir());
    ASSERT_TRUE(pool.ok()) << pool.status();
    grad_pool_ = std::move(*pool);
    for (const Expert& x : all_) {
      auto g = grad_pool_->Open(x);
      ASSERT_TRUE(g.ok()) << g.status();
      const float* from = grads_.data() + layout_->ExpertOffset(x.first, x.second);
      std::copy(from, from + floats_, *g);
      grad_pool_->Close(x);
    }
    // The committed step: weights, moments and counts of every expert.
    for (const Expert& x : all_) {
      const auto [l, e] = x;
      const float* w = params_.data() + layout_->ExpertOffset(l, e);
      std::vector<float> m(floats_), v(floats_);
      for (int64_t i = 0; i < floats_; ++i) {
        m[i] = 0.001f * static_cast<float>(i % 5);
        v[i] = 0.0001f * static_cast<float>(1 + i % 7);
      }
      io_->Set(v1::BLOB_KIND_WEIGHTS, l, e, 0, Blob(w).data(), blob_bytes_);
      io_->Set(v1::BLOB_KIND_MASTER, l, e, 0, w, bytes);
      io_->Set(v1::BLOB_KIND_ADAM_M, l, e, 0, m.data(), bytes);
      io_->Set(v1::BLOB_KIND_ADAM_V, l, e, 0, v.data(), bytes);
      const int64_t count = kInitialCount;
      io_->Set(v1::BLOB_KIND_STATE, l, e, 0, &count, sizeof(count));
    }
    auto memory = worker_->Allocate(blob_bytes_ * kSlots);
    ASSERT_TRUE(memory.ok());
    auto cache = ExpertCache::Create(
        std::move(*memory), blob_bytes_, kSlots,
        [this](absl::Span<ExpertCache::FetchRequest> requests, size_t size, ucp_mem_h) {
          for (ExpertCache::FetchRequest& r : requests) {
            const std::vector<uint8_t> w =
                io_->Get(v1::BLOB_KIND_WEIGHTS, r.expert.first, r.expert.second, 0);
            std::memcpy(r.dst, w.data(), size);
          }
          return absl::OkStatus();
        });
    ASSERT_TRUE(cache.ok());
    cache_ = std::move(*cache);
    updater_ = std::make_unique<ExpertUpdater>(
        ExpertUpdater::Deps{"job", io_.get(), cache_.get(), layout_.get(), &config_,
                            grad_pool_.get(), &backend_, &update_backend_});
  }
  void TearDown() override {
    updater_.reset();
    cache_.reset();
    io_.reset();
    worker_.reset();
  }

  // The weights blob of the fp32 expert at `w`: its bytes, or its bf16 form.
  std::vector<uint8_t> Blob(const float* w) const {
    std::vector<uint8_t> blob(blob_bytes_);
    if (shape_.compute_dtype == ComputeDtype::kBf16) {
      PackExpertBf16(w, shape_.channels, shape_.hidden, blob.data());
    } else {
      std::memcpy(blob.data(), w, blob_bytes_);
    }
    return blob;
  }

  // What AdamWOptimizer::Apply makes of the committed state for `used` at step s.
  void ExpectLikeTheOptimizer(const std::vector<Expert>& used, int64_t s, double grad_norm) {
    compute::CpuBackend backend(1);
    auto opt = model::AdamWOptimizer::Create(&backend, *layout_, config_);
    ASSERT_TRUE(opt.ok());
    std::vector<float> params = params_, grads = original_grads_;
    const size_t bytes = floats_ * sizeof(float);
    for (const Expert& x : all_) {
      const auto [l, e] = x;
      const int64_t o = layout_->ExpertOffset(l, e);
      std::memcpy((*opt)->m() + o, io_->Get(v1::BLOB_KIND_ADAM_M, l, e, 0).data(), bytes);
      std::memcpy((*opt)->v() + o, io_->Get(v1::BLOB_KIND_ADAM_V, l, e, 0).data(), bytes);
      for (int t = 0; t < 4; ++t)
        (*opt)->update_counts()[layout_->ExpertTensorIndex(l, e) + t] = kInitialCount;
    }
    const model::HasGrad has_grad = [&](const model::ParamTensor& t) {
      return t.layer >= 0 &&
             std::find(used.begin(), used.end(), Expert{t.layer, t.expert}) != used.end();
    };
    (*opt)->Apply(params.data(), grads.data(), s - 1, has_grad, grad_norm);
    ASSERT_TRUE(backend.Synchronize().ok());
    for (const Expert& x : all_) {
      const auto [l, e] = x;
      const bool updated = std::find(used.begin(), used.end(), x) != used.end();
      const std::vector<uint8_t> w = io_->Get(v1::BLOB_KIND_WEIGHTS, l, e, s);
      if (!updated) {
        EXPECT_TRUE(w.empty()) << l << "/" << e << " was not used but written";
        continue;
      }
      const int64_t o = layout_->ExpertOffset(l, e);
      EXPECT_EQ(AsFloats(io_->Get(v1::BLOB_KIND_MASTER, l, e, s)),
                std::vector<float>(params.begin() + o, params.begin() + o + floats_));
      EXPECT_EQ(w, Blob(params.data() + o));
      EXPECT_EQ(AsFloats(io_->Get(v1::BLOB_KIND_ADAM_M, l, e, s)),
                std::vector<float>((*opt)->m() + o, (*opt)->m() + o + floats_));
      EXPECT_EQ(AsFloats(io_->Get(v1::BLOB_KIND_ADAM_V, l, e, s)),
                std::vector<float>((*opt)->v() + o, (*opt)->v() + o + floats_));
      int64_t count = 0;
      const std::vector<uint8_t> state = io_->Get(v1::BLOB_KIND_STATE, l, e, s);
      ASSERT_EQ(state.size(), sizeof(count));
      std::memcpy(&count, state.data(), sizeof(count));
      EXPECT_EQ(count, kInitialCount + 1);
      // The cache holds the update too.
      absl::StatusOr<float*> cached = cache_->Acquire(x);
      ASSERT_TRUE(cached.ok());
      const auto* slot = reinterpret_cast<const uint8_t*>(*cached);
      EXPECT_EQ(std::vector<uint8_t>(slot, slot + blob_bytes_), w);
      cache_->Release(x);
    }
  }

  static constexpr int kSlots = 4;
  model::ModelShape shape_ = Shape();
  std::unique_ptr<model::ParamLayout> layout_;
  size_t blob_bytes_ = 0;
  model::OptimizerConfig config_;
  int64_t floats_ = 0;
  std::vector<float> params_, grads_, original_grads_;
  std::unique_ptr<GradPool> grad_pool_;
  const std::vector<Expert> all_ = {{0, 0}, {0, 1}, {1, 0}, {1, 1}};
  compute::CpuBackend update_backend_{1};
  compute::CpuBackend backend_{1};
  std::unique_ptr<ucx::Worker> worker_;
  std::unique_ptr<FakeBlobIo> io_;
  std::unique_ptr<ExpertCache> cache_;
  std::unique_ptr<ExpertUpdater> updater_;
};

TEST_P(ExpertUpdaterTest, UpdatesAsTheOptimizerDoesAndWritesEveryBlob) {
  const Mode mode = GetParam();
  ASSERT_TRUE(updater_->SetUp(all_, PlanMoments(kSlots, mode.budget == 0)).ok());
  ASSERT_EQ(updater_->OverlapWrites(mode.shared), mode.want);
  const std::vector<Expert> used = {{0, 1}, {1, 0}, {1, 1}};
  const int64_t s = 1;
  const double grad_norm = 5.0;  // clipped: grad_clip is 1
  PutQueue dense;                // a write queued before the experts' goes with them
  const float dense_bytes[2] = {1, 2};
  ASSERT_TRUE(io_->Put({"s0"}, BlobKeyOf("job", -1, 0, "wte", v1::BLOB_KIND_WEIGHTS), s,
                       dense_bytes, sizeof(dense_bytes), dense)
                  .ok());
  if (mode.want == ExpertUpdater::Overlap::kNone) {
    ASSERT_TRUE(updater_->UpdateNow(s, grad_norm, used, std::move(dense)).ok());
  } else {
    if (mode.early) updater_->StartEarlyMoments(used, mode.want);
    cache_->BeginUpdates(used);
    int thens = 0;
    UpdateHandle handle = updater_->Launch(s, grad_norm, mode.want, used, std::move(dense), [&] {
      ++thens;
      // Every write has landed by then.
      EXPECT_EQ(io_->primary_puts(), 1 + 5 * static_cast<int>(used.size()));
      return absl::OkStatus();
    });
    EXPECT_TRUE(handle.pending());
    ASSERT_TRUE(handle.Wait().ok());
    EXPECT_FALSE(handle.pending());
    EXPECT_EQ(thens, 1);
    EXPECT_TRUE(cache_->AwaitUpdates().ok());
  }
  EXPECT_EQ(io_->primary_puts(), 1 + 5 * static_cast<int>(used.size()));
  EXPECT_EQ(AsFloats(io_->Get(v1::BLOB_KIND_WEIGHTS, -1, 0, s)), std::vector<float>({1, 2}));
  ExpectLikeTheOptimizer(used, s, grad_norm);
}

INSTANTIATE_TEST_SUITE_P(
    Overlaps, ExpertUpdaterTest,
    ::testing::Values(Mode{0, false, false, ExpertUpdater::Overlap::kAll},
                      Mode{1, false, false, ExpertUpdater::Overlap::kBatches},
                      Mode{1, false, true, ExpertUpdater::Overlap::kBatches},
                      Mode{0, true, false, ExpertUpdater::Overlap::kNone},
                      Mode{1, true, false, ExpertUpdater::Overlap::kNone},
                      Mode{0, false, false, ExpertUpdater::Overlap::kAll, true},
                      Mode{1, false, true, ExpertUpdater::Overlap::kBatches, true},
                      Mode{1, true, false, ExpertUpdater::Overlap::kNone, true}));

TEST_F(ExpertUpdaterTest, AFailedFetchEndsTheHandleWithItsErrorAndWritesNothing) {
  ASSERT_TRUE(updater_->SetUp(all_, PlanMoments(kSlots, /*resident=*/false)).ok());
  io_->FailFetches(v1::BLOB_KIND_ADAM_V);
  const std::vector<Expert> used = {{0, 0}, {1, 1}};
  cache_->BeginUpdates(used);
  bool then = false;
  UpdateHandle handle =
      updater_->Launch(1, 1.0, ExpertUpdater::Overlap::kBatches, used, PutQueue{}, [&] {
        then = true;
        return absl::OkStatus();
      });
  EXPECT_EQ(handle.Wait().code(), absl::StatusCode::kNotFound);
  EXPECT_FALSE(then);
  EXPECT_EQ(io_->primary_puts(), 0);
  // The experts not updated stay unreadable until the next updates begin.
  EXPECT_EQ(cache_->AwaitUpdates().code(), absl::StatusCode::kNotFound);
  // Every slot was released: a new set of updates can pin them all.
  cache_->BeginUpdates({});
  for (const Expert& x : all_) {
    absl::StatusOr<float*> w = cache_->Acquire(x);
    ASSERT_TRUE(w.ok()) << w.status();
  }
  for (const Expert& x : all_) cache_->Release(x);
}

}  // namespace
}  // namespace pith::runtime
