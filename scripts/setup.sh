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
              gcc libc6-dev)  # the unit tests build a fake libcuda to drive weft gpu-check without a GPU
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

# The Kubernetes components the integration tests run (kubelet, kube-apiserver, kube-scheduler, kubectl,
# etcd, crictl, critest), built from Go modules once per set of pins (components/versions.env) into
# /var/cache/weft/kube, outside the checkout, and reused by every later run and clone on this machine; then
# containerd 1.7 and 2.x (components/containerd/versions.env) into /var/cache/weft/containerd the same way, for
# the smoke runs against them (Debian's 1.6 runs the rest); then kube-controller-manager and the test DRA
# driver (components/dra/build.sh, a cache key of its own in /var/cache/weft/dra, so it never rebuilds the kube set)
# for the DRA test; Helm (components/helm/build.sh, /var/cache/weft/helm) for the chart's tests; last, the newest
# Kubernetes release (components/next/build.sh) for its smoke run. Only the tests
# need them: scripts/test.sh starts the builds (WEFT_SETUP_KUBE=background:
# one after the other, kube first since its tests come sooner, at the lowest CPU priority, beside the tests
# that do not need them, which run first); WEFT_SETUP_KUBE=1 builds before going on.
if [ "${WEFT_SETUP_KUBE:-0}" = 1 ]; then
  bash "$ROOT/components/build.sh" >&2
  bash "$ROOT/components/containerd/build.sh" >&2
  bash "$ROOT/components/dra/build.sh" >&2
  bash "$ROOT/components/helm/build.sh" >&2
  bash "$ROOT/components/next/build.sh" >&2
elif [ "${WEFT_SETUP_KUBE:-0}" = background ] &&
     ! { bash "$ROOT/components/build.sh" --cached && bash "$ROOT/components/containerd/build.sh" --cached &&
         bash "$ROOT/components/dra/build.sh" --cached && bash "$ROOT/components/helm/build.sh" --cached &&
         bash "$ROOT/components/next/build.sh" --cached; } >/dev/null; then
  mkdir -p "$VENV/log"
  echo "weft: building the Kubernetes components, containerd 1.7/2.x, the DRA test binaries, Helm and the" \
    "newest Kubernetes release in the background (logs: $VENV/log/kube-build.log," \
    "$VENV/log/containerd-build.log, $VENV/log/dra-build.log, $VENV/log/helm-build.log," \
    "$VENV/log/kube-next-build.log)"
  # A session of its own, so that the whole build (go and its compilers) can be stopped as one.
  setsid nice -n 19 bash -c 'bash "$1/kube/build.sh" >"$2/kube-build.log" 2>&1
                             bash "$1/kube/containerd/build.sh" >"$2/containerd-build.log" 2>&1
                             bash "$1/kube/dra/build.sh" >"$2/dra-build.log" 2>&1
                             bash "$1/kube/helm/build.sh" >"$2/helm-build.log" 2>&1
                             bash "$1/kube/next/build.sh" >"$2/kube-next-build.log" 2>&1' \
    _ "$ROOT" "$VENV/log" &
  WEFT_KUBE_BUILD_PID=$!
fi
