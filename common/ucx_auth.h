// Authentication of the UCX data plane (DESIGN §8): once this process has the cluster's
// data-plane key (handed to members over mutual TLS when they register), every active
// message any ucx::Worker of the process sends carries a tag, HMAC-SHA256 of its message
// id and header truncated to kAuthTagBytes, and every message that arrives without the
// right tag is dropped before a handler sees it: a peer that does not hold the key gets
// no answer and changes nothing. Authenticated, not encrypted: payloads travel in the
// clear, and a header is not bound to its payload beyond the CRC32C it carries.
//
// Process-wide, as the key is the cluster's: Require() (a cluster member with TLS, at
// start) drops every message until SetKey(); without either, messages carry no tag and
// none is checked (plaintext clusters on loopback, standalone stores in tests).
//
// Thread safety: every function is thread-safe (the progress threads tag and check).
#ifndef PITH_COMMON_UCX_AUTH_H_
#define PITH_COMMON_UCX_AUTH_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace pith::ucx {

inline constexpr size_t kAuthTagBytes = 16;
// Bytes of a data-plane key (MakeDataPlaneKey).
inline constexpr size_t kDataPlaneKeyBytes = 32;

// Messages are dropped until SetKey.
void RequireDataPlaneAuth();
// From now on messages are tagged and checked with `key` (kDataPlaneKeyBytes); an empty
// key is ignored.
void SetDataPlaneKey(const std::string& key);
bool DataPlaneAuthActive();
// Messages dropped for a missing or wrong tag, since the process started.
uint64_t DroppedUnauthenticated();
// Called once per message dropped (on the thread that received it; keep it cheap), for
// the process's metrics. Replaces the one set before.
void OnUnauthenticatedDrop(std::function<void()> hook);
// A fresh random key (OpenSSL's RNG).
std::string MakeDataPlaneKey();

namespace internal {
// `header` with its tag appended (unchanged when auth is off).
std::string Tag(uint16_t id, std::string header);
// The length of `header` without its tag when the tag is right (the whole length when
// auth is off); nullopt when the message must be dropped (counted).
std::optional<size_t> Check(uint16_t id, absl::string_view header);
}  // namespace internal

}  // namespace pith::ucx

#endif  // PITH_COMMON_UCX_AUTH_H_
