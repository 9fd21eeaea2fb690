#include "security/client_limits.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace pith::security {

ClientLimits::ClientLimits(Options options, Clock clock)
    : options_(options), clock_(std::move(clock)) {}

ClientLimits::Client& ClientLimits::ClientLocked(const std::string& client, absl::Time now) {
  auto it = clients_.find(client);
  if (it == clients_.end()) {
    if (clients_.size() >= kMaxTrackedClients) {
      // Forget the client idle longest that holds no stream (a stream's count must stay).
      auto idle = clients_.end();
      for (auto c = clients_.begin(); c != clients_.end(); ++c) {
        if (c->second.streams == 0 &&
            (idle == clients_.end() || c->second.last_use < idle->second.last_use)) {
          idle = c;
        }
      }
      if (idle != clients_.end()) clients_.erase(idle);
    }
    it = clients_.emplace(client, Client{static_cast<double>(options_.burst), now, 0, now}).first;
  }
  it->second.last_use = now;
  return it->second;
}

absl::Status ClientLimits::Admit(const std::string& client) {
  if (options_.requests_per_second <= 0) return absl::OkStatus();
  const absl::Time now = clock_();
  absl::MutexLock lock(&mu_);
  Client& c = ClientLocked(client, now);
  c.tokens = std::min<double>(options_.burst, c.tokens + absl::ToDoubleSeconds(now - c.refilled) *
                                                             options_.requests_per_second);
  c.refilled = now;
  if (c.tokens < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat(client, " makes more than ", options_.requests_per_second,
                     " requests a second (burst ", options_.burst, "); slow down"));
  }
  c.tokens -= 1;
  return absl::OkStatus();
}

absl::StatusOr<ClientLimits::StreamSlot> ClientLimits::OpenStream(const std::string& client) {
  StreamSlot slot;
  if (options_.streams <= 0) return slot;
  absl::MutexLock lock(&mu_);
  Client& c = ClientLocked(client, clock_());
  if (c.streams >= options_.streams) {
    return absl::ResourceExhaustedError(
        absl::StrCat(client, " holds ", c.streams, " streams open already (the most allowed)"));
  }
  ++c.streams;
  // The slot finds its client again by name: the entry is never forgotten while it holds
  // a stream.
  slot.release_ = std::unique_ptr<void, std::function<void(void*)>>(this, [this, client](void*) {
    absl::MutexLock lock(&mu_);
    auto it = clients_.find(client);
    if (it != clients_.end() && it->second.streams > 0) --it->second.streams;
  });
  return slot;
}

size_t ClientLimits::tracked() {
  absl::MutexLock lock(&mu_);
  return clients_.size();
}

}  // namespace pith::security
