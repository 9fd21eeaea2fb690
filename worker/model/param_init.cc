#include "worker/model/param_init.h"

#include <algorithm>
#include <cmath>

namespace pith::model {
namespace {

bool IsLayerNormWeight(const ParamTensor& t) {
  return t.name.ends_with("ln1.w") || t.name.ends_with("ln2.w") || t.name == "ln_f.w";
}

// Matrices draw two numbers per element (Box-Muller); nothing else draws.
bool Draws(const ParamTensor& t) { return t.shape.size() == 2 && !IsLayerNormWeight(t); }

}  // namespace

ParamInit::ParamInit(const ParamLayout& layout, uint64_t seed)
    : layout_(layout), rng_(seed), residual_scale_(1.0 / std::sqrt(2.0 * layout.shape().layers)) {}

double ParamInit::Normal() {
  // Box-Muller on 53-bit uniforms: the same numbers on every platform for a seed.
  const double u1 = (static_cast<double>(rng_() >> 11) + 1.0) * 0x1.0p-53;
  const double u2 = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

void ParamInit::SkipTo(int index) {
  for (; next_ < index; ++next_) {
    const ParamTensor& t = layout_.tensors()[next_];
    if (Draws(t)) rng_.discard(2 * static_cast<unsigned long long>(t.numel));
  }
}

void ParamInit::Fill(int index, float* out) {
  SkipTo(index);
  const ParamTensor& t = layout_.tensors()[index];
  if (IsLayerNormWeight(t)) {
    std::fill(out, out + t.numel, 1.0f);
  } else if (Draws(t)) {
    const bool residual_out = t.name.ends_with("attn.o.w") || t.name.ends_with(".w2");
    const double stddev = 0.02 * (residual_out ? residual_scale_ : 1.0);
    for (int64_t i = 0; i < t.numel; ++i) out[i] = static_cast<float>(Normal() * stddev);
  } else {
    std::fill(out, out + t.numel, 0.0f);  // biases and LayerNorm betas
  }
  next_ = index + 1;
}

void ParamInit::FillExpert(int layer, int expert, float* out) {
  const int first = layout_.ExpertTensorIndex(layer, expert);
  const int64_t base = layout_.ExpertOffset(layer, expert);
  for (int i = first; i < first + 4; ++i) Fill(i, out + (layout_.tensors()[i].offset - base));
}

}  // namespace pith::model
