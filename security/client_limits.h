// Per-client limits of the job API: a request rate (a token bucket per client) and the
// streams (watches, downloads) a client holds open at once, so that one client's loop or
// flood cannot starve the others or the coordinator. A client is its certificate's or
// token's identity (role and name), or, without TLS, its peer host.
//
// The clients tracked are bounded (kMaxTrackedClients): past that the one idle longest is
// forgotten (its bucket starts full again), so a flood of identities costs bounded memory.
//
// Thread safety: thread-safe; StreamSlot is released by its destructor on any thread.
#ifndef PITH_SECURITY_CLIENT_LIMITS_H_
#define PITH_SECURITY_CLIENT_LIMITS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pith::security {

inline constexpr size_t kMaxTrackedClients = 10000;

class ClientLimits {
 public:
  struct Options {
    double requests_per_second = 100;  // sustained, per client; <= 0: unlimited
    int burst = 200;                   // requests a client may make at once
    int streams = 16;                  // streams a client holds open at once; <= 0: unlimited
  };
  using Clock = std::function<absl::Time()>;
  explicit ClientLimits(
      Options options, Clock clock = [] { return absl::Now(); });

  // Takes one request of `client`'s rate: RESOURCE_EXHAUSTED (naming the limit) when its
  // bucket is empty.
  absl::Status Admit(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);

  // One of `client`'s streams, held until the slot is destroyed (which must be before
  // this ClientLimits is); RESOURCE_EXHAUSTED when it holds Options::streams already.
  class StreamSlot {
   public:
    StreamSlot() = default;
    StreamSlot(StreamSlot&&) = default;
    StreamSlot& operator=(StreamSlot&&) = default;
    ~StreamSlot() = default;

   private:
    friend class ClientLimits;
    std::unique_ptr<void, std::function<void(void*)>> release_;
  };
  absl::StatusOr<StreamSlot> OpenStream(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);

  // Clients tracked now (for tests).
  size_t tracked() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Client {
    double tokens = 0;
    absl::Time refilled;
    int streams = 0;
    absl::Time last_use;
  };
  Client& ClientLocked(const std::string& client, absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  const Clock clock_;
  absl::Mutex mu_;
  std::map<std::string, Client> clients_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pith::security

#endif  // PITH_SECURITY_CLIENT_LIMITS_H_
