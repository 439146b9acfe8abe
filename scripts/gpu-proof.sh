#!/usr/bin/env bash
# The proof of weft's GPU enforcement on real hardware, on a machine with an NVIDIA GPU and driver, its output in
# one folder. Two modes:
#
#   (default)      `weft gpu-check --json` (with its live test) and the NVML backend contract suite
#   --whole-path   a GPU pod's whole path (python -m bench.gpu_whole_path): containerd 2 and runc, the driver's
#                  CDI spec written by the NVIDIA container toolkit (nvidia-ctk, with its nvidia-cdi-hook), the
#                  agent's CRI socket, the weft handler and OCI hook, the broker on NVML with MPS; two opted-in
#                  pods sharing the GPU at 25 % and 50 %, a plain pod with the whole GPU, the CDI spec missing,
#                  an MPS daemon killed under a running pod; then the node as the GPU Operator's toolkit leaves it
#                  (NVIDIA's nvidia-container-runtime, CDI mode, containerd's default and run by the weft handler):
#                  from an image setting NVIDIA_VISIBLE_DEVICES=all, an opted-in container without a lease sees no
#                  GPU, a leased one its lease, a plain one every GPU
#   --value        the founding promise (python -m bench.gpu_value): the same N two-stage pods (a CPU stage that
#                  decodes and resizes images, a GPU stage running CUDA work per batch) for the same wall time
#                  each way on this GPU, bundled (not opted in, the whole GPU each, one after another) and split
#                  by weft (opted in, each GPU stage a share of the GPU, each CPU stage rerouted to a CPU node: two
#                  test nodes on CPUs apart from the GPU node's); items per GPU-hour, the GPU's activity (NVML, and
#                  SM activity by GPM where the GPU has it), memory, GPU-seconds held and active per pod and the
#                  GPU node's CPU, side by side, and record.om, the samples in dcgm-exporter's and the broker's
#                  names. WEFT_VALUE_ARGS adds bench.gpu_value's flags (default "--pods 4 --window 120"; add
#                  --kill-one for the fault). Where Prometheus is (not on the GPU machine, as a rule):
#                  python -m bench.gpu_value --report OUT_DIR backfills one from record.om and runs weft report
#
#   scripts/gpu-proof.sh --prepare [--whole-path | --value]
#        on a machine that reaches PyPI (and, for --whole-path and --value, the Go module proxy): download what the
#        proof imports into dist/gpu-proof-wheels (WEFT_PROOF_PYTHONS="3.11 3.12" adds wheels for other Python
#        versions, default: this machine's). --whole-path (or --value, the same carry) adds every runtime
#        dependency of weft (the agent runs)
#        and packs dist/gpu-proof-carry.tar.xz: containerd, its runc shim and ctr (the checkout's containerd 2
#        pin, components/containerd/build.sh), runc with its libseccomp, iproute2's ip with its libraries and
#        busybox-static (this machine's, from Debian's packages), nvidia-ctk and nvidia-cdi-hook (built from the
#        Go module github.com/NVIDIA/nvidia-container-toolkit at NVIDIA_CTK_VERSION), nvidia-container-runtime
#        (the same module and version, components/nvidia-toolkit/build.sh 1.20), the native OCI hook
#        (hooks/native.py), and the CNI plugins the test nodes' pods need (bridge, host-local, loopback, portmap:
#        this machine's, Debian's containernetworking-plugins)
#   scripts/gpu-proof.sh [--whole-path | --value] [OUT_DIR]
#        on the GPU machine, as root, from the source checkout with dist/ beside it; reaches no registry.
#        OUT_DIR defaults to bench/results/gpu-proof-<UTC time> (gpu-whole-path-<UTC time> with --whole-path,
#        gpu-value-<UTC time> with --value)
#
# It installs nothing system-wide: the wheels go into a temporary directory on PYTHONPATH, the carried binaries
# into another on PATH, and weft runs from this checkout. Every step has a time limit (a run stays under ten
# minutes); a failed step is recorded in OUT_DIR/summary.txt and the others still run. Exit 0 when the mode's
# checks all passed (gpu-check failed no check and the contract suite passed with the NVML backend run, not
# skipped; or every whole-path check passed; or the value run measured both windows and left nothing), else 1;
# 2 when it cannot start (no Python 3.11+, no wheels, no carry; for --value also a GPU missing or busy).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/dist/gpu-proof-wheels"
CARRY="$ROOT/dist/gpu-proof-carry.tar.xz"
NVIDIA_CTK_VERSION=v1.20.2
PY="${PYTHON:-python3}"
# What gpu-check and the contract suite import (weft itself runs from the checkout): grpc and protobuf for the
# broker, structlog for logs, prometheus-client for the broker's metrics, psutil, nvidia-ml-py, pytest; and pip,
# run from its own wheel to install them where no pip is.
PACKAGES=(grpcio protobuf structlog prometheus-client psutil nvidia-ml-py pytest pip)

