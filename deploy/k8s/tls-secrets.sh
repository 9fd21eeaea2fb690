#!/usr/bin/env bash
# Prints the TLS Secrets of deploy/k8s/ as YAML, made from a `pith certs --dir TLS_DIR`
# directory (never its ca.key), for `kubectl apply -f -`:
#   pith-coordinator-tls  ca.pem, cert.pem, key.pem of TLS_DIR/coordinator/
#   pith-store-tls        ca.pem, and NAME.cert.pem, NAME.key.pem of each TLS_DIR/pith-store-N/
#   pith-worker-tls       ca.pem, and NAME.cert.pem, NAME.key.pem of each TLS_DIR/pith-worker-N/
# A pod picks its own pair by its name. Run it again after issuing certificates for more
# stores or workers, then scale.
#   deploy/k8s/tls-secrets.sh /etc/pith/tls | kubectl apply -f -
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
  echo "usage: deploy/k8s/tls-secrets.sh TLS_DIR [NAMESPACE]   (NAMESPACE: pith)" >&2
  exit 2
fi
dir=${1%/}
ns=${2:-pith}
[[ -f "$dir/ca.pem" ]] || { echo "tls-secrets.sh: $dir holds no ca.pem (make it with pith certs --dir $dir)" >&2; exit 1; }
command -v kubectl >/dev/null || { echo "tls-secrets.sh: needs kubectl" >&2; exit 1; }

secret() {  # NAME FROM-FILE-ARGS...: one Secret, as YAML
  kubectl create secret generic "$1" --namespace "$ns" "${@:2}" --dry-run=client -o yaml
}

[[ -f "$dir/coordinator/cert.pem" ]] || {
  echo "tls-secrets.sh: no $dir/coordinator/cert.pem: pith certs --dir $dir --role coordinator --name coordinator --hosts pith-coordinator,..." >&2
  exit 1
}
secret pith-coordinator-tls --from-file=ca.pem="$dir/ca.pem" \
  --from-file=cert.pem="$dir/coordinator/cert.pem" --from-file=key.pem="$dir/coordinator/key.pem"

for kind in store worker; do
  args=(--from-file=ca.pem="$dir/ca.pem")
  n=0
  for member in "$dir"/pith-"$kind"-*/; do
    [[ -f "$member/cert.pem" && -f "$member/key.pem" ]] || continue
    name=$(basename "$member")
    args+=(--from-file="$name.cert.pem=$member/cert.pem" --from-file="$name.key.pem=$member/key.pem")
    n=$((n + 1))
  done
  if ((n == 0)); then
    echo "tls-secrets.sh: no $dir/pith-$kind-N/ certificates: pith certs --dir $dir --role member --name pith-$kind-0,..." >&2
    exit 1
  fi
  echo "---"
  secret "pith-$kind-tls" "${args[@]}"
  echo "tls-secrets.sh: pith-$kind-tls holds $n certificate(s)" >&2
done
