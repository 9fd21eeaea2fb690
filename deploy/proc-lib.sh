# Shell helpers shared by the e2e tests and deploy/run-demo.sh: start Pith processes, read
# their ready lines, stop them.
# Every process started with start_proc is killed when the test exits.

PIDS=()
E2E_TMP=$(mktemp -d /tmp/pith-run.XXXXXX)
# What the processes make in $TMPDIR (their certificate stage, workers' scratch) goes with it.
export TMPDIR=$E2E_TMP

cleanup() {
  for pid in "${PIDS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  # E2E_KEEP=1 keeps the folder (logs, data) of a run to read after it.
  if [[ ${E2E_KEEP:-0} == 1 ]]; then echo "kept $E2E_TMP" >&2; else rm -rf "$E2E_TMP"; fi
}
trap cleanup EXIT

# The logs' tails: the test's own processes', and those of a cluster it keeps in a folder
# of its own (pith up's DIR/NAME.log).
fail() {
  echo "FAIL: $*" >&2
  for f in "$E2E_TMP"/*.log "$E2E_TMP"/*/*.log; do
    [[ -f $f ]] && { echo "--- $f" >&2; tail -n 20 "$f" >&2; }
  done
  exit 1
}

# start_proc NAME CMD...: runs CMD in the background with its log in $E2E_TMP/NAME.log.
start_proc() {
  local name=$1
  shift
  "$@" >"$E2E_TMP/$name.log" 2>&1 &
  PIDS+=($!)
  eval "PID_$name=$!"
}

# wait_ready NAME: waits (10 s at most) for the "ready: grpc_port=X metrics_port=Y" line
# and sets GRPC_PORT_NAME and METRICS_PORT_NAME.
wait_ready() {
  local name=$1 line
  for _ in $(seq 100); do
    line=$(grep -m1 -o 'ready: grpc_port=[0-9]* metrics_port=-\?[0-9]*' "$E2E_TMP/$name.log" || true)
    if [[ -n $line ]]; then
      eval "GRPC_PORT_$name=$(sed 's/.*grpc_port=\([0-9]*\).*/\1/' <<<"$line")"
      eval "METRICS_PORT_$name=$(sed 's/.*metrics_port=\(-\?[0-9]*\).*/\1/' <<<"$line")"
      return 0
    fi
    sleep 0.1
  done
  fail "$name did not report ready"
}

# stop_proc NAME: SIGTERM, then expects a clean exit (status 0) within 10 s.
stop_proc() {
  local name=$1 pid
  pid=$(eval "echo \$PID_$name")
  if ! kill -TERM "$pid" 2>/dev/null; then
    local rc=0
    wait "$pid" || rc=$?
    fail "$name had exited (status $rc) before its SIGTERM"
  fi
  for _ in $(seq 100); do
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" && return 0
      fail "$name exited non-zero after SIGTERM"
    fi
    sleep 0.1
  done
  fail "$name did not stop within 10 s of SIGTERM"
}

# make_tls PITH ROLE NAME... [-- HOST...]: certificates for NAME... with ROLE under
# $E2E_TMP/tls (one cluster CA), as `pith certs` makes them; a process then takes
# --tls_dir=$E2E_TMP/tls/NAME. HOSTs: the addresses its servers are reached at (default:
# this machine's).
make_tls() {
  local pith=$1 role=$2 names=() hosts=()
  shift 2
  while (($#)) && [[ $1 != -- ]]; do names+=("$1"); shift; done
  (($#)) && shift
  hosts=("$@")
  local IFS=, extra=()
  ((${#hosts[@]})) && extra=(--hosts "${hosts[*]}")
  "$pith" certs --dir "$E2E_TMP/tls" --role "$role" --name "${names[*]}" "${extra[@]}" \
    >/dev/null || fail "pith certs --role $role ${names[*]}"
}

# free_port: a TCP port on 127.0.0.1 that nothing listens on right now.
free_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 30000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
      echo "$p"
      return 0
    fi
  done
  return 1
}

# tiny_tokens PITH LINES: $E2E_TMP/tokens.bin, the tokens of a LINES-line text.
tiny_tokens() {
  for i in $(seq "$2"); do echo "line $i: experts come from the stores when they are needed."; done \
    >"$E2E_TMP/text.txt"
  "$1" data prepare --out "$E2E_TMP/tokens.bin" "$E2E_TMP/text.txt" >/dev/null
}

# tiny_spec NAME STEPS N_LAYER: a spec of a tiny model training on $E2E_TMP/tokens.bin
# with 2 workers and 2 store replicas.
tiny_spec() {
  cat <<JSON
{"name": "$1", "model": {"vocab_size": 256, "seq_len": 8, "d_model": 16, "n_layer": $3,
 "n_head": 2, "n_expert": 4, "top_k": 2, "d_ff": 32},
 "train": {"data_path": "$E2E_TMP/tokens.bin", "batch": 4, "steps": $2, "lr": 0.01},
 "cluster": {"workers": 2, "store_replicas": 2}}
JSON
}

# start_prometheus CONFIG: a real Prometheus server (Debian's) on a free port, its data in
# $E2E_TMP/tsdb; sets PROM_PORT once it is ready.
start_prometheus() {
  local prometheus
  prometheus=$(command -v prometheus || true)
  [[ -x /usr/bin/prometheus ]] && prometheus=/usr/bin/prometheus
  [[ -n $prometheus ]] || fail "prometheus is not installed (deploy/install-deps.sh installs it)"
  for attempt in 1 2 3; do
    PROM_PORT=$(free_port)
    start_proc prometheus "$prometheus" --config.file="$1" --storage.tsdb.path="$E2E_TMP/tsdb" \
      --web.listen-address="127.0.0.1:$PROM_PORT"
    for _ in $(seq 100); do
      curl -sf "http://127.0.0.1:$PROM_PORT/-/ready" >/dev/null 2>&1 && return 0
      kill -0 "$PID_prometheus" 2>/dev/null || break
      sleep 0.2
    done
    kill -9 "$PID_prometheus" 2>/dev/null || true
  done
  fail "prometheus did not start"
}

# prom_query QUERY: Prometheus' JSON answer to an instant query.
prom_query() {
  curl -sf -G "http://127.0.0.1:$PROM_PORT/api/v1/query" --data-urlencode "query=$1" || true
}

# prom_wait QUERY PATTERN [TRIES]: polls QUERY (every 0.2 s) until its answer matches PATTERN
# (grep -E); fails with the last answer otherwise.
prom_wait() {
  local result
  for _ in $(seq "${3:-150}"); do
    result=$(prom_query "$1")
    grep -qE "$2" <<<"$result" && return 0
    sleep 0.2
  done
  fail "prometheus never answered $1 with $2; last answer: ${result:-none}"
}
