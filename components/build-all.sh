#!/usr/bin/env bash
# Every build the integration tests need, one after the other, in the order the tests need them: the Kubernetes
# components (the first kube tests), containerd 1.7 and 2.x (the installer's tests and the smoke runs), NVIDIA's
# container toolkit (the tests of weft beside the GPU Operator), the DRA binaries, Helm (the chart's tests), Kueue
# (the tests beneath it), the newest Kubernetes release (its smoke run last) and the cluster's node root
# (integration/nodes). Each answers at once from its cache under ${WEFT_CACHE_ROOT:-/var/cache/weft} and
# builds under that cache's lock when it is not there, so a test that needs a binary meanwhile waits for the
# lock (or builds the one it needs itself) and never finds half a build. scripts/setup.sh runs this in the
# background for scripts/test.sh; WEFT_SETUP_KUBE=1 runs it in the foreground.
#
# Usage: build-all.sh                  build every one not cached, in order
#        build-all.sh --cached         exit 0 if every one is built already, 1 if not (builds nothing)
#        build-all.sh --log-dir DIR    the same, each build's output in DIR/<name>-build.log and how long each
#                                      took in DIR/builds.tsv (name, seconds, exit status)
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# Each build's name (its log's) and script.
BUILDS=(kube:"$HERE/build.sh"
        containerd:"$HERE/containerd/build.sh"
        nvidia-toolkit:"$HERE/nvidia-toolkit/build.sh"
        dra:"$HERE/dra/build.sh"
        helm:"$HERE/helm/build.sh"
        kueue:"$HERE/kueue/build.sh"
        kube-next:"$HERE/next/build.sh"
        syft:"$HERE/syft/build.sh"
        cosign:"$HERE/cosign/build.sh"
        oras:"$HERE/oras/build.sh"
        ociregistry:"$HERE/ociregistry/build.sh"
        noderoot:"$HERE/../harness/nodes/rootfs.sh")
if [ "${1:-}" = --cached ]; then
  for b in "${BUILDS[@]}"; do
    bash "${b#*:}" --cached >/dev/null 2>&1 || exit 1
  done
  exit 0
fi
LOG_DIR=""
if [ "${1:-}" = --log-dir ]; then
  LOG_DIR="${2:?build-all.sh --log-dir: which directory?}"
  mkdir -p "$LOG_DIR"
  : >"$LOG_DIR/builds.tsv"
fi
failed=0
for b in "${BUILDS[@]}"; do
  name="${b%%:*}" script="${b#*:}"
  started=$(date +%s)
  if [ -n "$LOG_DIR" ]; then
    bash "$script" >"$LOG_DIR/$name-build.log" 2>&1
  else
    bash "$script" >&2
  fi
  rc=$?
  [ "$rc" -eq 0 ] || failed=1
  [ -z "$LOG_DIR" ] || printf '%s\t%s\t%s\n' "$name" "$(( $(date +%s) - started ))" "$rc" >>"$LOG_DIR/builds.tsv"
done
exit "$failed"
