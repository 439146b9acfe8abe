"""``weft bench hook``: what ``weft-oci-hook`` adds to a container start, timed as runc runs it.

runc starts the hook as a fresh process for every container and every stage,
with the OCI state JSON on stdin, so the hook's cost is mostly interpreter
start-up; timing ``run()`` in-process would hide exactly the part that
matters. Each figure here is the wall time of one whole process, spawn to
exit, as the parent sees it (the parent's fork/exec is in it, as runc's is):

* ``fast_path``: a container with no ``weft.io/lease`` annotation, in the form
  weft's base spec installs (``python -S -I hooks/weft_oci_hook.py``); every
  container on a weft node pays this, GPU or not;
* ``fast_path_console_script``: the same through the installed
  ``weft-oci-hook`` console script, which loads site-packages (reference);
* ``python_floor``: ``python -S -I -c pass``, the interpreter alone, so the
  hook's own share is the difference (reference);
* ``bind``: createRuntime with a lease, against a real ``weft broker``
  (simulated GPUs) over its hook socket;
* ``release``: poststop for the same lease;
* ``native_fast_path``, ``native_bind``, ``native_release``: the same three
  with the native hook (``hooks/weft_oci_hook.c``, built here by
  ``hooks.native``), what a node runs where the image carries it; each native
  bind gets a lease of its own.

Every run gets a freshly acquired lease (over gRPC, not timed) and all the
kinds are interleaved run by run, in rotating order, so drift in the
machine's load hits them alike. Each lease is released by its own poststop
run, so the broker holds at most one at a time. It reports figures and
whether they meet weft's targets; it is a measurement, not a test, so a
missed target does not change the exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hooks import native
from shim._pb import broker_pb2 as pb
from shim.bench.running import labelled, run_in_scratch, summary, targets_met
from shim.errors import WeftError
from shim.localfabric.broker import HOOK_SCRIPT, PYTHON_HOOK, BrokerProcess

LIMITS = {"fast_path_p99_ms": 30.0, "bind_p99_ms": 60.0}
MAX_RUNS = 300  # each run spawns five processes; 300 keeps the whole bench near a minute
DEVICES = "8x80GiB"
LEASE_BYTES = 1 << 30
RPC_TIMEOUT = 10.0
HOOK_TIMEOUT = 30.0
KINDS = ("fast_path", "fast_path_console_script", "python_floor", "bind", "release", "native_fast_path",
         "native_bind", "native_release")
NATIVE = ("native_fast_path", "native_bind", "native_release")


def _say(msg: str) -> None:
    # stdout is reserved for the figures (one JSON object with --json).
    print(f"weft bench hook: {msg}", file=sys.stderr, flush=True)


def _console_script() -> str | None:
    # The venv's own script first: a weft-oci-hook elsewhere on PATH may be another install.
    own = Path(sys.prefix) / "bin" / "weft-oci-hook"
    if os.access(own, os.X_OK):
        return str(own)
    return shutil.which("weft-oci-hook")


def _state(container: str, pid: int, lease: str | None = None, sandbox_id: str = "", name: str = "") -> bytes:
    """The OCI state runc gives the hook; with a lease, containerd's annotations naming the lease's owner."""
    annotations = {"weft.io/lease": lease, "io.kubernetes.cri.sandbox-id": sandbox_id,
                   "io.kubernetes.cri.container-name": name} if lease else {}
    return json.dumps({"ociVersion": "1.0.2", "id": container, "pid": pid, "annotations": annotations}).encode()


def _timed(argv: list[str], stdin: bytes, what: str) -> int:
    """Nanoseconds from spawn to exit; any failure or stderr output aborts the run."""
    t0 = time.perf_counter_ns()
    res = subprocess.run(argv, input=stdin, capture_output=True, timeout=HOOK_TIMEOUT, check=False)
    dt = time.perf_counter_ns() - t0
    # poststop exits 0 even when the broker refuses (it must never block a
    # removal), so a message on stderr is the only sign a release went wrong.
    if res.returncode != 0 or res.stderr:
        raise RuntimeError(f"{what}: {' '.join(argv)} exited {res.returncode}: "
                           f"{res.stderr.decode(errors='replace').strip()}")
    return dt


def _native() -> tuple[str | None, str]:
    try:
        return str(native.build()), ""
    except native.NativeHookUnavailable as exc:
        return None, str(exc)


def _measure(runs: int, warmup: int, workdir: Path) -> dict[str, list[int]]:
    hook = list(PYTHON_HOOK)
    console = _console_script()
    out: dict[str, list[int]] = {k: [] for k in KINDS}
    if console is None:
        _say("no weft-oci-hook console script installed; skipping that form")
        del out["fast_path_console_script"]
    native_hook, why = _native()
    if native_hook is None:
        _say(f"no native hook: {why}")
        for k in NATIVE:
            del out[k]
    broker = BrokerProcess(workdir / "broker", devices=DEVICES)
    # Bound leases whose PID is gone are released by the broker's watchdog, so
    # the bind needs a process that outlives the run; its cgroup is read too.
    holder = subprocess.Popen(["sleep", "600"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        broker.start()
        socket = str(broker.socket)
        own = _state("c1", os.getpid())
        ch, stub = broker.stub()
        with ch:
            def acquire(key: str) -> str:
                return stub.Acquire(pb.AcquireRequest(
                    key=f"bench-hook/{key}", namespace="bench", pod=f"hook-{key}", container="main",
                    sandbox_id=f"bench-hook-{key}", memory_bytes=LEASE_BYTES, compute_percent=1),
                    timeout=RPC_TIMEOUT).lease_id

            for i in range(warmup + runs):
                lease = acquire(str(i))
                container = f"bench-hook-{i:06d}"

                def bind(lease: str = lease, container: str = container, i: int = i) -> int:
                    return _timed([*hook, "createRuntime", "--broker-socket", socket],
                                  _state(container, holder.pid, lease, f"bench-hook-{i}", "main"), "bind")

                steps: list[tuple[str, Callable[[], int]]] = [
                    ("fast_path", lambda: _timed([*hook, "createRuntime"], own, "fast path")),
                    ("python_floor", lambda: _timed([*hook[:3], "-c", "pass"], b"", "python floor")),
                    ("bind", bind),
                ]
                if console is not None:
                    steps.append(("fast_path_console_script",
                                  lambda: _timed([console, "createRuntime"], own, "console script")))
                if native_hook is not None:
                    n_lease, n_key = acquire(f"n{i}"), f"bench-hook-n{i}"
                    steps += [("native_fast_path", lambda: _timed([native_hook, "createRuntime"], own, "native")),
                              ("native_bind", lambda n_lease=n_lease, n_key=n_key: _timed(
                                  [native_hook, "createRuntime", "--broker-socket", socket],
                                  _state(f"{n_key}-c", holder.pid, n_lease, n_key, "main"), "native bind"))]
                k = i % len(steps)  # rotate, so no kind always runs first
                timed = [(name, step()) for name, step in steps[k:] + steps[:k]]
                # poststop comes after createRuntime, as in a container's life.
                timed.append(("release", _timed([*hook, "poststop", "--broker-socket", socket],
                                                _state(container, holder.pid, lease, f"bench-hook-{i}", "main"),
                                                "release")))
                if native_hook is not None:
                    timed.append(("native_release", _timed(
                        [native_hook, "poststop", "--broker-socket", socket],
                        _state(f"{n_key}-c", holder.pid, n_lease, n_key, "main"), "native release")))
                if i >= warmup:
                    for name, dt in timed:
                        out[name].append(dt)
                if i % 50 == 49:
                    _say(f"{i + 1 - warmup if i >= warmup else 0} of {runs} runs")
            left = list(stub.List(pb.ListRequest(), timeout=RPC_TIMEOUT).leases)
            if left:
                raise RuntimeError(f"{len(left)} leases left after every poststop release ran, e.g. {left[0].lease_id}")
    finally:
        holder.kill()
        holder.wait()
        broker.stop()
    return out


def _figures(raw: dict[str, list[int]], samples: int, runs: int, warmup: int, workdir: str) -> dict:
    f: dict = {name: summary(ns, 3) for name, ns in raw.items()}
    f.setdefault("fast_path_console_script", None)
    for k in NATIVE:
        f.setdefault(k, None)
    if f["native_fast_path"] is not None:
        # What the native hook leaves of the Python one's time, as a node runs each (p50).
        f["native_over_python_fast_path_p50"] = round(f["native_fast_path"]["p50_ms"] / f["fast_path"]["p50_ms"], 3)
        f["native_over_python_bind_p50"] = round(f["native_bind"]["p50_ms"] / f["bind"]["p50_ms"], 3)
    targets = {"fast_path_p99": f["fast_path"]["p99_ms"] <= LIMITS["fast_path_p99_ms"],
               "bind_p99": f["bind"]["p99_ms"] <= LIMITS["bind_p99_ms"]}
    targets["all"] = all(targets.values())
    f["hook_own_p50_ms"] = round(f["fast_path"]["p50_ms"] - f["python_floor"]["p50_ms"], 3)
    f["targets"] = targets
    f["limits"] = LIMITS
    f["environment"] = {
        "samples_requested": samples, "runs": runs, "warmup_runs": warmup, "max_runs": MAX_RUNS,
        "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "executable": sys.executable,
        "hook_script": str(HOOK_SCRIPT), "console_script": _console_script(), "native_hook": _native()[0],
        "simulated_devices": DEVICES,
        "workdir": workdir,
    }
    return f


# -- output --------------------------------------------------------------------
def _table(f: dict) -> str:
    ok = {True: "✓", False: "✗"}
    t, env = f["targets"], f["environment"]
    rows = [("hook run (whole process)", "p50 ms", "p99 ms", "max ms", "target", "")]
    labels = {"fast_path": "createRuntime, no lease (python -S -I)",
              "fast_path_console_script": "createRuntime, no lease (console script)",
              "python_floor": "python -S -I -c pass (interpreter alone)",
              "bind": "createRuntime, bind a lease", "release": "poststop, release the lease",
              "native_fast_path": "native hook: createRuntime, no lease", "native_bind": "native hook: bind a lease",
              "native_release": "native hook: release the lease"}
    limit = {"fast_path": ("fast_path_p99", "fast_path_p99_ms"), "bind": ("bind_p99", "bind_p99_ms")}
    for name, label in labels.items():
        s = f[name]
        if s is None:
            rows.append((label, "-", "-", "-", "not installed", ""))
            continue
        target, mark = "reference", ""
        if name in limit:
            target, mark = f"p99 ≤ {LIMITS[limit[name][1]]:g} ms", ok[t[limit[name][0]]]
        rows.append((label, f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}", f"{s['max_ms']:.2f}", target, mark))
    capped = f" (of {env['samples_requested']} asked; capped at {env['max_runs']})" \
        if env["runs"] < env["samples_requested"] else ""
    lines = [f"weft bench hook: {env['runs']} runs{capped} after {env['warmup_runs']} warm-up, interleaved, "
             f"broker simulating {env['simulated_devices']}, python {env['python']}, {env['cpu_count']} CPUs", ""]
    lines += labelled(rows)
    lines += ["", f"the hook's own share of the fast path, p50: {f['hook_own_p50_ms']:+.2f} ms over the interpreter"]
    if "native_over_python_fast_path_p50" in f:
        lines.append(f"native over Python, p50: fast path {f['native_over_python_fast_path_p50']:.3f}x, "
                     f"bind {f['native_over_python_bind_p50']:.3f}x")
    lines += ["each figure is one process as runc starts it: spawn, interpreter start-up, hook, exit",
              targets_met(t)]
    return "\n".join(lines)


def main(*, as_json: bool, samples: int = 2000, output: Path | None = None) -> int:
    if samples < 10:
        raise WeftError("need --samples >= 10")
    runs = min(samples, MAX_RUNS)
    warmup = min(20, max(3, runs // 10))

    def measure(workdir: Path) -> dict:
        _say(f"{runs} runs{' (capped)' if runs < samples else ''} after {warmup} warm-up, each a fresh process "
             f"per kind, interleaved; broker and work files in {workdir}")
        return _figures(_measure(runs, warmup, workdir), samples, runs, warmup, str(workdir))

    return run_in_scratch("weft-bench-hook-", _say, measure, as_json, output, _table)
