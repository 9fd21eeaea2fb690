#include "worker/runtime/cluster_worker.h"

#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/file.h"
#include "common/grpc_util.h"
#include "common/metrics.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/coordinator.grpc.pb.h"
#include "server/coordinator/member_agent.h"
#include "server/store/store_client.h"
#include "worker/compute/cpu_backend.h"
#include "worker/data/token_dataset.h"
#include "worker/model/checkpoint.h"
#include "worker/model/moe_gpt.h"
#include "worker/model/optimizer.h"
#include "worker/runtime/dispatch.h"
#include "worker/runtime/expert_cache.h"
#include "worker/runtime/peer_group.h"
#include "worker/runtime/task_threads.h"

namespace pith::runtime {
namespace {

using store::StoreClient;

// A store that does not answer within this is taken for dead (its lease then runs out).
constexpr absl::Duration kStoreTimeout = absl::Seconds(10);
// Most scratch moment segments (a small cache budget): batch k of a step's updates uses
// segment k % ring_, so that later batches' moments are fetched while batch k is updated
// and the writes of the batches before it go on.
constexpr int kMaxRing = 4;

struct Metrics {
  prometheus::Counter* tokens = nullptr;
  prometheus::Histogram* step_seconds = nullptr;
  prometheus::Counter* hits = nullptr;
  prometheus::Counter* misses = nullptr;
  prometheus::Counter* fetch_bytes = nullptr;
  prometheus::Histogram* fetch_seconds = nullptr;
  prometheus::Counter* put_bytes = nullptr;
  prometheus::Counter* rows_sent = nullptr;
  prometheus::Counter* prefetch_hits = nullptr;
  prometheus::Gauge* resident = nullptr;
  prometheus::Gauge* step = nullptr;
  prometheus::Gauge* loss = nullptr;
};

absl::StatusOr<Metrics> MakeMetrics(MetricsRegistry& r) {
  Metrics m;
  ASSIGN_OR_RETURN(m.tokens, r.Counter("pith_worker_tokens_total", "Tokens trained on"));
  ASSIGN_OR_RETURN(m.step_seconds, r.Histogram("pith_worker_step_seconds", "Wall time of a step",
                                               MetricsRegistry::LatencyBuckets()));
  ASSIGN_OR_RETURN(m.hits, r.Counter("pith_worker_expert_cache_hits_total",
                                     "Expert weights found resident when a step needed them"));
  ASSIGN_OR_RETURN(m.misses, r.Counter("pith_worker_expert_cache_misses_total",
                                       "Expert weights fetched from a store when needed"));
  ASSIGN_OR_RETURN(m.fetch_bytes,
                   r.Counter("pith_worker_fetch_bytes_total", "Bytes fetched from stores"));
  ASSIGN_OR_RETURN(m.fetch_seconds, r.Histogram("pith_worker_fetch_seconds",
                                                "Time of one batched fetch from a store",
                                                MetricsRegistry::LatencyBuckets()));
  ASSIGN_OR_RETURN(m.put_bytes,
                   r.Counter("pith_worker_put_bytes_total", "Bytes written to stores"));
  ASSIGN_OR_RETURN(
      m.rows_sent,
      r.Counter("pith_worker_dispatch_rows_sent_total",
                "Token rows sent to other workers for their experts (a token once per worker)"));
  ASSIGN_OR_RETURN(m.prefetch_hits,
                   r.Counter("pith_worker_expert_cache_prefetch_hits_total",
                             "Expert weights the prefetcher had fetched before they were needed"));
  ASSIGN_OR_RETURN(m.resident, r.Gauge("pith_worker_expert_cache_resident_bytes",
                                       "Bytes of expert weights resident in the cache"));
  ASSIGN_OR_RETURN(m.step, r.Gauge("pith_job_step", "Last step this worker saw committed"));
  ASSIGN_OR_RETURN(m.loss, r.Gauge("pith_job_loss", "Loss of the last committed step"));
  return m;
}

// One assignment: the model, optimizer and peers of one job at one (rank, world).
class JobRun {
 public:
  JobRun(const v1::Assignment& a, std::string me, PeerGroup* peers, StoreClient* client,
         v1::CoordinatorService::Stub* coordinator, const ClusterWorkerOptions& options,
         Metrics* metrics)
      : a_(a),
        job_id_(a.job_id()),
        me_(std::move(me)),
        peers_(peers),
        client_(client),
        coordinator_(coordinator),
        options_(options),
        metrics_(metrics),
        backend_(options.threads) {}

  ~JobRun() {
    if (writes_.valid()) writes_.wait();
    done_ = true;
    if (watcher_.joinable()) watcher_.join();
  }

  // Trains until the job ends or the assignment changes (OK: fetch it again), or a
  // failure (reported to the coordinator, which aborts the step).
  absl::Status Run(const std::atomic<bool>& stop) {
    absl::Status s = Setup();
    if (s.ok()) watcher_ = std::thread([this] { WatchForAbort(); });
    int64_t step = a_.committed_step();  // the last committed step
    bool reported = false;               // step `step` is written and reported, not committed
    if (s.ok()) {
      if (step < 0) {
        step = 0;
        s = WriteInitial();
        reported = true;
      } else {
        s = LoadCommitted();
      }
    }
    // NOTE: step s + 1's compute runs while step s commits (the stores sync it to disk):
    // it needs nothing step s's commit decides. Its writes wait for the commit; if step s
    // is aborted instead, or the assignment changes, the compute is thrown away.
    while (s.ok() && !stop) {
      const bool more = step < a_.spec().train().steps();
      absl::Status computed = absl::OkStatus();
      if (reported) {
        if (more) {
          SetPending(step);
          computed = Compute(step + 1);
        }
        absl::StatusOr<Settled> settled = Finish(step);
        ClearPending();
        if (!settled.ok()) return settled.status();  // the coordinator is unreachable: start over
        if (*settled == Settled::kStop) return absl::OkStatus();
        if (*settled == Settled::kReassigned) {
          // A new placement from the next step: adopted in place when only the placement
          // changed (the model, optimizer, dataset and cache stay), else start over. The
          // step computed under the old one is computed again.
          absl::StatusOr<bool> adopted = Adopt();
          if (!adopted.ok() || !*adopted) return absl::OkStatus();
          if (more) computed = Compute(step + 1);
        }
      } else if (more) {
        computed = Compute(step + 1);
      }
      if (!more) return absl::OkStatus();
      ++step;
      s = computed.ok() ? Write(step) : computed;
      reported = true;
    }
    if (!s.ok()) {
      ReportFailure(step, s);
      return s;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Setup() {
    const v1::JobSpec& spec = a_.spec();
    shape_ = model::ModelShape::FromSpec(spec.model());
    const int W = a_.world(), B = spec.train().batch();
    for (int i = a_.rank(); i < B; i += W) rows_.push_back(i);
    if (rows_.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("global batch ", B, " has no rows for rank ", a_.rank(), " of ", W));
    }
    ASSIGN_OR_RETURN(model_,
                     model::MoeGpt::Create(&backend_, shape_, static_cast<int>(rows_.size())));
    ASSIGN_OR_RETURN(optimizer_,
                     model::AdamWOptimizer::Create(&backend_, model_->layout(),
                                                   model::OptimizerConfig::FromSpec(spec.train())));
    std::vector<std::string> addresses;
    for (const v1::MemberInfo& p : a_.peers()) addresses.push_back(p.ucx_address());
    RETURN_IF_ERROR(peers_->Join(a_.rank(), addresses, a_.assignment_version()));
    DealDense();
    version_ = a_.assignment_version();
    RETURN_IF_ERROR(ApplyPlacement());
    // The expert cache, in registered memory.
    const size_t slot_bytes = shape_.expert_floats() * sizeof(float);
    const int slots = CacheSlots(static_cast<int>(owned_.size()));
    ASSIGN_OR_RETURN(std::unique_ptr<ucx::MemoryRegion> slot_memory,
                     client_->AllocateBuffer(slot_bytes * slots));
    slots_ = {slot_memory->data(), slot_bytes * slots, slot_memory->handle()};
    ASSIGN_OR_RETURN(cache_,
                     ExpertCache::Create(
                         std::move(slot_memory), slot_bytes, slots,
                         [this](absl::Span<ExpertCache::FetchRequest> requests, size_t bytes,
                                ucp_mem_h memh) { return FetchWeights(requests, bytes, memh); },
                         /*pinned_wait=*/kStoreTimeout));
    dispatch_->SetCache(cache_.get());
    RETURN_IF_ERROR(SetUpMoments());
    ASSIGN_OR_RETURN(dataset_, data::TokenDataset::Open(spec.train().data_path(), shape_.vocab));
    inputs_.resize(rows_.size() * shape_.seq);
    targets_.resize(rows_.size() * shape_.seq);
    zeros_.assign(std::max<int64_t>(shape_.expert_floats(), LargestDense()), 0.0f);
    LOG(INFO) << "job " << a_.job_id() << ": rank " << a_.rank() << " of " << W << ", "
              << rows_.size() << " rows per step, " << owned_.size() << " experts computed ("
              << updated_.size() << " updated), " << slots << " cache slots, placement epoch "
              << a_.placement().epoch();
    return absl::OkStatus();
  }

  // Takes this assignment's placement: compute owners, the dispatch over them, the experts
  // computed and updated here, every group's stores (connected).
  absl::Status ApplyPlacement() {
    const int W = a_.world();
    std::vector<std::vector<ExpertOwners>> owners(shape_.layers,
                                                  std::vector<ExpertOwners>(shape_.experts));
    primary_.assign(shape_.layers, std::vector<int>(shape_.experts, -1));
    for (const v1::ExpertPlacement& e : a_.placement().experts()) {
      if (e.layer() < 0) {
        dense_stores_.assign(e.store_ids().begin(), e.store_ids().end());
        dense_write_stores_ = dense_stores_;
        dense_write_stores_.insert(dense_write_stores_.end(), e.joining_store_ids().begin(),
                                   e.joining_store_ids().end());
        continue;
      }
      if (e.layer() >= shape_.layers || e.expert() >= shape_.experts || e.owners_size() == 0) {
        return absl::InvalidArgumentError(absl::StrCat("placement entry of layer ", e.layer(),
                                                       " expert ", e.expert(), " does not fit"));
      }
      primary_[e.layer()][e.expert()] = e.owners(0).rank();
      for (const v1::ComputeOwner& o : e.owners()) {
        if (o.rank() < 0 || o.rank() >= W) {
          return absl::InvalidArgumentError(absl::StrCat("owner rank ", o.rank(), " outside ", W));
        }
        owners[e.layer()][e.expert()].push_back({o.rank(), o.token_share()});
      }
      absl::MutexLock lock(&stores_mu_);  // the cache's prefetch thread reads them
      std::vector<std::string>& read = expert_stores_[{e.layer(), e.expert()}];
      read.assign(e.store_ids().begin(), e.store_ids().end());
      std::vector<std::string>& write = expert_write_stores_[{e.layer(), e.expert()}];
      write = read;
      write.insert(write.end(), e.joining_store_ids().begin(), e.joining_store_ids().end());
    }
    for (const auto& layer : primary_) {
      for (int o : layer) {
        if (o < 0) return absl::InvalidArgumentError("placement leaves an expert without owner");
      }
    }
    owners_ = owners;
    dispatch_ = std::make_unique<Dispatch>(&backend_, model_.get(), peers_, std::move(owners));
    model_->SetExpertParallel(dispatch_.get());
    if (cache_ != nullptr) dispatch_->SetCache(cache_.get());
    dispatch_->SetRoutingKnown([this] { OnRoutingKnown(); });
    owned_.clear();
    updated_.clear();
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (dispatch_->Computes(l, e)) owned_.push_back({l, e});
        if (primary_[l][e] == a_.rank()) updated_.push_back({l, e});
      }
    }
    for (const v1::MemberInfo& s : a_.stores()) {
      {
        absl::MutexLock lock(&stores_mu_);
        if (store_peer_.count(s.member_id())) continue;
      }
      ASSIGN_OR_RETURN(int peer, client_->Connect(s.ucx_address()));
      absl::MutexLock lock(&stores_mu_);
      store_peer_[s.member_id()] = peer;
    }
    return absl::OkStatus();
  }

