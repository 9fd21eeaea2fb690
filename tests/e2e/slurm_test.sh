#!/usr/bin/env bash
# deploy/slurm/pith.sbatch on a real Slurm: a one-node Slurm cluster of Debian's packages
# (slurmctld, slurmd, munged; own configuration, key, sockets, ports and state under a temp
# directory) runs the batch script with `sbatch --wait`: a coordinator, 2 stores and 2
# workers as job steps, mutual TLS, a tiny job of 40 steps. The Slurm job must complete with
# exit 0, the Pith job succeed with its loss down, the final weights be exported, and no
# Pith process, certificate or node-local directory outlive it. Everything started here is
# stopped on exit, pass or fail. Skipped (exit 77) where Slurm cannot run: not root, its
# packages missing (slurmctld slurmd slurm-client munge), or its daemons not coming up.
#
# usage: slurm_test.sh PITH   (the pith binary of a build tree, or that build directory)
set -euo pipefail
ARG=$1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
source "$REPO/deploy/proc-lib.sh"
if [[ -d $ARG ]]; then BIN=$(cd "$ARG" && pwd); else BIN=$(cd "$(dirname "$ARG")/.." && pwd); fi
PITH=$BIN/client/pith
[[ -x $PITH ]] || PITH=$BIN/pith
[[ -x $PITH ]] || fail "no pith binary under $BIN"

skip() {
  echo "SKIP: $*"
  exit 77
}
[[ $(id -u) == 0 ]] || skip "a private Slurm cluster needs root (slurmd runs jobs as their users)"
for tool in slurmctld slurmd munged sbatch srun scontrol squeue scancel sinfo; do
  command -v "$tool" >/dev/null || skip "$tool is not installed (Debian: slurmctld slurmd slurm-client munge)"
done

# Nothing of a surrounding Slurm job or of the caller's Slurm settings leaks in.
for v in $(compgen -e | grep -E '^(SLURM|SBATCH|SRUN|SALLOC)_' || true); do unset "$v"; done
S=$E2E_TMP/slurm
mkdir -p "$S"/{munge,state,spool,log} "$E2E_TMP/local"
chmod 711 "$E2E_TMP"  # munged wants every directory above its socket searchable
export SLURM_CONF=$S/slurm.conf
HOST=$(hostname -s)
MUNGED_PID='' CTLD_PID='' SLURMD_PID=''

