// PeerGroup: the workers of one job talking point to point over UCX active messages.
// Messages carry (attempt, source rank, tag) and land in a mailbox that Receive() waits
// on; the collectives a step needs are built on top: a deterministic all-reduce (every
// rank sums the contributions in rank order, so all end with the same bits).
//
// Attempts (the job's assignment versions, which only grow): a step attempt that is
// aborted leaves messages in flight. SetAttempt() starts a new one: messages of older
// attempts are dropped, while those of newer ones (a peer that got there first) are kept.
//
// Thread safety: all methods are thread-safe; Receive and the collectives block the
// calling thread (never the UCX progress thread).
#ifndef PITH_WORKER_RUNTIME_PEER_GROUP_H_
#define PITH_WORKER_RUNTIME_PEER_GROUP_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/ucx.h"

namespace pith::runtime {

// How long a step waits for a peer's message before it gives up on the step (the abort
// watch usually ends the wait sooner: AbandonAttempt).
inline constexpr absl::Duration kPeerReceiveTimeout = absl::Seconds(120);

// A step's failure that a peer caused (its endpoint failed, or it sent nothing within
// the wait) carries the peer's rank as a payload: the failure report names that worker
// (StepWrittenRequest.unreachable_worker_id), and the coordinator holds the job until it
// knows whether the worker is dead instead of counting the attempt against the job.
inline constexpr char kUnreachablePeerPayload[] = "pith.dev/unreachable-peer";
// `status` (not OK) marked as caused by rank `rank`; the first rank marked stays.
absl::Status WithUnreachablePeer(absl::Status status, int rank);
// The rank a status was marked with; -1 for none.
int UnreachablePeer(const absl::Status& status);

class PeerGroup {
 public:
  static absl::StatusOr<std::unique_ptr<PeerGroup>> Create();
  ~PeerGroup();

  // The packed UCX address peers connect to (published as MemberInfo.ucx_address).
  const std::string& address() const { return worker_->address(); }

  // Joins a group: this worker is `rank` of `addresses.size()`; the others are reached
  // through the connections kept from earlier groups, or new ones. Starts attempt
  // `attempt`.
  absl::Status Join(int rank, const std::vector<std::string>& addresses, uint64_t attempt);
  int rank() const { return rank_; }
  int world() const { return world_; }
  // Starts attempt `attempt` (no older than the current one).
  void SetAttempt(uint64_t attempt);
  // Gives up the current attempt (it was aborted): every Receive waiting on it returns
  // UNAVAILABLE now, and so does every later one until the next Join or SetAttempt starts
  // an attempt that was not abandoned (AbandonAttempt).
  void Abandon();
  // Abandon() if the current attempt is still `attempt` (a later one is left alone); and
  // when SetAttempt or Join next starts `attempt` (the current one again, or one not
  // started yet: an abort or a stop seen before a run's setup joined), it starts
  // abandoned. Only that attempt: a newer one starts afresh and forgets the mark.
  // True when `attempt` was the current one.
  bool AbandonAttempt(uint64_t attempt);

  // Sends `bytes` to `peer` under `tag` (the bytes are kept until sent).
  absl::Status Send(int peer, uint64_t tag, std::string bytes);
  // The message `peer` sent under `tag` in this attempt. DEADLINE_EXCEEDED after
  // `timeout`; UNAVAILABLE when the peer failed or the attempt changed meanwhile.
  absl::StatusOr<std::string> Receive(int peer, uint64_t tag,
                                      absl::Duration timeout = kPeerReceiveTimeout);

  // Rank `root`'s `bytes` on every rank (the others' `bytes` are ignored): how the GPU
  // workers of a job share one NCCL id per placement epoch (tag: unique within the
  // attempt). DEADLINE_EXCEEDED or UNAVAILABLE as Receive.
  absl::StatusOr<std::string> Broadcast(int root, uint64_t tag, std::string bytes,
                                        absl::Duration timeout = kPeerReceiveTimeout);
  // Sums `values` across the group (tag: unique within the attempt). Deterministic.
  absl::Status AllReduceSum(double* values, size_t n, uint64_t tag);
  absl::Status AllReduceSum(float* values, size_t n, uint64_t tag);

 private:
  PeerGroup() = default;
  void OnMessage(ucx::AmMessage& m);
  void Deliver(uint64_t attempt, int source, uint64_t tag, std::string bytes);
  template <typename T>
  absl::Status AllReduce(T* values, size_t n, uint64_t tag);

  // Progress thread only: the connection to `address` (one made now, or the one kept).
  absl::StatusOr<ucp_ep_h> ConnectionTo(const std::string& address);
  // Progress thread only: the connection to `address` failed; its ranks in the current
  // group fail with it, and the next group that has it connects afresh.
  void OnPeerFailed(const std::string& address, const absl::Status& status);

  std::unique_ptr<ucx::Worker> worker_;
  int rank_ = 0, world_ = 1;
  std::vector<ucp_ep_h> endpoints_;  // by rank; progress thread only
  std::vector<std::string> group_;   // the current group's addresses by rank; progress thread
  // Connections by peer address, kept across groups until the peer fails (progress thread
  // only). A closed endpoint between two live workers leaves its TCP connection open on
  // both sides (UCX keeps a connection its remote end may still send on, and without
  // peer-failure mode no close reaches the remote end): closing at every join left a socket
  // per job behind. Nor is a live peer's connection ever closed from one side: the peer
  // would go on sending on its own, whose messages name ours (in this error mode endpoint
  // ids on the wire are addresses). A peer that dies fails its connection (its socket
  // closes, or TCP keepalive, on by default in UCX, gives up on its host), which closes
  // it here: the map holds the live peers this worker has met.
  std::map<std::string, ucp_ep_h> connections_;

  absl::Mutex mu_;
  uint64_t attempt_ ABSL_GUARDED_BY(mu_) = 0;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t abandoned_ahead_ ABSL_GUARDED_BY(mu_) = 0;  // starts abandoned (0: none)
  // (attempt, source rank, tag) -> bytes
  std::map<std::tuple<uint64_t, int, uint64_t>, std::string> mailbox_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> failed_ ABSL_GUARDED_BY(mu_);  // by rank: the endpoint failed
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_PEER_GROUP_H_