  // After a commit under a new assignment: takes it in place when it is the same job, the
  // same workers and ranks and the same spec (only the placement changed), keeping the
  // model, optimizer, dataset and cache; false when it is not (the caller starts over).
  absl::StatusOr<bool> Adopt() {
    DropEarlyMoments();  // it reads the stores of the placement this replaces
    v1::GetAssignmentRequest req;
    req.set_worker_id(me_);
    v1::Assignment next;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    RETURN_IF_ERROR(FromGrpcStatus(coordinator_->GetAssignment(&ctx, req, &next)));
    bool same = next.job_id() == a_.job_id() && next.world() == a_.world() &&
                next.rank() == a_.rank() && next.peers_size() == a_.peers_size() &&
                next.spec().SerializeAsString() == a_.spec().SerializeAsString();
    for (int i = 0; same && i < next.peers_size(); ++i) {
      same = next.peers(i).member_id() == a_.peers(i).member_id() &&
             next.peers(i).ucx_address() == a_.peers(i).ucx_address();
    }
    if (!same) return false;
    // The cache keeps its slots: a worker that would want more (it computes more experts
    // now, and its budget allows) starts over instead.
    if (!CacheFits(next)) return false;
    // A cached expert is current only if this worker made its last update (it was its
    // primary); the others may have moved on.
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (primary_[l][e] != a_.rank()) cache_->Invalidate({l, e});
      }
    }
    a_ = std::move(next);
    peers_->SetAttempt(a_.assignment_version());
    version_ = a_.assignment_version();
    RETURN_IF_ERROR(ApplyPlacement());
    // The experts updated here changed: their moments come from the stores.
    RETURN_IF_ERROR(SetUpMoments());
    LOG(INFO) << "job " << a_.job_id() << ": placement epoch " << a_.placement().epoch()
              << " adopted in place (" << owned_.size() << " experts computed, " << updated_.size()
              << " updated)";
    return true;
  }

  // Whether the cache has the slots Setup would give `next`'s placement (or more).
  bool CacheFits(const v1::Assignment& next) const {
    int owned = 0;
    for (const v1::ExpertPlacement& e : next.placement().experts()) {
      for (const v1::ComputeOwner& o : e.owners())
        owned += e.layer() >= 0 && o.rank() == next.rank();
    }
    return CacheSlots(owned) <= cache_->slots();
  }

  // Cache slots for `owned` experts: --cache_bytes of them (all owned experts, plus one,
  // when 0), two at least.
  int CacheSlots(int owned) const {
    const size_t slot_bytes = shape_.expert_floats() * sizeof(float);
    const uint64_t budget = CacheBudget();
    int slots = owned + 1;
    if (budget > 0) slots = std::min<int64_t>(slots, static_cast<int64_t>(budget / slot_bytes));
    return std::max(slots, 2);
  }

  // Moment buffers for the experts this worker updates: one per expert, kept across steps
  // (fetched from the stores only when not current here) when the budget holds them
  // beside the cache's slots, else ring_ segments of scratch, each for one update batch,
  // fetched every time. A batch pins its experts' slots (the rest stay free for the
  // prefetcher): half the slots (at most 8 experts) with resident moments; with scratch,
  // a batch's slots stay pinned until its writes land, so the ring_ batches in flight pin
  // about half the slots: an eighth of them a batch (1 to 4 experts), 2 to 4 segments (a
  // segment is free once its moments land, the slots once the weights do, so when the
  // weights lag, more batches may pin theirs for a while; an Acquire that finds every slot
  // pinned waits for a write to land). The scratch then holds at most as many blobs as
  // the cache has slots.
  absl::Status SetUpMoments() {
    DropEarlyMoments();
    segments_free_ = {};
    const size_t slot_bytes = shape_.expert_floats() * sizeof(float);
    const uint64_t budget = CacheBudget();
    const uint64_t want = slot_bytes * (owned_.size() + 1 + 2 * updated_.size());
    const bool resident = budget == 0 || budget >= want;
    const int slots = cache_->slots();
    const int batch = resident ? std::clamp(slots / 2, 1, 8) : std::clamp(slots / 8, 1, 4);
    update_batch_ = static_cast<size_t>(batch);
    ring_ = resident ? 1 : static_cast<size_t>(std::clamp(slots / 2 / batch, 2, kMaxRing));
    const size_t buffers = resident ? updated_.size() : ring_ * update_batch_;
    // Registered memory (huge pages where the kernel allows), as the cache's slots: the
    // moments go to and from the stores straight from it.
    moment_memory_.reset();
    ASSIGN_OR_RETURN(moment_memory_,
                     client_->AllocateBuffer(std::max<size_t>(1, buffers * 2 * slot_bytes)));
    moments_registered_ = {moment_memory_->data(), moment_memory_->size(),
                           moment_memory_->handle()};
    moment_current_.assign(buffers, 0);
    moment_index_.clear();
    if (resident) {
      for (size_t i = 0; i < updated_.size(); ++i) moment_index_[updated_[i]] = i;
    }
    counts_.assign(updated_.size(), 0);
    count_current_.assign(updated_.size(), 0);
    count_index_.clear();
    for (size_t i = 0; i < updated_.size(); ++i) count_index_[updated_[i]] = i;
    LOG_IF(INFO, resident && !updated_.empty())
        << "job " << a_.job_id() << ": the moments of the " << updated_.size()
        << " experts updated here stay resident between steps";
    return absl::OkStatus();
  }

  // The job's cache budget (cluster.cache_bytes) when it sets one, else this worker's; 0:
  // none.
  uint64_t CacheBudget() const {
    return a_.spec().cluster().cache_bytes() > 0
               ? static_cast<uint64_t>(a_.spec().cluster().cache_bytes())
               : options_.cache_bytes;
  }

  int64_t LargestDense() const {
    int64_t n = 0;
    for (const model::ParamTensor& t : model_->layout().tensors()) {
      if (t.layer < 0) n = std::max(n, t.numel);
    }
    return n;
  }

  // Whether this worker is the expert's primary owner: it applies its update.
  bool Owns(int layer, int expert) const { return primary_[layer][expert] == a_.rank(); }

  v1::BlobKey Key(int layer, int expert, const std::string& tensor, v1::BlobKind kind) const {
    v1::BlobKey k;
    k.set_job_id(job_id_);  // also on the cache's prefetch thread, while Adopt replaces a_
    k.set_layer(layer);
    k.set_kind(kind);
    if (layer < 0) {
      k.set_tensor(tensor);
    } else {
      k.set_expert(expert);
    }
    return k;
  }

  // Queues one blob's new version for every store of its group; Flush sends the queue
  // (all in flight at once). `data` must stay put until then.
  absl::Status Put(const std::vector<std::string>& stores, const v1::BlobKey& key, int64_t version,
                   const void* data, size_t bytes) {
    if (stores.empty()) return absl::FailedPreconditionError("a group has no store");
    for (const std::string& id : stores) {
      const int peer = StorePeer(id);
      if (peer < 0) {
        return absl::UnavailableError(absl::StrCat("store ", id, " is not in the assignment"));
      }
      StoreClient::PutItem item;
      item.peer = peer;
      item.key = key;
      item.version = version;
      item.data = data;
      item.size = bytes;
      item.memh = Registration(data, bytes);
      puts_.push_back(std::move(item));
      primary_put_.push_back(id == stores.front());
    }
    return absl::OkStatus();
  }

  // The registration of registered memory holding [data, data + bytes): a cache slot or
  // a moment buffer; null for the rest (UCX registers or copies it itself).
  ucp_mem_h Registration(const void* data, size_t bytes) const {
    const auto* p = static_cast<const uint8_t*>(data);
    for (const Registered& r : {slots_, moments_registered_}) {
      if (r.data != nullptr && p >= r.data && p + bytes <= r.data + r.bytes) return r.memh;
    }
    return nullptr;
  }

  absl::Status Flush() {
    absl::Status s = FlushItems(puts_, primary_put_);
    puts_.clear();
    primary_put_.clear();
    return s;
  }
  // Sends `puts` (primary[i]: to its group's first store, reported as written).
  // `buffers_free` as PutMany's.
  absl::Status FlushItems(std::vector<StoreClient::PutItem>& puts, const std::vector<bool>& primary,
                          const std::function<void(const absl::Status&)>& buffers_free = nullptr) {
    absl::Status s = client_->PutMany(absl::MakeSpan(puts), kStoreTimeout, buffers_free);
    absl::MutexLock lock(&written_mu_);
    for (size_t i = 0; i < puts.size(); ++i) {
      if (!puts[i].status.ok()) continue;
      if (primary[i]) *written_.Add() = puts[i].info;
      metrics_->put_bytes->Increment(static_cast<double>(puts[i].size));
    }
    return s;
  }

  // How step s's expert updates and writes overlap the work after them. kNone: they end
  // before Write returns, when a worker reads another's update of an expert from the
  // stores (an expert has two owners). Otherwise they go on while the next step computes
  // (Write): kAll when every expert updated here has its own moment buffer (the writes
  // go once all are updated, from slots pinned until then); kBatches (scratch moments):
  // each update batch's writes start as soon as it is updated, from its slots (pinned
  // until they land: a read of the expert meanwhile is a hit) and its scratch segment
  // (refilled once they have landed).
  enum class Overlap { kNone, kAll, kBatches };
  Overlap OverlapWrites() const {
    if (SharedExperts()) return Overlap::kNone;
    return moment_index_.empty() ? Overlap::kBatches : Overlap::kAll;
  }
  // Whether an expert has several owners (computed by a worker that reads its primary's
  // update from the stores).
  bool SharedExperts() const {
    for (const auto& layer : owners_) {
      for (const ExpertOwners& o : layer) {
        if (o.size() > 1) return true;
      }
    }
    return false;
  }
  // Sends what puts_ holds (the writes of `batch`, whose slots are pinned, and whatever
  // was queued before them) on threads of their own: sets `landed` as soon as the
  // moments' payloads have landed (the batch's scratch segment is free), releases the
  // batch's slots once the weights' have (the master copies, references to the weights,
  // go after that). The future: every write answered.
  std::shared_future<absl::Status> LaunchFlush(absl::Span<const ExpertCache::Expert> batch,
                                               std::promise<absl::Status> landed) {
    // NOTE: the moments go as a flush of their own, started first: the segment (what the
    // next fetch of moments waits for) is free once they have landed, without waiting for
    // the weights and counts too (measured: 12.5 -> 10 ms a batch on the 2-core bench).
    std::vector<StoreClient::PutItem> moments, rest;
    std::vector<bool> moments_primary, rest_primary;
    for (size_t i = 0; i < puts_.size(); ++i) {
      const v1::BlobKind kind = puts_[i].key.kind();
      const bool moment = kind == v1::BLOB_KIND_ADAM_M || kind == v1::BLOB_KIND_ADAM_V;
      (moment ? moments : rest).push_back(std::move(puts_[i]));
      (moment ? moments_primary : rest_primary).push_back(primary_put_[i]);
    }
    puts_.clear();
    primary_put_.clear();
    std::shared_future<absl::Status> moments_done =
        tasks_
            .Async([this, puts = std::move(moments), primary = std::move(moments_primary),
                    landed = std::move(landed)]() mutable {
              return FlushItems(puts, primary,
                                [&](const absl::Status& sent) { landed.set_value(sent); });
            })
            .share();
    return tasks_
        .Async([this, puts = std::move(rest), primary = std::move(rest_primary),
                held = std::vector<ExpertCache::Expert>(batch.begin(), batch.end()),
                moments_done]() mutable {
          absl::Status st = FlushItems(puts, primary, [&](const absl::Status&) {
            for (const ExpertCache::Expert& x : held) cache_->Release(x);
          });
          st.Update(moments_done.get());
          return st;
        })
        .share();
  }

  // Waits for the writes and the report of the step written last, if they went on in the
  // background; a failure is reported to the coordinator (which aborts the step).
  absl::Status JoinWrites(int64_t s) {
    if (!writes_.valid()) return absl::OkStatus();
    absl::Status st = writes_.get();
    if (!st.ok()) ReportFailure(s, st);
    return st;
  }

  // The peer id of a connected store, -1 if none.
  int StorePeer(const std::string& id) {
    absl::MutexLock lock(&stores_mu_);
    auto it = store_peer_.find(id);
    return it == store_peer_.end() ? -1 : it->second;
  }
  // An expert's stores to read from (a copy: a new placement may replace them).
  std::vector<std::string> ReadStores(ExpertCache::Expert x) {
    absl::MutexLock lock(&stores_mu_);
    return expert_stores_.at(x);
  }

  // Reads the committed versions of `items` from the first store of `stores` that answers.
  absl::Status Fetch(const std::vector<std::string>& stores,
                     std::vector<StoreClient::FetchItem>& items) {
    absl::Status last = absl::FailedPreconditionError("a group has no store");
    for (const std::string& id : stores) {
      const int peer = StorePeer(id);
      if (peer < 0) continue;
      const auto start = std::chrono::steady_clock::now();
      last = client_->Fetch(peer, absl::MakeSpan(items), kStoreTimeout);
      if (!last.ok()) continue;
      metrics_->fetch_seconds->Observe(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      for (const auto& item : items) {
        if (item.info.size_bytes() != item.capacity) {
          return absl::DataLossError(absl::StrCat("blob ", item.key.ShortDebugString(), " has ",
                                                  item.info.size_bytes(), " bytes, want ",
                                                  item.capacity));
        }
        metrics_->fetch_bytes->Increment(static_cast<double>(item.capacity));
      }
      return absl::OkStatus();
    }
    return last;
  }

  // Reads the newest versions of expert `items`: while a step is pending (written, its
  // commit not yet known), its version of the experts it wrote (those that got tokens: a
  // missing one is an error), the committed version of the others; with `updating[i]`
  // (item i's update is still to be applied here) the committed version, which the update
  // reads.
  absl::Status FetchNewest(const std::vector<std::string>& stores,
                           std::vector<StoreClient::FetchItem>& items,
                           const std::vector<bool>& updating) {
    {
      absl::MutexLock lock(&pending_mu_);
      for (size_t i = 0; i < items.size(); ++i) {
        StoreClient::FetchItem& item = items[i];
        const v1::BlobKey& k = item.key;
        const bool written = pending_step_ >= 0 && !updating[i] &&
                             pending_written_[k.layer() * shape_.experts + k.expert()];
        item.version = written ? pending_step_ : -1;
      }
    }
    return Fetch(stores, items);
  }

  // The cache's fetch function: one FetchNewest per store group of the requests.
  absl::Status FetchWeights(absl::Span<ExpertCache::FetchRequest> requests, size_t bytes,
                            ucp_mem_h memh) {
    std::map<std::vector<std::string>, std::vector<size_t>> groups;
    for (size_t i = 0; i < requests.size(); ++i)
      groups[ReadStores(requests[i].expert)].push_back(i);
    absl::Status first;
    for (const auto& [stores, members] : groups) {
      std::vector<StoreClient::FetchItem> items;
      std::vector<bool> updating;
      for (size_t i : members) {
        const auto [l, e] = requests[i].expert;
        items.push_back(Item(Key(l, e, "", v1::BLOB_KIND_WEIGHTS), requests[i].dst, bytes));
        items.back().memh = memh;
        updating.push_back(requests[i].updating);
      }
      const absl::Status st = FetchNewest(stores, items, updating);
      for (size_t k = 0; k < members.size(); ++k) {
        // An item the last store read answered whole is good even if another was not.
        const StoreClient::FetchItem& item = items[k];
        const bool good = st.ok() || (item.status.ok() && item.info.size_bytes() == bytes);
        requests[members[k]].status = good ? absl::OkStatus() : item.status.ok() ? st : item.status;
      }
      first.Update(st);
    }
    return first;
  }

  // Step s is written and reported; the next step's reads ask for its versions.
  void SetPending(int64_t s) {
    absl::MutexLock lock(&pending_mu_);
    pending_step_ = s;
    pending_written_.assign(shape_.layers * shape_.experts, s == 0);
    if (s == 0) return;  // step 0 wrote every expert
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        pending_written_[l * shape_.experts + e] = model_->ExpertUsed(l, e);
      }
    }
  }
  void ClearPending() {
    absl::MutexLock lock(&pending_mu_);
    pending_step_ = -1;
  }
  bool Pending() {
    absl::MutexLock lock(&pending_mu_);
    return pending_step_ >= 0;
  }

  StoreClient::FetchItem Item(const v1::BlobKey& key, void* buffer, size_t bytes) {
    StoreClient::FetchItem item;
    item.key = key;
    item.buffer = buffer;
    item.capacity = bytes;
    return item;
  }

  // Step 0: every worker builds the same initial weights and writes its share of the
  // dense tensors and the experts it owns, with zero moments and counts.
  absl::Status WriteInitial() {
    const std::string& init = a_.spec().train().init_path();
    if (!init.empty()) {
      ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Read(init));
      RETURN_IF_ERROR(model::LoadWeights(backend_, model_->layout(), file, model_->params()));
    } else {
      RETURN_IF_ERROR(model_->InitWeights(a_.spec().train().seed()));
    }
    {
      absl::MutexLock lock(&written_mu_);
      written_.Clear();
    }
    RETURN_IF_ERROR(WriteOwned(0, /*all_experts=*/true));
    return Report(0, model::StepLoss(), 0);
  }

  // Writes version `version` of what this worker updates: its share of the dense tensors
  // and its experts (all of them, or those that got tokens).
  absl::Status WriteOwned(int64_t version, bool all_experts) {
    const model::ParamLayout& layout = model_->layout();
    const float* p = model_->params();
    const float* m = version == 0 ? zeros_.data() : optimizer_->m();
    const float* v = version == 0 ? zeros_.data() : optimizer_->v();
    {
      for (const model::ParamTensor& t : layout.tensors()) {
        if (!DenseHere(t)) continue;
        const size_t bytes = t.numel * sizeof(float);
        const int64_t o = version == 0 ? 0 : t.offset;
        RETURN_IF_ERROR(Put(dense_write_stores_, Key(-1, 0, t.name, v1::BLOB_KIND_WEIGHTS), version,
                            p + t.offset, bytes));
        RETURN_IF_ERROR(Put(dense_write_stores_, Key(-1, 0, t.name, v1::BLOB_KIND_MASTER), version,
                            p + t.offset, bytes));
        RETURN_IF_ERROR(Put(dense_write_stores_, Key(-1, 0, t.name, v1::BLOB_KIND_ADAM_M), version,
                            m + o, bytes));
        RETURN_IF_ERROR(Put(dense_write_stores_, Key(-1, 0, t.name, v1::BLOB_KIND_ADAM_V), version,
                            v + o, bytes));
      }
    }
    // Training steps write experts as they update them; their first flush sends these too.
    if (!all_experts) return absl::OkStatus();
    const size_t bytes = shape_.expert_floats() * sizeof(float);
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (!Owns(l, e)) continue;
        const std::vector<std::string>& stores = expert_write_stores_.at({l, e});
        const int64_t off = layout.ExpertOffset(l, e);
        const int64_t o = version == 0 ? 0 : off;
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_WEIGHTS), version, p + off, bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_MASTER), version, p + off, bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_ADAM_M), version, m + o, bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_ADAM_V), version, v + o, bytes));
        counts_scratch_.push_back(optimizer_->update_counts()[layout.ExpertTensorIndex(l, e)]);
      }
    }
    // The counts' addresses are stable once they are all in place.
    size_t next = 0;
    for (int l = 0; l < shape_.layers; ++l) {
      for (int e = 0; e < shape_.experts; ++e) {
        if (!Owns(l, e)) continue;
        RETURN_IF_ERROR(Put(expert_write_stores_.at({l, e}), Key(l, e, "", v1::BLOB_KIND_STATE),
                            version, &counts_scratch_[next++], sizeof(int64_t)));
      }
    }
    absl::Status flushed = Flush();
    counts_scratch_.clear();
    return flushed;
  }

  // Rebuilds this worker's state from the committed step in the stores: the dense
  // tensors and their moments; experts come through the cache when needed.
  absl::Status LoadCommitted() {
    const model::ParamLayout& layout = model_->layout();
    RETURN_IF_ERROR(FetchDense());
    std::vector<int64_t>& counts = optimizer_->update_counts();
    for (size_t i = 0; i < layout.tensors().size(); ++i) {
      if (layout.tensors()[i].layer < 0) counts[i] = a_.committed_step();
    }
    return absl::OkStatus();
  }

  // Reads every dense tensor and its moments, committed.
  absl::Status FetchDense() {
    std::vector<StoreClient::FetchItem> items;
    for (const model::ParamTensor& t : model_->layout().tensors()) {
      if (t.layer >= 0) continue;
      const size_t bytes = t.numel * sizeof(float);
      items.push_back(
          Item(Key(-1, 0, t.name, v1::BLOB_KIND_WEIGHTS), model_->params() + t.offset, bytes));
      items.push_back(
          Item(Key(-1, 0, t.name, v1::BLOB_KIND_ADAM_M), optimizer_->m() + t.offset, bytes));
      items.push_back(
          Item(Key(-1, 0, t.name, v1::BLOB_KIND_ADAM_V), optimizer_->v() + t.offset, bytes));
    }
    return Fetch(dense_stores_, items);
  }

  // Whether this worker writes dense tensor `t` (and counts its gradient in the norm):
  // every worker applies AdamW to every dense tensor (the same all-reduced gradients, the
  // same bits), and each tensor is written by one of them; they are dealt out in layout
  // order to the worker with the fewest bytes so far, so the writes take about as long on
  // every worker.
  bool DenseHere(const model::ParamTensor& t) const {
    if (t.layer >= 0) return false;
    auto it = dense_rank_.find(t.offset);
    return it != dense_rank_.end() && it->second == a_.rank();
  }
  void DealDense() {
    dense_rank_.clear();
    std::vector<int64_t> load(a_.world(), 0);
    for (const model::ParamTensor& t : model_->layout().tensors()) {
      if (t.layer >= 0) continue;
      const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      dense_rank_[t.offset] = r;
      load[r] += t.numel;
    }
  }

  // The first half of training step s >= 1 (data step s - 1): forward/backward with the
  // experts dispatched, replica gradients reduced, dense gradients summed, the global grad
  // norm. It reads only what this worker holds (the dense tensors are updated alike on
  // every worker) and, with replica experts, what their primaries wrote for step s - 1
  // (the barrier below), committed or not, so it runs while step s - 1 commits.
  absl::Status Compute(int64_t s) {
    current_step_ = s;
    step_start_ = std::chrono::steady_clock::now();
    if (Pending() && SharedExperts()) {
      // Every worker's writes of the step before are in the stores: this worker reads its
      // replica experts' updates from there (their primaries wrote them).
      double one = 1;
      RETURN_IF_ERROR(
          peers_->AllReduceSum(&one, 1, (static_cast<uint64_t>(s) << 32) | (1ull << 28)));
    }
    dispatch_->SetStep(s);
    // The owner's compute order, for the prefetcher: the forward through the layers, of
    // the experts expected to get tokens (those that got some last step; every one before
    // the first), then the backward, then the updates (OnRoutingKnown: only those that did).
    // Experts this worker computes but does not update were updated by their primary.
    for (const ExpertCache::Expert& x : owned_) {
      if (!Owns(x.first, x.second)) cache_->Invalidate(x);
    }
    std::vector<ExpertCache::Expert> order;
    for (const ExpertCache::Expert& x : owned_) {
      if (last_used_.empty() || last_used_[x.first * shape_.experts + x.second]) order.push_back(x);
    }
    const std::vector<ExpertCache::Expert> forward = order;
    order.insert(order.end(), forward.rbegin(), forward.rend());
    cache_->SetSchedule(std::move(order));
    const int T = shape_.seq;
    const int64_t B = a_.spec().train().batch();
    for (size_t j = 0; j < rows_.size(); ++j) {
      dataset_->Row((s - 1) * B + rows_[j], T, inputs_.data() + j * T, targets_.data() + j * T);
    }
    ASSIGN_OR_RETURN(computed_loss_, model_->ForwardBackward(inputs_.data(), targets_.data(), B));
    RETURN_IF_ERROR(ReduceReplicaGradients(s));
    const uint64_t tag = (static_cast<uint64_t>(s) << 32) | (1ull << 30);
    RETURN_IF_ERROR(peers_->AllReduceSum(model_->grads(), model_->layout().dense_floats(), tag));
    const model::HasGrad has_grad = [&](const model::ParamTensor& t) {
      return t.layer < 0 ? DenseHere(t)
                         : Owns(t.layer, t.expert) && model_->ExpertUsed(t.layer, t.expert);
    };
    double sum_sq = optimizer_->LocalSumOfSquares(model_->grads(), has_grad);
    RETURN_IF_ERROR(peers_->AllReduceSum(&sum_sq, 1, tag | 1));
    grad_norm_ = std::sqrt(sum_sq);
    return absl::OkStatus();
  }

  // The second half of step s, once step s - 1 is committed: the updates applied and
  // written (every dense tensor applied here, this worker's share of them written; experts
  // by their primary, with moments from the stores), heat and the step reported. The
  // experts' part goes on while the next step computes, unless OverlapWrites is kNone.
  absl::Status Write(int64_t s) {
    ReportHeat(s);
    const int T = shape_.seq;
    // Every dense tensor through the optimizer (the same bits on every worker: the same
    // all-reduced gradients and norm); experts in batches below, with their moments
    // fetched from the stores.
    const model::HasGrad dense = [](const model::ParamTensor& t) { return t.layer < 0; };
    lr_ = optimizer_->Apply(model_->params(), model_->grads(), s - 1, dense, grad_norm_).lr;
    RETURN_IF_ERROR(backend_.Synchronize());  // the dense puts read what it wrote
    {
      absl::MutexLock lock(&written_mu_);  // the step's writes have all ended (Finish)
      written_.Clear();
    }
    const Overlap overlap = OverlapWrites();
    RETURN_IF_ERROR(WriteOwned(s, /*all_experts=*/false));
    metrics_->tokens->Increment(static_cast<double>(rows_.size() * T));
    metrics_->rows_sent->Increment(static_cast<double>(dispatch_->rows_sent()));
    // The experts this step updates: its routing, read before the next step's forward.
    std::vector<ExpertCache::Expert> used = UsedExperts();
    const StepTail tail{s, computed_loss_, rows_.size() * T, step_start_};
    if (overlap == Overlap::kNone) {
      absl::Status updated = UpdateExperts(s, grad_norm_, overlap, used);
      if (updated.ok() && !puts_.empty()) updated = Flush();
      if (!updated.ok()) {
        DropWrites();
        return updated;
      }
      ObserveStep(tail);
      return Report(s, computed_loss_, tail.tokens);
    }
    // NOTE: the expert updates, their writes, then the report go on while the next step
    // computes: its reads of an expert wait in the cache until the update has been
    // applied there (BeginUpdates), its backward until they all have (they read the
    // gradients the backward overwrites). They use what the next step's compute does not
    // touch (the moment buffers and counts with their flags, puts_, held_, flushes_,
    // written_, observed_, step_hits_ and step_misses_, update_backend_) and read what it
    // does not change (the stores of each group, lr_; Report sets last_loss_); Finish
    // waits for them before the step can settle, and before anything replaces those. A
    // fetch of an updated expert asks for this step's version (pending from here; a slot
    // is pinned until its writes land).
    cache_->BeginUpdates(used);
    SetPending(s);
    std::promise<absl::Status> segments_free;
    segments_free_ = segments_free.get_future().share();
    writes_ =
        tasks_.Async([this, overlap, used = std::move(used), grad_norm = grad_norm_, tail,
                      segments_free = std::move(segments_free), early = std::move(early_moments_),
                      early_used = std::move(early_used_)]() mutable {
          absl::Status st =
              UpdateExperts(tail.step, grad_norm, overlap, used, std::move(early), early_used);
          cache_->EndUpdates(st);
          // The scratch segments are free once every batch's payloads have landed: the next
          // step's backward fetches into them (StartEarlyMoments).
          absl::Status free = st;
          for (const std::shared_future<absl::Status>& f : landed_) free.Update(f.get());
          landed_.clear();
          segments_free.set_value(free);
          if (st.ok() && !puts_.empty()) st = Flush();
          for (const ExpertCache::Expert& x : held_) cache_->Release(x);
          held_.clear();
          for (const std::shared_future<absl::Status>& f : flushes_) st.Update(f.get());
          flushes_.clear();
          if (!st.ok()) {
            DropWrites();
            return st;
          }
          ObserveStep(tail);
          return Report(tail.step, tail.loss, tail.tokens);
        });
    return absl::OkStatus();
  }

  // The experts this step updates: those updated here that got tokens (its routing).
  std::vector<ExpertCache::Expert> UsedExperts() const {
    std::vector<ExpertCache::Expert> used;
    for (const ExpertCache::Expert& x : updated_) {
      if (model_->ExpertUsed(x.first, x.second)) used.push_back(x);
    }
    return used;
  }

  // Once step s's routing is known, before its backward (the training thread): the rest
  // of the cache's schedule, the backward of the experts computed here that got tokens,
  // then the updates (and the next step's forward guess, last_used_); the early fetch of
  // the updates' first moments.
  void OnRoutingKnown() {
    last_used_.assign(shape_.layers * shape_.experts, 0);
    std::vector<ExpertCache::Expert> order;
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) {
      if (!model_->ExpertUsed(it->first, it->second)) continue;
      last_used_[it->first * shape_.experts + it->second] = 1;
      order.push_back(*it);
    }
    std::vector<ExpertCache::Expert> updates = UsedExperts();
    order.insert(order.end(), updates.begin(), updates.end());
    cache_->SetSchedule(std::move(order));
    StartEarlyMoments(std::move(updates));
  }

  // In step s's backward: with scratch moments (kBatches), fetches the moments and counts
  // of the first ring_ update batches of `used` (the experts it updates) into their
  // segments as soon as step s - 1's payloads have landed there, at the versions the
  // update will read: step s - 1's for the experts it wrote (pending, or committed by
  // then), the committed one for the others. The update starts from them instead of
  // waiting a round trip (UpdateExperts).
  void StartEarlyMoments(std::vector<ExpertCache::Expert> used) {
    DropEarlyMoments();
    if (OverlapWrites() != Overlap::kBatches) return;
    const size_t count = std::min(used.size(), ring_ * update_batch_);
    if (count == 0) return;
    std::vector<int64_t> versions(count, -1);
    {
      absl::MutexLock lock(&pending_mu_);
      for (size_t i = 0; i < count; ++i) {
        const auto [l, e] = used[i];
        if (pending_step_ >= 0 && pending_written_[l * shape_.experts + e]) {
          versions[i] = pending_step_;
        }
      }
    }
    std::vector<size_t> buffer(count);  // batch k in segment k
    std::iota(buffer.begin(), buffer.end(), 0);
    std::vector<ExpertCache::Expert> early(used.begin(), used.begin() + count);
    early_used_ = std::move(used);
    early_moments_ = tasks_.Async([this, early = std::move(early), buffer = std::move(buffer),
                                   versions = std::move(versions), free = segments_free_]() {
      if (free.valid()) RETURN_IF_ERROR(free.get());
      return FetchMoments(early, buffer, &versions);
    });
  }
  // Waits for an early fetch that will not be used.
  void DropEarlyMoments() {
    if (early_moments_.valid()) early_moments_.wait();
    early_moments_ = {};
    early_used_.clear();
  }

  // What a step's report and metrics need once its updates end (captured as Write
  // starts them: the next step's compute replaces the members).
  struct StepTail {
    int64_t step = 0;
    model::StepLoss loss;
    uint64_t tokens = 0;
    std::chrono::steady_clock::time_point start;
  };
  // The cache's figures since the last step's (its hits and misses go in its report too;
  // with pipelined updates a step's span overlaps the next one's, so each is counted
  // once, from the end of one step's updates to the end of the next's) and its time.
  void ObserveStep(const StepTail& tail) {
    const ExpertCache::Stats before = observed_;
    const ExpertCache::Stats after = observed_ = cache_->stats();
    step_hits_ = after.hits - before.hits;
    step_misses_ = after.misses - before.misses;
    metrics_->hits->Increment(static_cast<double>(step_hits_));
    metrics_->misses->Increment(static_cast<double>(step_misses_));
    metrics_->prefetch_hits->Increment(
        static_cast<double>(after.prefetch_hits - before.prefetch_hits));
    metrics_->resident->Set(static_cast<double>(after.resident_bytes));
    metrics_->step_seconds->Observe(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - tail.start).count());
  }
  // After a failed update: nothing more is sent; the pins of held writes are dropped.
  void DropWrites() {
    puts_.clear();
    primary_put_.clear();
    for (const ExpertCache::Expert& x : held_) cache_->Release(x);
    held_.clear();
    flushes_.clear();  // ended: UpdateExperts waits for them on a failure
  }

  // Experts computed by several workers (hot ones): their gradients are summed at the
  // primary owner, in rank order (the same bits every run); the others' copies are zeroed.
  absl::Status ReduceReplicaGradients(int64_t s) {
    const int64_t floats = shape_.expert_floats();
    const uint64_t base = (static_cast<uint64_t>(s) << 32) | (1ull << 29);
    std::vector<float> sum(floats);
    for (const ExpertCache::Expert& x : owned_) {
      const auto [l, e] = x;
      const ExpertOwners& owners = owners_[l][e];
      if (owners.size() < 2 || !model_->ExpertUsed(l, e)) continue;
      float* g = model_->grads() + model_->layout().ExpertOffset(l, e);
      const uint64_t tag = base | static_cast<uint64_t>(l * shape_.experts + e);
      const int primary = primary_[l][e];
      if (primary != a_.rank()) {
        RETURN_IF_ERROR(peers_->Send(
            primary, tag, std::string(reinterpret_cast<const char*>(g), floats * sizeof(float))));
        std::fill(g, g + floats, 0.0f);
        continue;
      }
      std::vector<int> ranks;
      for (const auto& [rank, share] : owners) ranks.push_back(rank);
      std::sort(ranks.begin(), ranks.end());
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int rank : ranks) {
        const float* part = g;
        std::string got;
        if (rank != a_.rank()) {
          ASSIGN_OR_RETURN(got, peers_->Receive(rank, tag));
          if (got.size() != floats * sizeof(float)) {
            return absl::DataLossError(
                absl::StrCat("replica gradient from rank ", rank, " has ", got.size(), " bytes"));
          }
          part = reinterpret_cast<const float*>(got.data());
        }
        for (int64_t i = 0; i < floats; ++i) sum[i] += part[i];
      }
      std::copy(sum.begin(), sum.end(), g);
    }
    return absl::OkStatus();
  }

  // AdamW on each expert of `used` (updated here, got tokens), exactly as
  // AdamWOptimizer::Apply does it: the weights in its cache slot, the moments of the
  // committed step from the stores (or resident), the count kept here (fetched when not
  // current); the new versions go straight back. Experts go in
  // batches of update_batch_: one fetch per store group for the batch's moments, one flush
  // for its writes (one round trip each per batch, not per expert). Each expert is marked
  // Updated in the cache once applied.
  // With kAll, its writes stay queued in puts_ (the slots they send from pinned, held_);
  // with kBatches, each batch's writes are sent in the background (flushes_); the caller
  // waits for either. `early_moments`: the early fetch of the first batches' moments
  // (StartEarlyMoments) for `early_used`, used when that is `used`; waited for anyway.
  absl::Status UpdateExperts(int64_t s, double grad_norm, Overlap overlap,
                             const std::vector<ExpertCache::Expert>& used,
                             std::future<absl::Status> early_moments = {},
                             const std::vector<ExpertCache::Expert>& early_used = {}) {
    std::vector<absl::Span<const ExpertCache::Expert>> batches;
    std::vector<std::vector<size_t>> buffers;  // each expert's moment buffer, per batch
    for (size_t b = 0; b < used.size(); b += update_batch_) {
      batches.push_back(
          absl::MakeConstSpan(used).subspan(b, std::min(used.size() - b, update_batch_)));
      std::vector<size_t>& buffer = buffers.emplace_back();
      for (size_t i = 0; i < batches.back().size(); ++i) {
        auto it = moment_index_.find(batches.back()[i]);
        // Scratch: batch k's in segment k % ring_.
        buffer.push_back(it != moment_index_.end()
                             ? it->second
                             : (batches.size() - 1) % ring_ * update_batch_ + i);
      }
    }
    const size_t n = batches.size();
    const bool batched = overlap == Overlap::kBatches;
    // Scratch: batch k's segment is batch k - ring_'s, free once that one's writes have
    // landed (kBatches; its flush says so) or it is updated and written (kNone).
    const bool reuse = moment_index_.empty();
    // Batches whose moments the backward fetched (StartEarlyMoments), if it fetched them
    // for these experts; whatever it did, it has ended before the buffers are touched.
    size_t early = 0;
    if (early_moments.valid()) {
      const absl::Status got = early_moments.get();
      if (got.ok() && batched && reuse && early_used == used) early = std::min(n, ring_);
    }
    if (batches.empty()) return absl::OkStatus();
    std::vector<std::promise<absl::Status>> freed(n), fetched(n);
    std::vector<std::shared_future<absl::Status>> segment_free;
    std::vector<std::future<absl::Status>> moments_in;
    for (size_t k = 0; k < n; ++k) {
      segment_free.push_back(freed[k].get_future().share());
      moments_in.push_back(fetched[k].get_future());
    }
    // NOTE: a fetcher fills the segments ahead of the updates, each as soon as it is free:
    // batch j once batch j - ring_'s is, together with every later batch whose segment is
    // free by then (one round trip for them all). Resident moments are current after the
    // first step: nothing to fetch.
    std::future<void> fetcher = tasks_.Async([&] {
      const auto is_free = [&](size_t j) {
        return !reuse || j < ring_ ||
               (segment_free[j - ring_].wait_for(std::chrono::seconds(0)) ==
                    std::future_status::ready &&
                segment_free[j - ring_].get().ok());
      };
      for (size_t m = 0; m < early; ++m) fetched[m].set_value(absl::OkStatus());
      for (size_t j = early; j < n;) {
        absl::Status st = reuse && j >= ring_ ? segment_free[j - ring_].get() : absl::OkStatus();
        size_t end = j + 1;
        if (st.ok()) {
          while (end < n && is_free(end)) ++end;
          std::vector<size_t> buffer;
          for (size_t m = j; m < end; ++m) {
            buffer.insert(buffer.end(), buffers[m].begin(), buffers[m].end());
          }
          const size_t first = j * update_batch_;
          st = FetchMoments(absl::MakeConstSpan(used).subspan(first, buffer.size()), buffer);
        }
        for (size_t m = j; m < (st.ok() ? end : n); ++m) fetched[m].set_value(st);
        if (!st.ok()) return;
        j = end;
      }
    });
    std::vector<std::shared_future<absl::Status>> flushes;
    absl::Status status;
    size_t k = 0;
    for (; k < n; ++k) {
      status = moments_in[k].get();
      if (status.ok()) status = UpdateBatch(s, grad_norm, batches[k], buffers[k], overlap);
      if (!status.ok()) break;
      if (batched) {
        held_.resize(held_.size() - batches[k].size());  // the flush releases them
        flushes.push_back(LaunchFlush(batches[k], std::move(freed[k])));
      } else {
        freed[k].set_value(absl::OkStatus());
      }
    }
    // On a failure the fetcher stops at the segments never freed; nothing may still be
    // fetching into the buffers or sending from them when this returns.
    for (size_t m = k; m < n; ++m) freed[m].set_value(status);
    fetcher.wait();
    if (batched) landed_ = segment_free;
    if (!status.ok()) {
      for (const std::shared_future<absl::Status>& f : flushes) f.wait();
      // Nothing here is current any more (a step that does not commit ends this JobRun
      // anyway).
      moment_current_.assign(moment_current_.size(), 0);
      count_current_.assign(count_current_.size(), 0);
      return status;
    }
    flushes_ = std::move(flushes);
    return absl::OkStatus();
  }

  // Fetches the moments and counts of `batch` not current here into their buffers, one
  // fetch per distinct store group, at `versions` (one per expert; null: the committed
  // ones). On the fetcher thread (UpdateExperts) or the early fetch's (StartEarlyMoments):
  // it touches only its buffers.
  absl::Status FetchMoments(absl::Span<const ExpertCache::Expert> batch,
                            const std::vector<size_t>& buffer,
                            const std::vector<int64_t>* versions = nullptr) {
    const size_t bytes = shape_.expert_floats() * sizeof(float);
    std::map<std::vector<std::string>, std::vector<StoreClient::FetchItem>> fetches;
    for (size_t i = 0; i < batch.size(); ++i) {
      const size_t b = buffer[i], c = count_index_.at(batch[i]);
      const auto [l, e] = batch[i];
      const auto add = [&](v1::BlobKind kind, void* dst, size_t size, ucp_mem_h memh) {
        std::vector<StoreClient::FetchItem>& items = fetches[expert_stores_.at(batch[i])];
        items.push_back(Item(Key(l, e, "", kind), dst, size));
        items.back().memh = memh;
        if (versions != nullptr) items.back().version = (*versions)[i];
      };
      if (moment_index_.empty() || !moment_current_[b]) {
        add(v1::BLOB_KIND_ADAM_M, M(b), bytes, moment_memory_->handle());
        add(v1::BLOB_KIND_ADAM_V, V(b), bytes, moment_memory_->handle());
      }
      if (!count_current_[c]) add(v1::BLOB_KIND_STATE, &counts_[c], sizeof(int64_t), nullptr);
    }
    for (auto& [stores, items] : fetches) RETURN_IF_ERROR(Fetch(stores, items));
    return absl::OkStatus();
  }

  // AdamW on `batch` (its moments in `buffer`, fetched), then its writes from its slots:
  // sent (the slots released) with kNone, else left queued in puts_ (the slots pinned and
  // appended to held_).
  absl::Status UpdateBatch(int64_t s, double grad_norm, absl::Span<const ExpertCache::Expert> batch,
                           const std::vector<size_t>& buffer, Overlap overlap) {
    const bool hold = overlap != Overlap::kNone;
    // Pipelined, the update has a backend of its own (backend_ computes the next step).
    compute::CpuBackend& backend = hold ? update_backend_ : backend_;
    const model::OptimizerConfig& c = optimizer_->config();
    const model::ParamLayout& layout = model_->layout();
    const float lr = static_cast<float>(model::LearningRate(c, s - 1));
    const double coef = c.grad_clip > 0 ? c.grad_clip / (grad_norm + 1e-6) : 1.0;
    const int64_t floats = shape_.expert_floats();
    const size_t bytes = floats * sizeof(float);
    std::vector<float*> w(batch.size(), nullptr);
    size_t pinned = 0;
    absl::Status status = [&]() -> absl::Status {
      for (; pinned < batch.size(); ++pinned) {
        // Pipelined (the next step computing meanwhile): the update's own read, which
        // leaves the schedule to the compute.
        ASSIGN_OR_RETURN(w[pinned], hold ? cache_->AcquireForUpdate(batch[pinned])
                                         : cache_->Acquire(batch[pinned]));
      }
      for (size_t i = 0; i < batch.size(); ++i) {
        const auto [l, e] = batch[i];
        const size_t b = buffer[i];
        const int64_t base = layout.ExpertOffset(l, e);
        float* g = model_->grads() + base;
        // NOTE: from here the buffer holds this step's moments, current here only once
        // the step commits; a step that does not commit ends this JobRun (Run returns),
        // and the buffers with it.
        if (!moment_index_.empty()) moment_current_[b] = 1;
        const size_t n = count_index_.at(batch[i]);
        count_current_[n] = 1;
        const int64_t count = ++counts_[n];
        const int first = layout.ExpertTensorIndex(l, e);
        for (int t_index = 0; t_index < 4; ++t_index) {
          const model::ParamTensor& t = layout.tensors()[first + t_index];
          const int64_t o = t.offset - base;
          if (coef < 1.0) backend.Scale(g + o, static_cast<float>(coef), t.numel);
          backend.AdamW(w[i] + o, g + o, M(b) + o, V(b) + o, t.numel, lr,
                        static_cast<float>(c.beta1), static_cast<float>(c.beta2),
                        static_cast<float>(c.eps),
                        t.decay ? static_cast<float>(c.weight_decay) : 0.0f, count);
        }
      }
      RETURN_IF_ERROR(backend.Synchronize());
      for (const ExpertCache::Expert& x : batch) cache_->Updated(x);
      for (size_t i = 0; i < batch.size(); ++i) {
        const auto [l, e] = batch[i];
        const size_t b = buffer[i];
        const float* weights = w[i];
        const std::vector<std::string>& stores = expert_write_stores_.at(batch[i]);
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_WEIGHTS), s, weights, bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_MASTER), s, weights, bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_ADAM_M), s, M(b), bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_ADAM_V), s, V(b), bytes));
        RETURN_IF_ERROR(Put(stores, Key(l, e, "", v1::BLOB_KIND_STATE), s,
                            &counts_[count_index_.at(batch[i])], sizeof(int64_t)));
      }
      if (hold) return absl::OkStatus();
      return Flush();  // before the slots, the scratch buffers and the counts are reused
    }();
    if (hold && status.ok()) {
      held_.insert(held_.end(), batch.begin(), batch.end());
      return status;
    }
    if (!status.ok()) {
      puts_.clear();  // a failed batch sends nothing more
      primary_put_.clear();
    }
    for (size_t i = 0; i < pinned; ++i) cache_->Release(batch[i]);
    return status;
  }

  float* M(size_t buffer) {
    return reinterpret_cast<float*>(moment_memory_->data()) + 2 * buffer * shape_.expert_floats();
  }
  float* V(size_t buffer) { return M(buffer) + shape_.expert_floats(); }

  absl::Status Report(int64_t s, const model::StepLoss& loss, uint64_t tokens) {
    v1::StepWrittenRequest r;
    r.set_job_id(a_.job_id());
    r.set_worker_id(me_);
    r.set_step(s);
    r.set_placement_epoch(a_.placement().epoch());
    r.set_assignment_version(a_.assignment_version());
    r.set_ok(true);
    {
      absl::MutexLock lock(&written_mu_);
      *r.mutable_written() = written_;
    }
    r.set_loss(loss.loss);
    r.set_ce(loss.ce);
    r.set_lr(lr_);
    r.set_tokens(tokens);
    r.set_cache_hits(step_hits_);
    r.set_cache_misses(step_misses_);
    last_loss_ = loss;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::StepWrittenResponse resp;
    return FromGrpcStatus(coordinator_->ReportStepWritten(&ctx, r, &resp));
  }

  void ReportFailure(int64_t s, const absl::Status& why) {
    v1::StepWrittenRequest r;
    r.set_job_id(a_.job_id());
    r.set_worker_id(me_);
    r.set_step(s);
    r.set_assignment_version(a_.assignment_version());
    r.set_ok(false);
    r.set_failure(std::string(why.message()));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::StepWrittenResponse resp;
    (void)coordinator_->ReportStepWritten(&ctx, r, &resp);
  }

  void ReportHeat(int64_t s) {
    v1::HeatReport r;
    r.set_job_id(a_.job_id());
    r.set_worker_id(me_);
    r.set_step(s);
    r.set_tokens(rows_.size() * shape_.seq);
    const int E = shape_.experts, k = shape_.top_k;
    const int64_t tokens = static_cast<int64_t>(rows_.size()) * shape_.seq;
    // Co-activation (pairs of experts chosen by one token) for layers of up to 64 experts;
    // wider ones report token counts only (the packed triangle would outweigh the step).
    const bool pairs = E <= 64;
    std::vector<int32_t> chosen(pairs ? tokens * k : 0);
    for (int l = 0; l < shape_.layers; ++l) {
      v1::LayerRouting* routing = r.add_layers();
      routing->set_layer(l);
      for (int64_t n : model_->routed(l)) routing->add_tokens_per_expert(n);
      if (!pairs || !model_->CopyChosenExperts(l, chosen.data()).ok()) continue;
      routing->mutable_coactivation()->Resize(E * (E - 1) / 2, 0);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int i = 0; i < k; ++i) {
          for (int j = i + 1; j < k; ++j) {
            const int a = std::min(chosen[t * k + i], chosen[t * k + j]);
            const int b = std::max(chosen[t * k + i], chosen[t * k + j]);
            if (a == b || a < 0) continue;
            const int64_t idx = int64_t{a} * E - int64_t{a} * (a + 1) / 2 + (b - a - 1);
            routing->set_coactivation(idx, routing->coactivation(idx) + 1);
          }
        }
      }
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    v1::HeatReportResponse resp;
    grpc::Status st = coordinator_->ReportHeat(&ctx, r, &resp);
    if (!st.ok()) VLOG(1) << "heat report: " << st.error_message();
  }

  // While a step runs, asks the coordinator whether its attempt was aborted (a peer or
  // store died): then every wait on a peer ends at once instead of timing out.
  void WatchForAbort() {
    while (!done_) {
      v1::WaitStepRequest req;
      req.set_job_id(job_id_);
      req.set_step(current_step_.load());
      const int64_t version = version_.load();
      req.set_assignment_version(version);
      v1::StepStatus st;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      const grpc::Status rpc = coordinator_->WaitStep(&ctx, req, &st);
      if (rpc.ok() && st.committed_step() < req.step() &&
          (st.aborted() || st.assignment_version() != version)) {
        LOG(INFO) << "step " << req.step() << " of job " << job_id_
                  << " was aborted: " << st.abort_reason();
        // Only the attempt it watched (an adopted placement's is already newer); then it
        // waits for the next assignment, adopted in place, or the end of this run.
        peers_->AbandonAttempt(static_cast<uint64_t>(version));
        while (!done_ && version_.load() == version) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        continue;
      }
      if (rpc.ok() && st.committed_step() >= req.step()) {
        // Settled: wait for the next step to start.
        while (!done_ && current_step_.load() == req.step()) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      } else if (!rpc.ok() && rpc.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
  }

  enum class Settled { kCommitted, kReassigned, kStop };
  // Waits for step s to settle: committed (under this assignment, or with a new one from
  // the next step: kReassigned), or aborted / the job ended (kStop: start over).
  absl::StatusOr<Settled> Finish(int64_t s) {
    RETURN_IF_ERROR(JoinWrites(s));
    while (true) {
      v1::WaitStepRequest req;
      req.set_job_id(a_.job_id());
      req.set_step(s);
      req.set_assignment_version(a_.assignment_version());
      v1::StepStatus st;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(35));
      absl::Status rpc = FromGrpcStatus(coordinator_->WaitStep(&ctx, req, &st));
      if (absl::IsDeadlineExceeded(rpc)) continue;
      RETURN_IF_ERROR(rpc);
      if (st.committed_step() >= s) {
        OnCommitted(s);
        if (st.job_ended()) return Settled::kStop;
        // A new placement epoch (or worker set) from the next step: re-fetch.
        return st.assignment_version() == a_.assignment_version() ? Settled::kCommitted
                                                                  : Settled::kReassigned;
      }
      if (st.aborted() || st.job_ended()) {
        LOG(INFO) << "step " << s << " of job " << a_.job_id() << " aborted: " << st.abort_reason();
        return Settled::kStop;
      }
    }
  }

  void OnCommitted(int64_t s) {
    metrics_->step->Set(static_cast<double>(s));
    if (s == 0) return;
    metrics_->loss->Set(last_loss_.loss);
    if (a_.rank() == 0 && (s == 1 || s % 10 == 0 || s == a_.spec().train().steps())) {
      LOG(INFO) << absl::StrFormat("job %s step %d/%d loss %.4f ce %.4f lr %.3g", a_.job_id(), s,
                                   a_.spec().train().steps(), last_loss_.loss, last_loss_.ce, lr_);
    }
    if (a_.rank() == 0 && !options_.loss_log.empty()) {
      const std::string line = absl::StrFormat("%d %.9g %.9g\n", s, last_loss_.loss, last_loss_.ce);
      UniqueFd fd(
          ::open(options_.loss_log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
      if (fd.valid()) {
        (void)WriteAll(fd.get(), {reinterpret_cast<const uint8_t*>(line.data()), line.size()},
                       options_.loss_log);
      }
    }
  }

  v1::Assignment a_;          // training thread only (Adopt replaces it)
  const std::string job_id_;  // a_.job_id(), for the watcher
  const std::string me_;
  PeerGroup* peers_;
  StoreClient* client_;
  v1::CoordinatorService::Stub* coordinator_;
  const ClusterWorkerOptions& options_;
  Metrics* metrics_;
  // The expert updates' element-wise loops (on the update thread, while backend_ computes
  // the next step); constructed first: a CpuBackend sets OpenBLAS's thread count, which
  // must be backend_'s.
  compute::CpuBackend update_backend_{1};
  compute::CpuBackend backend_;
  model::ModelShape shape_;
  std::vector<int> rows_;
  std::unique_ptr<model::MoeGpt> model_;
  std::unique_ptr<model::AdamWOptimizer> optimizer_;
  std::unique_ptr<Dispatch> dispatch_;
  std::optional<data::TokenDataset> dataset_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<float> zeros_;
  // Each group's stores: those read from (complete copies, primary first), and those
  // written to (the same, then the stores joining the group). Written by the training
  // thread under stores_mu_ (ApplyPlacement); the cache's prefetch thread reads them under
  // it (ReadStores); a step's update threads read them without it, as ApplyPlacement runs
  // only once they have ended (Finish).
  std::vector<std::string> dense_stores_, dense_write_stores_;
  std::map<std::pair<int, int>, std::vector<std::string>> expert_stores_, expert_write_stores_;
  // Written by the training thread, read by the cache's prefetch thread too.
  absl::Mutex stores_mu_;
  std::map<std::string, int> store_peer_ ABSL_GUARDED_BY(stores_mu_);
  // What the primary stores recorded for this step's writes (flushes add to it).
  absl::Mutex written_mu_;
  google::protobuf::RepeatedPtrField<v1::BlobInfo> written_ ABSL_GUARDED_BY(written_mu_);
  model::StepLoss last_loss_;
  double lr_ = 0;
  std::map<int64_t, int> dense_rank_;  // dense tensor (by offset) -> the rank writing it
  // The step written and reported but not known to be committed while the next one
  // computes (-1: none), and which experts it wrote: reads then ask for its versions
  // (FetchNewest, also on the cache's prefetch thread).
  absl::Mutex pending_mu_;
  int64_t pending_step_ ABSL_GUARDED_BY(pending_mu_) = -1;
  std::vector<bool> pending_written_ ABSL_GUARDED_BY(pending_mu_);  // layer * E + expert
  // Between Compute and Write of a step.
  std::chrono::steady_clock::time_point step_start_;
  ExpertCache::Stats observed_;  // the cache's stats at the last ObserveStep
  model::StepLoss computed_loss_;
  double grad_norm_ = 0;
  std::atomic<int64_t> current_step_{0};
  std::vector<ExpertCache::Expert> owned_;    // computed here, in (layer, expert) order
  std::vector<ExpertCache::Expert> updated_;  // primary here: updated here
  std::vector<std::vector<int>> primary_;     // [layer][expert] -> primary owner's rank
  std::vector<std::vector<ExpertOwners>> owners_;
  std::unique_ptr<ExpertCache> cache_;
  size_t update_batch_ = 1;
  size_t ring_ = 1;  // scratch moment segments (SetUpMoments)
  // Moment buffers (SetUpMoments): adam_m and adam_v of an expert each, one per updated
  // expert (moment_index_) or one per expert of an update batch. The fetcher reads the
  // current flags (these and the counts') of some experts while the update thread sets
  // others': bytes, not bits.
  std::unique_ptr<ucx::MemoryRegion> moment_memory_;
  // The cache slots' memory (owned by cache_) and the moments', for Registration.
  struct Registered {
    const uint8_t* data = nullptr;
    size_t bytes = 0;
    ucp_mem_h memh = nullptr;
  };
  Registered slots_;
  Registered moments_registered_;        // moment_memory_'s
  std::vector<uint8_t> moment_current_;  // the buffer holds the expert's newest moments
  std::map<ExpertCache::Expert, size_t> moment_index_;  // empty: scratch
  // The AdamW count of each expert updated here (count_index_), fetched only while not
  // current here (this worker did not make its last update): 8 bytes an expert.
  std::vector<int64_t> counts_;
  std::vector<uint8_t> count_current_;
  std::map<ExpertCache::Expert, size_t> count_index_;
  uint64_t step_hits_ = 0, step_misses_ = 0;
  std::vector<StoreClient::PutItem> puts_;  // queued by Put, sent by Flush
  std::vector<bool> primary_put_;           // the item goes to its group's first store
  std::vector<int64_t> counts_scratch_;
  std::vector<ExpertCache::Expert> held_;  // slots pinned for queued writes (UpdateExperts)
  std::vector<std::shared_future<absl::Status>> flushes_;  // kBatches batches' writes (Write)
  // Each update batch's payloads landed (its scratch segment free): the update thread's,
  // from UpdateExperts to the end of its writes task.
  std::vector<std::shared_future<absl::Status>> landed_;
  // The training thread's: every scratch segment is free again (the last written step's
  // payloads have all landed; its writes task sets it), and the early fetch of the next
  // step's first batches' moments (StartEarlyMoments) with the experts that step updates,
  // handed to its writes task (Write).
  std::shared_future<absl::Status> segments_free_;
  // [layer * E + expert]: the expert got tokens in the last step computed (OnRoutingKnown);
  // empty before the first. The training thread's.
  std::vector<uint8_t> last_used_;
  std::future<absl::Status> early_moments_;
  std::vector<ExpertCache::Expert> early_used_;
  std::atomic<bool> done_{false};
  std::thread watcher_;
  std::atomic<int64_t> version_{0};  // a_.assignment_version(), for the watcher
  // The writes and report of the step written last, going on while the next one computes
  // (Write), waited for by Finish and the destructor; last, so it ends first.
  std::future<absl::Status> writes_;
  // The threads writes_, the fetcher and the flushes run on; last: its destructor waits
  // for them before anything they use goes.
  TaskThreads tasks_;
};

}  // namespace

absl::Status RunClusterWorker(const ClusterWorkerOptions& options, MetricsRegistry& registry,
                              const std::atomic<bool>& stop) {
  if (options.coordinator.empty()) return absl::InvalidArgumentError("--coordinator is required");
  ASSIGN_OR_RETURN(Metrics metrics, MakeMetrics(registry));
  v1::MemberInfo self;
  self.set_metrics_address(options.metrics_address);
  ASSIGN_OR_RETURN(std::unique_ptr<PeerGroup> peers, PeerGroup::Create());
  ASSIGN_OR_RETURN(std::unique_ptr<StoreClient> client, StoreClient::Create());
  self.set_role(v1::MEMBER_ROLE_WORKER);
  self.set_grpc_address(options.listen);
  self.set_ucx_address(peers->address());
  self.set_capacity_bytes(options.cache_bytes);
  self.set_backend(v1::BACKEND_CPU);
  ASSIGN_OR_RETURN(std::unique_ptr<MemberAgent> agent,
                   MemberAgent::Start(options.coordinator, self, [](v1::MemberInfo*) {}));
  LOG(INFO) << "worker " << agent->member_id() << " joined " << options.coordinator;
  auto coordinator = v1::CoordinatorService::NewStub(
      grpc::CreateChannel(options.coordinator, grpc::InsecureChannelCredentials()));
  while (!stop) {
    v1::GetAssignmentRequest req;
    req.set_worker_id(agent->member_id());
    v1::Assignment a;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    absl::Status s = FromGrpcStatus(coordinator->GetAssignment(&ctx, req, &a));
    if (!s.ok() || a.job_id().empty()) {
      if (!s.ok()) VLOG(1) << "assignment: " << s;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    JobRun run(a, agent->member_id(), peers.get(), client.get(), coordinator.get(), options,
               &metrics);
    s = run.Run(stop);
    if (!s.ok()) {
      LOG(WARNING) << "job " << a.job_id() << ": " << s;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  return absl::OkStatus();
}

}  // namespace pith::runtime
