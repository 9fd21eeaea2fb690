// ParamLayout: where every moe-gpt parameter lives in one flat fp32 arena, with the
// DESIGN §3 tensor names. This is the checkpoint contract the coordinator, the stores, the
// CLI and the worker share, so it lives in common/ and links no compute code (the names
// of export files and blobs are in checkpoint_names.h). Dense tensors come first; then,
// per layer and expert, one contiguous blob [w1 | b1 | w2 | b2] (DESIGN §4: one expert
// kind = one blob). Gradients and the AdamW moments use the same layout.
//
// Thread safety: immutable after construction.
#ifndef PITH_COMMON_PARAM_LAYOUT_H_
#define PITH_COMMON_PARAM_LAYOUT_H_

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/bf16.h"
#include "common/compute_dtype.h"

// NOTE: the namespace stays the model's (model::ParamLayout): this is the model's contract;
// it lives in common/ only so that code without the compute engine can link it.
namespace pith::v1 {
class ModelConfig;
}  // namespace pith::v1

namespace pith::model {

// The model hyper-parameters of DESIGN §3, checked.
struct ModelShape {
  int vocab = 0;     // V
  int seq = 0;       // T
  int channels = 0;  // d
  int layers = 0;    // L
  int heads = 0;     // H
  int experts = 0;   // E
  int top_k = 0;     // k
  int hidden = 0;    // f
  double capacity_factor = 0;
  double aux_loss_coef = 0;
  double z_loss_coef = 0;
  bool renormalize_topk = true;
  ComputeDtype compute_dtype = ComputeDtype::kFp32;

  // From a validated spec's model config (param_layout_io.cc: the only part that needs
  // the protos).
  static ModelShape FromSpec(const v1::ModelConfig& model);
  // Floats in one expert blob.
  int64_t expert_floats() const { return int64_t{channels} * hidden * 2 + hidden + channels; }
  // Bytes of one expert's weights blob, the one workers fetch into their caches: its fp32
  // floats, or for bf16 the bf16 form of common/bf16.h.
  int64_t expert_blob_bytes() const {
    return compute_dtype == ComputeDtype::kBf16 ? Bf16ExpertLayout(channels, hidden).bytes
                                                : expert_floats() * int64_t{sizeof(float)};
  }
  // Bytes of the largest blob a job of this shape stores: an expert's, or the largest
  // dense tensor (wte, wpe, attn.qkv.w, moe.router.w).
  int64_t largest_blob_bytes() const {
    const int64_t c = channels;
    return int64_t{sizeof(float)} * std::max({expert_floats(), int64_t{vocab} * c, int64_t{seq} * c,
                                              3 * c * c, c * experts});
  }
};

struct ParamTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in floats, into the arena
  int64_t numel = 0;
  bool decay = false;  // AdamW weight decay applies (2-D weights only)
  int layer = -1;      // for expert tensors; -1 for dense ones
  int expert = -1;
};

// "h.<layer>.moe.e<expert>": an expert's contiguous blob, and the prefix of its tensors
// ("h.<layer>.moe.e<expert>.w1", ...). The checkpoint names (checkpoint_names.h) build on it.
std::string ExpertTensorPrefix(int layer, int expert);

class ParamLayout {
 public:
  explicit ParamLayout(const ModelShape& shape);

  const ModelShape& shape() const { return shape_; }
  // Every tensor: dense first (DESIGN order), then experts by layer, expert, w1 b1 w2 b2.
  const std::vector<ParamTensor>& tensors() const { return tensors_; }
  int64_t total_floats() const { return total_floats_; }
  int64_t dense_floats() const { return dense_floats_; }
  // Floats of the largest dense tensor.
  int64_t largest_dense_floats() const {
    int64_t n = 0;
    for (const ParamTensor& t : tensors_) {
      if (t.layer < 0) n = std::max(n, t.numel);
    }
    return n;
  }
  // Index into tensors() of a dense tensor by name, or -1.
  int Find(const std::string& name) const;
  // Offset of the expert blob of (layer, expert).
  int64_t ExpertOffset(int layer, int expert) const {
    return dense_floats_ + (int64_t{layer} * shape_.experts + expert) * shape_.expert_floats();
  }
  // Index in tensors() of the first tensor (w1) of an expert; its four tensors follow.
  int ExpertTensorIndex(int layer, int expert) const {
    return first_expert_tensor_ + 4 * (layer * shape_.experts + expert);
  }

  // Offsets of the dense tensors the model uses (filled from the names).
  struct Layer {
    int64_t ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b, ln2_w, ln2_b, router_w;
  };
  int64_t wte() const { return wte_; }
  int64_t wpe() const { return wpe_; }
  int64_t lnf_w() const { return lnf_w_; }
  int64_t lnf_b() const { return lnf_b_; }
  const Layer& layer(int l) const { return layers_[l]; }

 private:
  int64_t Add(std::string name, std::vector<int64_t> shape, bool decay, int layer = -1,
              int expert = -1);

  ModelShape shape_;
  std::vector<ParamTensor> tensors_;
  std::vector<Layer> layers_;
  int64_t total_floats_ = 0;
  int64_t dense_floats_ = 0;
  int first_expert_tensor_ = 0;
  int64_t wte_ = 0, wpe_ = 0, lnf_w_ = 0, lnf_b_ = 0;
};

// A job's exported weights file records its spec (JSON) under this __metadata__ key.
inline constexpr char kSpecMetadataKey[] = "pith.job_spec";

// Writes a whole host arena of layout.total_floats() floats as a DESIGN §3 weights file
// (every tensor by name, fp32, [in, out]) with `metadata` in `__metadata__`.
absl::Status SaveHostWeights(const ParamLayout& layout, const float* host, const std::string& path,
                             const std::map<std::string, std::string>& metadata = {});

}  // namespace pith::model

#endif  // PITH_COMMON_PARAM_LAYOUT_H_