# stop_pid PID: SIGTERM, SIGKILL after 10 s.
stop_pid() {
  [[ -n $1 ]] && kill -TERM "$1" 2>/dev/null || return 0
  for _ in $(seq 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.1; done
  kill -KILL "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}
# our_stepds: this cluster's slurmstepd processes (they carry its SLURM_CONF).
our_stepds() {
  local pid
  for pid in $(pgrep -x slurmstepd || true); do
    grep -qzx "SLURM_CONF=$SLURM_CONF" "/proc/$pid/environ" 2>/dev/null && echo "$pid"
  done
  return 0
}
teardown() {
  local rc=$? stepds=() pid
  mapfile -t stepds < <(our_stepds)
  if [[ -n $CTLD_PID ]] && kill -0 "$CTLD_PID" 2>/dev/null; then
    squeue --noheader --format=%A 2>/dev/null | xargs -r scancel 2>/dev/null || true
    # A running step has a socket NODE_JOB.STEP in the spool directory until its slurmstepd ends.
    for _ in $(seq 150); do
      [[ -z $(squeue --noheader 2>/dev/null) ]] && ! compgen -G "$S/spool/*_[0-9]*.*" >/dev/null && break
      sleep 0.1
    done
  fi
  mapfile -t -O "${#stepds[@]}" stepds < <(our_stepds)
  stop_pid "$SLURMD_PID"
  stop_pid "$CTLD_PID"
  # A slurmstepd that outlived slurmd is killed; each is waited for until init has reaped it.
  for pid in $(our_stepds); do kill -9 "$pid" 2>/dev/null || true; done
  for pid in $(pgrep -f -- "--tls_dir=$E2E_TMP/" || true); do kill -9 "$pid" 2>/dev/null || true; done
  for pid in "${stepds[@]}"; do
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  stop_pid "$MUNGED_PID"
  cleanup
  exit "$rc"
}
trap teardown EXIT

# --- a one-node Slurm cluster -------------------------------------------------------------
if command -v mungekey >/dev/null; then
  mungekey --create --keyfile="$S/munge/munge.key" || skip "mungekey could not make a key"
else
  dd if=/dev/urandom of="$S/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 400 "$S/munge/munge.key"
munged --foreground --socket="$S/munge/munge.socket" --key-file="$S/munge/munge.key" \
  --pid-file="$S/munge/munged.pid" --seed-file="$S/munge/munged.seed" \
  --log-file="$S/log/munged.log" >"$S/log/munged.out" 2>&1 &
MUNGED_PID=$!
for _ in $(seq 50); do [[ -S $S/munge/munge.socket ]] && break; sleep 0.1; done
[[ -S $S/munge/munge.socket ]] || skip "munged did not start: $(tail -2 "$S/log/munged.out")"

write_conf() {  # CTLD_PORT SLURMD_PORT
  cat >"$SLURM_CONF" <<EOF
ClusterName=pithtest
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$1
SlurmdPort=$2
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$S/munge/munge.socket
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$(nproc) RealMemory=100 State=UNKNOWN
PartitionName=pith Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}
# Free ports are picked, not reserved: a daemon that exits (a clash) gets another pair.
up=0
for _ in 1 2 3; do
  exited=0
  write_conf "$(free_port)" "$(free_port)"
  slurmctld -D -f "$SLURM_CONF" >"$S/log/slurmctld.out" 2>&1 &
  CTLD_PID=$!
  slurmd -D -f "$SLURM_CONF" -N "$HOST" >"$S/log/slurmd.out" 2>&1 &
  SLURMD_PID=$!
  for _ in $(seq 100); do
    [[ $(sinfo --noheader --nodes="$HOST" --format=%T 2>/dev/null) == idle ]] && { up=1; break; }
    kill -0 "$CTLD_PID" 2>/dev/null && kill -0 "$SLURMD_PID" 2>/dev/null || { exited=1; break; }
    sleep 0.2
  done
  ((up)) && break
  stop_pid "$SLURMD_PID"
  stop_pid "$CTLD_PID"
  CTLD_PID='' SLURMD_PID=''
  ((exited)) || break
done
((up)) || skip "slurmctld/slurmd did not come up: $(cat "$S"/log/slurm* 2>/dev/null |
  grep -v -e pmix -e MPI | tail -n 3 | tr '\n' ' ')"
echo "  ok: Slurm $(sinfo --version | awk '{print $2}') up on $HOST ($(nproc) CPUs)"

# --- the batch script ---------------------------------------------------------------------
tiny_tokens "$PITH" 300
tiny_spec slurm 40 1 >"$E2E_TMP/spec.json"
cd "$E2E_TMP"  # the job's working directory: its output and run directory land here
start=$SECONDS
rc=0
PITH_BIN=$BIN PITH_STORES=2 PITH_WORKERS=2 PITH_LOCAL_DIR=$E2E_TMP/local \
  PITH_STORE_ARGS=--ram_bytes=$((64 << 20)) PITH_START_TIMEOUT=60 \
  timeout 90 sbatch --wait --parsable --chdir="$E2E_TMP" --output="$E2E_TMP/pith-%j.out" \
  --time=5 "$REPO/deploy/slurm/pith.sbatch" spec.json >"$E2E_TMP/sbatch.txt" 2>&1 || rc=$?
id=$(grep -m1 -o '^[0-9]\+' "$E2E_TMP/sbatch.txt" || true)
out=$E2E_TMP/pith-$id.out
report() {
  echo "--- sbatch: $(cat "$E2E_TMP/sbatch.txt")" >&2
  [[ -f $out ]] && { echo "--- $out" >&2; tail -n 30 "$out" >&2; }
  for f in "$E2E_TMP/pith-$id"/logs/*.log; do [[ -f $f ]] && { echo "--- $f" >&2; tail -n 8 "$f" >&2; }; done
  fail "$*"
}
[[ -n $id ]] || report "sbatch printed no job id"
((rc == 0)) || report "sbatch --wait exited $rc"
scontrol show job "$id" >"$E2E_TMP/job.txt"
grep -q "JobState=COMPLETED" "$E2E_TMP/job.txt" && grep -q " ExitCode=0:0" "$E2E_TMP/job.txt" ||
  report "Slurm job $id: $(grep -o 'JobState=[A-Z_]*\|ExitCode=[0-9:]*' "$E2E_TMP/job.txt" | tr '\n' ' ')"
echo "  ok: Slurm job $id COMPLETED, exit 0, in $((SECONDS - start)) s"

grep -q "pith.sbatch: Pith job slurm-[0-9]* SUCCEEDED" "$out" || report "no SUCCEEDED line"
summary=$(grep -m1 "succeeded at step 40: loss" "$out") || report "no watch summary for step 40"
first=$(sed 's/.*loss \([0-9.]*\)\( (step [0-9]*)\)\{0,1\} -> .*/\1/' <<<"$summary")
last=$(sed 's/.* -> \([0-9.]*\),.*/\1/' <<<"$summary")
awk -v a="$first" -v b="$last" 'BEGIN {exit !(b < a)}' || report "loss did not go down: $summary"
run=$E2E_TMP/pith-$id
# Rank 0 appends a step once it learns of its commit: the last line may trail the job's end.
lines=$(wc -l <"$run/loss.log" 2>/dev/null || echo 0)
[[ $(head -c 2 "$run/loss.log") == "1 " ]] && ((lines >= 39 && lines <= 40)) ||
  report "loss.log has $lines lines, want 40 from step 1"
"$PITH" safetensors inspect "$run/model.safetensors" >/dev/null || report "no readable final weights"
echo "  ok: ${summary#job }"

# Every step stopped on SIGTERM; nothing of the cluster is left but its logs and output.
grep -q "stopping on signal 15" "$run/logs/coordinator.log" || report "the coordinator was not stopped by SIGTERM"
for s in 0 1; do
  grep -q "stopping on signal 15" "$run/logs/store$s.log" || report "store$s was not stopped by SIGTERM"
done
grep -q "step ended with status" "$out" && report "a step ended with a non-zero status"
[[ -z $(pgrep -f -- "--tls_dir=$E2E_TMP/" || true) ]] || report "Pith processes outlived the job"
[[ ! -e $run/tls ]] || report "the certificates outlived the job"
[[ ! -e $E2E_TMP/local/pith-$id ]] || report "the node-local directory outlived the job"
echo "  ok: every step stopped; certificates and node-local data removed"
echo "PASS"