die() { echo "gpu-proof: $*" >&2; exit 2; }

# Every runtime dependency of weft, by name, as pyproject.toml lists them.
runtime_dependencies() {
  "$PY" -c '
import re, sys, tomllib
for dep in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]:
    print(re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0])
' "$ROOT/pyproject.toml"
}

# dist/gpu-proof-carry.tar.xz: what the whole path runs that a GPU machine may lack, built or copied here.
# bin/NAME: libexec/NAME run with the carry's lib/ first on the loader's path (libraries the GPU machine may lack).
wrap() {
  printf '%s\n' '#!/bin/sh' 'here="$(dirname "$(readlink -f "$0")")/.."' \
    "LD_LIBRARY_PATH=\"\$here/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}\" exec \"\$here/libexec/$1\" \"\$@\"" \
    > "$out/bin/$1"
  chmod 755 "$out/bin/$1"
}

prepare_carry() {
  local tmp out line_bin seccomp toolkit_bin
  tmp="$(mktemp -d /tmp/weft-gpu-carry.XXXXXX)"
  out="$tmp/gpu-proof-carry"
  mkdir -p "$out/bin" "$out/libexec" "$out/lib"
  line_bin="$(bash "$ROOT/components/containerd/build.sh" 2 | tail -n 1)" || die "components/containerd/build.sh 2 failed"
  cp "$line_bin/containerd" "$line_bin/containerd-shim-runc-v2" "$out/bin/" || die "no containerd in $line_bin"
  # ctr from the same module and pins: the harness imports images and reads the default OCI spec with it.
  (cd "$ROOT/components/containerd/2" && CGO_ENABLED=0 go build -tags "no_btrfs no_devmapper no_zfs no_aufs" \
    -ldflags "-s -w" -o "$out/bin/" github.com/containerd/containerd/v2/cmd/ctr) || die "building ctr failed"
  GOBIN="$out/bin" CGO_ENABLED=1 go install -trimpath -ldflags "-s -w" \
    "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk@$NVIDIA_CTK_VERSION" \
    "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-cdi-hook@$NVIDIA_CTK_VERSION" \
    || die "building nvidia-ctk $NVIDIA_CTK_VERSION failed"
  # NVIDIA's runtime, as the GPU Operator's toolkit installs it (the proof runs it in CDI mode: it needs no
  # libnvidia-container), from the toolkit line the tests build, which must be the version nvidia-ctk is.
  toolkit_bin="$(bash "$ROOT/components/nvidia-toolkit/build.sh" 1.20 | tail -n 1)" \
    || die "components/nvidia-toolkit/build.sh 1.20 failed"
  cp "$toolkit_bin/nvidia-container-runtime" "$out/bin/" || die "no nvidia-container-runtime in $toolkit_bin"
  [ "$("$out/bin/nvidia-container-runtime" --version | head -n 1)" \
    = "NVIDIA Container Runtime version ${NVIDIA_CTK_VERSION#v}" ] \
    || die "nvidia-container-runtime is not $NVIDIA_CTK_VERSION (pinned in components/nvidia-toolkit/versions.env)"
  # Debian's runc loads libseccomp, which the GPU machine may not have: both go, runc behind a wrapper.
  cp "$(command -v runc)" "$out/libexec/runc" || die "no runc here"
  seccomp="$(ldd "$(command -v runc)" | awk '/libseccomp/ {print $3}')"
  [ -z "$seccomp" ] || cp -L "$seccomp" "$out/lib/"
  wrap runc
  cp /bin/busybox "$out/bin/busybox" || die "no /bin/busybox here (Debian's busybox-static)"
  # iproute2's ip (the node's network namespace; a GPU machine may have none), its libraries behind a wrapper.
  cp "$(command -v ip)" "$out/libexec/ip" || die "no ip here (Debian's iproute2)"
  ldd "$(command -v ip)" | awk '/=>/ {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in libc.so.*|ld-linux*) ;; *) cp -L "$lib" "$out/lib/" ;; esac
  done
  wrap ip
  # The CNI plugins the value run's test nodes give their pods a network with (WEFT_CNI_BIN points at them).
  mkdir -p "$out/cni"
  for plugin in bridge host-local loopback portmap; do
    cp "/usr/lib/cni/$plugin" "$out/cni/" || die "no /usr/lib/cni/$plugin here (Debian's containernetworking-plugins)"
  done
  # The native OCI hook (static), where hooks.native looks for it once WEFT_CACHE_ROOT names the carry's cache.
  WEFT_CACHE_ROOT="$out/cache" "$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); from hooks import native; native.build()' \
    "$ROOT" || die "building the native OCI hook failed (it needs a C compiler: gcc, libc6-dev)"
  {
    echo "containerd: $("$out/bin/containerd" --version)"
    echo "ctr: $("$out/bin/ctr" --version)"
    echo "runc: $("$out/bin/runc" --version | head -n 1)"
    echo "nvidia-ctk: $("$out/bin/nvidia-ctk" --version | head -n 1)"
    echo "nvidia-container-runtime: $("$out/bin/nvidia-container-runtime" --version | head -n 1)"
    echo "busybox: $("$out/bin/busybox" | head -n 1)"
    echo "ip: $("$out/bin/ip" -V)"
    echo "weft-oci-hook: native, $(find "$out/cache/hook" -name weft-oci-hook | head -n 1 | sed "s|$out/||")"
    echo "cni: $("$out/cni/bridge" 2>&1 | head -n 1)"
  } > "$out/VERSIONS" || die "a carried binary does not run"
  mkdir -p "$(dirname "$CARRY")"
  tar -C "$tmp" -cf - gpu-proof-carry | xz -6 -T0 > "$CARRY.tmp" || die "packing $CARRY failed"
  mv "$CARRY.tmp" "$CARRY"
  cat "$out/VERSIONS"
  rm -rf "$tmp"
  du -h "$CARRY"
}

