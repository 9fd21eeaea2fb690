// Tests only: `n` PeerGroups in one process over UCX loopback, joined as ranks 0..n-1 of
// attempt `attempt`.
#ifndef PITH_WORKER_RUNTIME_PEER_GROUP_TESTING_H_
#define PITH_WORKER_RUNTIME_PEER_GROUP_TESTING_H_

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/peer_group.h"

namespace pith::runtime {

inline std::vector<std::unique_ptr<PeerGroup>> JoinedPeerGroups(int n, uint64_t attempt = 1) {
  std::vector<std::unique_ptr<PeerGroup>> g;
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    auto p = PeerGroup::Create();
    EXPECT_TRUE(p.ok()) << p.status();
    addresses.push_back((*p)->address());
    g.push_back(std::move(*p));
  }
  for (int i = 0; i < n; ++i) EXPECT_TRUE(g[i]->Join(i, addresses, attempt).ok());
  return g;
}

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_PEER_GROUP_TESTING_H_
