#include "server/store/store_client.h"

#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/crc32c.h"
#include "common/status.h"

namespace pith::store {

// Requests waited for together: one wake-up for all of them, not one each.
struct StoreClient::Round {
  explicit Round(size_t n) : remaining(n) {
    if (n == 0) all_done.Notify();
  }
  std::atomic<size_t> remaining;
  absl::Notification all_done;
};

// One outstanding fetch or put. Touched on the progress thread until it ends (`done`, or
// `finished` set by FailPeer when the caller gives up: see Wait), and by the waiting
// caller after that; but for `to_check` (under its mutex) and the large fetch items it
// names, which the caller checks while the rest are in flight.
struct StoreClient::Pending {
  int peer = 0;
  FetchItem* items = nullptr;  // fetch
  size_t count = 0;
  size_t remaining = 0;
  v1::BlobInfo put_info;  // put
  absl::Status status;
  bool finished = false;
  int receiving = 0;          // payloads being received into the caller's buffers
  std::vector<bool> replied;  // fetch: the items answered already
  // Fetch: the items whose payload landed whole. Each is checked end to end while the
  // rest are in flight: one under kCheckOnCallerBytes where it landed (on the progress
  // thread; its status is the check), so that the caller wakes once per request, not once
  // per blob; a larger one by the waiting caller (`to_check`), in parallel with the
  // progress thread, which also moves the bytes (CMA, the kernel's TCP copies).
  std::vector<bool> landed;
  absl::Notification done;
  std::shared_ptr<Round> round;  // null: waited for alone
  absl::Mutex to_check_mu;
  std::vector<size_t> to_check ABSL_GUARDED_BY(to_check_mu);
  size_t taken ABSL_GUARDED_BY(to_check_mu) = 0;  // how many of them the caller has checked
  bool ToCheckOrDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(to_check_mu) {
    return to_check.size() > taken || done.HasBeenNotified();
  }

