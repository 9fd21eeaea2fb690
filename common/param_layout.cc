#include "common/param_layout.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace pith::model {

std::string ExpertTensorPrefix(int layer, int expert) {
  return absl::StrCat("h.", layer, ".moe.e", expert);
}

int64_t ParamLayout::Add(std::string name, std::vector<int64_t> shape, bool decay, int layer,
                         int expert) {
  ParamTensor t;
  t.name = std::move(name);
  t.numel = 1;
  for (int64_t d : shape) t.numel *= d;
  t.shape = std::move(shape);
  t.offset = total_floats_;
  t.decay = decay;
  t.layer = layer;
  t.expert = expert;
  total_floats_ += t.numel;
  tensors_.push_back(std::move(t));
  return tensors_.back().offset;
}

ParamLayout::ParamLayout(const ModelShape& s) : shape_(s) {
  const int64_t C = s.channels;
  wte_ = Add("wte", {s.vocab, C}, true);
  wpe_ = Add("wpe", {s.seq, C}, true);
  lnf_w_ = Add("ln_f.w", {C}, false);
  lnf_b_ = Add("ln_f.b", {C}, false);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("h.", l, ".");
    Layer layer;
    layer.ln1_w = Add(p + "ln1.w", {C}, false);
    layer.ln1_b = Add(p + "ln1.b", {C}, false);
    layer.qkv_w = Add(p + "attn.qkv.w", {C, 3 * C}, true);
    layer.qkv_b = Add(p + "attn.qkv.b", {3 * C}, false);
    layer.o_w = Add(p + "attn.o.w", {C, C}, true);
    layer.o_b = Add(p + "attn.o.b", {C}, false);
    layer.ln2_w = Add(p + "ln2.w", {C}, false);
    layer.ln2_b = Add(p + "ln2.b", {C}, false);
    layer.router_w = Add(p + "moe.router.w", {C, s.experts}, true);
    layers_.push_back(layer);
  }
  dense_floats_ = total_floats_;
  first_expert_tensor_ = static_cast<int>(tensors_.size());
  for (int l = 0; l < s.layers; ++l) {
    for (int e = 0; e < s.experts; ++e) {
      const std::string p = ExpertTensorPrefix(l, e) + ".";
      Add(p + "w1", {C, s.hidden}, true, l, e);
      Add(p + "b1", {s.hidden}, false, l, e);
      Add(p + "w2", {s.hidden, C}, true, l, e);
      Add(p + "b2", {C}, false, l, e);
    }
  }
}

int ParamLayout::Find(const std::string& name) const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace pith::model
