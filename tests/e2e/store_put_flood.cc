// store_put_flood: a store client that keeps many large writes in flight to one pith-store
// until it is killed. store_e2e_test kills it with `kill -9` at random points to check that
// a store outlives clients that die with writes (rendezvous payloads) half-sent.
//
// Usage: store_put_flood <store grpc host:port> <blob bytes> <writes in flight> <tls dir>
//   (tls dir: a coordinator's or an admin's certificate directory)
// Logs "flooding" once the first batch is answered, then one line per 100 batches.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "common/grpc_util.h"
#include "grpcpp/grpcpp.h"
#include "pith/v1/store.grpc.pb.h"
#include "security/tls.h"
#include "server/store/store_client.h"

namespace pith::store {
namespace {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "store_put_flood: %s\n", status.ToString().c_str());
  return 1;
}

int Run(const std::string& target, size_t blob_bytes, int in_flight, const std::string& tls_dir) {
  auto security = security::TransportSecurity::Tls(tls_dir);
  if (!security.ok()) return Fail(security.status());
  auto stub = v1::StoreService::NewStub(
      NewChannel(target, security->ChannelCredentials(security::Role::kMember)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::UcxAddress address;
  absl::Status s = FromGrpcStatus(stub->GetUcxAddress(&ctx, v1::GetUcxAddressRequest(), &address));
  if (!s.ok()) return Fail(s);
  auto client = StoreClient::Create();
  if (!client.ok()) return Fail(client.status());
  auto peer = (*client)->Connect(address.worker_address());
  if (!peer.ok()) return Fail(peer.status());
  auto region = (*client)->AllocateBuffer(blob_bytes * in_flight);
  if (!region.ok()) return Fail(region.status());
  for (size_t i = 0; i < (*region)->size(); ++i) (*region)->data()[i] = static_cast<uint8_t>(i);
  std::vector<StoreClient::PutItem> items(in_flight);
  for (int i = 0; i < in_flight; ++i) {
    StoreClient::PutItem& item = items[i];
    item.peer = *peer;
    item.key.set_job_id("flood");
    item.key.set_layer(0);
    item.key.set_expert(i);
    item.key.set_kind(v1::BLOB_KIND_WEIGHTS);
    item.version = 1;  // a rewrite of a pending version replaces it: the store stays small
    item.data = (*region)->data() + i * blob_bytes;
    item.size = blob_bytes;
    item.memh = (*region)->handle();
  }
  for (int batch = 0;; ++batch) {
    s = (*client)->PutMany(absl::MakeSpan(items), absl::Seconds(30));
    if (!s.ok()) return Fail(s);
    if (batch % 100 == 0) {
      std::printf(batch == 0 ? "flooding\n" : "batch %d\n", batch);
      std::fflush(stdout);
    }
  }
}

}  // namespace
}  // namespace pith::store

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr,
                 "usage: store_put_flood <store grpc host:port> <blob bytes> <in flight> "
                 "<tls dir>\n");
    return 2;
  }
  return pith::store::Run(argv[1], std::strtoull(argv[2], nullptr, 10), std::atoi(argv[3]),
                          argv[4]);
}
