#include "worker/runtime/store_io.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pith::runtime {

using store::StoreClient;

v1::BlobKey BlobKeyOf(const std::string& job_id, int layer, int expert, const std::string& tensor,
                      v1::BlobKind kind) {
  v1::BlobKey k;
  k.set_job_id(job_id);
  k.set_layer(layer);
  k.set_kind(kind);
  if (layer < 0) {
    k.set_tensor(tensor);
  } else {
    k.set_expert(expert);
  }
  return k;
}

StoreClient::FetchItem FetchItemOf(const v1::BlobKey& key, void* buffer, size_t bytes) {
  StoreClient::FetchItem item;
  item.key = key;
  item.buffer = buffer;
  item.capacity = bytes;
  return item;
}

absl::Status StoreIo::ApplyPlacement(const v1::Assignment& a) {
  {
    absl::MutexLock lock(&mu_);  // the cache's prefetch thread reads them
    attempt_ = a.assignment_version();
    for (const v1::ExpertPlacement& e : a.placement().experts()) {
      const StoreGroup group = e.layer() < 0 ? kDenseGroup : StoreGroup{e.layer(), e.expert()};
      std::vector<std::string>& read = read_stores_[group];
      read.assign(e.store_ids().begin(), e.store_ids().end());
      std::vector<std::string>& write = write_stores_[group];
      write = read;
      write.insert(write.end(), e.joining_store_ids().begin(), e.joining_store_ids().end());
    }
  }
  for (const v1::MemberInfo& s : a.stores()) {
    {
      absl::MutexLock lock(&mu_);
      auto known = store_address_.find(s.member_id());
      if (known != store_address_.end() && known->second == s.ucx_address()) continue;
    }
    // A store new to this worker, or one that came back at another address.
    ASSIGN_OR_RETURN(int peer, client_->Connect(s.ucx_address()));
    absl::MutexLock lock(&mu_);
    store_peer_[s.member_id()] = peer;
    store_address_[s.member_id()] = s.ucx_address();
  }
  return absl::OkStatus();
}

std::vector<std::string> StoreIo::ReadStores(StoreGroup group) {
  absl::MutexLock lock(&mu_);
  auto it = read_stores_.find(group);
  return it == read_stores_.end() ? std::vector<std::string>{} : it->second;
}

std::vector<std::string> StoreIo::WriteStores(StoreGroup group) {
  absl::MutexLock lock(&mu_);
  auto it = write_stores_.find(group);
  return it == write_stores_.end() ? std::vector<std::string>{} : it->second;
}

int StoreIo::StorePeer(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = store_peer_.find(id);
  return it == store_peer_.end() ? -1 : it->second;
}

ucp_mem_h StoreIo::Registration(const void* data, size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (const auto& [region, r] : regions_) {
    if (r.data != nullptr && p >= r.data && p + bytes <= r.data + r.bytes) return r.memh;
  }
  return nullptr;
}

void StoreIo::SetRegion(Region region, const uint8_t* data, size_t bytes, ucp_mem_h memh) {
  absl::MutexLock lock(&mu_);
  regions_[region] = {data, bytes, memh};
}

absl::Status StoreIo::PutParams(const std::vector<std::string>& stores, int layer, int expert,
                                const std::string& tensor, int64_t version, const float* w,
                                const float* m, const float* v, size_t bytes, PutQueue& queue,
                                const void* blob, size_t blob_bytes) {
  const auto key = [&](v1::BlobKind kind) {
    return BlobKeyOf(job_id_, layer, expert, tensor, kind);
  };
  RETURN_IF_ERROR(Put(stores, key(v1::BLOB_KIND_WEIGHTS), version, blob != nullptr ? blob : w,
                      blob != nullptr ? blob_bytes : bytes, queue));
  for (const auto& [kind, data] :
       {std::pair{v1::BLOB_KIND_MASTER, w}, std::pair{v1::BLOB_KIND_ADAM_M, m},
        std::pair{v1::BLOB_KIND_ADAM_V, v}}) {
    RETURN_IF_ERROR(Put(stores, key(kind), version, data, bytes, queue));
  }
  return absl::OkStatus();
}

absl::Status StoreIo::Put(const std::vector<std::string>& stores, const v1::BlobKey& key,
                          int64_t version, const void* data, size_t bytes, PutQueue& queue) {
  if (stores.empty()) return absl::FailedPreconditionError("a group has no store");
  absl::MutexLock lock(&mu_);
  for (const std::string& id : stores) {
    auto it = store_peer_.find(id);
    if (it == store_peer_.end()) {
      return absl::UnavailableError(absl::StrCat("store ", id, " is not in the assignment"));
    }
    StoreClient::PutItem item;
    item.peer = it->second;
    item.key = key;
    item.version = version;
    item.attempt = attempt_;
    item.data = data;
    item.size = bytes;
    item.memh = Registration(data, bytes);
    queue.items.push_back(std::move(item));
    queue.primary.push_back(id == stores.front());
  }
  return absl::OkStatus();
}

