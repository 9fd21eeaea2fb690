#!/usr/bin/env bash
# pith data prepare + pith-worker --standalone, as a user runs them: training lowers the
# loss, a run from the exported init repeats the losses exactly, the saved weights are a
# valid checkpoint, and bad input is one line on stderr with a non-zero exit.
set -euo pipefail
PITH=$1 WORKER=$2 SRC=$3
source "$(dirname "$0")/../../deploy/proc-lib.sh"
cd "$E2E_TMP"

"$PITH" data prepare --out tokens.bin "$SRC/README.md" "$SRC/tests/golden/moe_gpt_reference.py" >/dev/null
cat >spec.json <<JSON
{"name": "e2e",
 "model": {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layer": 2, "n_head": 4,
           "n_expert": 8, "top_k": 2, "d_ff": 128, "capacity_factor": 1.25,
           "aux_loss_coef": 0.01, "z_loss_coef": 0.001, "renormalize_topk": true},
 "train": {"data_path": "tokens.bin", "batch": 8, "steps": 40, "lr": 0.003, "warmup": 5,
           "weight_decay": 0.1, "grad_clip": 1.0, "seed": 1337}}
JSON

"$WORKER" --standalone --spec=spec.json --export_init=init.safetensors --loss_log=a.txt \
  --save=final.safetensors --backend=cpu 2>train.log || fail "training failed: $(tail -3 train.log)"
[[ $(wc -l <a.txt) == 40 ]] || fail "loss log has $(wc -l <a.txt) lines, want 40"
# On an AVX2 CPU the worker never runs OpenBLAS's SSE3 fallback kernels (it re-executes
# itself with OPENBLAS_CORETYPE when OpenBLAS does not recognise the CPU model).
if grep -qw avx2 /proc/cpuinfo && grep -qw fma /proc/cpuinfo; then
  core=$(sed -n 's/.*trained.*OpenBLAS \([^ ]*\) kernels.*/\1/p' train.log)
  [[ -n $core && $core != Prescott && $core != Core2 && $core != Nehalem && $core != Sandybridge ]] ||
    fail "OpenBLAS kernels on an AVX2 CPU: '${core}'"
  echo "  OpenBLAS kernels: $core"
fi
first=$(head -5 a.txt | awk '{s += $2} END {print s / NR}')
last=$(tail -5 a.txt | awk '{s += $2} END {print s / NR}')
awk -v f="$first" -v l="$last" 'BEGIN {exit !(l < f - 0.5)}' || fail "loss did not fall: $first -> $last"
"$PITH" safetensors inspect final.safetensors | grep "h.1.moe.e7.b2" >/dev/null || fail "final weights incomplete"

"$WORKER" --standalone --spec=spec.json --init=init.safetensors --steps=40 --loss_log=b.txt 2>/dev/null
cmp -s a.txt b.txt || fail "a run from the exported init differs"
echo "  trained 40 steps: mean loss $first -> $last; rerun from the exported init is identical"

# expect_one_line WANT CMD...: exit non-zero and exactly one stderr line containing WANT.
expect_one_line() {
  local want=$1 rc=0
  shift
  "$@" >out.txt 2>err.txt || rc=$?
  [[ $rc != 0 ]] || fail "$* succeeded"
  [[ $(wc -l <err.txt) == 1 ]] || fail "$*: not one line: $(cat err.txt)"
  grep -q -- "$want" err.txt || fail "$*: error lacks '$want': $(cat err.txt)"
  echo "  ok: $(cat err.txt)"
}
sed 's/"tokens.bin"/"missing.bin"/' spec.json >missing.json
expect_one_line "missing.bin" "$WORKER" --standalone --spec=missing.json
sed 's/"n_head": 4/"n_head": 3/' spec.json >heads.json
expect_one_line "expected cpu, cuda or auto" "$WORKER" --standalone --spec=spec.json --backend=tpu
if ! command -v nvidia-smi >/dev/null; then  # no GPU: --backend=cuda says why, in one line
  expect_one_line "cuda" "$WORKER" --standalone --spec=spec.json --backend=cuda --steps=1
fi
expect_one_line "model.n_head" "$WORKER" --standalone --spec=heads.json
sed 's/"top_k": 2/"top_k": 9/' spec.json >topk.json
expect_one_line "model.top_k" "$WORKER" --standalone --spec=topk.json
head -c 50000 init.safetensors >cut.safetensors
expect_one_line "truncated" "$WORKER" --standalone --spec=spec.json --init=cut.safetensors
sed 's/"d_ff": 128/"d_ff": 96/' spec.json >other.json
expect_one_line "h.0.moe.e0.w1" "$WORKER" --standalone --spec=other.json --init=init.safetensors
echo "worker standalone: OK"
