// The parts of the parameter layout that need the protos or the safetensors writer: the
// shape from a job spec, and a whole arena written as a weights file.
#include "common/param_layout.h"
#include "common/safetensors.h"
#include "common/status.h"
#include "pith/v1/spec.pb.h"

namespace pith::model {

ModelShape ModelShape::FromSpec(const v1::ModelConfig& m) {
  ModelShape s;
  s.vocab = m.vocab_size();
  s.seq = m.seq_len();
  s.channels = m.d_model();
  s.layers = m.n_layer();
  s.heads = m.n_head();
  s.experts = m.n_expert();
  s.top_k = m.top_k();
  s.hidden = m.d_ff();
  s.capacity_factor = m.capacity_factor();
  s.aux_loss_coef = m.aux_loss_coef();
  s.z_loss_coef = m.z_loss_coef();
  s.renormalize_topk = m.renormalize_topk();
  // A validated spec names fp32 or bf16.
  s.compute_dtype = ParseComputeDtype(m.compute_dtype()).value_or(ComputeDtype::kFp32);
  return s;
}

absl::Status SaveHostWeights(const ParamLayout& layout, const float* host, const std::string& path,
                             const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter writer;
  for (const auto& [key, value] : metadata) writer.SetMetadata(key, value);
  for (const ParamTensor& t : layout.tensors()) {
    RETURN_IF_ERROR(
        writer.Add(t.name, TensorView{DType::kF32,
                                      t.shape,
                                      {reinterpret_cast<const uint8_t*>(host + t.offset),
                                       static_cast<size_t>(t.numel) * sizeof(float)}}));
  }
  return writer.Write(path);
}

}  // namespace pith::model
