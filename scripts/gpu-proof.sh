#!/usr/bin/env bash
# The proof of weft's GPU enforcement on real hardware: `weft gpu-check --json` (with its live test) and the
# NVML backend contract suite, on a machine with an NVIDIA GPU and driver, their output in one folder.
#
#   scripts/gpu-proof.sh --prepare     on a machine that reaches PyPI: download what the proof imports into
#                                      dist/gpu-proof-wheels (about 20 MiB; WEFT_PROOF_PYTHONS="3.11 3.12" adds
#                                      wheels for other Python versions, default: this machine's)
#   scripts/gpu-proof.sh [OUT_DIR]     on the GPU machine, as root, from the source checkout with
#                                      dist/gpu-proof-wheels beside it; reaches no registry. OUT_DIR defaults to
#                                      bench/results/gpu-proof-<UTC time>
#
# It installs nothing system-wide: the wheels go into a temporary directory on PYTHONPATH, and weft runs from
# this checkout. Every step has a time limit (the whole run stays under ten minutes); a failed step is recorded
# in OUT_DIR/summary.txt and the others still run. Exit 0 when gpu-check failed no check and the contract suite
# passed with the NVML backend run (not skipped), else 1; 2 when it cannot start (no Python 3.11+, no wheels).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/dist/gpu-proof-wheels"
PY="${PYTHON:-python3}"
# What gpu-check and the contract suite import (weft itself runs from the checkout): grpc and protobuf for the
# broker, structlog for logs, prometheus-client for the broker's metrics, psutil, nvidia-ml-py, pytest; and pip,
# run from its own wheel to install them where no pip is.
PACKAGES=(grpcio protobuf structlog prometheus-client psutil nvidia-ml-py pytest pip)

die() { echo "gpu-proof: $*" >&2; exit 2; }

if [ "${1:-}" = "--prepare" ]; then
  mkdir -p "$WHEELS"
  # The versions this checkout is tested with, where its virtual environment has them.
  pins=()
  for p in "${PACKAGES[@]}"; do
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
  exit 0
fi

OUT="${1:-$ROOT/bench/results/gpu-proof-$(date -u +%Y%m%dT%H%M%SZ)}"
"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "$PY is not Python 3.11 or newer (weft needs it); set PYTHON=/path/to/python3.11+"
ls "$WHEELS"/pip-*.whl >/dev/null 2>&1 || die "no wheels in $WHEELS: run scripts/gpu-proof.sh --prepare first"
[ "$(id -u)" -eq 0 ] || echo "gpu-proof: not root: gpu-check's live test will fail (it needs cgroups and mount namespaces)" >&2
mkdir -p "$OUT" || die "cannot make $OUT"
SITE="$(mktemp -d /tmp/weft-gpu-proof.XXXXXX)"
trap 'rm -rf "$SITE"' EXIT
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"
# WEFT_PROOF_COMMIT: the commit the tree is, where it was copied without its history (a GPU machine reached
# through a file copy may carry an older .git beside a newer tree).
summary "weft GPU proof, $(date -u +%FT%TZ), commit ${WEFT_PROOF_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}"

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
    --no-index --find-links "$WHEELS" --target "$SITE" "${PACKAGES[@]:0:${#PACKAGES[@]}-1}" \
    > "$OUT/install.txt" 2>&1; then
  summary "install: FAILED (see install.txt; are there wheels for $("$PY" -V) in $WHEELS?)"
  exit 2
fi
export PYTHONPATH="$SITE:$ROOT"
cd "$ROOT" || die "cannot enter $ROOT"

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
