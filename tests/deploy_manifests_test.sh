#!/usr/bin/env bash
# deploy/systemd/ and deploy/k8s/ checked against the binaries of BUILD_DIR:
#  1. `systemd-analyze verify` on every unit (a template as an instance: pith-store@store0),
#     its /usr/local/bin/pith-* replaced by BUILD_DIR's binaries; a failure or any warning
#     about a unit (an unknown key, a value it cannot parse) fails the test.
#  2. every --flag a unit's ExecStart, its Environment= or an env/*.env file (PITH_*_ARGS)
#     and every k8s container's command/args pass to pith-coordinator, pith-store or
#     pith-worker is one that binary's --helpfull lists; each unknown one is named. Also:
#     every ${VAR} of an ExecStart has a default, and every $(VAR) of a container its env
#     entry.
#  3. the k8s YAML parses (python3-yaml) and has its shape: one Recreate coordinator on a
#     claim, stores with a claim each behind a headless Service, TLS and data paths on
#     mounts, scrape annotations on the metrics ports. With kubectl: `kubectl kustomize`
#     renders deploy/k8s (and with the gpu component), checked again as rendered, and
#     tls-secrets.sh turns `pith certs` output into the Secrets the pods mount.
# usage: tests/deploy_manifests_test.sh BUILD_DIR [DEPLOY_DIR]
# (DEPLOY_DIR, default deploy/: check a copy.) Exit 77 (skip) without systemd-analyze or
# python3-yaml.
set -euo pipefail
BUILD=$(cd "${1:?usage: deploy_manifests_test.sh BUILD_DIR [DEPLOY_DIR]}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DEPLOY=$(cd "${2:-$ROOT/deploy}" && pwd)

command -v systemd-analyze >/dev/null || { echo "SKIP: no systemd-analyze (Debian: systemd)"; exit 77; }
python3 -c 'import yaml' 2>/dev/null || { echo "SKIP: no python3 yaml module (Debian: python3-yaml)"; exit 77; }

declare -A BIN=(
  [pith-coordinator]=$BUILD/server/coordinator/pith-coordinator
  [pith-store]=$BUILD/server/store/pith-store
  [pith-worker]=$BUILD/worker/pith-worker
)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail=0

# --- the flags each binary knows ------------------------------------------------------
mkdir -p "$TMP/flags"
for name in "${!BIN[@]}"; do
  [[ -x ${BIN[$name]} ]] || { echo "FAIL: no binary ${BIN[$name]}"; exit 1; }
  # --helpfull exits 1 after printing; the flag list is what matters.
  "${BIN[$name]}" --helpfull 2>&1 | sed -n 's/^ *--\([A-Za-z0-9_]*\) (.*/\1/p' >"$TMP/flags/$name" || true
  (($(wc -l <"$TMP/flags/$name") >= 5)) || { echo "FAIL: $name --helpfull lists no flags"; exit 1; }
done

# --- 1. systemd-analyze verify ----------------------------------------------------------
mkdir -p "$TMP/units"
units=("$DEPLOY"/systemd/*.service)
[[ -e ${units[0]} ]] || { echo "FAIL: no units in $DEPLOY/systemd"; exit 1; }
for unit in "${units[@]}"; do
  base=$(basename "$unit")
  grep -Eq '^ExecStart=/usr/local/bin/pith-(coordinator|store|worker) ' "$unit" ||
    { echo "FAIL: $base: ExecStart is not /usr/local/bin/pith-coordinator|store|worker"; fail=1; }
  sed -e "s#/usr/local/bin/pith-coordinator#${BIN[pith-coordinator]}#g" \
      -e "s#/usr/local/bin/pith-store#${BIN[pith-store]}#g" \
      -e "s#/usr/local/bin/pith-worker#${BIN[pith-worker]}#g" "$unit" >"$TMP/units/$base"
done
for unit in "$TMP"/units/*.service; do
  base=$(basename "$unit")
  case $base in  # a template is verified as an instance
    pith-store@.service) base=pith-store@store0.service ;;
    pith-worker@.service) base=pith-worker@worker0.service ;;
    *@.service) base=${base%@.service}@test0.service ;;
  esac
  rc=0
  out=$(cd "$TMP/units" && SYSTEMD_LOG_COLOR=0 systemd-analyze verify --man=no "./$base" 2>&1) || rc=$?
  bad=$(grep -F -e "$TMP/units" -e "$base" <<<"$out" || true)
  if ((rc != 0)) || [[ -n $bad ]]; then
    echo "FAIL: systemd-analyze verify $base (rc $rc):"
    sed -e "s#$TMP/units#$DEPLOY/systemd#g" -e 's/^/    /' <<<"$out"
    fail=1
  else
    [[ -z $out ]] || sed 's/^/    note: /' <<<"$out"
    echo "ok: systemd-analyze verify $base"
  fi
done

# --- kubectl: render, and the Secrets from `pith certs` output ----------------------------
if command -v kubectl >/dev/null; then
  if kubectl kustomize "$DEPLOY/k8s" >"$TMP/rendered.yaml" 2>"$TMP/kustomize.err"; then
    echo "ok: kubectl kustomize deploy/k8s"
  else
    echo "FAIL: kubectl kustomize deploy/k8s:"; sed 's/^/    /' "$TMP/kustomize.err"; fail=1
    rm -f "$TMP/rendered.yaml"
  fi
  if [[ -d $DEPLOY/k8s/gpu ]]; then
    mkdir -p "$TMP/overlay/k8s" "$TMP/overlay/gpu"
    cp -r "$DEPLOY/k8s/." "$TMP/overlay/k8s/"
    printf 'resources: [../k8s]\ncomponents: [../k8s/gpu]\n' >"$TMP/overlay/gpu/kustomization.yaml"
    if kubectl kustomize "$TMP/overlay/gpu" >"$TMP/rendered-gpu.yaml" 2>"$TMP/kustomize.err" &&
        grep -q 'nvidia.com/gpu: 1' "$TMP/rendered-gpu.yaml"; then
      echo "ok: kubectl kustomize with the gpu component"
    else
      echo "FAIL: kubectl kustomize with the gpu component:"; sed 's/^/    /' "$TMP/kustomize.err"; fail=1
      rm -f "$TMP/rendered-gpu.yaml"
    fi
  fi
  PITH=$BUILD/client/pith
  if [[ -x $DEPLOY/k8s/tls-secrets.sh && -x $PITH ]]; then
    tls=$TMP/tls
    "$PITH" certs --dir "$tls" --role coordinator --name coordinator --hosts pith-coordinator >/dev/null
    "$PITH" certs --dir "$tls" --role member --name pith-store-0,pith-store-1,pith-worker-0,pith-worker-1 >/dev/null
    if "$DEPLOY/k8s/tls-secrets.sh" "$tls" >"$TMP/secrets.yaml" 2>"$TMP/secrets.err"; then
      echo "ok: tls-secrets.sh"
    else
      echo "FAIL: tls-secrets.sh:"; sed 's/^/    /' "$TMP/secrets.err"; fail=1
      rm -f "$TMP/secrets.yaml"
    fi
  fi
else
  echo "note: no kubectl: kustomize rendering and tls-secrets.sh not checked"
fi

# --- 2 and 3: flags, YAML, shape ------------------------------------------------------------
python3 - "$DEPLOY" "$TMP" <<'PY' || fail=1
import glob, os, re, shlex, sys
import yaml

deploy, tmp = sys.argv[1], sys.argv[2]
BINS = ("pith-coordinator", "pith-store", "pith-worker")
known = {b: set(open(os.path.join(tmp, "flags", b)).read().split()) for b in BINS}
errors = []
seen = {}  # (source, binary) -> invocations checked


def err(msg):
    errors.append(msg)


def check_flags(where, binary, tokens):
    """Every -flag / --flag[=v] token is one of binary's (absl: --noBOOL too)."""
    seen[(where.split(":")[0], binary)] = seen.get((where.split(":")[0], binary), 0) + 1
    flags = {}
    for tok in tokens:
        if not tok.startswith("-") or tok in ("-", "--"):
            continue
        name, _, value = tok.lstrip("-").partition("=")
        flags[name] = value
        if name in known[binary] or (name.startswith("no") and name[2:] in known[binary]):
            continue
        err(f"{where}: {binary} has no flag --{name} (not in its --helpfull)")
    return flags


# --- systemd units and env files
def unit_lines(path):
    """Logical lines of a unit file (comments dropped, continuations joined)."""
    out, cur = [], ""
    for raw in open(path):
        line = raw.rstrip("\n")
        if not cur and line.lstrip().startswith(("#", ";")):
            continue
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out + ([cur] if cur else [])


def args_var_binary(var):
    m = re.fullmatch(r"PITH_([A-Z]+)_ARGS", var)
    return "pith-" + m.group(1).lower() if m and "pith-" + m.group(1).lower() in BINS else None


for unit in sorted(glob.glob(os.path.join(deploy, "systemd", "*.service"))):
    where = "systemd:" + os.path.basename(unit)
    env, execs = {}, []
    for line in unit_lines(unit):
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key.strip() == "Environment":
            for assign in shlex.split(value):
                k, _, v = assign.partition("=")
                env[k] = v
        elif key.strip().startswith("Exec"):
            execs.append((key.strip(), value.strip().lstrip("@-:+!|")))
    found = False
    for key, cmd in execs:
        argv = shlex.split(cmd)
        binary = os.path.basename(argv[0]) if argv else ""
        if binary not in BINS:
            continue
        found = True
        check_flags(f"{where} {key}", binary, argv[1:])
        for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", cmd):
            if var not in env:
                err(f"{where} {key}: ${var} has no default (Environment={var}=...)")
    if not found:
        err(f"{where}: no ExecStart of {', '.join(BINS)}")
    for var, value in env.items():
        if args_var_binary(var):
            check_flags(f"{where} Environment {var}", args_var_binary(var), shlex.split(value))

for envfile in sorted(glob.glob(os.path.join(deploy, "systemd", "env", "*.env"))):
    for n, line in enumerate(open(envfile), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        var, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            err(f"systemd:env/{os.path.basename(envfile)}:{n}: not VAR=value: {line}")
        elif args_var_binary(var):
            check_flags(f"systemd:env/{os.path.basename(envfile)}:{n}", args_var_binary(var),
                        shlex.split(value))


# --- Kubernetes manifests
def pod_specs(doc):
    """(workload, pod spec) of a Deployment/StatefulSet/... or a bare Pod."""
    spec = doc.get("spec") or {}
    if doc.get("kind") == "Pod":
        return [spec]
    tmpl = (spec.get("template") or {}).get("spec")
    return [tmpl] if tmpl else []


def invocation(container):
    cmd = container.get("command") or []
    if cmd and os.path.basename(str(cmd[0])) in BINS:
        return os.path.basename(cmd[0]), [str(a) for a in cmd[1:] + (container.get("args") or [])]
    if not cmd and container.get("args") and "pith" in str(container.get("image", "")):
        return "unknown", []
    return None, []


def under(path, mounts):
    return any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts)


def check_k8s(source, docs, shape):
    services = {d["metadata"]["name"]: d for d in docs if d.get("kind") == "Service"}
    for doc in docs:
        kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
        where = f"{source}:{kind}/{name}"
        for pod in pod_specs(doc):
            volumes = {v["name"]: v for v in pod.get("volumes") or []}
            claims = {c["metadata"]["name"] for c in (doc.get("spec") or {}).get("volumeClaimTemplates") or []}
            for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
                binary, argv = invocation(c)
                if binary is None:
                    continue
                cw = f"{where} container {c.get('name')}"
                if binary == "unknown":
                    err(f"{cw}: args without command: give command: [/usr/local/bin/pith-...]")
                    continue
                flags = check_flags(cw, binary, argv)
                env = {e["name"] for e in c.get("env") or []}
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(argv)):
                    if var not in env:
                        err(f"{cw}: $({var}) is not in its env: Kubernetes leaves it as is")
                if not shape:
                    continue
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts") or []}
                for flag in ("tls_dir", "data_dir", "scratch_dir"):
                    if flag in flags and not under(flags[flag].replace("$(POD_NAME)", "x"), mounts):
                        err(f"{cw}: --{flag}={flags[flag]} is on no volumeMount")
                if "tls_dir" not in flags:
                    err(f"{cw}: no --tls_dir")
                port = flags.get("metrics_port")
                notes = (((doc.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("annotations") or {}
                if port and port != "-1" and (notes.get("prometheus.io/scrape") != "true" or notes.get("prometheus.io/port") != port):
                    err(f"{cw}: --metrics_port={port} without prometheus.io/scrape \"true\" and prometheus.io/port \"{port}\"")
                if "data_dir" in flags:
                    vol = next((mounts[m] for m in sorted(mounts, key=len, reverse=True)
                                if under(flags["data_dir"].replace("$(POD_NAME)", "x"), [m])), None)
                    persistent = vol in claims or "persistentVolumeClaim" in volumes.get(vol, {})
                    if not persistent:
                        err(f"{cw}: --data_dir is not on a PersistentVolumeClaim")
                if binary == "pith-coordinator":
                    if kind != "Deployment" or doc["spec"].get("replicas") != 1 or \
                            (doc["spec"].get("strategy") or {}).get("type") != "Recreate":
                        err(f"{where}: the coordinator must be a Deployment, replicas 1, strategy Recreate")
                if binary == "pith-store":
                    svc = services.get(doc["spec"].get("serviceName"))
                    if kind != "StatefulSet" or not claims or not svc or svc["spec"].get("clusterIP") != "None":
                        err(f"{where}: stores must be a StatefulSet with volumeClaimTemplates and a headless serviceName Service")
                    if not pod.get("setHostnameAsFQDN"):
                        err(f"{where}: a store advertises its host name: set setHostnameAsFQDN")


def load(path):
    try:
        return [d for d in yaml.safe_load_all(open(path)) if d is not None]
    except yaml.YAMLError as e:
        err(f"{os.path.relpath(path, deploy)}: not YAML: {e}")
        return []


raw = []
for path in sorted(glob.glob(os.path.join(deploy, "k8s", "**", "*.y*ml"), recursive=True)):
    for doc in load(path):
        rel = os.path.relpath(path, deploy)
        if not isinstance(doc, dict) or "apiVersion" not in doc or "kind" not in doc:
            err(f"k8s:{rel}: a document without apiVersion and kind")
            continue
        if doc["kind"] not in ("Kustomization", "Component") and not (doc.get("metadata") or {}).get("name"):
            err(f"k8s:{rel}: {doc['kind']} without metadata.name")
        if doc["kind"] in ("Kustomization", "Component"):
            for res in doc.get("resources", []) + [p["path"] for p in doc.get("patches", []) if "path" in p]:
                if not os.path.exists(os.path.join(os.path.dirname(path), res)):
                    err(f"k8s:{rel}: {res} does not exist")
        elif "/gpu/" not in path:  # the component's patch is a fragment
            raw.append(doc)
check_k8s("k8s", raw, shape=True)

for name in ("rendered.yaml", "rendered-gpu.yaml"):
    if os.path.exists(os.path.join(tmp, name)):
        check_k8s("k8s(" + name + ")", load(os.path.join(tmp, name)), shape=False)

secrets_path = os.path.join(tmp, "secrets.yaml")
if os.path.exists(secrets_path):
    secrets = {d["metadata"]["name"]: d.get("data") or {} for d in load(secrets_path)}
    for doc in raw:
        for pod in pod_specs(doc):
            for v in pod.get("volumes") or []:
                sname = (v.get("secret") or {}).get("secretName")
                if not sname:
                    continue
                keys = secrets.get(sname)
                where = f"k8s:{doc['kind']}/{doc['metadata']['name']}"
                if keys is None:
                    err(f"{where}: mounts Secret {sname}, which tls-secrets.sh does not make")
                    continue
                # A StatefulSet's pod N picks NAME-N.cert.pem / .key.pem; others mount ca/cert/key.
                want = ["ca.pem"] + ([f"{doc['metadata']['name']}-0.cert.pem", f"{doc['metadata']['name']}-0.key.pem"]
                                     if doc["kind"] == "StatefulSet" else ["cert.pem", "key.pem"])
                for key in want:
                    if key not in keys:
                        err(f"{where}: Secret {sname} from tls-secrets.sh has no {key}")

for source in ("systemd", "k8s"):
    for b in BINS:
        if not seen.get((source, b)):
            err(f"{source}: no invocation of {b} found (nothing of it was checked)")

for e in errors:
    print("FAIL: " + e)
checked = sum(seen.values())
print(f"{'ok' if not errors else 'FAIL'}: flags of {checked} invocations checked against --helpfull; "
      f"{len(errors)} problem(s)")
sys.exit(1 if errors else 0)
PY

if ((fail)); then
  echo "deploy_manifests_test: FAIL"
  exit 1
fi
echo "deploy_manifests_test: OK"
