#include "server/store/data_plane.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/crc32c.h"
#include "common/status.h"
#include "common/ucx_auth.h"
#include "glog/logging.h"

namespace pith::store {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

v1::UcxBlobReply ErrorReply(uint64_t request_id, uint32_t index, const absl::Status& status) {
  v1::UcxBlobReply r;
  r.set_request_id(request_id);
  r.set_index(index);
  r.set_code(static_cast<int32_t>(status.code()));
  r.set_message(std::string(status.message()));
  r.set_disk_full(IsDiskFull(status));
  return r;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlane>> DataPlane::Create(ucx::Worker* worker, BlobStore* store,
                                                             const ucx::MemoryRegion* arena,
                                                             MetricsRegistry* metrics) {
  std::unique_ptr<DataPlane> d(new DataPlane(worker, store, arena));
  if (metrics != nullptr) {
    const auto buckets = MetricsRegistry::LatencyBuckets();
    ASSIGN_OR_RETURN(d->bytes_sent_,
                     metrics->Counter("pith_store_bytes_sent_total", "Blob bytes sent over UCX"));
    ASSIGN_OR_RETURN(d->bytes_received_, metrics->Counter("pith_store_bytes_received_total",
                                                          "Blob bytes received over UCX"));
    ASSIGN_OR_RETURN(
        d->get_seconds_,
        metrics->Histogram("pith_store_get_seconds",
                           "Time to serve one blob of a fetch, lookup to sent", buckets));
    ASSIGN_OR_RETURN(
        d->put_seconds_,
        metrics->Histogram("pith_store_put_seconds",
                           "Time to take one blob version, header to durable", buckets));
    ASSIGN_OR_RETURN(d->errors_, metrics->Counter("pith_store_data_plane_errors_total",
                                                  "Data-plane requests answered with an error"));
    ASSIGN_OR_RETURN(prometheus::Counter * dropped,
                     metrics->Counter("pith_store_unauthenticated_messages_total",
                                      "UCX messages dropped for a missing or wrong tag"));
    // The registry outlives the store's UCX worker, whose threads run the hook.
    ucx::OnUnauthenticatedDrop([dropped] { dropped->Increment(); });
  }
  DataPlane* self = d.get();
  d->ticker_ = std::thread([self] {
    while (!self->stop_ticker_.WaitForNotificationWithTimeout(absl::Milliseconds(2))) {
      if (self->has_waiting_.load(std::memory_order_acquire)) {
        self->worker_->Post([self] { self->RetryWaiting(); });
      }
    }
  });
  worker->SetHandler(v1::UCX_MESSAGE_HELLO, [self](ucx::AmMessage& m) { self->OnHello(m); });
  worker->SetHandler(v1::UCX_MESSAGE_GET_REQUEST, [self](ucx::AmMessage& m) { self->OnGet(m); });
  worker->SetHandler(v1::UCX_MESSAGE_PUT_REQUEST, [self](ucx::AmMessage& m) { self->OnPut(m); });
  return d;
}

void DataPlane::OnHello(ucx::AmMessage& m) {
  v1::UcxHello hello;
  if (!hello.ParseFromString(m.header) || hello.client_id() == 0 ||
      hello.worker_address().empty()) {
    LOG(WARNING) << "ignored a malformed UCX hello";
    if (errors_) errors_->Increment();
    return;
  }
  const uint64_t client = hello.client_id();
  // A client that connects again (its last endpoint failed or timed out) says hello again.
  RetireClient(client);
  absl::StatusOr<ucp_ep_h> ep = EndpointTo(hello.worker_address());
  if (!ep.ok()) {
    LOG(WARNING) << "cannot answer client " << client << ": " << ep.status();
    if (errors_) errors_->Increment();
    return;
  }
  if (clients_.size() >= kMaxClients) {
    auto idle = std::min_element(
        clients_.begin(), clients_.end(),
        [](const auto& a, const auto& b) { return a.second.last_use < b.second.last_use; });
    VLOG(1) << "too many clients: client " << idle->first << " forgotten";
    RetireClient(idle->first);
  }
  clients_[client] = Client{*ep, ++uses_};
}

absl::StatusOr<ucp_ep_h> DataPlane::EndpointTo(const std::string& address) {
  if (auto known = endpoints_.find(address); known != endpoints_.end()) return known->second;
  if (endpoints_.size() >= kMaxEndpoints) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the store has endpoints to ", endpoints_.size(), " peers already"));
  }
  auto slot = std::make_shared<ucp_ep_h>(nullptr);
  ASSIGN_OR_RETURN(*slot, worker_->Connect(address, [this, address, slot](absl::Status status) {
    auto it = endpoints_.find(address);
    // The failure of an earlier endpoint to the peer does not retire the current one.
    if (it == endpoints_.end() || it->second != *slot) return;
    VLOG(1) << "a client endpoint failed: " << status;
    endpoints_.erase(it);  // the worker keeps it open (late messages name it) until it stops
    std::vector<uint64_t> gone;
    for (const auto& [id, c] : clients_) {
      if (c.ep == *slot) gone.push_back(id);
    }
    for (uint64_t id : gone) RetireClient(id);
  }));
  endpoints_[address] = *slot;
  return *slot;
}

void DataPlane::RetireClient(uint64_t client) {
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  clients_.erase(it);
  // Its waiting puts will never be answered: receiving them would only hold RAM for a
  // sender that is gone.
  for (auto w = waiting_.begin(); w != waiting_.end();) {
    if (w->request.client_id() != client) {
      ++w;
      continue;
    }
    worker_->Release(w->message);
    w = waiting_.erase(w);
  }
  has_waiting_.store(!waiting_.empty(), std::memory_order_release);
}

void DataPlane::Reply(uint64_t client, ucp_ep_h via, uint16_t id, const v1::UcxBlobReply& reply,
                      BlobRef payload) {
  if (reply.code() != 0 && errors_) errors_->Increment();
  ucp_ep_h ep = nullptr;
  if (auto it = clients_.find(client); it != clients_.end()) {
    ep = it->second.ep;
    it->second.last_use = ++uses_;
  } else {
    for (const auto& entry : clients_) {
      if (entry.second.ep == via) ep = via;
    }
  }
  if (ep == nullptr) {
    VLOG(1) << "no endpoint to client " << client << ": reply to request " << reply.request_id()
            << " dropped";
    if (reply.code() == 0 && errors_) errors_->Increment();
    return;
  }
  const void* data = payload.data();
  const size_t size = payload.size();
  // The BlobRef rides in the completion: the blob stays pinned until UCX has sent it.
  worker_->Send(ep, id, reply.SerializeAsString(), data, size, payload.in_ram() ? memh_ : nullptr,
                false, [payload, this, size](absl::Status status) {
                  if (status.ok() && bytes_sent_) bytes_sent_->Increment(static_cast<double>(size));
                  if (!status.ok()) VLOG(1) << "reply not delivered: " << status;
                });
}

void DataPlane::OnGet(ucx::AmMessage& m) {
  v1::UcxGetRequest request;
  if (!request.ParseFromString(m.header)) {
    Reply(0, m.reply_ep, v1::UCX_MESSAGE_GET_REPLY,
          ErrorReply(0, 0, absl::InvalidArgumentError("malformed fetch request")), BlobRef());
    return;
  }
  for (int i = 0; i < request.items_size(); ++i) {
    const auto start = std::chrono::steady_clock::now();
    const v1::UcxGetItem& item = request.items(i);
    absl::StatusOr<BlobRef> ref = store_->Get(item.key(), item.version());
    if (ref.ok() && ref->size() > item.capacity()) {
      ref = absl::ResourceExhaustedError(
          absl::StrCat("blob has ", ref->size(), " bytes, the buffer ", item.capacity()));
    }
    if (!ref.ok()) {
      Reply(request.client_id(), m.reply_ep, v1::UCX_MESSAGE_GET_REPLY,
            ErrorReply(request.request_id(), i, ref.status()), BlobRef());
      continue;
    }
    v1::UcxBlobReply reply;
    reply.set_request_id(request.request_id());
    reply.set_index(i);
    v1::BlobInfo* info = reply.mutable_info();
    *info->mutable_key() = item.key();
    info->set_version(ref->version());
    info->set_size_bytes(ref->size());
    info->set_crc32c(ref->crc());
    info->set_committed(item.version() < 0);
    Reply(request.client_id(), m.reply_ep, v1::UCX_MESSAGE_GET_REPLY, reply, *ref);
    if (get_seconds_) get_seconds_->Observe(SecondsSince(start));
  }
}

void DataPlane::OnPut(ucx::AmMessage& m) {
  const auto start = std::chrono::steady_clock::now();
  v1::UcxPutRequest request;
  if (!request.ParseFromString(m.header)) {
    Reply(0, m.reply_ep, v1::UCX_MESSAGE_PUT_REPLY,
          ErrorReply(0, 0, absl::InvalidArgumentError("malformed put request")), BlobRef());
    return;
  }
  const uint64_t payload = request.same_as_kind() != v1::BLOB_KIND_UNSPECIFIED ? 0 : request.size();
  if (payload != m.length) {
    Reply(request.client_id(), m.reply_ep, v1::UCX_MESSAGE_PUT_REPLY,
          ErrorReply(request.request_id(), 0,
                     absl::InvalidArgumentError(
                         absl::StrCat("put says ", payload, " bytes, carries ", m.length))),
          BlobRef());
    return;
  }
  if (request.same_as_kind() != v1::BLOB_KIND_UNSPECIFIED) {
    // No payload: the bytes are the sibling version's, already here.
    absl::StatusOr<v1::BlobInfo> info =
        request.key().kind() == request.same_as_kind()
            ? absl::InvalidArgumentError("a put cannot be the same as its own kind")
            : store_->PutSibling(request.key(), request.version(), request.size(), request.crc32c(),
                                 request.attempt());
    v1::UcxBlobReply reply = ErrorReply(request.request_id(), 0, info.status());
    if (info.ok()) {
      *reply.mutable_info() = *info;
      if (put_seconds_) put_seconds_->Observe(SecondsSince(start));
    }
    Reply(request.client_id(), m.reply_ep, v1::UCX_MESSAGE_PUT_REPLY, reply, BlobRef());
    return;
  }
  if (stopping_) return;  // the worker releases the payload
  if (!waiting_.empty() || !TryPut(m, request, start)) {
    waiting_.push_back({std::move(m), std::move(request), start});
    has_waiting_.store(true, std::memory_order_release);
  }
}

bool DataPlane::TryPut(ucx::AmMessage& m, const v1::UcxPutRequest& request,
                       std::chrono::steady_clock::time_point start) {
  absl::StatusOr<PutReservation> reservation =
      store_->BeginPut(request.key(), request.version(), request.size(), request.attempt());
  if (absl::IsUnavailable(reservation.status()) &&
      std::chrono::steady_clock::now() - start < absl::ToChronoNanoseconds(kPutWaitLimit)) {
    return false;
  }
  if (!reservation.ok()) {
    absl::Status why = reservation.status();
    if (absl::IsUnavailable(why)) {
      why = absl::ResourceExhaustedError(absl::StrCat(
          "waited ", absl::FormatDuration(kPutWaitLimit), " for RAM: ", why.message()));
    }
    Reply(request.client_id(), m.reply_ep, v1::UCX_MESSAGE_PUT_REPLY,
          ErrorReply(request.request_id(), 0, why), BlobRef());
    worker_->Release(m);
    return true;
  }
  ucp_ep_h via = m.reply_ep;  // compared only (see Reply)
  uint8_t* target = reservation->data();
  worker_->ReceiveData(
      m, target, memh_,
      [this, via, request, reservation = std::move(*reservation),
       start](absl::Status status) mutable {
        absl::StatusOr<v1::BlobInfo> info =
            status.ok() ? store_->FinishPut(std::move(reservation), request.crc32c())
                        : absl::StatusOr<v1::BlobInfo>(status);
        v1::UcxBlobReply reply = ErrorReply(request.request_id(), 0, info.status());
        if (info.ok()) {
          *reply.mutable_info() = *info;
          if (bytes_received_) bytes_received_->Increment(static_cast<double>(request.size()));
          if (put_seconds_) put_seconds_->Observe(SecondsSince(start));
        }
        Reply(request.client_id(), via, v1::UCX_MESSAGE_PUT_REPLY, reply, BlobRef());
        // Its block is a demotable version now (or free): room for a waiting put.
        RetryWaiting();
      });
  return true;
}

void DataPlane::RetryWaiting() {
  // A put whose payload was eager lands inside TryPut and asks again from there: the loop
  // below goes on instead.
  if (retrying_ || stopping_) return;
  retrying_ = true;
  while (!waiting_.empty()) {
    WaitingPut w = std::move(waiting_.front());
    waiting_.pop_front();
    if (!clients_.contains(w.request.client_id())) {  // gone, or never said hello
      worker_->Release(w.message);
      continue;
    }
    if (!TryPut(w.message, w.request, w.start)) {
      waiting_.push_front(std::move(w));
      break;
    }
  }
  retrying_ = false;
  has_waiting_.store(!waiting_.empty(), std::memory_order_release);
}

void DataPlane::Shutdown() {
  if (!stop_ticker_.HasBeenNotified()) stop_ticker_.Notify();
  if (ticker_.joinable()) ticker_.join();
  // On the progress thread while it runs (inline once it has stopped).
  worker_->RunSync([this] {
    stopping_ = true;
    for (WaitingPut& w : waiting_) worker_->Release(w.message);
    waiting_.clear();
    has_waiting_.store(false, std::memory_order_release);
  });
}

DataPlane::~DataPlane() { Shutdown(); }

}  // namespace pith::store