absl::Status NamePutFailure(absl::Span<const store::StoreClient::PutItem> items,
                            const std::map<std::string, int>& store_peer, absl::Status failure) {
  if (failure.ok()) return failure;
  for (const store::StoreClient::PutItem& item : items) {
    if (item.status != failure) continue;
    for (const auto& [id, peer] : store_peer) {
      if (peer != item.peer) continue;
      absl::Status named = Annotate(failure, absl::StrCat("store ", id));
      if (IsDiskFull(named)) named.SetPayload(kDiskFullPayload, absl::Cord(id));
      return named;
    }
    break;
  }
  return failure;
}

absl::Status StoreIo::Flush(PutQueue& queue,
                            const std::function<void(const absl::Status&)>& buffers_free) {
  // Failures name their store, both the one the buffers' release is told of (a caller
  // may report that one first) and the one returned.
  const auto named = [&](const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return NamePutFailure(queue.items, store_peer_, s);
  };
  std::function<void(const absl::Status&)> free_named;
  if (buffers_free) free_named = [&](const absl::Status& sent) { buffers_free(named(sent)); };
  absl::Status s = named(client_->PutMany(absl::MakeSpan(queue.items), kStoreTimeout, free_named));
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < queue.items.size(); ++i) {
      if (!queue.items[i].status.ok()) continue;
      if (queue.primary[i]) *written_.Add() = queue.items[i].info;
      if (!queue.items[i].by_reference) {  // a reference sends no payload
        metrics_->put_bytes->Increment(static_cast<double>(queue.items[i].size));
      }
    }
  }
  queue.clear();
  return s;
}

absl::Status StoreIo::Fetch(const std::vector<std::string>& stores,
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

// While a step is pending (written, its commit not yet known): its version of the
// experts it wrote (those that got tokens: a missing one is an error), the committed
// version of the others.
absl::Status StoreIo::FetchNewest(const std::vector<std::string>& stores,
                                  std::vector<StoreClient::FetchItem>& items,
                                  const std::vector<bool>& updating) {
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < items.size(); ++i) {
      StoreClient::FetchItem& item = items[i];
      const v1::BlobKey& k = item.key;
      const bool written =
          pending_step_ >= 0 && !updating[i] && pending_written_[k.layer() * experts_ + k.expert()];
      item.version = written ? pending_step_ : -1;
    }
  }
  return Fetch(stores, items);
}

absl::Status StoreIo::FetchWeights(absl::Span<ExpertCache::FetchRequest> requests, size_t bytes,
                                   ucp_mem_h memh) {
  std::map<std::vector<std::string>, std::vector<size_t>> groups;
  for (size_t i = 0; i < requests.size(); ++i) groups[ReadStores(requests[i].expert)].push_back(i);
  absl::Status first;
  for (const auto& [stores, members] : groups) {
    std::vector<StoreClient::FetchItem> items;
    std::vector<bool> updating;
    for (size_t i : members) {
      const auto [l, e] = requests[i].expert;
      items.push_back(
          FetchItemOf(BlobKeyOf(job_id_, l, e, "", v1::BLOB_KIND_WEIGHTS), requests[i].dst, bytes));
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

void StoreIo::SetPending(int64_t s, std::vector<bool> written) {
  absl::MutexLock lock(&mu_);
  pending_step_ = s;
  pending_written_ = std::move(written);
}

void StoreIo::ClearPending() {
  absl::MutexLock lock(&mu_);
  pending_step_ = -1;
}

bool StoreIo::Pending() {
  absl::MutexLock lock(&mu_);
  return pending_step_ >= 0;
}

int64_t StoreIo::PendingVersion(StoreGroup expert) {
  absl::MutexLock lock(&mu_);
  const auto [l, e] = expert;
  return pending_step_ >= 0 && pending_written_[l * experts_ + e] ? pending_step_ : -1;
}

void StoreIo::ClearWritten() {
  absl::MutexLock lock(&mu_);
  written_.Clear();
}

google::protobuf::RepeatedPtrField<v1::BlobInfo> StoreIo::Written() {
  absl::MutexLock lock(&mu_);
  return written_;
}

}  // namespace pith::runtime