  // Ends the request (once; later calls do nothing).
  void Complete() {
    if (finished) return;
    finished = true;
    done.Notify();
    { absl::MutexLock wake(&to_check_mu); }  // a caller waiting on `to_check` looks again
    if (round != nullptr && round->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      round->all_done.Notify();
    }
  }
  // One item (or the put) is done.
  void ItemDone() {
    if (remaining > 0 && --remaining == 0) Complete();
  }
  void Fail(const absl::Status& s) {
    if (status.ok()) status = s;
  }
};

absl::StatusOr<std::unique_ptr<StoreClient>> StoreClient::Create(absl::Duration retired_linger) {
  std::unique_ptr<StoreClient> c(new StoreClient());
  c->retired_linger_ = retired_linger;
  std::random_device random;
  while (c->client_id_ == 0) {
    c->client_id_ = (static_cast<uint64_t>(random()) << 32) ^ random();
  }
  auto worker = ucx::Worker::Create();
  if (!worker.ok()) return worker.status();
  c->worker_ = std::move(*worker);
  StoreClient* self = c.get();
  c->worker_->SetHandler(v1::UCX_MESSAGE_GET_REPLY,
                         [self](ucx::AmMessage& m) { self->OnReply(m, true); });
  c->worker_->SetHandler(v1::UCX_MESSAGE_PUT_REPLY,
                         [self](ucx::AmMessage& m) { self->OnReply(m, false); });
  if (absl::Status s = c->worker_->Start(); !s.ok()) return s;
  return c;
}

StoreClient::~StoreClient() {
  worker_->RunSync([this] {
    for (auto& [id, p] : pending_) {
      p->Fail(absl::CancelledError("store client closed"));
      p->Complete();
    }
    pending_.clear();
  });
  worker_.reset();
}

absl::StatusOr<int> StoreClient::Connect(const std::string& ucx_address) {
  if (ucx_address.empty()) return absl::InvalidArgumentError("empty UCX address");
  absl::StatusOr<int> result;
  worker_->RunSync([&] {
    auto it = peer_by_address_.find(ucx_address);
    if (it != peer_by_address_.end()) {
      result = it->second;
      return;
    }
    const int peer = next_peer_++;
    address_of_[peer] = ucx_address;
    absl::StatusOr<ucp_ep_h> ep = Endpoint(peer, /*fail_fast=*/false);
    if (!ep.ok()) {
      address_of_.erase(peer);
      result = ep.status();
      return;
    }
    peer_by_address_[ucx_address] = peer;
    result = peer;
  });
  return result;
}

absl::StatusOr<ucp_ep_h> StoreClient::Endpoint(int peer, bool fail_fast) {
  if (auto open = peers_.find(peer); open != peers_.end()) return open->second;
  auto address = address_of_.find(peer);
  if (address == address_of_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("no store peer ", peer));
  }
  auto down = down_.find(peer);
  // Each timeout leaves its endpoint open for a while (see FailPeer): past a bound of
  // them, a store that failed is not connected again until the oldest closes.
  CloseLingeredRetired();
  if (down != down_.end() && retired_.size() >= kMaxRetiredEndpoints) {
    return absl::UnavailableError(
        absl::StrCat("store connection failed (", down->second.why, "); not reconnected while ",
                     retired_.size(), " connections that timed out in the last ",
                     absl::FormatDuration(retired_linger_), " stay open"));
  }
  // A fetch from a store that just failed is not tried again before its backoff ends: the
  // caller moves on to a replica at once instead of waiting out a deadline per call. A put
  // (every copy must be written) tries again at once.
  if (fail_fast && down != down_.end() && absl::Now() < down->second.retry_at) {
    return absl::UnavailableError(
        absl::StrCat("store connection failed (", down->second.why, "); next try in ",
                     absl::FormatDuration(
                         absl::Trunc(down->second.retry_at - absl::Now(), absl::Milliseconds(1)))));
  }
  // The failure of an endpoint this one replaced fails nothing of this one's.
  auto self = std::make_shared<ucp_ep_h>(nullptr);
  ASSIGN_OR_RETURN(*self, worker_->Connect(address->second, [this, peer, self](absl::Status s) {
    if (auto open = peers_.find(peer); open != peers_.end() && open->second == *self) {
      FailPeer(peer, s);
    }
  }));
  // First on the endpoint, so the store knows where to answer before any request (a
  // store that forgot this client learns of it again).
  v1::UcxHello hello;
  hello.set_client_id(client_id_);
  hello.set_worker_address(worker_->address());
  worker_->Send(*self, v1::UCX_MESSAGE_HELLO, hello.SerializeAsString(), nullptr, 0, nullptr, false,
                [](absl::Status) {});  // a lost hello shows as the requests' timeouts
  peers_[peer] = *self;
  return *self;
}

absl::StatusOr<std::unique_ptr<ucx::MemoryRegion>> StoreClient::AllocateBuffer(size_t bytes,
                                                                               bool fault_in) {
  return worker_->Allocate(bytes, fault_in);
}

void StoreClient::FailPeer(int peer, const absl::Status& status) {
  // Progress thread. Every request to that store fails; the endpoint goes.
  bool receiving = false;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second->peer != peer) {
      ++it;
      continue;
    }
    std::shared_ptr<Pending> p = it->second;
    receiving |= p->receiving > 0;
    it = pending_.erase(it);
    p->Fail(absl::UnavailableError(absl::StrCat("store connection lost: ", status.message())));
    p->Complete();
  }
  auto ep = peers_.find(peer);
  if (ep == peers_.end()) return;
  Down& down = down_[peer];
  down.backoff = down.backoff == absl::ZeroDuration()
                     ? kReconnectBackoff
                     : std::min(2 * down.backoff, kMaxReconnectBackoff);
  down.retry_at = absl::Now() + down.backoff;
  down.why = std::string(status.message());
  // A store that failed, or one still writing a payload into a caller's buffer, is closed
  // (which cancels those receives). One that merely has not answered in time is retired:
  // left open, unused, so its late answers arrive on an endpoint that still exists and are
  // dropped (the endpoint ids on the wire are its address: closing it under a live peer
  // leaves that peer's next message naming freed memory). Retired ones close once they
  // are kRetiredLinger old (CloseLingeredRetired), or with the client.
  if (receiving || !absl::IsDeadlineExceeded(status)) {
    worker_->Close(ep->second);
  } else {
    retired_.push_back({ep->second, std::chrono::steady_clock::now()});
  }
  peers_.erase(ep);  // the next request to this peer opens a new one (Endpoint)
}

