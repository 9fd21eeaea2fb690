#include "common/ucx.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status.h"
#include "common/ucx_address.h"
#include "common/ucx_auth.h"

namespace pith::ucx {
namespace {

// NOTE: the progress thread runs briefly and often, and every message waits for it: it
// asks the scheduler for a short time slice (EEVDF, Linux 6.12+: an earlier deadline, so
// its wake-up preempts a compute thread instead of queueing behind it). Unprivileged; older
// kernels ignore the request for normal threads. Measured on the 2-core cluster_bench:
// message post delay 0.34 -> 0.15 ms on average, cluster tokens/s +3%.
void RequestShortSlice() {
  struct SchedAttr {  // struct sched_attr (linux/sched/types.h), not in glibc 2.36
    uint32_t size;
    uint32_t sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
    uint32_t sched_util_min, sched_util_max;
  } attr{};
  attr.size = sizeof(attr);
  attr.sched_policy = SCHED_OTHER;
  attr.sched_runtime = 100'000;  // ns: the shortest slice the kernel takes
  (void)::syscall(SYS_sched_setattr, 0, &attr, 0);
}

// Completion context of one send or receive.
struct OpContext {
  Worker::Done done;
  std::string header;           // kept alive until the send completes
  bool* called_back = nullptr;  // set while the operation is being issued (see Issue)
};

// Issues one ucp operation: `start(ctx)` makes the call with `ctx` as its user data. UCX
// completes it in one of three ways: at once (a status, no callback), later (a request,
// then the callback), or, on some error paths (a receive from a peer that just failed),
// by running the callback before the call returns, a request pointer or not. In every case
// `done` runs exactly once and the context is freed once. The callback must call
// FinishOp.
template <typename Start>
void Issue(std::unique_ptr<OpContext> ctx, absl::string_view what, Start start) {
  bool called_back = false;
  ctx->called_back = &called_back;
  OpContext* raw = ctx.release();  // the callback frees it, if it runs
  const ucs_status_ptr_t r = start(raw);
  if (called_back) return;
  if (UCS_PTR_IS_PTR(r)) {
    raw->called_back = nullptr;  // the callback runs later
    return;
  }
  std::unique_ptr<OpContext> own(raw);
  own->done(FromUcs(UCS_PTR_STATUS(r), what));
}

// The callbacks' side of Issue: frees the request and the context, then runs `done`.
void FinishOp(void* request, ucs_status_t status, void* user_data, absl::string_view what) {
  std::unique_ptr<OpContext> ctx(static_cast<OpContext*>(user_data));
  ucp_request_free(request);
  if (ctx->called_back != nullptr) *ctx->called_back = true;
  ctx->done(FromUcs(status, what));
}

}  // namespace

std::string UcxNetDevices(const std::string& listen, const std::string& choice) {
  if (choice == "all") return "";
  if (choice != "auto") return choice;
  const std::string host = listen.substr(0, listen.rfind(':'));
  in_addr want{};
  if (::inet_pton(AF_INET, host.c_str(), &want) != 1 || want.s_addr == htonl(INADDR_ANY)) {
    return "";  // every interface (or a name UCX would resolve anyway)
  }
  if ((ntohl(want.s_addr) >> 24) == 127) return "lo";
  std::string devices;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if (reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr == want.s_addr) {
      devices = a->ifa_name;
      break;
    }
  }
  ::freeifaddrs(list);
  if (devices.empty()) return "";  // not an address of this host: let UCX report it
  std::error_code ec;
  for (const auto& dev : std::filesystem::directory_iterator("/sys/class/infiniband", ec)) {
    for (const auto& port : std::filesystem::directory_iterator(dev.path() / "ports", ec)) {
      absl::StrAppend(&devices, ",", dev.path().filename().string(), ":",
                      port.path().filename().string());
    }
  }
  return devices;
}

std::string LocalAddressToward(const std::string& target) {
  const size_t colon = target.rfind(':');
  if (colon == std::string::npos) return "";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(target.substr(0, colon).c_str(), target.substr(colon + 1).c_str(), &hints,
                    &found) != 0) {
    return "";
  }
  std::string local;
  // A datagram socket's connect sends nothing: it only picks the route and source address.
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_in self{};
  socklen_t len = sizeof(self);
  char text[INET_ADDRSTRLEN];
  if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&self), &len) == 0 &&
      ::inet_ntop(AF_INET, &self.sin_addr, text, sizeof(text)) != nullptr) {
    local = absl::StrCat(text, ":0");
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(found);
  return local;
}

