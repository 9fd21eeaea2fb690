// Expert parallelism is math-preserving: two workers, each with half the rows (i % 2 == r,
// DESIGN §3 data order), dispatching experts to their owners over UCX, give the loss and
// the gradients of one model on the whole batch (dropless), and twice the same bits.
#include "worker/runtime/dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "common/ucx.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu_backend.h"
#include "worker/compute/opaque_backend.h"
#include "worker/runtime/device_group.h"
#include "worker/runtime/expert_gradients.h"

namespace pith::runtime {
namespace {

// An assignment's placement becomes the owners table; entries that do not fit the model or
// the world, a repeated expert and an expert without owner are refused.
TEST(OwnersOfTest, ReadsThePlacementAndRefusesWhatDoesNotFit) {
  v1::PlacementTable p;
  p.add_experts()->set_layer(-1);  // the dense group: no owners
  for (int e = 0; e < 2; ++e) {
    v1::ExpertPlacement* x = p.add_experts();
    x->set_layer(0);
    x->set_expert(e);
    v1::ComputeOwner* o = x->add_owners();
    o->set_rank(1 - e);
    o->set_token_share(e == 0 ? 1.0 : 0.25);
    if (e == 1) {
      o = x->add_owners();
      o->set_rank(1);
      o->set_token_share(0.75);
    }
  }
  auto owners = OwnersOf(p, 1, 2, 2);
  ASSERT_TRUE(owners.ok()) << owners.status();
  EXPECT_EQ((*owners)[0][0], (ExpertOwners{{1, 1.0}}));
  EXPECT_EQ((*owners)[0][1], (ExpertOwners{{0, 0.25}, {1, 0.75}}));
  EXPECT_FALSE(OwnersOf(p, 1, 3, 2).ok());  // expert 2 has no owner
  EXPECT_FALSE(OwnersOf(p, 1, 1, 2).ok());  // expert 1 is outside the model
  EXPECT_FALSE(OwnersOf(p, 1, 2, 1).ok());  // rank 1 is outside the world
  *p.add_experts() = p.experts(1);
  EXPECT_FALSE(OwnersOf(p, 1, 2, 2).ok());  // expert 0 twice
}

model::ModelShape Shape() {
  model::ModelShape s;
  s.vocab = 13;
  s.seq = 6;
  s.channels = 16;
  s.layers = 2;
  s.heads = 2;
  s.experts = 4;
  s.top_k = 2;
  s.hidden = 12;
  s.capacity_factor = 8.0;  // dropless
  s.aux_loss_coef = 0.1;
  s.z_loss_coef = 0.01;
  s.renormalize_topk = true;
  return s;
}

struct Result {
  model::StepLoss loss;
  std::vector<float> grads;  // summed over the workers
  std::vector<bool> used;
  int64_t rows_sent = 0, assignments_sent = 0;  // over the workers' forward passes
  std::vector<uint64_t> uploads;                // rank 0's slot uploads after each step
  uint64_t exchanges = 0;                       // rank 0's exchanges on a device group
  uint64_t downloads = 0;                       // rank 0's gradients copied down to its pool
};

constexpr int kRows = 6;

std::vector<int32_t> Tokens(const model::ModelShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(kRows * s.seq);
  for (int32_t& v : t) v = static_cast<int32_t>(rng() % s.vocab);
  return t;
}

Result Alone(const model::ModelShape& s) {
  compute::CpuBackend backend(1);
  auto m = model::MoeGpt::Create(&backend, s, kRows);
  EXPECT_TRUE(m.ok());
  EXPECT_TRUE((*m)->InitWeights(7).ok());
  const auto in = Tokens(s, 1), tgt = Tokens(s, 2);
  auto loss = (*m)->ForwardBackward(in.data(), tgt.data(), kRows);
  EXPECT_TRUE(loss.ok()) << loss.status();
  Result r{
      *loss, std::vector<float>((*m)->grads(), (*m)->grads() + (*m)->layout().total_floats()), {}};
  for (int l = 0; l < s.layers; ++l) {
    for (int e = 0; e < s.experts; ++e) r.used.push_back((*m)->ExpertUsed(l, e));
  }
  return r;
}

// Owners of each expert of each layer: single owners (rank 0 owns experts 0 and 3 of
// layer 0, the rest alternate), or — replicated — experts shared by ranks 0 and 1 with
// a third worker that owns nothing and splits its rows.
std::vector<std::vector<ExpertOwners>> Owners(bool replicated) {
  if (!replicated) {
    return {{{{0, 1.0}}, {{1, 1.0}}, {{1, 1.0}}, {{0, 1.0}}},
            {{{1, 1.0}}, {{0, 1.0}}, {{1, 1.0}}, {{0, 1.0}}}};
  }
  return {{{{0, 0.5}, {1, 0.5}}, {{1, 1.0}}, {{1, 0.25}, {0, 0.75}}, {{0, 1.0}}},
          {{{1, 1.0}}, {{0, 0.5}, {1, 0.5}}, {{1, 1.0}}, {{0, 0.6}, {1, 0.4}}}};
}

// The backend memory's contents, read as the runtime must read it: through a copy.
std::vector<float> Read(compute::Backend& b, const float* p, int64_t n) {
  std::vector<float> v(n);
  EXPECT_TRUE(b.CopyToHost(v.data(), p, n * sizeof(float)).ok());
  return v;
}

// An expert cache whose host slots fill from a host copy of the model's experts.
struct TestCache {
  std::vector<float> host_experts;
  std::unique_ptr<ucx::Worker> ucx_worker;  // its memory
  std::unique_ptr<ExpertCache> cache;