void StoreClient::CloseLingeredRetired() {
  const auto cutoff = std::chrono::steady_clock::now() - absl::ToChronoNanoseconds(retired_linger_);
  while (!retired_.empty() && retired_.front().at <= cutoff) {
    worker_->Close(retired_.front().ep);
    retired_.pop_front();
  }
}

void StoreClient::OnReply(ucx::AmMessage& m, bool is_get) {
  v1::UcxBlobReply reply;
  if (!reply.ParseFromString(m.header)) return;  // not from a store; the payload is released
  auto it = pending_.find(reply.request_id());
  if (it == pending_.end()) return;  // a request that timed out
  std::shared_ptr<Pending> p = it->second;
  down_.erase(p->peer);  // it answers: a later failure backs off from the start
  const absl::Status status =
      reply.disk_full() &&
              reply.code() == static_cast<int32_t>(absl::StatusCode::kResourceExhausted)
          ? DiskFullError(reply.message())
          : absl::Status(static_cast<absl::StatusCode>(reply.code()), reply.message());
  if (!is_get) {
    p->Fail(status);
    p->put_info = reply.info();
    pending_.erase(it);
    p->Complete();
    return;
  }
  if (reply.index() >= p->count) return;
  // One reply per item: a repeat (a broken or hostile store) would write over bytes the
  // caller may be checking, or already has.
  if (p->replied.empty()) p->replied.assign(p->count, false);
  if (p->replied[reply.index()]) return;
  p->replied[reply.index()] = true;
  FetchItem& item = p->items[reply.index()];
  const uint64_t id = reply.request_id();
  auto item_done = [this, p, id] {
    p->ItemDone();
    if (p->finished) pending_.erase(id);
  };
  if (!status.ok()) {
    item.status = status;
    p->Fail(status);
    item_done();
    return;
  }
  if (m.length != reply.info().size_bytes() || m.length > item.capacity) {
    item.status = absl::DataLossError("fetched payload does not match its header");
    p->Fail(item.status);
    item_done();
    return;  // the worker releases the payload
  }
  item.info = reply.info();
  ++p->receiving;
  const size_t index = reply.index();
  worker_->ReceiveData(m, item.buffer, item.memh, [p, &item, index, item_done](absl::Status s) {
    --p->receiving;
    if (p->finished) return;  // the request already failed; the buffers are not ours
    if (!s.ok()) {
      item.status = s;
      p->Fail(s);
    } else {
      p->landed[index] = true;
      if (item.info.size_bytes() < kCheckOnCallerBytes) {
        item.status = CheckFetched(item);
      } else {
        absl::MutexLock lock(&p->to_check_mu);
        p->to_check.push_back(index);
      }
    }
    item_done();
  });
}

absl::Status StoreClient::Issue(int peer, uint64_t id, const std::shared_ptr<Pending>& pending,
                                uint16_t message, std::string header, const void* data, size_t size,
                                ucp_mem_h memh, absl::Time deadline, absl::Duration budget,
                                const std::function<void(size_t)>& on_landed) {
  worker_->Post(
      [this, peer, pending, id, message, data, size, memh, header = std::move(header)]() mutable {
        absl::StatusOr<ucp_ep_h> ep = Endpoint(peer, message == v1::UCX_MESSAGE_GET_REQUEST);
        if (!ep.ok()) {
          pending->Fail(ep.status());
          pending->Complete();
          return;
        }
        pending_[id] = pending;
        worker_->Send(*ep, message, std::move(header), data, size, memh, true,
                      [this, pending, id](absl::Status s) {
                        if (s.ok() || !pending_.count(id)) return;
                        pending_.erase(id);
                        pending->Fail(s);
                        pending->Complete();
                      });
      });
  return Wait(peer, pending, deadline, budget, on_landed);
}

