#!/usr/bin/env bash
# Installs exactly the Debian packages Pith needs to build, test and run.
# Idempotent: when every package is already installed it only runs dpkg-query and exits.
# --reference also installs PyTorch (python3-torch, for /usr/bin/python3), which the demo
# and cluster_bench use to check Pith against tests/golden/moe_gpt_reference.py; the
# tests never need it.
set -euo pipefail

PACKAGES=(
  # build
  build-essential cmake ccache pkg-config git clang clang-format libclang-rt-14-dev
  # control plane
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler libabsl-dev
  # data plane and storage
  libucx-dev ucx-utils librocksdb-dev rocksdb-tools
  # observability and logging
  prometheus-cpp-dev libgoogle-glog-dev libgflags-dev
  # compute
  libopenblas-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev libbenchmark-dev curl openssl
  # the metrics scrape test runs a real Prometheus server
  prometheus
  # the demo's English text corpus
  fortunes
  # the Python client (client/python) and its test
  python3-grpcio python3-protobuf
  # the dashboard's test runs a real headless browser
  chromium
  # deploy/: systemd-analyze verify of the units, the manifests' YAML, and a real Slurm
  systemd python3-yaml slurmctld slurmd slurm-client munge
)

if [[ ${1:-} == --reference ]]; then
  PACKAGES+=(python3-torch)
elif [[ $# -gt 0 ]]; then
  echo "usage: deploy/install-deps.sh [--reference]" >&2
  exit 2
fi

missing=()
for p in "${PACKAGES[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "installed" ]] || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# The package lists may be stale or absent on a fresh machine; refresh them once per install.
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# The Slurm and munge packages are here for a test that runs its own private Slurm: on a
# machine booted with systemd, do not leave the daemons apt just enabled running (without a
# slurm.conf they only fail). Daemons that were installed before are left alone.
if [[ -d /run/systemd/system ]]; then
  for unit in slurmctld slurmd munge; do
    if [[ " ${missing[*]} " == *" $unit "* ]]; then
      $SUDO systemctl disable --now "$unit" >/dev/null 2>&1 || true
    fi
  done
fi
echo "install-deps: done" >&2
