#!/usr/bin/env bash
# The README main command. Installs what is missing, builds Pith, starts a local cluster
# on loopback with `pith up` (1 coordinator, 2 expert stores, 2 workers, each with gRPC and
# Prometheus /metrics), prepares an English text corpus, submits the demo job
# (deploy/demo/spec.json, DESIGN §3) and watches it train through the cluster — experts
# fetched from the stores into worker caches far smaller than the experts and their
# optimizer state — then prints the loss at start and end, tokens/s and cache hit rate,
# exports a checkpoint, scores it on held-out text, prints a sample, stops the cluster
# with `pith down`, and scores the same checkpoint with the independent PyTorch
# implementation (tests/golden/moe_gpt_reference.py): the two held-out losses must agree.
set -euo pipefail
cd "$(dirname "$0")/.."

deploy/install-deps.sh --reference
BUILD_DIR=${PITH_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$BUILD_DIR" -j"$(nproc)" --target pith-coordinator pith-store pith-worker pith

source deploy/proc-lib.sh
PITH="$BUILD_DIR/client/pith"
# `pith up` starts the processes detached, each with its own ports, data dir and log under
# $PITH_HOME; every other pith command finds the cluster there.
export PITH_HOME=$E2E_TMP/cluster
cleanup_cluster() { [[ -f $PITH_HOME/pids ]] && "$PITH" down >/dev/null 2>&1 || true; }
trap 'cleanup_cluster; cleanup' EXIT
# Each worker caches 1 MiB of expert weights: the job's 64 experts hold 16.9 MB of fp32
# weights and 67.5 MB with their master copy and AdamW moments, all in the stores.
echo
"$PITH" up --stores 2 --workers 2 --cache_bytes 1048576
"$PITH" cluster | sed 's/^/  /'

echo
echo "Corpus: the fortune cookies of Debian's fortunes packages (held-out: the last 5%)."
mapfile -t texts < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | LC_ALL=C sort)
[[ ${#texts[@]} -gt 0 ]] || fail "no fortunes corpus (deploy/install-deps.sh installs it)"
cat "${texts[@]}" >"$E2E_TMP/corpus.txt"
total=$(stat -c %s "$E2E_TMP/corpus.txt")
head -c $((total * 95 / 100)) "$E2E_TMP/corpus.txt" >"$E2E_TMP/train.txt"
tail -c $((total - total * 95 / 100)) "$E2E_TMP/corpus.txt" >"$E2E_TMP/heldout.txt"
"$PITH" data prepare --out "$E2E_TMP/tokens.bin" "$E2E_TMP/train.txt"
"$PITH" data prepare --out "$E2E_TMP/heldout.bin" "$E2E_TMP/heldout.txt"
sed "s|\"data_path\": \"tokens.bin\"|\"data_path\": \"$E2E_TMP/tokens.bin\"|" deploy/demo/spec.json \
  >"$E2E_TMP/spec.json"

echo
echo "Training the demo model (d 128, 4 layers, 16 experts, top-2; 300 steps) on 2 workers:"
job=$("$PITH" submit "$E2E_TMP/spec.json")
echo "  submitted job $job"
"$PITH" watch "$job" | awk 'NR <= 2 || /step [0-9]*0\// || /^job/' | sed 's/^/  /' ||
  fail "the job did not succeed"

echo
for name in coordinator store0 store1 worker0 worker1; do
  metrics=$(grep -m1 -o 'metrics_port=[0-9]*' "$PITH_HOME/$name.log" | cut -d= -f2)
  curl -sf "http://127.0.0.1:$metrics/metrics" >"$E2E_TMP/$name.metrics" ||
    fail "$name does not serve /metrics"
done
echo "Every process answered /metrics; a few of the figures:"
grep -h -E '^pith_worker_expert_cache_(hits|misses|prefetch_hits)_total|^pith_worker_tokens_total' \
  "$E2E_TMP/worker0.metrics" | sed 's/^/  worker0: /'
grep -h -E '^pith_store_tier_bytes' "$E2E_TMP/store0.metrics" | sed 's/^/  store0: /'
grep -h -E '^pith_coordinator_steps_committed_total' "$E2E_TMP/coordinator.metrics" |
  sed 's/^/  coordinator: /'

echo
"$PITH" checkpoint "$job" --out "$E2E_TMP/demo.safetensors" | sed 's/^/  /'
pith_eval=$("$PITH" eval --spec "$E2E_TMP/spec.json" --checkpoint "$E2E_TMP/demo.safetensors" \
  --tokens "$E2E_TMP/heldout.bin" --batches 4)
echo "  held-out $pith_eval"
echo
echo "A sample from the checkpoint (prompt \"Q: What\"):"
"$PITH" sample --checkpoint "$E2E_TMP/demo.safetensors" --prompt "Q: What" --tokens 200 \
  --temperature 0.7 | sed 's/^/  | /'

echo
"$PITH" down | sed -e 's/ (data and logs kept there)//' -e 's/^/  /'
echo "Cluster stopped cleanly (SIGTERM)."

# What the run leaves (the temporary folder goes): the checkpoint, the spec, the held-out
# tokens and every process's log, so the checkpoint can be checked independently.
OUT=${PITH_DEMO_OUT:-demo-out}
rm -rf "$OUT" && mkdir -p "$OUT/logs"
cp "$E2E_TMP/demo.safetensors" "$E2E_TMP/heldout.bin" "$OUT/"
sed "s|\"data_path\": \"[^\"]*\"|\"data_path\": \"tokens.bin\"|" "$E2E_TMP/spec.json" >"$OUT/spec.json"
find "$PITH_HOME" -maxdepth 1 -name '*.log' -exec cp {} "$OUT/logs/" \;
echo
echo "The same checkpoint scored by the independent PyTorch implementation"
echo "(tests/golden/moe_gpt_reference.py, /usr/bin/python3 with python3-torch):"
torch_eval=$(/usr/bin/python3 tests/golden/moe_gpt_reference.py --spec "$OUT/spec.json" \
  --init "$OUT/demo.safetensors" --tokens "$OUT/heldout.bin" --eval 4 | grep '^eval ') ||
  fail "the PyTorch reference could not score the checkpoint"
echo "  pith    $pith_eval"
echo "  pytorch $torch_eval"
# Both print "eval rows=R tokens=N ce=X loss=Y": the losses agree to float precision.
read -r pith_ce pith_loss < <(sed -E 's/.*ce=([^ ]+) loss=([^ ]+).*/\1 \2/' <<<"$pith_eval")
read -r torch_ce torch_loss < <(sed -E 's/.*ce=([^ ]+) loss=([^ ]+).*/\1 \2/' <<<"$torch_eval")
awk -v a="$pith_ce" -v b="$torch_ce" -v c="$pith_loss" -v d="$torch_loss" 'BEGIN {
  r1 = (a - b) / b; r2 = (c - d) / d; if (r1 < 0) r1 = -r1; if (r2 < 0) r2 = -r2;
  printf "  relative difference: ce %.1e, loss %.1e\n", r1, r2; exit !(r1 < 1e-5 && r2 < 1e-5) }' ||
  fail "Pith and PyTorch disagree on the checkpoint's held-out loss"

echo
echo "Kept in $OUT/: demo.safetensors, spec.json, heldout.bin, logs/ (rerun the check with"
echo "  /usr/bin/python3 tests/golden/moe_gpt_reference.py --spec $OUT/spec.json \\"
echo "    --init $OUT/demo.safetensors --tokens $OUT/heldout.bin --eval 4)"