if [ "${1:-}" = "--prepare" ]; then
  whole=0
  case "${2:-}" in --whole-path|--value) whole=1 ;; esac
  mkdir -p "$WHEELS"
  wanted=("${PACKAGES[@]}")
  if [ "$whole" -eq 1 ]; then
    mapfile -t deps < <(runtime_dependencies)
    [ "${#deps[@]}" -gt 0 ] || die "cannot read the dependencies in $ROOT/pyproject.toml"
    wanted+=("${deps[@]}")
  fi
  # The versions this checkout is tested with, where its virtual environment has them.
  pins=()
  for p in $(printf '%s\n' "${wanted[@]}" | sort -u); do
    v="$("$ROOT/.venv/bin/python" -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')"
    pins+=("${p}${v:+==$v}")
  done
  versions="${WEFT_PROOF_PYTHONS:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}"
  for v in $versions; do
    echo "gpu-proof: wheels for Python $v into $WHEELS"
    "$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: --python-version "$v" \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --implementation cp -d "$WHEELS" "${pins[@]}" || die "pip download for Python $v failed"
  done
  du -sh "$WHEELS"
  if [ "$whole" -eq 1 ]; then prepare_carry; fi
  exit 0
fi

WHOLE=0
VALUE=0
MODE=proof
if [ "${1:-}" = "--whole-path" ]; then
  WHOLE=1
  MODE=whole-path
  shift
elif [ "${1:-}" = "--value" ]; then
  WHOLE=1  # the same carry, wheels and checks before it starts
  VALUE=1
  MODE=value
  shift
