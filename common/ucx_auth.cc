#include "common/ucx_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <algorithm>
#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace pith::ucx {
namespace {

struct AuthState {
  absl::Mutex mu;
  bool required ABSL_GUARDED_BY(mu) = false;
  std::shared_ptr<const std::string> key ABSL_GUARDED_BY(mu);
  std::function<void()> on_drop ABSL_GUARDED_BY(mu);
};

AuthState& State() {
  static auto* state = new AuthState();
  return *state;
}

std::atomic<uint64_t> g_dropped{0};

void CountDrop() {
  g_dropped.fetch_add(1, std::memory_order_relaxed);
  std::function<void()> hook;
  {
    AuthState& s = State();
    absl::MutexLock lock(&s.mu);
    hook = s.on_drop;
  }
  if (hook) hook();
}

// (required, key): the key is copied out by pointer, so the tag is computed unlocked.
std::pair<bool, std::shared_ptr<const std::string>> Snapshot() {
  AuthState& s = State();
  absl::MutexLock lock(&s.mu);
  return {s.required, s.key};
}

// False when OpenSSL could not compute it (then no tag matches: see Check).
bool Mac(const std::string& key, uint16_t id, absl::string_view header,
         unsigned char out[EVP_MAX_MD_SIZE]) {
  std::string message(2 + header.size(), '\0');  // id (little-endian) || header
  message[0] = static_cast<char>(id & 0xff);
  message[1] = static_cast<char>(id >> 8);
  std::copy(header.begin(), header.end(), message.begin() + 2);
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), out,
           &len) == nullptr ||
      len < kAuthTagBytes) {
    std::fill(out, out + EVP_MAX_MD_SIZE, 0);
    return false;
  }
  return true;
}

}  // namespace

void RequireDataPlaneAuth() {
  AuthState& s = State();
  absl::MutexLock lock(&s.mu);
  s.required = true;
}

void SetDataPlaneKey(const std::string& key) {
  if (key.empty()) return;
  AuthState& s = State();
  absl::MutexLock lock(&s.mu);
  s.required = true;
  s.key = std::make_shared<const std::string>(key);
}

bool DataPlaneAuthActive() { return Snapshot().first; }

uint64_t DroppedUnauthenticated() { return g_dropped.load(std::memory_order_relaxed); }

void OnUnauthenticatedDrop(std::function<void()> hook) {
  AuthState& s = State();
  absl::MutexLock lock(&s.mu);
  s.on_drop = std::move(hook);
}

std::string MakeDataPlaneKey() {
  std::string key(kDataPlaneKeyBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(key.data()), static_cast<int>(key.size())) != 1) {
    return std::string();
  }
  return key;
}

namespace internal {

std::string Tag(uint16_t id, std::string header) {
  auto [required, key] = Snapshot();
  if (key == nullptr) return header;
  unsigned char mac[EVP_MAX_MD_SIZE];
  (void)Mac(*key, id, header, mac);  // on failure a tag no receiver accepts
  header.append(reinterpret_cast<const char*>(mac), kAuthTagBytes);
  return header;
}

std::optional<size_t> Check(uint16_t id, absl::string_view header) {
  auto [required, key] = Snapshot();
  if (!required) return header.size();
  if (key == nullptr || header.size() < kAuthTagBytes) {
    CountDrop();
    return std::nullopt;
  }
  const size_t body = header.size() - kAuthTagBytes;
  unsigned char mac[EVP_MAX_MD_SIZE];
  // A tag that cannot be computed here matches nothing (never the zeros Mac leaves).
  if (!Mac(*key, id, header.substr(0, body), mac) ||
      CRYPTO_memcmp(mac, header.data() + body, kAuthTagBytes) != 0) {
    CountDrop();
    return std::nullopt;
  }
  return body;
}

}  // namespace internal
}  // namespace pith::ucx
