// For tests: the job spec example of DESIGN §3, verbatim, as JSON.
#ifndef PITH_COMMON_JOB_SPEC_TESTING_H_
#define PITH_COMMON_JOB_SPEC_TESTING_H_

namespace pith::testing {

inline constexpr char kDesignExampleSpecJson[] = R"json({
  "name": "demo",
  "model": {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layer": 4, "n_head": 4,
            "n_expert": 16, "top_k": 2, "d_ff": 256, "capacity_factor": 1.25,
            "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "renormalize_topk": true},
  "train": {"data_path": "tokens.bin", "batch": 16, "steps": 300, "lr": 0.003,
            "warmup": 20, "min_lr_ratio": 0.1, "weight_decay": 0.1, "grad_clip": 1.0,
            "seed": 1337, "init_path": ""},
  "cluster": {"workers": 2, "store_replicas": 2, "cache_bytes": 0}
})json";

}  // namespace pith::testing

#endif  // PITH_COMMON_JOB_SPEC_TESTING_H_