absl::Status StoreClient::Wait(int peer, const std::shared_ptr<Pending>& pending,
                               absl::Time deadline, absl::Duration budget,
                               const std::function<void(size_t)>& on_landed) {
  // Each deadline moved on by however long this process did not run meanwhile: the store's
  // answer waits, unread, while this process is stopped.
  const auto running = [&] { return Running(deadline, budget); };
  if (on_landed) {
    Pending* p = pending.get();
    std::vector<size_t> landed;
    do {
      {
        absl::MutexLock lock(&p->to_check_mu);
        p->to_check_mu.AwaitWithDeadline(absl::Condition(p, &Pending::ToCheckOrDone), running());
        landed.assign(p->to_check.begin() + p->taken, p->to_check.end());
        p->taken = p->to_check.size();
      }
      for (size_t i : landed) on_landed(i);
      // None new: the request ended, or the deadline passed.
    } while (!landed.empty() || (!pending->done.HasBeenNotified() && absl::Now() < running()));
  }
  while (!pending->done.WaitForNotificationWithTimeout(
      std::max(absl::ZeroDuration(), running() - absl::Now()))) {
    if (absl::Now() >= running()) break;
  }
  if (pending->done.HasBeenNotified()) return pending->status;
  // Give up: no late payload may land in the caller's buffers (see FailPeer).
  worker_->RunSync([&] {
    if (!pending->done.HasBeenNotified()) {
      FailPeer(peer, absl::DeadlineExceededError("timed out"));
    }
  });
  return absl::DeadlineExceededError(
      absl::StrCat("store did not answer within ", absl::FormatDuration(budget)));
}

absl::Status StoreClient::Fetch(int peer, absl::Span<FetchItem> items, absl::Duration timeout) {
  // A request travels as one UCX message header: past the transport's segment (8 KiB over
  // shared memory, when UCX_TLS allows it) UCX would send it by rendezvous, whose first
  // message cannot carry it, and abort the process. A large fetch goes as several requests, one
  // after another.
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status first = absl::OkStatus();
  size_t begin = 0;
  while (begin < items.size()) {
    size_t end = begin, bytes = 0;
    while (end < items.size()) {
      const size_t item = items[end].key.ByteSizeLong() + kItemOverheadBytes;
      if (end > begin && bytes + item > kMaxRequestBytes) break;
      bytes += item;
      ++end;
    }
    if (absl::Now() >= Running(deadline, timeout)) {  // an earlier part took the time
      for (size_t i = begin; i < items.size(); ++i) {
        items[i].status = absl::DeadlineExceededError("not fetched: the deadline passed");
      }
      first.Update(items[begin].status);
      break;
    }
    first.Update(FetchOnce(peer, items.subspan(begin, end - begin), deadline, timeout));
    begin = end;
  }
  return first;
}

absl::Status StoreClient::CheckFetched(const FetchItem& item) {
  const v1::BlobInfo& info = item.info;
  const v1::BlobKey &a = item.key, &b = info.key();
  const bool same_key = a.job_id() == b.job_id() && a.layer() == b.layer() &&
                        a.kind() == b.kind() &&
                        (a.layer() < 0 ? a.tensor() == b.tensor() : a.expert() == b.expert());
  if (!same_key || (item.version >= 0 && info.version() != item.version)) {
    return absl::DataLossError(absl::StrCat("asked for {", a.ShortDebugString(), "} version ",
                                            item.version, ", the store answered {",
                                            b.ShortDebugString(), "} version ", info.version()));
  }
  if (Crc32c(item.buffer, info.size_bytes()) != info.crc32c()) {
    return absl::DataLossError(absl::StrCat("fetched bytes of {", a.ShortDebugString(),
                                            "} version ", info.version(),
                                            " do not match their CRC32C"));
  }
  return absl::OkStatus();
}

