#!/usr/bin/env bash
# Installs what weft's demo and tests need, idempotently: Debian packages
# (containerd, runc, CNI plugins, busybox-static for the test images, ...) and a
# virtual environment in .venv with weft and its test tools. Sourced by
# scripts/demo.sh and scripts/test.sh; safe to run again and again.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

if [ "$(id -u)" -ne 0 ]; then
  echo "weft: run this as root (it installs packages and drives containerd, runc and network namespaces)" >&2
  exit 1
fi

APT_PACKAGES=(containerd runc containernetworking-plugins busybox-static iproute2 iptables util-linux
              docker-registry skopeo apache2-utils prometheus faketime
              systemd-container debootstrap  # the test cluster's nodes: systemd booted under systemd-nspawn
              python3 python3-venv python3-pip
              gcc libc6-dev  # the unit tests build a fake libcuda to drive weft gpu-check without a GPU
              gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static)  # the image's arm64 build, run emulated
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "weft: installing Debian packages: ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The machine's python3 if it is new enough, else Debian's.
PY=python3
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  PY=/usr/bin/python3
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "weft: creating $VENV"
  "$PY" -m venv "$VENV"
fi
# Reinstall only when the dependencies changed.
STAMP="$VENV/.weft-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "weft: installing weft and its dependencies into $VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi

# kubectl 1.20 (Debian's kubernetes-client), unpacked into the venv and put on no PATH: the
# integration tests' SPDY client of the streaming relay (newer kubectl speaks WebSocket instead).
KUBECTL_DIR="$VENV/opt/kubernetes-client"
if [ ! -x "$KUBECTL_DIR/usr/bin/kubectl" ]; then
  echo "weft: unpacking kubectl 1.20 (Debian's kubernetes-client) into $KUBECTL_DIR for the tests"
  deb_dir="$(mktemp -d)"
  if ! (cd "$deb_dir" && apt-get download -q kubernetes-client >/dev/null 2>&1); then
    apt-get update -q
    (cd "$deb_dir" && apt-get download -q kubernetes-client)
  fi
  rm -rf "$KUBECTL_DIR.tmp"
  mkdir -p "$VENV/opt"
  dpkg-deb -x "$deb_dir"/kubernetes-client_*.deb "$KUBECTL_DIR.tmp"
  rm -rf "$deb_dir" "$KUBECTL_DIR"
  mv "$KUBECTL_DIR.tmp" "$KUBECTL_DIR"
fi

# What the integration tests build from Go modules and debootstrap (components/build-all.sh names every build, in
# order: the Kubernetes components, containerd 1.7 and 2.x, the DRA binaries, Helm, the newest Kubernetes release,
# the cluster's node root), each once per set of pins into ${WEFT_CACHE_ROOT:-/var/cache/weft}, outside the checkout,
# and reused by every later run and clone on this machine. Only the tests need them: scripts/test.sh starts them
# (WEFT_SETUP_KUBE=background: one after the other, at the lowest CPU priority, beside the tests that do not need
# them, which run first; a test that needs one before it is done waits on its cache's lock or builds it);
# WEFT_SETUP_KUBE=1 builds them before going on.
if [ "${WEFT_SETUP_KUBE:-0}" = 1 ]; then
  bash "$ROOT/components/build-all.sh"
elif [ "${WEFT_SETUP_KUBE:-0}" = background ] && ! bash "$ROOT/components/build-all.sh" --cached; then
  mkdir -p "$VENV/log"
  echo "weft: building what the integration tests run (Kubernetes, containerd 1.7/2.x, the DRA test binaries, Helm," \
    "the newest Kubernetes release, the test nodes' root) in the background, at the lowest priority" \
    "(logs: $VENV/log/*-build.log; times: $VENV/log/builds.tsv)"
  # A session of its own, so that the whole build (go and its compilers) can be stopped as one.
  setsid nice -n 19 bash "$ROOT/components/build-all.sh" --log-dir "$VENV/log" &
  WEFT_KUBE_BUILD_PID=$!
fi
