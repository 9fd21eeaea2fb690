// What the gRPC handler fuzz targets share: requests made of a valid base message with the
// fuzzer's bytes merged over it (so most inputs reach past the first check), and the
// rules every answer obeys whatever was asked.
#ifndef PITH_TESTS_FUZZ_RPC_FUZZ_H_
#define PITH_TESTS_FUZZ_RPC_FUZZ_H_

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "grpcpp/grpcpp.h"

namespace pith::fuzz {

// Protobuf's parse errors (invalid UTF-8 in a string field) are expected here: unlogged.
inline void QuietProtobuf() { google::protobuf::SetLogHandler(nullptr); }

// `base`, or nothing, with up to 512 of the fuzzer's bytes parsed over it. A parse that
// stops halfway still leaves a message to send, as a hostile client's would be.
template <typename Message>
Message Request(const Message& base, FuzzedDataProvider& in) {
  Message m;
  if (in.ConsumeBool()) m = base;
  (void)m.MergeFromString(in.ConsumeRandomLengthString(512));
  return m;
}

// A handler answers every request with OK or an error that says what is wrong: never
// UNKNOWN (an exception or an unset status), never INTERNAL (a bug, or a tier failing,
// which these in-memory worlds never do), never an empty message.
inline void CheckAnswer(const char* method, const grpc::Status& s) {
  if (s.ok()) return;
  const bool bad = s.error_code() == grpc::StatusCode::UNKNOWN ||
                   s.error_code() == grpc::StatusCode::INTERNAL || s.error_message().empty();
  if (!bad) return;
  std::fprintf(stderr, "%s answered code %d: \"%s\"\n", method, static_cast<int>(s.error_code()),
               s.error_message().c_str());
  __builtin_trap();
}

// A check every state must pass; `what` says which.
inline void Require(bool holds, const char* what) {
  if (holds) return;
  std::fprintf(stderr, "broken: %s\n", what);
  __builtin_trap();
}

}  // namespace pith::fuzz

#endif  // PITH_TESTS_FUZZ_RPC_FUZZ_H_
