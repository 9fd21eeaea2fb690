// The checkpoint names every side shares: the export file, expert blobs and optimizer
// prefixes agree with the tensor names of the parameter layout.
#include "common/checkpoint_names.h"

#include "common/param_layout.h"
#include "gtest/gtest.h"

namespace pith::model {
namespace {

v1::BlobKey Key(v1::BlobKind kind, int layer, int expert, const std::string& tensor = "") {
  v1::BlobKey key;
  key.set_job_id("job-1");
  key.set_kind(kind);
  key.set_layer(layer);
  key.set_expert(expert);
  key.set_tensor(tensor);
  return key;
}

TEST(CheckpointNamesTest, ExportFile) {
  EXPECT_EQ(CheckpointFileName("cluster-1", 20), "cluster-1.step20.safetensors");
  EXPECT_EQ(CheckpointFileName("j", 0), "j.step0.safetensors");
}

TEST(CheckpointNamesTest, BlobNamesInAnExport) {
  EXPECT_EQ(ExportTensorName(Key(v1::BLOB_KIND_WEIGHTS, -1, 0, "wte")), "wte");
  EXPECT_EQ(ExportTensorName(Key(v1::BLOB_KIND_WEIGHTS, 2, 5)), "h.2.moe.e5");
  EXPECT_EQ(ExportTensorName(Key(v1::BLOB_KIND_ADAM_M, -1, 0, "ln_f.w")), "m.ln_f.w");
  EXPECT_EQ(ExportTensorName(Key(v1::BLOB_KIND_ADAM_V, 0, 1)), "v.h.0.moe.e1");
  EXPECT_EQ(ExportTensorName(Key(v1::BLOB_KIND_MASTER, 1, 0)), "master.h.1.moe.e0");
  EXPECT_EQ(ExportTensorName(Key(v1::BLOB_KIND_STATE, -1, 0, "wpe")), "state.wpe");
}

TEST(CheckpointNamesTest, ExpertTensorsOfTheLayoutStartWithTheBlobName) {
  ModelShape shape;
  shape.vocab = 16, shape.seq = 4, shape.channels = 8, shape.layers = 2, shape.heads = 2;
  shape.experts = 3, shape.top_k = 1, shape.hidden = 8;
  const ParamLayout layout(shape);
  int experts = 0;
  for (const ParamTensor& t : layout.tensors()) {
    if (t.layer < 0) continue;
    ++experts;
    EXPECT_EQ(t.name.rfind(ExpertTensorPrefix(t.layer, t.expert) + ".", 0), 0u) << t.name;
  }
  EXPECT_EQ(experts, 2 * 3 * 4);
}

}  // namespace
}  // namespace pith::model
