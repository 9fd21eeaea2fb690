// UCX (ucp) behind a small RAII surface: a context + worker driven by one progress thread,
// endpoints, memory registrations, and active messages with rendezvous payloads received
// straight into caller memory. Nothing here assumes a transport: UCX picks TCP, RDMA or
// CMA by itself (but not its shared-memory FIFOs: see kDefaultTransports); Pith only uses
// active messages, which are fast on all of them (one-sided RMA is only emulated over TCP,
// and slowly).
//
// Threading: every ucp call happens on the worker's progress thread. Handlers and
// completion callbacks run there; other threads hand work over with Post() or RunSync().
// Methods marked "progress thread" must only be called from it.
#ifndef PITH_COMMON_UCX_H_
#define PITH_COMMON_UCX_H_

#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pith::ucx {

absl::Status FromUcs(ucs_status_t status, absl::string_view what);

// UCX_TLS unless the environment sets it: every transport but the shared-memory FIFOs
// (posix, sysv, xpmem). A sender reserves a slot in its receiver's FIFO, fills it, then
// marks it ready; one killed in between (kill -9, the OOM killer) leaves a slot that never
// becomes ready, and the receiver, which reads its FIFO in order, never gets another
// message from anyone: a store or worker that outlives a dead peer goes deaf for good
// (store_e2e_test's killed flood clients: deaf after 95 and 144 kills; 400 without these
// transports). Peers on one host then talk over TCP loopback, with payloads still moved
// by CMA (process_vm_readv), which fails cleanly when its peer is gone.
inline constexpr char kDefaultTransports[] = "^mm";
// The UCX transports this process uses: UCX_TLS, or kDefaultTransports.
std::string Transports();
// UCX_TCP_CONN_NB unless the environment sets it. UCX 1.13's TCP transport otherwise opens
// an endpoint with a blocking connect(): one to a host that stopped answering (its link
// cut, the machine gone) held the progress thread, and every request of the process behind
// it, for the kernel's ARP timeout (3 s on a shared subnet, each time) or its SYN retries
// (about 2 minutes across routers). Non-blocking, the endpoint is made at once and its
// failure arrives as an endpoint error (ucx_connect_test). UCX keeps it off by default as
// many simultaneous connects can overflow a listener's backlog into resets; UCX retries
// those (UCX_TCP_MAX_CONN_RETRIES), and Pith's processes open a few endpoints each.
inline constexpr char kDefaultTcpConnectNonBlocking[] = "y";

class Worker;

// The network devices UCX may use (UCX_NET_DEVICES) for a process whose gRPC listens on
// `listen` ("host:port"), `choice` being its --ucx_net_devices: "auto" restricts them to
// what `listen` names (a loopback host: "lo"; another specific address: the interface
// holding it, plus every RDMA port under /sys/class/infiniband, so RDMA stays in use;
// 0.0.0.0 or a host name: every device); "all" restricts nothing; anything else is a
// UCX device list, used as given. Empty: leave UCX's default.
std::string UcxNetDevices(const std::string& listen, const std::string& choice);
// This host's address on the route to `target` ("host:port"), as "a.b.c.d:0" (loopback
// for a local target); empty if it cannot be found.
std::string LocalAddressToward(const std::string& target);
// Sets UCX_NET_DEVICES from UcxNetDevices before any Worker is created, unless the
// environment already sets it, and UCX_TCP_CONN_NB (kDefaultTcpConnectNonBlocking). Call
// from main(), before any thread starts (setenv races with other threads' getenv).
void RestrictUcxDevices(const std::string& listen, const std::string& choice);

// Memory registered with UCX (ucp_mem_map), allocated by UCX or borrowed; unregistered
// (and freed when allocated) on destruction, which must happen before the Worker's.
class MemoryRegion {
 public:
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  ucp_mem_h handle() const { return memh_; }

 private:
  friend class Worker;
  MemoryRegion(ucp_context_h context, ucp_mem_h memh, uint8_t* data, size_t size,
               size_t mapped_bytes)
      : context_(context), memh_(memh), data_(data), size_(size), mapped_bytes_(mapped_bytes) {}
  ucp_context_h context_;
  ucp_mem_h memh_;
  uint8_t* data_;
  size_t size_;
  size_t mapped_bytes_;  // > 0 when this region owns an mmap of that many bytes
};

// An incoming active message, as a handler sees it. The payload is either in `eager`
// (small messages) or still at the sender (rendezvous): then the handler calls
// Worker::ReceiveData to land it in its own memory, or Worker::Release to refuse it.
struct AmMessage {
  AmMessage() = default;
  // Moving hands the payload over: the moved-from message holds none (nothing to release).
  AmMessage(AmMessage&& other) noexcept { *this = std::move(other); }
  AmMessage& operator=(AmMessage&& other) noexcept {
    id = other.id;
    header = std::move(other.header);
    reply_ep = other.reply_ep;
    length = other.length;
    rndv_desc = std::exchange(other.rndv_desc, nullptr);
    persistent = std::exchange(other.persistent, nullptr);
    eager_copy = std::move(other.eager_copy);
    return *this;
  }
  AmMessage(const AmMessage&) = delete;
  AmMessage& operator=(const AmMessage&) = delete;

