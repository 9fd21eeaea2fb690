// Dispatch: expert parallelism over a PeerGroup (DESIGN §6, steps 2-4) on the CPU
// backend. At each MoE layer a worker sends every other worker the rows of the expert
// buckets that worker owns — point to point, and only where there is something to send
// (a peer with no rows gets a bucket-count header alone), each token's row once per peer
// however many of its top-k experts the peer computes — computes the buckets it owns
// itself for its own rows and for those it received, returns the outputs, and scatters
// the outputs it gets back into place. Backward mirrors it: the owner of an expert gets
// the gradient rows, accumulates the expert's gradient (so expert gradients never cross
// workers) and returns the input gradients.
//
// Every message of a step is tagged with (step, layer, phase) (peer_channels.h); peers are
// always handled in rank order, so gradients accumulate in the same order on every run
// (bit-identical).
//
// On a backend whose memory the host cannot reach (a GPU's: host_addressable() false) the
// same steps run through copies: the rows sent to peers are read back to the host, the
// rows peers send are computed in device buffers kept from forward to backward, results
// go back through host copies. The cache's slots have device copies (the backend's
// SlotMirror, as many slots as the device gives, reused least recently used first): an
// expert is uploaded when no device slot holds its bytes (its cache Generation), on the
// device's copy stream beside the compute, and its host slot stays pinned until that
// upload is done (the next expert's turn, or the end of the layer's phase). An expert's
// gradient accumulates in a device slot of its own (another SlotMirror, one slot per
// gradient pool buffer, at most 4, used in turn) and goes down to its pool buffer
// on the copy stream while the next experts compute; the buffer stays open until the
// copy has landed (before the slot's next use, or at the end of the last layer's
// backward). Neither direction makes the host wait per expert.
//
// Such a backend's workers may share a device group (NCCL among GPUs: SetDeviceGroup).
// Then the rows never leave the devices: each phase sends its peers a header over the
// peer group (the row counts, and for the token rows their index), gathers each peer's
// rows into one device buffer, and moves them all in one grouped exchange of the
// non-empty pairs, after which the rows are spread (token rows) or scattered (results)
// into place on the device (dispatch_device.cc). The same bits as through the host.
//
// Thread safety: one thread (the training loop) at a time.
#ifndef PITH_WORKER_RUNTIME_DISPATCH_H_
#define PITH_WORKER_RUNTIME_DISPATCH_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "pith/v1/common.pb.h"
#include "worker/compute/backend.h"
#include "worker/model/moe_gpt.h"
#include "worker/runtime/device_group.h"
#include "worker/runtime/expert_cache.h"
#include "worker/runtime/grad_pool.h"
#include "worker/runtime/peer_group.h"

namespace pith::runtime {

// The workers computing one expert: (rank, share of its tokens), shares summing to 1.
using ExpertOwners = std::vector<std::pair<int, double>>;

// Every expert's owners in an assignment's placement, [layer][expert], the primary (which
// updates it) first. INVALID_ARGUMENT for an entry outside the model's `layers` x
// `experts` or the `world`'s ranks, or an expert left without owner.
absl::StatusOr<std::vector<std::vector<ExpertOwners>>> OwnersOf(const v1::PlacementTable& placement,
                                                                int layers, int experts, int world);

// How many experts `rank` computes in `placement`, and of those how many it updates (is
// their primary owner).
std::pair<int, int> ComputedAndUpdated(const v1::PlacementTable& placement, int rank);

// Whether any expert has several owners.
bool AnyShared(const std::vector<std::vector<ExpertOwners>>& owners);

class Dispatch final : public model::ExpertParallel {
 public:
  // `owners[l][e]`: the ranks computing expert e of layer l. A worker that owns an expert
  // computes all of its own rows of it; the others split their rows of it among the owners
  // by share (contiguous parts, in the listed order). None of the pointers is owned.
  Dispatch(compute::Backend* backend, model::MoeGpt* model, PeerGroup* peers,
           std::vector<std::vector<ExpertOwners>> owners);
  ~Dispatch() override;  // waits for the copies in flight
  // Waits for the copies in flight (after a failed phase, or before the cache's slots
  // change): releases the host slots whose uploads were pending and closes the pool
  // buffers whose gradients were on their way down.
  absl::Status SettleCopies();
  // Uploads of cache slots to the device so far (a staged backend's; 0 elsewhere).
  uint64_t slot_uploads() const { return mirror_ != nullptr ? mirror_->uploads() : 0; }
  // Expert gradients copied down to the gradient pool so far (likewise).
  uint64_t grad_downloads() const {
    return grad_mirror_ != nullptr ? grad_mirror_->downloads() : 0;
  }

