// ParamInit: the seeded initial weights of DESIGN §3, one tensor at a time. The numbers
// are one stream over the layout's tensors in order (normal(0, 0.02) for matrices, from a
// 64-bit Mersenne Twister; biases and LayerNorm betas 0, gammas 1; attn.o.w and the
// experts' w2 scaled by 1/sqrt(2L)), so a worker that holds only some tensors (the dense
// ones, the experts it owns) makes the very numbers a process holding the whole model
// makes, skipping the rest without memory.
//
// Thread safety: one thread at a time.
#ifndef PITH_WORKER_MODEL_PARAM_INIT_H_
#define PITH_WORKER_MODEL_PARAM_INIT_H_

#include <cstdint>
#include <random>

#include "common/param_layout.h"

namespace pith::model {

class ParamInit {
 public:
  ParamInit(const ParamLayout& layout, uint64_t seed);

  // Writes tensor `index`'s initial values to `out` (numel floats). Tensors are visited in
  // layout order: `index` must not be before the last one filled; the ones between are
  // skipped.
  void Fill(int index, float* out);
  // The four tensors of an expert into `out` (expert_floats, in w1 b1 w2 b2 order), under
  // the same rule.
  void FillExpert(int layer, int expert, float* out);

 private:
  void SkipTo(int index);
  double Normal();

  const ParamLayout& layout_;
  std::mt19937_64 rng_;
  int next_ = 0;  // the next tensor of the stream
  double residual_scale_;
};

}  // namespace pith::model

#endif  // PITH_WORKER_MODEL_PARAM_INIT_H_