  uint16_t id = 0;
  std::string header;
  ucp_ep_h reply_ep = nullptr;
  size_t length = 0;
  void* rndv_desc = nullptr;   // set for a rendezvous payload not yet received
  void* persistent = nullptr;  // eager payload UCX keeps until released
  std::string eager_copy;      // eager payload copied out of UCX
  const uint8_t* eager_data() const {
    return persistent ? static_cast<const uint8_t*>(persistent)
                      : reinterpret_cast<const uint8_t*>(eager_copy.data());
  }
  bool has_rndv() const { return rndv_desc != nullptr; }
};

class Worker {
 public:
  using Handler = std::function<void(AmMessage&)>;
  using Done = std::function<void(absl::Status)>;

  // A context and worker with active messages and wakeup; UCX_* environment variables
  // (UCX_TLS, ...) apply.
  static absl::StatusOr<std::unique_ptr<Worker>> Create();
  // Closes every endpoint (cancelling what is in flight; completions still run), then
  // stops the progress thread. Idempotent. Memory regions may be destroyed after it.
  void Stop();
  // Stop(), then releases the worker and context.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Registers the handler of active-message `id`; call before Start().
  void SetHandler(uint16_t id, Handler handler);
  absl::Status Start();

  // The packed worker address peers connect to.
  const std::string& address() const { return address_; }

  // Thread-safe: allocates and registers `size` bytes, or registers caller memory. With
  // `fault_in` every page is faulted in now (RESOURCE_EXHAUSTED when the host has not that
  // much memory): for long-lived regions that will be used whole (a RAM tier, a cache).
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Allocate(size_t size, bool fault_in = true);
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Register(void* data, size_t size);

  // Thread-safe: runs `fn` on the progress thread soon.
  void Post(std::function<void()> fn);
  // Thread-safe, not from the progress thread: runs `fn` there and waits for it.
  void RunSync(const std::function<void()>& fn);
  bool OnProgressThread() const { return std::this_thread::get_id() == thread_.get_id(); }

  // --- progress thread only ----------------------------------------------------------
  // An endpoint to the worker at `address`; `on_error` runs (on the progress thread, outside
  // UCX's progress: it may Close the endpoint) when the peer fails. Outstanding operations
  // on it then complete with an error.
  absl::StatusOr<ucp_ep_h> Connect(const std::string& address,
                                   std::function<void(absl::Status)> on_error);
  // Closes an endpoint (forcefully: outstanding operations are cancelled). Progresses the
  // worker until the close completes, kCloseBound at most: not from a send or receive
  // completion.
  void Close(ucp_ep_h ep);
  static constexpr std::chrono::milliseconds kCloseBound{2000};
  // Sends active message `id` with `header` and `size` bytes of payload from `data` (which
  // must stay valid until `done` runs; memh, when given, is its registration). With
  // `want_reply` the receiver gets a reply endpoint.
  void Send(ucp_ep_h ep, uint16_t id, std::string header, const void* data, size_t size,
            ucp_mem_h memh, bool want_reply, Done done);
  // Receives a rendezvous payload of `message` into `buffer` (length bytes).
  void ReceiveData(AmMessage& message, void* buffer, ucp_mem_h memh, Done done);
  // Drops a payload the handler does not want.
  void Release(AmMessage& message);

 private:
  Worker() = default;
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param);
  static void OnSendDone(void* request, ucs_status_t status, void* user_data);
  static void OnRecvDone(void* request, ucs_status_t status, size_t length, void* user_data);
  static void OnEndpointError(void* arg, ucp_ep_h ep, ucs_status_t status);
  void Loop();
  absl::StatusOr<std::unique_ptr<MemoryRegion>> Map(void* data, size_t size, size_t mapped_bytes);

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::string address_;
  int wake_fd_ = -1;  // eventfd: Post() wakes the loop
  int ucx_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};

  struct HandlerSlot {
    Worker* worker;
    uint16_t id;
  };
  std::map<uint16_t, Handler> handlers_;
  std::vector<std::unique_ptr<HandlerSlot>> slots_;
  std::deque<AmMessage> arrived_;  // progress thread only

  std::mutex mu_;
  std::vector<std::function<void()>> posted_;  // guarded by mu_
  std::atomic<bool> has_posted_{false};        // posted_ may be non-empty

  struct EndpointState {
    Worker* worker;
    uint64_t id;  // tells a closed endpoint's failure from a later one's at the same address
    std::function<void(absl::Status)> on_error;
  };
  std::map<ucp_ep_h, std::unique_ptr<EndpointState>> endpoints_;  // progress thread only
  uint64_t endpoint_ids_ = 0;                                     // progress thread only
  // The states of closed endpoints: UCX may still call an endpoint's error handler after
  // its close, as late as ucp_worker_destroy (over TCP, a peer's socket closing marks it
  // failed), so a state lives until the worker is destroyed (a member: freed after the
  // destructor's body). A few dozen bytes per endpoint ever closed.
  std::vector<std::unique_ptr<EndpointState>> closed_states_;  // progress thread only
  struct FailedEndpoint {
    ucp_ep_h ep;
    uint64_t id;
    ucs_status_t status;
  };
  std::deque<FailedEndpoint> failed_endpoints_;  // progress thread only
  void RunEndpointErrors();
};

}  // namespace pith::ucx

#endif  // PITH_COMMON_UCX_H_