  // Takes the owned experts' weights from `cache` (not owned; it must outlive this
  // object) instead of the model's arena; null: the arena.
  void SetCache(ExpertCache* cache) { cache_ = cache; }
  // At most `n` device slots for the cache's (0: as many as it has, or as the backend can
  // hold); set before the first step.
  void SetMirrorSlots(int n) { mirror_slots_ = n; }
  // Accumulates the owned experts' gradients in `pool` (not owned; reset before each
  // backward) instead of the model's arena; null: the arena.
  void SetGradPool(GradPool* pool) { grad_pool_ = pool; }
  // Moves the token rows over `slot`'s device group (not owned; it must outlive this
  // object) whenever it holds one and the backend's memory is not the host's; the peer
  // group carries them otherwise.
  void SetDeviceGroup(DeviceGroupSlot* slot) { device_group_ = slot; }
  // Grouped exchanges on the device group so far (token rows, replica gradients; for
  // metrics).
  uint64_t device_exchanges() const { return device_exchanges_; }
  // Whether the replica reduce runs on the device group (ReduceReplicasOnDevice, instead
  // of ExpertGradients::ReduceReplicas): a staged backend with a gradient pool and a
  // device group, where every rank's device copies of shared experts fit in what its
  // gradient pool holds (the ranks vote at each backward). The gradients of experts
  // with several owners then stay on the device through the backward, outside the pool,
  // and ExpertGradients::ReduceReplicas must not run (it would sum zeros).
  bool ReplicasOnDevice() const;
  // The replica reduce on the device group, after the backward: every other owner of an
  // expert computed here by several workers that got tokens sends its gradient (zeros
  // when it had no rows of it) to the primary, all in one grouped exchange; the primary
  // sums them from zero in rank order, as the host path does (the same bits), and puts
  // the sum in its pool buffer. The other owners keep none in their pools.
  absl::Status ReduceReplicasOnDevice();
  // Tags the messages of the coming step.
  void SetStep(int64_t step) {
    step_ = step;
    reduce_seq_ = 0;
  }
  // Whether this worker computes expert e of layer l.
  bool Computes(int layer, int expert) const override;
  // Waits for the cache's updates in flight (the previous step's, pipelined: they have
  // read their gradients), then empties the gradient pool for this step's.
  absl::Status BeforeBackward() override;
  // Calls `hook` (on the training thread) once each step's routing is known.
  void SetRoutingKnown(std::function<void()> hook) { routing_known_ = std::move(hook); }
  void RoutingKnown() override {
    if (routing_known_) routing_known_();
  }
  // Token rows this worker sent to peers in the last step's forward passes (a token once
  // per peer, however many of its experts the peer computes), the expert rows they stood
  // for, and the expert rows received (for metrics).
  int64_t rows_sent() const { return rows_sent_; }
  int64_t assignments_sent() const { return assignments_sent_; }
  int64_t rows_received() const { return rows_received_; }

  absl::Status Forward(int layer, float* y, float* hpre, float* h, const float* xperm,
                       const int64_t* offsets, const int32_t* bucket_token) override;
  absl::Status Backward(int layer, float* dxperm, float* dh, const float* dy, const float* xperm,
                        const float* hpre, const float* h, const int64_t* offsets) override;
  absl::Status AllReduce(double* values, size_t n) override;

