#!/usr/bin/env bash
# The whole test suite: lint, layer contracts, unit tests, integration tests
# against real containerd/runc (each test makes and removes its own).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WEFT_SETUP_KUBE=background source "$ROOT/scripts/setup.sh"
# What a cold machine paid for its builds: each background build's time (components/build-all.sh writes them) and
# each time a test waited for a build or built one itself (shim/localfabric/builds.py appends them).
mkdir -p "$VENV/log"
export WEFT_BUILD_WAITS="$VENV/log/build-waits.tsv"
: >"$WEFT_BUILD_WAITS"
finish() {
  set +e  # a trap that stops at its first failing command would say nothing
  # A background build ends with this script, whatever happens.
  if [ -n "${WEFT_KUBE_BUILD_PID:-}" ]; then
    kill -- "-$WEFT_KUBE_BUILD_PID" 2>/dev/null
  fi
  if [ -n "${WEFT_KUBE_BUILD_PID:-}" ] && [ -s "$VENV/log/builds.tsv" ]; then
    echo "weft: background builds (name, seconds, exit status):"
    sed 's/^/  /' "$VENV/log/builds.tsv"
  fi
  if [ -s "$WEFT_BUILD_WAITS" ]; then
    echo "weft: tests waited for a build (script, seconds, pid):"
    sed 's/^/  /' "$WEFT_BUILD_WAITS"
  fi
  true
}
trap finish EXIT
cd "$ROOT"
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
# The tests that run real Kubernetes components go last (integration/conftest.py); by then the builds have had
# the time the others left idle, and each build script waits for its build (a lock) if it has not finished.
# On WEFT_TEST_WORKERS workers (pytest-xdist; 0: one process), a module to a worker, since a module's tests share
# its fabric or cluster: most of the time an integration test waits on daemons, not on the CPU.
# With no arguments, the nodes booted with systemd (integration/nodes: the day-one cluster runs three whole nodes'
# services) run on their own after the rest, as their own pytest: beside them on two cores, the rest's
# throughput- and race-bound tests (a fast writer's log against its cap, a cut link's fencing) were starved.
if [ "$#" -eq 0 ]; then
  "$VENV/bin/pytest" -n "${WEFT_TEST_WORKERS:-3}" --dist loadfile --durations=25 --ignore=integration/nodes
  echo "weft: the cluster of real nodes (integration/nodes; log: $VENV/log/nodes.log)"
  if "$VENV/bin/pytest" -n 2 --dist loadfile -p no:cacheprovider integration/nodes >"$VENV/log/nodes.log" 2>&1; then
    grep -E '^\[weft kube\] day one' "$VENV/log/nodes.log" || true
    tail -n 1 "$VENV/log/nodes.log"
  else
    echo "weft: the cluster of real nodes FAILED:"
    tail -n 80 "$VENV/log/nodes.log"
    exit 1
  fi
else
  "$VENV/bin/pytest" -n "${WEFT_TEST_WORKERS:-3}" --dist loadfile --durations=25 "$@"
fi

# The whole suite ran on Debian's containerd 1.6; a smoke subset runs on each release WEFT_TEST_CONTAINERDS names
# (default "1.7 2", both lines built by components/containerd/build.sh in any case; side by side they add about half a
# minute to 2.x alone): the harness and its config, the pass-through differential,
# a pod's lifecycle through the agent, an opted-in GPU pod and a plain one through the weft handler, one rerouted
# pod under real kubelets, and critest direct vs through the agent. Only for the whole suite (no arguments);
# the releases run side by side, each on two workers: critest is the long pole and mostly waits on daemons.
[ "$#" -eq 0 ] || exit 0
SMOKE=(integration/localfabric/test_harness.py integration/cri/test_differential.py integration/cri/test_lifecycle.py
       integration/broker/test_gpu_fabric.py::test_opted_in_pod_is_classified_leased_and_explained
       integration/broker/test_gpu_fabric.py::test_plain_pod_is_passed_through_untouched
       integration/kube/test_kube_reroute.py::test_the_rerouted_stage_is_ready_through_its_http_probe
       integration/cri/test_critest.py)
KUBE_SMOKE=(integration/kube/test_kube_node.py
            integration/kube/test_kube_reroute.py::test_the_rerouted_stage_is_ready_through_its_http_probe)
smoke=()
for line in ${WEFT_TEST_CONTAINERDS-1.7 2}; do
  echo "weft: smoke run on containerd $line (log: $VENV/log/smoke-containerd-$line.log)"
  # Each run its own --basetemp: side by side in pytest's shared /tmp/pytest-of-<user>, one run's exit
  # prunes the numbered directories the other is still writing, and fails on "Directory not empty".
  WEFT_CONTAINERD="$line" "$VENV/bin/pytest" -n 2 --dist loadfile -p no:cacheprovider \
    --basetemp="/tmp/weft-smoke-containerd-$line" "${SMOKE[@]}" \
    >"$VENV/log/smoke-containerd-$line.log" 2>&1 &
  smoke+=("$line:$!")
done
failed=0
for run in "${smoke[@]}"; do
  log="$VENV/log/smoke-containerd-${run%%:*}.log"
  if wait "${run#*:}"; then
    echo "weft: smoke run on containerd ${run%%:*} passed:"
    grep -E '^\[weft kube\] (critest|kube cluster .*teardown)' "$log" || true
    tail -n 1 "$log"
  else
    failed=1
    echo "weft: smoke run on containerd ${run%%:*} FAILED:"
    tail -n 80 "$log"
  fi
done

# Likewise kubelet: the one-node module and one rerouted pod under the newest Kubernetes release the module proxy
# serves (components/next; WEFT_KUBE=next), its kubelet, API server, scheduler and kubectl on Debian's containerd, after
# the containerd runs (beside them on two cores the rerouted stage's timings would be the machine's).
echo "weft: smoke run on the newest Kubernetes release (log: $VENV/log/smoke-kube-next.log)"
if WEFT_KUBE=next "$VENV/bin/pytest" -n 2 --dist loadfile -p no:cacheprovider "${KUBE_SMOKE[@]}" \
     >"$VENV/log/smoke-kube-next.log" 2>&1; then
  echo "weft: smoke run on the newest Kubernetes release passed:"
  grep -E '^\[weft kube\] kube cluster .*teardown' "$VENV/log/smoke-kube-next.log" || true
  tail -n 1 "$VENV/log/smoke-kube-next.log"
else
  failed=1
  echo "weft: smoke run on the newest Kubernetes release FAILED:"
  tail -n 80 "$VENV/log/smoke-kube-next.log"
fi
exit "$failed"
