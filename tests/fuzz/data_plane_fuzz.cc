// libFuzzer target: what a peer can send a store's data plane, before any UCX or disk is
// involved. The first byte picks the message (hello, fetch request, put request), the rest
// is parsed as it, and the store's checks run on it as the data plane runs them: the
// hello's address envelope, every key's validation. Nothing may crash; every key that
// passes validation must survive the store's key encoding (decode(encode(k)) == k, the
// encoding sorting by job); and any bytes read back as an encoded key (what the index
// holds) decode to a valid key or INVALID_ARGUMENT.
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "common/ucx_address.h"
#include "google/protobuf/util/message_differencer.h"
#include "pith/v1/store.pb.h"
#include "server/store/blob_key.h"

namespace {

void CheckKey(const pith::v1::BlobKey& key) {
  if (!pith::store::ValidateBlobKey(key).ok()) return;
  const std::string encoded = pith::store::EncodeBlobKey(key);
  absl::StatusOr<pith::v1::BlobKey> decoded = pith::store::DecodeBlobKey(encoded);
  if (!decoded.ok()) __builtin_trap();
  pith::v1::BlobKey expected = key;
  if (expected.layer() < 0) expected.set_expert(0);  // dense keys carry no expert
  if (expected.layer() >= 0) expected.clear_tensor();
  expected.DiscardUnknownFields();  // fields of no meaning to the store are not encoded
  if (!google::protobuf::util::MessageDifferencer::Equals(*decoded, expected)) __builtin_trap();
  if (!absl::StartsWith(encoded, pith::store::JobKeyPrefix(key.job_id()))) __builtin_trap();
  (void)pith::store::BlobKeyDebugString(key);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: {
      pith::v1::UcxHello hello;
      if (hello.ParseFromString(body)) (void)pith::UnwrapUcxAddress(hello.worker_address());
      break;
    }
    case 1: {
      pith::v1::UcxGetRequest request;
      if (!request.ParseFromString(body)) break;
      for (const pith::v1::UcxGetItem& item : request.items()) CheckKey(item.key());
      break;
    }
    case 2: {
      pith::v1::UcxPutRequest request;
      if (request.ParseFromString(body)) CheckKey(request.key());
      break;
    }
    default: {
      absl::StatusOr<pith::v1::BlobKey> key = pith::store::DecodeBlobKey(body);
      if (key.ok() && !pith::store::ValidateBlobKey(*key).ok()) __builtin_trap();
      if (!key.ok() && key.status().code() != absl::StatusCode::kInvalidArgument) {
        __builtin_trap();
      }
    }
  }
  return 0;
}