absl::Status StoreClient::FetchOnce(int peer, absl::Span<FetchItem> items, absl::Time deadline,
                                    absl::Duration budget) {
  if (items.empty()) return absl::OkStatus();
  auto pending = std::make_shared<Pending>();
  pending->peer = peer;
  pending->items = items.data();
  pending->count = items.size();
  pending->remaining = items.size();
  v1::UcxGetRequest request;
  request.set_request_id(next_request_++);
  request.set_client_id(client_id_);
  for (FetchItem& item : items) {
    item.status = absl::OkStatus();
    v1::UcxGetItem* g = request.add_items();
    *g->mutable_key() = item.key;
    g->set_version(item.version);
    g->set_capacity(item.capacity);
  }
  pending->landed.assign(items.size(), false);
  std::vector<absl::Status> checked(items.size());  // the large items this thread checked
  std::vector<bool> seen(items.size(), false);
  absl::Status status =
      Issue(peer, request.request_id(), pending, v1::UCX_MESSAGE_GET_REQUEST,
            request.SerializeAsString(), nullptr, 0, nullptr, deadline, budget, [&](size_t i) {
              checked[i] = CheckFetched(items[i]);
              seen[i] = true;
            });
  // The request has ended (or was failed on the progress thread): the items are ours.
  const absl::Status request_status = status;
  for (size_t i = 0; i < items.size(); ++i) {
    if (!pending->landed[i]) {
      if (items[i].status.ok()) {  // not failed by itself: by the request
        items[i].status = request_status.ok()
                              ? absl::InternalError("the fetch ended before this item landed")
                              : request_status;
      }
    } else if (items[i].info.size_bytes() >= kCheckOnCallerBytes) {
      items[i].status = seen[i] ? checked[i] : CheckFetched(items[i]);  // or as it ended
    }  // else checked where it landed
    status.Update(items[i].status);
  }
  return status;
}

namespace {

// Whether `item` is the other one of weights and master of the expert or tensor `source`
// is (the caller has matched their store, bytes and version).
bool SiblingKinds(const StoreClient::PutItem& item, const StoreClient::PutItem& source) {
  const v1::BlobKind a = item.key.kind(), b = source.key.kind();
  if (!((a == v1::BLOB_KIND_MASTER && b == v1::BLOB_KIND_WEIGHTS) ||
        (a == v1::BLOB_KIND_WEIGHTS && b == v1::BLOB_KIND_MASTER))) {
    return false;
  }
  v1::BlobKey k = item.key;
  k.set_kind(b);
  return k.SerializeAsString() == source.key.SerializeAsString();
}

}  // namespace

absl::Status StoreClient::PutMany(absl::Span<PutItem> items, absl::Duration timeout,
                                  const std::function<void(const absl::Status&)>& buffers_free) {
  // NOTE: an item whose bytes another item of the call sends to the same store as the
  // sibling kind (fp32 weights are their own master copy) goes in a second round, once
  // that one is written, as a reference to it: no payload, no second checksum there.
  std::vector<int> source(items.size(), -1);
  {
    std::map<std::tuple<int, const void*, size_t, int64_t>, std::vector<size_t>> by_bytes;
    for (size_t i = 0; i < items.size(); ++i) {
      auto& same = by_bytes[{items[i].peer, items[i].data, items[i].size, items[i].version}];
      for (size_t j : same) {
        if (source[j] < 0 && SiblingKinds(items[i], items[j])) {
          source[i] = static_cast<int>(j);
          break;
        }
      }
      same.push_back(i);
    }
  }
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<size_t> first_round, second_round;
  for (size_t i = 0; i < items.size(); ++i) {
    if (source[i] < 0) first_round.push_back(i);
  }
  absl::Status first = PutRound(items, first_round, source, deadline, timeout);
  if (buffers_free) buffers_free(first);  // the references carry no payload
  for (size_t i = 0; i < items.size(); ++i) {
    if (source[i] < 0) continue;
    if (items[source[i]].status.ok()) {
      second_round.push_back(i);
      items[i].by_reference = true;
    } else {
      items[i].status = items[source[i]].status;  // nothing to refer to
    }
  }
  absl::Status second = PutRound(items, second_round, source, deadline, timeout);
  return first.ok() ? second : first;
}