  void Make(compute::Backend& backend, model::MoeGpt& m, int slots) {
    const model::ModelShape& s = m.shape();
    const int64_t floats = s.expert_floats(), experts = s.experts;
    host_experts =
        Read(backend, m.params() + m.layout().ExpertOffset(0, 0), s.layers * s.experts * floats);
    ucx_worker = *ucx::Worker::Create();
    auto memory = ucx_worker->Allocate(slots * floats * sizeof(float));
    ASSERT_TRUE(memory.ok()) << memory.status();
    // Called on the cache's prefetch thread: this object outlives the cache.
    auto made = ExpertCache::Create(
        std::move(*memory), floats * sizeof(float), slots,
        [this, floats, experts](absl::Span<ExpertCache::FetchRequest> requests, size_t size,
                                ucp_mem_h) {
          for (ExpertCache::FetchRequest& r : requests) {
            const int64_t at = (r.expert.first * experts + r.expert.second) * floats;
            std::memcpy(r.dst, host_experts.data() + at, size);
          }
          return absl::OkStatus();
        });
    ASSERT_TRUE(made.ok()) << made.status();
    cache = std::move(*made);
  }
  ExpertCache* get() const { return cache.get(); }
};

// How each worker of Parallel computes: on the CPU backend, or on the opaque one (the
// CPU's math on memory the host may not touch, as a GPU's); the experts' gradients in the
// model's arena or in a gradient pool (as a cluster worker keeps them).
struct Setup {
  bool opaque = false;
  bool pool = false;
  int cache_slots = 0;        // > 0: the owned experts' weights through a cache of these slots
  int mirror_slots = 0;       // > 0: at most these device slots for them
  int steps = 1;              // more: the same step again (the result is the first's)
  bool device_group = false;  // opaque: the rows over a device group of the workers
  int pool_buffers = 0;       // > 0: the pool's buffers (else one per expert)
  // With a pool: the replica reduce after the step (on the device group where there is
  // one, else ExpertGradients' over the peer group); each expert's gradient is then read
  // from its primary's pool only.
  bool reduce_replicas = false;
};

Result Parallel(const model::ModelShape& s, int W = 2, bool replicated = false, Setup setup = {}) {
  std::vector<std::unique_ptr<PeerGroup>> peers;
  std::vector<std::string> addresses;
  for (int r = 0; r < W; ++r) {
    peers.push_back(*PeerGroup::Create());
    addresses.push_back(peers.back()->address());
  }
  for (int r = 0; r < W; ++r) EXPECT_TRUE(peers[r]->Join(r, addresses, 1).ok());
  const auto owner = Owners(replicated);
  const auto in = Tokens(s, 1), tgt = Tokens(s, 2);
  std::vector<model::StepLoss> losses(W);
  std::vector<std::vector<float>> grads(W);
  std::vector<absl::Status> status(W);
  std::vector<std::pair<int64_t, int64_t>> sent(W);
  Result r;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < W; ++rank) {
    threads.emplace_back([&, rank] {
      std::unique_ptr<compute::Backend> made;
      if (setup.opaque) {
        made = std::make_unique<compute::OpaqueBackend>(1);
      } else {
        made = std::make_unique<compute::CpuBackend>(1);
      }
      compute::Backend& backend = *made;
      int rows = 0;
      for (int row = rank; row < kRows; row += W) ++rows;
      auto m = model::MoeGpt::Create(&backend, s, rows);
      if (!m.ok() || !(*m)->InitWeights(7).ok()) {
        status[rank] = absl::InternalError("model");
        return;
      }
      TestCache cache;
      if (setup.cache_slots > 0) {
        ASSERT_NO_FATAL_FAILURE(cache.Make(backend, **m, setup.cache_slots));
      }
      DeviceGroupSlot group;
      if (setup.device_group) {
        const absl::Status joined = group.Rejoin(backend, *peers[rank], absl::Seconds(30));
        ASSERT_TRUE(joined.ok()) << joined;
        ASSERT_NE(group.group(), nullptr);
      }
      std::unique_ptr<GradPool> pool;  // outlives the dispatch, which may close its buffers
      if (setup.pool) {
        auto made_pool = GradPool::Create(
            s.expert_floats(), setup.pool_buffers > 0 ? setup.pool_buffers : s.layers * s.experts,
            ::testing::TempDir());
        ASSERT_TRUE(made_pool.ok()) << made_pool.status();
        pool = std::move(*made_pool);
      }
      Dispatch dispatch(&backend, m->get(), peers[rank].get(), owner);
      dispatch.SetDeviceGroup(&group);
      dispatch.SetCache(cache.get());
      dispatch.SetMirrorSlots(setup.mirror_slots);
      dispatch.SetGradPool(pool.get());
      dispatch.SetStep(1);
      (*m)->SetExpertParallel(&dispatch);
      std::vector<int32_t> my_in, my_tgt;
      for (int row = rank; row < kRows; row += W) {
        my_in.insert(my_in.end(), in.begin() + row * s.seq, in.begin() + (row + 1) * s.seq);
        my_tgt.insert(my_tgt.end(), tgt.begin() + row * s.seq, tgt.begin() + (row + 1) * s.seq);
      }
      std::vector<std::vector<int>> primary(s.layers, std::vector<int>(s.experts));
      std::vector<std::pair<int, int>> owned;
      for (int l = 0; l < s.layers; ++l) {
        for (int e = 0; e < s.experts; ++e) {
          primary[l][e] = owner[l][e][0].first;
          if (dispatch.Computes(l, e)) owned.push_back({l, e});
        }
      }
      const ExpertGradients host{pool.get(), &(*m)->layout(),
                                 &owner,     &primary,
                                 rank,       [&](int l, int e) { return (*m)->ExpertUsed(l, e); }};
      auto reduce = [&](int64_t step) {
        if (!setup.reduce_replicas) return absl::OkStatus();
        return dispatch.ReplicasOnDevice() ? dispatch.ReduceReplicasOnDevice()
                                           : host.ReduceReplicas(*peers[rank], step, owned);
      };
      auto loss = (*m)->ForwardBackward(my_in.data(), my_tgt.data(), kRows);
      status[rank] = loss.ok() ? reduce(1) : loss.status();
      if (!status[rank].ok()) return;
      losses[rank] = *loss;
      if (rank == 0) r.uploads.push_back(dispatch.slot_uploads());
      for (int step = 2; step <= setup.steps; ++step) {
        dispatch.SetStep(step);
        const auto again = (*m)->ForwardBackward(my_in.data(), my_tgt.data(), kRows);
        ASSERT_TRUE(again.ok()) << again.status();
        ASSERT_TRUE(reduce(step).ok());
        EXPECT_EQ(again->loss, loss->loss);
        if (rank == 0) r.uploads.push_back(dispatch.slot_uploads());
      }
      sent[rank] = {dispatch.rows_sent(), dispatch.assignments_sent()};
      if (rank == 0) r.exchanges = dispatch.device_exchanges();
      if (rank == 0) r.downloads = dispatch.grad_downloads();
      grads[rank] = Read(backend, (*m)->grads(), (*m)->layout().total_floats());
      for (int l = 0; pool != nullptr && l < s.layers; ++l) {  // the pool's, in their places
        for (int e = 0; e < s.experts; ++e) {
          if (!pool->Has({l, e}) || (setup.reduce_replicas && primary[l][e] != rank)) continue;
          absl::StatusOr<float*> g = pool->Acquire({l, e});
          ASSERT_TRUE(g.ok()) << g.status();
          std::copy_n(*g, s.expert_floats(),
                      grads[rank].begin() + (*m)->layout().ExpertOffset(l, e));
          pool->Release({l, e});
        }
      }
      if (rank == 0) {
        for (int l = 0; l < s.layers; ++l) {
          for (int e = 0; e < s.experts; ++e) r.used.push_back((*m)->ExpertUsed(l, e));
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < W; ++rank) EXPECT_TRUE(status[rank].ok()) << status[rank];
  for (int rank = 1; rank < W; ++rank) {
    EXPECT_EQ(losses[0].loss, losses[rank].loss);  // the same bits on every worker
  }
  r.loss = losses[0];
  r.grads = grads[0];
  for (const auto& [rows, assignments] : sent) {
    r.rows_sent += rows;
    r.assignments_sent += assignments;
  }
  for (int rank = 1; rank < W; ++rank) {
    for (size_t i = 0; i < r.grads.size(); ++i) r.grads[i] += grads[rank][i];
  }
  return r;
}

void ExpectSameAs(const Result& alone, const Result& parallel) {
  EXPECT_NEAR(parallel.loss.loss, alone.loss.loss, 1e-6 * std::abs(alone.loss.loss));
  EXPECT_EQ(parallel.used, alone.used);
  double worst = 0;
  for (size_t i = 0; i < alone.grads.size(); ++i) {
    worst = std::max(worst, std::abs(double{parallel.grads[i]} - alone.grads[i]) /
                                (std::abs(double{alone.grads[i]}) + 1e-4));
  }
  EXPECT_LT(worst, 1e-3) << "largest relative gradient difference";
}

// A run on a backend the host cannot read (`device`) against the same run on the CPU
// (`plain`): the same bits, and the same rows sent.
void ExpectSameBits(const Result& plain, const Result& device) {
  EXPECT_EQ(device.loss.loss, plain.loss.loss);
  EXPECT_EQ(device.used, plain.used);
  EXPECT_EQ(device.grads, plain.grads);
  EXPECT_EQ(device.rows_sent, plain.rows_sent);
  EXPECT_EQ(device.assignments_sent, plain.assignments_sent);
}

// On a backend whose memory the host may not touch (a GPU's; here the CPU's math behind
// PROT_NONE pages, so a direct read would crash the test), dispatch goes through copies
// and computes the same bits, with the experts' gradients in the model or in a pool.
TEST(DispatchTest, ABackendTheHostCannotReadComputesTheSameBits) {
  const model::ModelShape s = Shape();
  for (bool replicated : {false, true}) {
    const int W = replicated ? 3 : 2;
    // No pool, a pool of a buffer per expert, and one of 2 (a gradient device slot, used
    // by expert after expert; the pool spills).
    for (const auto& [pool, buffers] :
         {std::pair{false, 0}, std::pair{true, 0}, std::pair{true, 2}}) {
      SCOPED_TRACE(::testing::Message()
                   << "replicated " << replicated << " pool " << pool << " of " << buffers);
      ::pith::runtime::Setup cpu{.opaque = false, .pool = pool};
      cpu.pool_buffers = buffers;
      ::pith::runtime::Setup device = cpu;
      device.opaque = true;
      const Result plain = Parallel(s, W, replicated, cpu);
      const Result opaque = Parallel(s, W, replicated, device);
      ExpectSameBits(plain, opaque);
      if (pool) ExpectSameAs(Alone(s), opaque);
      // With a pool, each expert gradient went down from a device slot of its own, behind
      // the next experts' compute (the opaque backend leaves NaNs in the pool buffer until
      // the copy is waited for: reading it sooner would change the gradients above).
      EXPECT_EQ(plain.downloads, 0u);
      if (pool) {
        EXPECT_GT(opaque.downloads, 0u);
      } else {
        EXPECT_EQ(opaque.downloads, 0u);
      }
    }
  }
}

// The experts' weights through a cache, on a backend the host cannot read: each slot has a
// device copy, uploaded when the slot's bytes change. The same bits as on the CPU; with a
// slot for every expert computed each is uploaded once (the backward and the next step
// reuse it), with 2 slots they turn over and go up again.
TEST(DispatchTest, CacheSlotsGoToTheDeviceWhenTheyChangeOnly) {
  const model::ModelShape s = Shape();
  // Rank 0 computes 4 experts (Owners(false)): 5 host slots hold them all, 2 turn over;
  // 2 device slots for 5 host slots turn over on the device only.
  for (const auto& [slots, mirror] : {std::pair{5, 0}, std::pair{2, 0}, std::pair{5, 2}}) {
    SCOPED_TRACE(::testing::Message() << slots << " slots, " << mirror << " device slots");
    ::pith::runtime::Setup cpu{.opaque = false, .pool = true, .cache_slots = slots, .steps = 2};
    cpu.mirror_slots = mirror;
    ::pith::runtime::Setup device = cpu;
    device.opaque = true;
    const Result plain = Parallel(s, 2, false, cpu);
    const Result opaque = Parallel(s, 2, false, device);
    ExpectSameBits(plain, opaque);
    ExpectSameAs(Alone(s), opaque);
    EXPECT_EQ(plain.uploads, std::vector<uint64_t>({0, 0}));
    ASSERT_EQ(opaque.uploads.size(), 2u);
    EXPECT_GT(opaque.uploads[0], 0u);
    if (slots == 5 && mirror == 0) {
      EXPECT_LE(opaque.uploads[0], 4u);
      EXPECT_EQ(opaque.uploads[1], opaque.uploads[0]) << "the second step uploaded again";
    } else {
      EXPECT_GT(opaque.uploads[1], opaque.uploads[0]);
    }
  }
}

// With a device group (NCCL among GPUs; here OpaqueBackend's stand-in), the rows go from
// device to device in one grouped exchange per phase (4 per layer and step), headers
// over the peer group: the same bits as through the host, replicated experts, a cache and
// a gradient pool included.
TEST(DispatchTest, RowsOverADeviceGroupComputeTheSameBits) {
  const model::ModelShape s = Shape();
  for (bool replicated : {false, true}) {
    const int W = replicated ? 3 : 2;
    for (int slots : {0, 3}) {
      SCOPED_TRACE(::testing::Message() << "replicated " << replicated << " slots " << slots);
      ::pith::runtime::Setup cpu{.opaque = false, .pool = true, .cache_slots = slots, .steps = 2};
      cpu.reduce_replicas = true;  // on the device group with one, as a cluster worker does
      ::pith::runtime::Setup device = cpu;
      device.opaque = true;
      device.device_group = true;
      const Result plain = Parallel(s, W, replicated, cpu);
      const Result opaque = Parallel(s, W, replicated, device);
      ExpectSameBits(plain, opaque);
      ExpectSameAs(Alone(s), opaque);
      EXPECT_EQ(plain.exchanges, 0u);
      // 4 per layer and step, and with shared experts the reduce's, one a step.
      EXPECT_EQ(opaque.exchanges, 2u * (4 * s.layers + (replicated ? 1 : 0)));
    }
  }
}

// The replica reduce on a device group: each shared expert's other owners send their
// gradients to its primary in one grouped exchange, which sums them in rank order: the
// bits of the host path's reduce over the peer group.
TEST(DispatchTest, ReplicaGradientsSumOnTheDeviceGroupAsOnTheHost) {
  const model::ModelShape s = Shape();
  ::pith::runtime::Setup cpu{.opaque = false, .pool = true};
  cpu.reduce_replicas = true;
  ::pith::runtime::Setup device = cpu;
  device.opaque = true;
  device.device_group = true;
  const Result plain = Parallel(s, 3, /*replicated=*/true, cpu);
  const Result opaque = Parallel(s, 3, /*replicated=*/true, device);
  ExpectSameBits(plain, opaque);
  ExpectSameAs(Alone(s), opaque);
  // 4 row exchanges per layer, then the reduce's (rank 0 is a primary of shared experts).
  EXPECT_EQ(opaque.exchanges, 4u * s.layers + 1);

  // Pools of 2 buffers cannot stand for the device buffers the ranks would keep (rank 0
  // would keep 8: 4 copies, 3 landed, the sum): they vote for the host path, with the
  // same bits.
  cpu.pool_buffers = device.pool_buffers = 2;
  const Result small_plain = Parallel(s, 3, /*replicated=*/true, cpu);
  const Result small = Parallel(s, 3, /*replicated=*/true, device);
  EXPECT_EQ(small.grads, small_plain.grads);
  EXPECT_EQ(small.grads, plain.grads);
  EXPECT_EQ(small.exchanges, 4u * s.layers);
}

TEST(DispatchTest, ReplicatedExpertsSplitTheirRowsAndTheMathHolds) {
  // Three workers, kRows = 6: two rows each; experts shared by ranks 0 and 1; rank 2 owns
  // nothing. The gradients of a shared expert add up across its owners.
  const model::ModelShape s = Shape();
  ExpectSameAs(Alone(s), Parallel(s, 3, /*replicated=*/true));
}

TEST(DispatchTest, TwoWorkersComputeWhatOneModelComputes) {
  const model::ModelShape s = Shape();
  const Result alone = Alone(s);
  const Result parallel = Parallel(s);
  // A token both of whose experts a peer computes went to it once.
  EXPECT_GT(parallel.rows_sent, 0);
  EXPECT_LT(parallel.rows_sent, parallel.assignments_sent);
  EXPECT_NEAR(parallel.loss.loss, alone.loss.loss, 1e-6 * std::abs(alone.loss.loss));
  EXPECT_NEAR(parallel.loss.ce, alone.loss.ce, 1e-6 * std::abs(alone.loss.ce));
  EXPECT_NEAR(parallel.loss.aux, alone.loss.aux, 1e-6 * std::abs(alone.loss.aux));
  EXPECT_NEAR(parallel.loss.z, alone.loss.z, 1e-5 * std::abs(alone.loss.z) + 1e-12);
  EXPECT_EQ(parallel.used, alone.used);
  ASSERT_EQ(parallel.grads.size(), alone.grads.size());
  double worst = 0;
  for (size_t i = 0; i < alone.grads.size(); ++i) {
    worst = std::max(worst, std::abs(double{parallel.grads[i]} - alone.grads[i]) /
                                (std::abs(double{alone.grads[i]}) + 1e-4));
  }
  EXPECT_LT(worst, 1e-3) << "largest relative gradient difference";
  // And again: the same bits.
  const Result again = Parallel(s);
  EXPECT_EQ(again.loss.loss, parallel.loss.loss);
  EXPECT_EQ(again.grads, parallel.grads);
}

// A peer's forward message that is short, overflowing or out of range is DATA_LOSS for
// the step, never a crash or a read past the message.
TEST(DispatchTest, ACorruptPeerMessageIsDataLoss) {
  const model::ModelShape s = Shape();
  const int E = s.experts;
  struct Case {
    const char* what;
    std::string bytes;
  };
  auto counts = [&](std::vector<int64_t> c) {
    c.resize(E, 0);
    return std::string(reinterpret_cast<const char*>(c.data()), E * sizeof(int64_t));
  };
  const int64_t huge = std::numeric_limits<int64_t>::max();
  // Rank 0 computes experts 0 and 3 of layer 0 (Owners(false)).
  std::vector<Case> cases = {
      {"short", std::string(3, '\0')},
      {"overflowing counts", counts({huge, 0, 0, huge}) + std::string(8, '\0')},
      {"a count past the bytes", counts({1 << 20, 0, 0, 0}) + std::string(16, '\0')},
      {"an index out of range",
       counts({1, 0, 0, 0}) + std::string("\x05\0\0\0", 4) + std::string(16 * 4, '\0')},
      {"rows nothing indexes",
       counts({1, 0, 0, 0}) + std::string(4, '\0') + std::string(2 * 16 * 4, '\0')},
      {"an expert it does not compute", counts({0, 1, 0, 0}) + std::string(4 + 16 * 4, '\0')},
  };
  for (const Case& c : cases) {
    std::vector<std::unique_ptr<PeerGroup>> peers;
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      peers.push_back(*PeerGroup::Create());
      addresses.push_back(peers.back()->address());
    }
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(peers[r]->Join(r, addresses, 1).ok());
    // Rank 1's layer-0 forward rows, as a broken peer sends them (step 1, phase 1).
    ASSERT_TRUE(peers[1]->Send(0, (uint64_t{1} << 32) | 1, c.bytes).ok());
    compute::CpuBackend backend(1);
    auto m = model::MoeGpt::Create(&backend, s, kRows / 2);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->InitWeights(7).ok());
    Dispatch dispatch(&backend, m->get(), peers[0].get(), Owners(false));
    dispatch.SetStep(1);
    (*m)->SetExpertParallel(&dispatch);
    const auto in = Tokens(s, 1), tgt = Tokens(s, 2);
    auto loss = (*m)->ForwardBackward(in.data(), tgt.data(), kRows);
    EXPECT_EQ(loss.status().code(), absl::StatusCode::kDataLoss) << c.what << ": " << loss.status();
  }
}

}  // namespace
}  // namespace pith::runtime

namespace pith::runtime {
namespace {

// Over a device group, a peer's row header that is short, overflowing, inconsistent or out
// of range is DATA_LOSS for the step before any rows move, never a crash or an allocation
// the header does not justify.
TEST(DispatchTest, ACorruptDeviceRowHeaderIsDataLoss) {
  const model::ModelShape s = Shape();
  const int E = s.experts;
  auto head = [&](std::vector<int64_t> c, int64_t n, std::vector<int32_t> index) {
    c.resize(E, 0);
    c.push_back(n);
    return std::string(reinterpret_cast<const char*>(c.data()), c.size() * sizeof(int64_t)) +
           std::string(reinterpret_cast<const char*>(index.data()), index.size() * 4);
  };
  const int64_t huge = std::numeric_limits<int64_t>::max();
  // Rank 0 computes experts 0 and 3 of layer 0 (Owners(false)).
  const std::vector<std::pair<const char*, std::string>> cases = {
      {"short", std::string(3, '\0')},
      {"a torn index", head({1, 0, 0, 0}, 1, {}) + std::string(3, '\0')},
      {"overflowing counts", head({huge, 0, 0, huge}, 1, {0, 0})},
      {"more rows than indices", head({1, 0, 0, 0}, 2, {0})},
      {"a negative row count", head({1, 0, 0, 0}, -1, {0})},
      {"an index out of range", head({1, 0, 0, 0}, 1, {5})},
      {"an expert it does not compute", head({0, 1, 0, 0}, 1, {0})},
  };
  for (const auto& [what, bytes] : cases) {
    SCOPED_TRACE(what);
    auto peers = std::vector<std::unique_ptr<PeerGroup>>();
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      peers.push_back(*PeerGroup::Create());
      addresses.push_back(peers.back()->address());
    }
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(peers[r]->Join(r, addresses, 1).ok());
    compute::OpaqueBackend backend(1), other(1);
    DeviceGroupSlot group, other_group;
    std::thread joiner(
        [&] { ASSERT_TRUE(other_group.Rejoin(other, *peers[1], absl::Seconds(30)).ok()); });
    ASSERT_TRUE(group.Rejoin(backend, *peers[0], absl::Seconds(30)).ok());
    joiner.join();
    ASSERT_NE(group.group(), nullptr);
    // Rank 1's layer-0 forward row header, as a broken peer sends it (step 1, phase 1).
    ASSERT_TRUE(peers[1]->Send(0, (uint64_t{1} << 32) | 1, bytes).ok());
    auto m = model::MoeGpt::Create(&backend, s, kRows / 2);
    ASSERT_TRUE(m.ok());
    ASSERT_TRUE((*m)->InitWeights(7).ok());
    Dispatch dispatch(&backend, m->get(), peers[0].get(), Owners(false));
    dispatch.SetDeviceGroup(&group);
    dispatch.SetStep(1);
    (*m)->SetExpertParallel(&dispatch);
    const auto in = Tokens(s, 1), tgt = Tokens(s, 2);
    auto loss = (*m)->ForwardBackward(in.data(), tgt.data(), kRows);
    EXPECT_EQ(loss.status().code(), absl::StatusCode::kDataLoss) << loss.status();
    EXPECT_EQ(dispatch.device_exchanges(), 0u);
  }
}

}  // namespace
}  // namespace pith::runtime