 private:
  // What a peer sent for one layer: rows per expert, and the activations kept for backward.
  struct Inbound {
    std::vector<int64_t> counts;   // E
    std::vector<int64_t> offsets;  // E + 1, prefix sums of counts
    std::vector<float> x, hpre, h, out, dy, dx, dh;
    // Staged: the device copies the backend computes in (x, dy uploaded; the rest
    // computed there, out and dx read back into their host vectors to return).
    struct Device {
      compute::DeviceBuffer x, hpre, h, out, dy, dx, dh;
    } dev;
  };
  // Where the backend computes on Inbound rows: the host vectors, or their device copies.
  float* At(Inbound& in, std::vector<float> Inbound::*rows,
            compute::DeviceBuffer Inbound::Device::*dev) const {
    return staged_ ? (in.dev.*dev).f32() : (in.*rows).data();
  }
  // Staged: `buf` holds at least `floats` floats on the device (grown, zeroed, when not).
  absl::Status Fit(compute::DeviceBuffer& buf, int64_t floats);
  // Staged: sizes the device copies of a peer's rows for a layer, uploading the rows it
  // sent (x forward, dy backward) from their host vector when `upload`.
  absl::Status StageInbound(Inbound& in, int64_t rows, bool forward, bool upload);
  // Whether expert e of `layer` has rows here or from a peer in this step.
  bool HasRows(int layer, int expert, const int64_t* offsets) const;
  // Takes one of `experts` (one layer's, in the cache's schedule order) off the list and
  // returns it with its weights, pinned: the first ready in the cache (each expert's
  // compute touches only its own rows and gradients, so the order does not change the
  // math), the first without a cache.
  absl::StatusOr<std::pair<int, compute::ExpertWeights>> NextWeights(
      std::vector<ExpertCache::Expert>& experts);
  // Releases an owned expert's weights after its compute (its host slot, once its upload
  // is done: SettleUploads).
  absl::Status SettleUploads();
  // Closes the pool buffer whose gradient device slot `slot` was downloading, once the
  // download has landed.
  absl::Status SettleGradient(int slot);
  absl::Status Done(int layer, int expert);
  // The device copy of the acquired expert's slot at `host` (uploaded unless current).
  absl::StatusOr<const void*> DeviceCopy(int layer, int expert, const void* host);
  // Where expert e of `layer`'s gradient accumulates: its pool buffer (opened; closed by
  // GradsDone), a staged backend's device slot for it (downloaded into the pool buffer
  // by GradsDone, the buffer closed once it landed), or the model's arena.
  absl::StatusOr<compute::ExpertGrads> GradsOf(int layer, int expert);
  // Closes it, or starts a staged gradient's way down.
  absl::Status GradsDone(int layer, int expert);
  uint64_t Tag(int layer, int phase) const;
  // The rows [begin, begin + count) of this worker's bucket of (layer, expert) (n rows) that
  // go to `rank`.
  std::pair<int64_t, int64_t> Part(int layer, int expert, int64_t n, int rank) const;
  // The rows of this worker's buckets (`offsets`) a message to `peer` carries: the row
  // counts by expert, and `source`, the rows of the buckets to send, in order. With
  // `tokens` (the token of each bucket row), `source` holds each token's first row only,
  // and `index` the position in `source` of every bucket row sent.
  absl::Status PlanRows(int layer, int peer, const int64_t* offsets, const int32_t* tokens,
                        std::vector<int64_t>& counts, std::vector<int64_t>& source,
                        std::vector<int32_t>& index);
  // Checks the row counts a peer sent (rows only of experts this worker computes, no more
  // than `most` in all) and returns their total.
  absl::StatusOr<int64_t> CheckCounts(int layer, int peer, const std::vector<int64_t>& counts,
                                      int64_t most) const;
  // The device group the rows move over now, or null (dispatch_device.cc).
  compute::DeviceGroup* RowsGroup() const;
  // Over `group`: what SendBuckets and every peer's ReceiveBuckets do, the rows landing
  // in each peer's Inbound device buffer `dst` (grown to fit). Either `tokens` (the
  // header's indices bound the rows) or `same_counts` (a peer must send the row counts it
  // sent in the forward), so a peer's header never asks for more memory than its bytes or
  // the forward justify.
  absl::Status ExchangeRows(compute::DeviceGroup& group, int layer, int phase, const float* rows,
                            int64_t width, const int64_t* offsets, const int32_t* tokens,
                            compute::DeviceBuffer Inbound::Device::*dst, bool same_counts);
  // Receives `peer`'s row header for `phase`, checks it (ExchangeRows) and takes its row
  // counts; returns the rows it sends and their bucket rows, with, when `indexed`, the
  // row sent for each bucket row in `index`.
  absl::StatusOr<std::pair<int64_t, int64_t>> TakeRowHeader(int layer, int phase, int peer,
                                                            bool indexed, bool same_counts,
                                                            std::vector<int32_t>& index);
  // Takes the ranks' vote on the replica reduce's path (ReplicasOnDevice), at each
  // backward.
  absl::Status VoteReplicasOnDevice();
  // Whether this rank's device buffers for the reduce fit the pool's budget and the
  // device: allocated now, and kept, when they do.
  bool ReplicasFit();
  void FreeReplicaBuffers();
  // Over `group`: what ReturnResults does.
  absl::Status ExchangeResults(compute::DeviceGroup& group, int layer,
                               compute::DeviceBuffer Inbound::Device::*results, int64_t width,
                               const int64_t* offsets, float* out);
  // Sends each peer the rows of `rows` ([A, width]) in the buckets it owns. With
  // `tokens` (the token of each row), each token's row goes once, with an index per
  // bucket row.
  absl::Status SendBuckets(int layer, int phase, const float* rows, int64_t width,
                           const int64_t* offsets, const int32_t* tokens = nullptr);
  // Receives what `peer` sent under `phase` into `in` (counts, then rows of `width`;
  // `deduplicated`: indices, then the distinct rows they name).
  absl::Status ReceiveBuckets(int layer, int phase, int peer, int64_t width, Inbound& in,
                              std::vector<float>& rows, bool deduplicated = false);
  // Receives the rows `peer` returns for the buckets it owns, into `out` ([A, width]).
  absl::Status ScatterReturned(int layer, int phase, int peer, int64_t width,
                               const int64_t* offsets, float* out);
  // Sends each peer its rows of `results` (what this worker computed for it) under
  // `phase`, then scatters what every peer returns under `phase` into `out`.
  absl::Status ReturnResults(int layer, int phase, std::vector<float> Inbound::*results,
                             compute::DeviceBuffer Inbound::Device::*dev_results, int64_t width,
                             const int64_t* offsets, float* out);