absl::Status StoreClient::PutRound(absl::Span<PutItem> items, const std::vector<size_t>& round,
                                   const std::vector<int>& source, absl::Time deadline,
                                   absl::Duration budget) {
  if (round.empty()) return absl::OkStatus();
  if (absl::Now() >= Running(deadline, budget)) {  // the first round took the time
    for (size_t i : round)
      items[i].status = absl::DeadlineExceededError("not sent: the deadline passed");
    return items[round.front()].status;
  }
  std::vector<std::shared_ptr<Pending>> pendings;
  std::vector<std::pair<uint64_t, std::string>> headers;
  // One checksum per buffer: a blob goes to each store of its group, and a buffer can
  // hold two kinds (fp32 weights are their own master copy).
  std::map<std::pair<const void*, size_t>, uint32_t> crcs;
  struct Outgoing {
    int peer;
    const void* data;
    size_t size;
    ucp_mem_h memh;
  };
  std::vector<Outgoing> out;
  auto all = std::make_shared<Round>(round.size());
  for (size_t i : round) {
    PutItem& item = items[i];
    auto pending = std::make_shared<Pending>();
    pending->peer = item.peer;
    pending->remaining = 1;
    pending->round = all;
    v1::UcxPutRequest request;
    request.set_request_id(next_request_++);
    request.set_client_id(client_id_);
    *request.mutable_key() = item.key;
    request.set_version(item.version);
    request.set_attempt(item.attempt);
    request.set_size(item.size);
    const bool reference = source[i] >= 0;
    if (reference) {
      request.set_same_as_kind(items[source[i]].key.kind());
      request.set_crc32c(items[source[i]].info.crc32c());
    } else {
      auto [crc, fresh] = crcs.try_emplace({item.data, item.size}, 0);
      if (fresh) crc->second = Crc32c(item.data, item.size);
      request.set_crc32c(crc->second);
    }
    headers.emplace_back(request.request_id(), request.SerializeAsString());
    pendings.push_back(std::move(pending));
    out.push_back({item.peer, reference ? nullptr : item.data, reference ? 0 : item.size,
                   reference ? nullptr : item.memh});
  }
  worker_->Post([this, out = std::move(out), pendings, headers = std::move(headers)]() mutable {
    for (size_t i = 0; i < out.size(); ++i) {
      const Outgoing& item = out[i];
      std::shared_ptr<Pending> pending = pendings[i];
      const uint64_t id = headers[i].first;
      absl::StatusOr<ucp_ep_h> ep = Endpoint(item.peer, /*fail_fast=*/false);
      if (!ep.ok()) {
        pending->Fail(ep.status());
        pending->Complete();
        continue;
      }
      pending_[id] = pending;
      worker_->Send(*ep, v1::UCX_MESSAGE_PUT_REQUEST, std::move(headers[i].second), item.data,
                    item.size, item.memh, true, [this, pending, id](absl::Status st) {
                      if (st.ok() || !pending_.count(id)) return;
                      pending_.erase(id);
                      pending->Fail(st);
                      pending->Complete();
                    });
    }
  });
  // One wait for the whole round; then each (done, or timed out from here).
  (void)all->all_done.WaitForNotificationWithTimeout(
      std::max(Running(deadline, budget) - absl::Now(), absl::ZeroDuration()));
  absl::Status first;
  for (size_t k = 0; k < round.size(); ++k) {
    PutItem& item = items[round[k]];
    absl::Status st = Wait(item.peer, pendings[k], deadline, budget);
    item.status = st;
    if (st.ok()) item.info = pendings[k]->put_info;
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

absl::StatusOr<v1::BlobInfo> StoreClient::Put(int peer, const v1::BlobKey& key, int64_t version,
                                              const void* data, size_t size, ucp_mem_h memh,
                                              absl::Duration timeout) {
  auto pending = std::make_shared<Pending>();
  pending->peer = peer;
  pending->remaining = 1;
  v1::UcxPutRequest request;
  request.set_request_id(next_request_++);
  request.set_client_id(client_id_);
  *request.mutable_key() = key;
  request.set_version(version);
  request.set_size(size);
  request.set_crc32c(Crc32c(data, size));
  absl::Status s =
      Issue(peer, request.request_id(), pending, v1::UCX_MESSAGE_PUT_REQUEST,
            request.SerializeAsString(), data, size, memh, absl::Now() + timeout, timeout);
  if (!s.ok()) return s;
  return pending->put_info;
}

}  // namespace pith::store