fi
OUT="${1:-$ROOT/bench/results/gpu-$MODE-$(date -u +%Y%m%dT%H%M%SZ)}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "$PY is not Python 3.11 or newer (weft needs it); set PYTHON=/path/to/python3.11+"
ls "$WHEELS"/pip-*.whl >/dev/null 2>&1 || die "no wheels in $WHEELS: run scripts/gpu-proof.sh --prepare first"
if [ "$WHOLE" -eq 1 ]; then
  [ -f "$CARRY" ] || die "no $CARRY: run scripts/gpu-proof.sh --prepare --$MODE first"
  [ "$(id -u)" -eq 0 ] || die "the $MODE run runs containerd, runc and the broker: run it as root"
  # What the carry does not bring and the harness runs: entering the node's network namespace (nsenter; ip is
  # carried), the MPS daemons' private /dev/shm (unshare, mount), the client image's libraries (ldd), the carry
  # itself (tar, xz); for the value run's test nodes, their CPUs (taskset) and forwarding (sysctl).
  tools=(nsenter unshare mount ldd tar xz)
  [ "$VALUE" -eq 1 ] && tools+=(taskset sysctl)
  missing=()
  for tool in "${tools[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ "${#missing[@]}" -eq 0 ] || die "the $MODE run needs ${missing[*]} on PATH, which this machine lacks"
  mapfile -t DEPS < <(runtime_dependencies)
else
  [ "$(id -u)" -eq 0 ] || echo "gpu-proof: not root: gpu-check's live test will fail (it needs cgroups and mount namespaces)" >&2
  DEPS=()
fi
mkdir -p "$OUT" || die "cannot make $OUT"
SITE="$(mktemp -d /tmp/weft-gpu-proof.XXXXXX)"
trap 'rm -rf "$SITE"' EXIT
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"
# WEFT_PROOF_COMMIT: the commit the tree is, where it was copied without its history (a GPU machine reached
# through a file copy may carry an older .git beside a newer tree).
summary "weft GPU proof$([ "$MODE" != proof ] && echo ", $MODE"), $(date -u +%FT%TZ), commit ${WEFT_PROOF_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"

# 1. What the proof runs with.
{
  echo "## uname"; uname -a
  echo "## python"; "$PY" -VV
  echo "## nvidia-smi -L"; timeout 30 nvidia-smi -L 2>&1
  echo "## nvidia-smi -q"; timeout 60 nvidia-smi -q 2>&1
  echo "## nvidia-cuda-mps-control"; command -v nvidia-cuda-mps-control nvidia-cuda-mps-server 2>&1
} > "$OUT/environment.txt" 2>&1

# 2. The wheels, offline, into a directory of their own.
if ! timeout 120 "$PY" "$(ls "$WHEELS"/pip-*.whl | head -n1)/pip" install -q --disable-pip-version-check \
    --no-index --find-links "$WHEELS" --target "$SITE/python" "${PACKAGES[@]:0:${#PACKAGES[@]}-1}" "${DEPS[@]}" \
    > "$OUT/install.txt" 2>&1; then
  summary "install: FAILED (see install.txt; are there wheels for $("$PY" -V) in $WHEELS?)"
  exit 2
fi
export PYTHONPATH="$SITE/python:$ROOT"
cd "$ROOT" || die "cannot enter $ROOT"

if [ "$WHOLE" -eq 1 ]; then
  # 3. The carried binaries, on PATH first: containerd's harness finds containerd, its shim, ctr and runc there.
  tar -C "$SITE" -xJf "$CARRY" || die "cannot unpack $CARRY"
  BIN="$SITE/gpu-proof-carry/bin"
  cp "$SITE/gpu-proof-carry/VERSIONS" "$OUT/carried-versions.txt"
  export PATH="$BIN:$PATH" WEFT_CONTAINERD_BIN="$BIN" WEFT_BUSYBOX="$BIN/busybox" \
    WEFT_HARNESS_CACHE="$SITE/harness-cache" WEFT_CACHE_ROOT="$SITE/gpu-proof-carry/cache"
  if [ "$VALUE" -eq 1 ]; then
    [ -x "$SITE/gpu-proof-carry/cni/bridge" ] || die "$CARRY has no CNI plugins: run scripts/gpu-proof.sh --prepare --value again"
    export WEFT_CNI_BIN="$SITE/gpu-proof-carry/cni"
    # 4. The value run: bench.gpu_value measures both windows, records and cleans up after itself.
    read -r -a value_args <<< "${WEFT_VALUE_ARGS:---pods 4 --window 120}"
    timeout -k 30 400 "$PY" -m bench.gpu_value --out "$OUT" "${value_args[@]}" --nvidia-ctk "$BIN/nvidia-ctk" \
      --cdi-hook "$BIN/nvidia-cdi-hook" > "$OUT/value.out" 2> "$OUT/value.log"
    rc=$?
    cat "$OUT/value.out" >> "$OUT/summary.txt"
    cat "$OUT/value.out"
    if [ "$rc" -eq 2 ]; then
      summary "result: the value run could not start: $(tail -n 1 "$OUT/value.log") (nothing was made)"
      exit 2
    fi
    if command -v prometheus >/dev/null && command -v promtool >/dev/null && [ -f "$OUT/record.om" ]; then
      timeout 120 "$PY" -m bench.gpu_value --report "$OUT" >> "$OUT/value.log" 2>&1
      summary "weft report on the record: exit $? (report.md)"
    else
      summary "no Prometheus here: run python -m bench.gpu_value --report $OUT where it is (the record is record.om)"
    fi
    if [ "$rc" -eq 0 ]; then
      summary "result: measured on this machine (see $OUT)"
      exit 0
    fi
    summary "result: the value run NOT measured: exit $rc (see $OUT, value.log)"
    exit 1
  fi
  # 4. The whole path: bench.gpu_whole_path checks, records and cleans up after itself.
  timeout 540 "$PY" -m bench.gpu_whole_path --out "$OUT" --nvidia-ctk "$BIN/nvidia-ctk" \
    --cdi-hook "$BIN/nvidia-cdi-hook" --nvidia-runtime "$BIN/nvidia-container-runtime" \
    > "$OUT/whole-path.out" 2> "$OUT/whole-path.log"
  rc=$?
  cat "$OUT/whole-path.out" >> "$OUT/summary.txt"
  cat "$OUT/whole-path.out"
  if [ "$rc" -eq 0 ]; then
    summary "result: the whole path proven on this machine (see $OUT)"
    exit 0
  fi
  summary "result: the whole path NOT proven: exit $rc (see $OUT, whole-path.log)"
  exit 1
fi

# 3. weft gpu-check --json: inventory, MPS, device plugin, and the live test through the broker.
timeout 480 "$PY" -m shim gpu-check --json > "$OUT/gpu-check.out" 2> "$OUT/gpu-check.log"
check_rc=$?
tail -n 1 "$OUT/gpu-check.out" > "$OUT/gpu-check.json"
verdict="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["verdict"])' "$OUT/gpu-check.json" 2>/dev/null \
  || echo "no JSON line")"
summary "gpu-check: exit $check_rc, verdict $verdict (gpu-check.json; its log: gpu-check.log)"
"$PY" - "$OUT/gpu-check.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
for c in doc["checks"]:
    print(f"  {c['result']:<4}  {c['name']}: {c['detail']}")
EOF

# 4. The NVML backend contract suite, on the real driver. The project's warning filters name hypothesis, which
# the proof does not carry; the suite's assertions are what it proves, so warnings are left as Python shows them.
timeout 120 "$PY" -m pytest -p no:cacheprovider -o filterwarnings= -v -rs tests/broker/test_backend_contract.py \
  --junitxml "$OUT/contract.xml" > "$OUT/contract.txt" 2>&1
contract_rc=$?
summary "contract suite: exit $contract_rc ($(tail -n 1 "$OUT/contract.txt"))"
nvml_skipped=0
if grep -q "SKIPPED.*no NVIDIA driver" "$OUT/contract.txt"; then
  nvml_skipped=1
  summary "  the NVML backend was SKIPPED: NVML found no driver, so this run proves nothing about real GPUs"
fi

if [ "$check_rc" -eq 0 ] && [ "$contract_rc" -eq 0 ] && [ "$nvml_skipped" -eq 0 ]; then
  summary "result: proven on this machine (see $OUT)"
  exit 0
fi
summary "result: NOT proven (see $OUT)"
exit 1
