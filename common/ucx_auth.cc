#include "common/ucx_auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <algorithm>
#include <atomic>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "glog/logging.h"

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
  // Counted on /metrics; said in the log too, now and then: a member whose peers drop its
  // messages sees only timeouts.
  LOG_EVERY_N(WARNING, 1000)
      << "dropped a UCX message without this cluster's tag (" << google::COUNTER
      << " so far): from a peer without the cluster's key (a stranger, or a member holding a "
         "key of a coordinator whose data was replaced), or damaged on the wire";
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

// Set once OpenSSL has cleaned up at exit: a thread ending after that leaks its context
// rather than free it into state that is gone.
std::atomic<bool> g_openssl_gone{false};

// HMAC-SHA256 of id (little-endian) || header under `key`, by a context each thread keys
// once per data-plane key and resets per message: the one-shot HMAC() this replaced keyed
// a new context for every message (1.19 us a 100-byte message on the 2-core VM; reset,
// 0.23 us), and every UCX message of a TLS cluster is tagged once and checked once.
class ThreadMac {
 public:
  ThreadMac() = default;
  ~ThreadMac() {
    if (!g_openssl_gone.load(std::memory_order_acquire)) EVP_MAC_CTX_free(ctx_);
  }
  ThreadMac(const ThreadMac&) = delete;
  ThreadMac& operator=(const ThreadMac&) = delete;

  // False when OpenSSL could not compute it.
  bool Compute(const std::shared_ptr<const std::string>& key, uint16_t id, absl::string_view header,
               unsigned char out[EVP_MAX_MD_SIZE]) {
    const bool ready = key == key_ ? EVP_MAC_init(ctx_, nullptr, 0, nullptr) == 1 : Rekey(key);
    if (!ready) return false;
    const unsigned char id_bytes[2] = {static_cast<unsigned char>(id & 0xff),
                                       static_cast<unsigned char>(id >> 8)};
    size_t len = 0;
    return EVP_MAC_update(ctx_, id_bytes, sizeof(id_bytes)) == 1 &&
           EVP_MAC_update(ctx_, reinterpret_cast<const unsigned char*>(header.data()),
                          header.size()) == 1 &&
           EVP_MAC_final(ctx_, out, &len, EVP_MAX_MD_SIZE) == 1 && len >= kAuthTagBytes;
  }

 private:
  bool Rekey(const std::shared_ptr<const std::string>& key) {
    static EVP_MAC* const hmac = [] {  // process-wide
      OPENSSL_atexit([] { g_openssl_gone.store(true, std::memory_order_release); });
      return EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    }();
    EVP_MAC_CTX_free(ctx_);
    key_ = nullptr;
    ctx_ = hmac != nullptr ? EVP_MAC_CTX_new(hmac) : nullptr;
    if (ctx_ == nullptr) return false;
    char digest[] = "SHA256";
    const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                                 OSSL_PARAM_construct_end()};
    if (EVP_MAC_init(ctx_, reinterpret_cast<const unsigned char*>(key->data()), key->size(),
                     params) != 1) {
      return false;  // key_ stays null: the next message keys again
    }
    key_ = key;  // held, so a new key can never reuse its address unnoticed
    return true;
  }

  std::shared_ptr<const std::string> key_;
  EVP_MAC_CTX* ctx_ = nullptr;
};

// False when OpenSSL could not compute it (then no tag matches: see Check).
bool Mac(const std::shared_ptr<const std::string>& key, uint16_t id, absl::string_view header,
         unsigned char out[EVP_MAX_MD_SIZE]) {
  thread_local ThreadMac mac;
  if (!mac.Compute(key, id, header, out)) {
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
  (void)Mac(key, id, header, mac);  // on failure a tag no receiver accepts
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
  if (!Mac(key, id, header.substr(0, body), mac) ||
      CRYPTO_memcmp(mac, header.data() + body, kAuthTagBytes) != 0) {
    CountDrop();
    return std::nullopt;
  }
  return body;
}

}  // namespace internal
}  // namespace pith::ucx