namespace {

// UCX reads its TCP transport's settings from the environment alone (a ucp_config_modify
// of TCP_CONN_NB is accepted and ignored by 1.13): the default goes there, once.
void SetTcpDefaults() {
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("UCX_TCP_CONN_NB", kDefaultTcpConnectNonBlocking, 0); });
}

}  // namespace

void RestrictUcxDevices(const std::string& listen, const std::string& choice) {
  SetTcpDefaults();
  if (std::getenv("UCX_NET_DEVICES") != nullptr) return;
  const std::string devices = UcxNetDevices(listen, choice);
  if (!devices.empty()) ::setenv("UCX_NET_DEVICES", devices.c_str(), 1);
}

std::string Transports() {
  const char* tls = std::getenv("UCX_TLS");
  return tls != nullptr ? tls : kDefaultTransports;
}

absl::Status FromUcs(ucs_status_t status, absl::string_view what) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string msg = absl::StrCat("ucx ", what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_INVALID_PARAM:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

MemoryRegion::~MemoryRegion() {
  ucp_mem_unmap(context_, memh_);
  if (mapped_bytes_ > 0) ::munmap(data_, mapped_bytes_);
}

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create() {
  // A process's main sets it before it starts threads (RestrictUcxDevices); this covers
  // the rest (tests, benchmarks), whose first worker comes before their other threads.
  SetTcpDefaults();
  std::unique_ptr<Worker> w(new Worker());
  ucp_config_t* config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &config);
  if (s != UCS_OK) return FromUcs(s, "config");
  if (std::getenv("UCX_TLS") == nullptr) {
    s = ucp_config_modify(config, "TLS", kDefaultTransports);
    if (s != UCS_OK) {
      ucp_config_release(config);
      return FromUcs(s, "config TLS");
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  s = ucp_init(&params, config, &w->context_);
  ucp_config_release(config);
  if (s != UCS_OK) return FromUcs(s, "init");

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  s = ucp_worker_create(w->context_, &wp, &w->worker_);
  if (s != UCS_OK) return FromUcs(s, "worker create");

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  s = ucp_worker_get_address(w->worker_, &addr, &addr_len);
  if (s != UCS_OK) return FromUcs(s, "worker address");
  w->address_ = WrapUcxAddress({reinterpret_cast<const char*>(addr), addr_len});
  ucp_worker_release_address(w->worker_, addr);

  s = ucp_worker_get_efd(w->worker_, &w->ucx_fd_);
  if (s != UCS_OK) return FromUcs(s, "worker efd");
  w->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (w->wake_fd_ < 0) return absl::InternalError("eventfd failed");
  return w;
}

Worker::~Worker() {
  Stop();
  if (worker_ != nullptr) ucp_worker_destroy(worker_);
  if (context_ != nullptr) ucp_cleanup(context_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Worker::Stop() {
  if (thread_.joinable()) {
    RunSync([this] {
      while (!endpoints_.empty()) Close(endpoints_.begin()->first);
      for (AmMessage& m : arrived_) Release(m);
      arrived_.clear();
      failed_endpoints_.clear();
    });
    stop_ = true;
    Post([] {});
    thread_.join();
  }
}

void Worker::SetHandler(uint16_t id, Handler handler) {
  handlers_[id] = std::move(handler);
  slots_.push_back(std::make_unique<HandlerSlot>(HandlerSlot{this, id}));
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                 UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = &Worker::OnAm;
  p.arg = slots_.back().get();
  p.flags = UCP_AM_FLAG_PERSISTENT_DATA;
  ucp_worker_set_am_recv_handler(worker_, &p);
}

absl::Status Worker::Start() {
  thread_ = std::thread([this] {
    RequestShortSlice();
    Loop();
  });
  return absl::OkStatus();
}

ucs_status_t Worker::OnAm(void* arg, const void* header, size_t header_length, void* data,
                          size_t length, const ucp_am_recv_param_t* param) {
  auto* slot = static_cast<HandlerSlot*>(arg);
  // A message without the data plane's tag (ucx_auth.h) is dropped here, its payload with
  // it (UCS_OK: UCX releases an eager one and ends a rendezvous): no handler sees it.
  const std::optional<size_t> body =
      internal::Check(slot->id, absl::string_view(static_cast<const char*>(header), header_length));
  if (!body) return UCS_OK;
  AmMessage m;
  m.id = slot->id;
  if (*body > 0) m.header.assign(static_cast<const char*>(header), *body);
  m.length = length;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) m.reply_ep = param->reply_ep;
  ucs_status_t status = UCS_OK;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    m.rndv_desc = data;
    status = UCS_INPROGRESS;
  } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) {
    m.persistent = data;
    status = UCS_INPROGRESS;
  } else if (length > 0) {
    m.eager_copy.assign(static_cast<const char*>(data), length);
  }
  // Handlers run after ucp_worker_progress returns, where they may send and receive.
  slot->worker->arrived_.push_back(std::move(m));
  return status;
}

void Worker::Loop() {
  // NOTE: after any activity the loop keeps polling for kPoll before it sleeps on the event
  // fd, yielding the core between polls: a rendezvous transfer takes several hops, and a
  // fetch's next request follows its last reply within microseconds; sleeping between them
  // makes every hop pay a wake-up (in a VM, an idle vCPU's halt and an IPI to wake it).
  // Yielding instead of spinning lets what else is queued on that CPU (compute, the peer
  // process, the kernel's network work) run first (on EEVDF kernels, 6.6+, reliably; CFS
  // honours a yield more loosely), so polling seldom costs anyone a time slice.
  // Measured on 2 vCPUs: a 64 KiB fetch over TCP between namespaces 1.2-1.4 -> 2.2-2.5
  // GB/s (0.72-0.81 of ucx_perftest's polling), over shared memory 5 -> 8-11 GB/s, and the
  // 2-worker cluster_bench 7% less wall time a step; sleeping at once (what this loop did
  // while the CPUs were contended) and spinning without yielding (a 2-worker demo job: 6%
  // more wall time a step) both did worse. With nothing for kPoll it sleeps: a process
  // waiting for a peer costs no CPU.
  constexpr auto kPoll = std::chrono::microseconds(200);
  auto last_active = std::chrono::steady_clock::now();
  int busy_idle = 0;
  // One read takes the whole count of the wake eventfd (called only when it has one).
  const auto drain_wake = [this] {
    uint64_t drained;
    (void)::read(wake_fd_, &drained, sizeof(drained));
  };
  while (!stop_) {
    bool active = false;
    while (ucp_worker_progress(worker_) != 0) active = true;
    while (!arrived_.empty()) {
      AmMessage m = std::move(arrived_.front());
      arrived_.pop_front();
      auto it = handlers_.find(m.id);
      if (it != handlers_.end()) it->second(m);
      Release(m);  // whatever the handler did not take
    }
    const bool failures = !failed_endpoints_.empty();
    RunEndpointErrors();
    std::vector<std::function<void()>> posted;
    if (has_posted_.exchange(false, std::memory_order_acquire)) {  // no lock per poll
      std::lock_guard<std::mutex> lock(mu_);
      posted.swap(posted_);
    }
    for (auto& fn : posted) fn();
    if (active || failures || !posted.empty() || !arrived_.empty()) {
      last_active = std::chrono::steady_clock::now();
      busy_idle = 0;
      continue;
    }
    if (std::chrono::steady_clock::now() - last_active < kPoll) {
      sched_yield();
      continue;
    }
    pollfd fds[2] = {{ucx_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    // BUSY: UCX has work to progress that no event will announce (a rendezvous waiting for
    // the peer, sends queued behind a full FIFO). Arming again at once made a loop of
    // failing eventfd reads (~400k syscalls/s per worker on the 2-core cluster_bench, ~9%
    // of a demo job's CPU a step); after a second BUSY with no progress between, the loop naps
    // 20 us instead (the polling above has had its turn), and the peer gets the core.
    if (ucp_worker_arm(worker_) == UCS_ERR_BUSY) {
      if (++busy_idle < 2) continue;  // the first: progress may have work at once
      timespec nap{0, 20'000};
      if (::ppoll(&fds[1], 1, &nap, nullptr) > 0) drain_wake();  // or until work is posted
      continue;
    }
    if (::poll(fds, 2, 100) > 0 && (fds[1].revents & POLLIN) != 0) drain_wake();
  }
}

void Worker::Post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    posted_.push_back(std::move(fn));
    has_posted_.store(true, std::memory_order_release);
  }
  const uint64_t one = 1;
  ssize_t n = ::write(wake_fd_, &one, sizeof(one));
  (void)n;
}

void Worker::RunSync(const std::function<void()>& fn) {
  if (OnProgressThread() || !thread_.joinable()) {
    fn();
    return;
  }
  absl::Notification done;
  Post([&] {
    fn();
    done.Notify();
  });
  done.WaitForNotification();
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> Worker::Map(void* data, size_t size,
                                                          size_t mapped_bytes) {
  ucp_mem_map_params_t p{};
  p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  p.address = data;
  p.length = size;
  ucp_mem_h memh = nullptr;
  absl::Status status;
  RunSync([&] { status = FromUcs(ucp_mem_map(context_, &p, &memh), "mem map"); });
  if (!status.ok()) {
    if (mapped_bytes > 0) ::munmap(data, mapped_bytes);
    return status;
  }
  return std::unique_ptr<MemoryRegion>(
      new MemoryRegion(context_, memh, static_cast<uint8_t*>(data), size, mapped_bytes));
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> Worker::Allocate(size_t size, bool fault_in) {
  // Our own mapping, in 2 MiB pages where the kernel allows: shared-memory transports pin
  // and copy page by page, so huge pages make large transfers markedly faster.
  constexpr size_t kHugePage = 2 << 20;
  const size_t bytes = (std::max<size_t>(size, 1) + kHugePage - 1) / kHugePage * kHugePage;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot map ", size, " bytes"));
  }
  ::madvise(p, bytes, MADV_HUGEPAGE);
  // Fault every page in now, as an RDMA registration would (it pins them): first touches
  // zero whole huge pages, which would otherwise land on the data path, inside the first
  // transfers into each region (a store's arena fills over its first hundreds of puts).
  // A host without that much memory says so here (ENOMEM), not with an OOM kill later.
  if (fault_in && ::madvise(p, bytes, MADV_POPULATE_WRITE) != 0) {
    const int error = errno;
    if (error != EINVAL) {  // EINVAL: a kernel before 5.14, without MADV_POPULATE_WRITE
      ::munmap(p, bytes);
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot fault in ", size, " bytes of memory: ", std::strerror(error)));
    }
    for (size_t off = 0; off < bytes; off += 4096) static_cast<volatile uint8_t*>(p)[off] = 0;
  }
  return Map(p, size, bytes);
}

absl::StatusOr<std::unique_ptr<MemoryRegion>> Worker::Register(void* data, size_t size) {
  return Map(data, size, 0);
}

void Worker::OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status) {
  // Inside ucp_worker_progress, where the handler could not close the endpoint (closing
  // progresses the worker): the loop runs it after progress returns.
  auto* state = static_cast<EndpointState*>(arg);
  state->worker->failed_endpoints_.push_back({ep, state->id, status});
}

void Worker::RunEndpointErrors() {
  while (!failed_endpoints_.empty()) {
    const FailedEndpoint f = failed_endpoints_.front();
    failed_endpoints_.pop_front();
    auto it = endpoints_.find(f.ep);
    if (it == endpoints_.end() || it->second->id != f.id) continue;  // closed meanwhile
    // A copy: the handler may close the endpoint, which destroys its state.
    const std::function<void(absl::Status)> on_error = it->second->on_error;
    if (on_error) on_error(FromUcs(f.status, "peer failed"));
  }
}

absl::StatusOr<ucp_ep_h> Worker::Connect(const std::string& address,
                                         std::function<void(absl::Status)> on_error) {
  // A peer's address, checked before UCX reads it (ucp_ep_create trusts its bytes).
  ASSIGN_OR_RETURN(const absl::string_view raw, UnwrapUcxAddress(address));
  auto state =
      std::make_unique<EndpointState>(EndpointState{this, ++endpoint_ids_, std::move(on_error)});
  ucp_ep_params_t p{};
  // NOTE: peer-failure handling (UCP_ERR_HANDLING_MODE_PEER) would make UCX drop every
  // transport that cannot detect a dead peer — CMA among them, even with shared memory's
  // error handling on — and move rendezvous payloads through the shared-memory FIFO instead:
  // store_fetch_bench, 1 MiB fetches, 30 GB/s -> 5 GB/s. Pith detects dead peers with
  // request deadlines and coordinator leases instead; the error handler still reports what
  // UCX does notice.
  // UCX frees an endpoint it made for an incoming connection when the peer fails, and a
  // message the dead peer sent before, still queued, then names freed memory (the endpoint
  // ids on the wire are addresses in this mode): a server must own the endpoints its
  // clients' messages arrive on (an endpoint opened back to a peer becomes the one its
  // connection uses) and keep them open while the peer may still have messages on the way
  // (see store/data_plane.h).
  p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.address = reinterpret_cast<const ucp_address_t*>(raw.data());
  p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  p.err_handler.cb = &Worker::OnEndpointError;
  p.err_handler.arg = state.get();
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(worker_, &p, &ep);
  if (s != UCS_OK) return FromUcs(s, "connect");
  endpoints_[ep] = std::move(state);
  return ep;
}

void Worker::Close(ucp_ep_h ep) {
  auto it = endpoints_.find(ep);
  if (it == endpoints_.end()) return;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &p);
  if (UCS_PTR_IS_PTR(r)) {
    // A forced close waits for no peer and completes within a few progress calls; the bound
    // keeps a transport that never completes it from holding the progress thread, and with
    // it every request of the process. Freed unfinished, UCX releases it when it completes.
    const auto deadline = std::chrono::steady_clock::now() + kCloseBound;
    bool done = false;
    while (!(done = ucp_request_check_status(r) != UCS_INPROGRESS) &&
           std::chrono::steady_clock::now() < deadline) {
      ucp_worker_progress(worker_);
    }
    if (!done) {
      std::fprintf(stderr,
                   "pith ucx: an endpoint close did not complete within %lld ms; left "
                   "to finish in the background\n",
                   static_cast<long long>(kCloseBound / std::chrono::milliseconds(1)));
    }
    ucp_request_free(r);
  }
  closed_states_.push_back(std::move(it->second));
  endpoints_.erase(it);
}

void Worker::OnSendDone(void* request, ucs_status_t status, void* user_data) {
  FinishOp(request, status, user_data, "send");
}

void Worker::OnRecvDone(void* request, ucs_status_t status, size_t, void* user_data) {
  FinishOp(request, status, user_data, "receive");
}

void Worker::Send(ucp_ep_h ep, uint16_t id, std::string header, const void* data, size_t size,
                  ucp_mem_h memh, bool want_reply, Done done) {
  auto ctx =
      std::make_unique<OpContext>(OpContext{std::move(done), internal::Tag(id, std::move(header))});
  Issue(std::move(ctx), "send", [&](OpContext* c) {
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &Worker::OnSendDone;
    p.user_data = c;
    p.flags = want_reply ? UCP_AM_SEND_FLAG_REPLY : 0;
    if (memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    return ucp_am_send_nbx(ep, id, c->header.data(), c->header.size(), data, size, &p);
  });
}

void Worker::ReceiveData(AmMessage& m, void* buffer, ucp_mem_h memh, Done done) {
  if (m.rndv_desc == nullptr) {
    if (m.length > 0) std::memcpy(buffer, m.eager_data(), m.length);
    Release(m);
    done(absl::OkStatus());
    return;
  }
  auto ctx = std::make_unique<OpContext>(OpContext{std::move(done), {}});
  void* desc = std::exchange(m.rndv_desc, nullptr);  // UCX owns it from here on
  Issue(std::move(ctx), "receive", [&](OpContext* c) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &Worker::OnRecvDone;
    p.user_data = c;
    if (memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    return ucp_am_recv_data_nbx(worker_, desc, buffer, m.length, &p);
  });
}

void Worker::Release(AmMessage& m) {
  if (m.rndv_desc != nullptr) ucp_am_data_release(worker_, std::exchange(m.rndv_desc, nullptr));
  if (m.persistent != nullptr) ucp_am_data_release(worker_, std::exchange(m.persistent, nullptr));
}

}  // namespace pith::ucx