  compute::Backend* backend_;
  model::MoeGpt* model_;
  PeerGroup* peers_;
  std::vector<std::vector<ExpertOwners>> owners_;
  int64_t step_ = 0;
  int64_t rows_sent_ = 0, assignments_sent_ = 0, rows_received_ = 0;
  std::vector<int32_t> slot_of_token_;         // SendBuckets scratch: token -> its row in a message
  std::vector<std::vector<Inbound>> inbound_;  // [layer][peer]
  ExpertCache* cache_ = nullptr;
  GradPool* grad_pool_ = nullptr;
  std::function<void()> routing_known_;
  uint64_t reduce_seq_ = 0;
  // Staging (see the top of this file).
  bool staged_ = false;
  std::vector<float> host_rows_;      // SendBuckets' rows, read back
  std::vector<int32_t> host_tokens_;  // and their tokens
  // The cache slots' device copies (made at the first staged acquire; at most
  // mirror_slots_ of them when set), by device slot the cache generation each holds (0:
  // none) and its last use, the device slot of the expert computing now and whether it
  // was uploaded for it, and the experts whose host slots wait for their uploads.
  std::unique_ptr<compute::SlotMirror> mirror_;
  int mirror_slots_ = 0;
  std::vector<uint64_t> mirrored_, mirror_used_;
  uint64_t mirror_clock_ = 0;
  int current_slot_ = -1;
  bool current_uploaded_ = false;
  std::vector<ExpertCache::Expert> unpin_after_upload_;
  // The gradients' device slots (made at the first staged backward with a pool): the
  // ring's next slot and the one accumulating now, the pool buffer it goes down to, and
  // by slot the expert whose download is in flight ({-1, -1}: none).
  std::unique_ptr<compute::SlotMirror> grad_mirror_;
  int grad_next_ = 0, grad_current_ = -1;
  float* grad_host_ = nullptr;
  std::vector<GradPool::Expert> grad_pending_;
  // Rows over the device group: the group's slot, and by peer rank the device buffers
  // of the rows sent and landed, with their row indices.
  DeviceGroupSlot* device_group_ = nullptr;
  struct PeerRows {
    compute::DeviceBuffer send, send_index, landed, landed_index;
  };
  std::vector<PeerRows> peer_rows_;
  uint64_t device_exchanges_ = 0;
  // The replica reduce on the device: this worker's gradient of each replicated expert
  // it computes (kept through the backward), those written this step, whether the one
  // accumulating now is one of them, and at a primary the other owners' copies and the
  // sum.
  std::map<GradPool::Expert, compute::DeviceBuffer> replica_grads_;
  std::set<GradPool::Expert> replica_written_;
  bool grad_replica_ = false;
  std::vector<compute::DeviceBuffer> replica_landed_;
  compute::DeviceBuffer replica_sum_;
  int replicas_on_device_ = 0;  // this step's vote
  int replicas_fit_ = -1;       // whether this rank's buffers fit (-1: not known yet)
};

}  // namespace pith::runtime

#endif  // PITH_WORKER_RUNTIME_DISPATCH_H_
