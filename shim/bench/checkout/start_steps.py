"""Where an opted-in pod's start goes: each CRI call of it against a plain pod's, and the rerouted start's parts.

``python -m bench.start_steps [--starts 10] [--json] [--output FILE]``, from a checkout, as root. The local
three-node fabric of ``weft bench e2e --cpusets`` (``gpu-1`` origin with the broker and this benchmark on half
the CPUs, hosts ``cpu-1`` and ``cpu-2`` on the other half). Three parts, each taking turns between its sides:

1. The two-stage pod of ``weft bench e2e`` started opted in and plain (RunPodSandbox, then Create and Start of
   its CPU container ``prep`` and its GPU container ``model``), each call timed as kubelet sees it; once with
   the containers asking for no seccomp profile, once with both under the runtime's default.
2. The rerouted ``prep``'s create and start split, from the host's ``shadow.created`` log (the image check,
   the wait for the creation lock, looking for a shadow of the key, the admission again, the checks and volumes,
   the shadow sandbox found or made, containerd's CreateContainer, the whole RunShadow)
   and ``shadow.started`` log (finding the shadow, containerd's StartContainer, reading its status; the
   shadows' group is weighed again after the answer): what is left of the time the origin's kubelet saw is
   the mesh (Admit and the round trips) and the origin's own work.
3. On a host's containerd directly, no weft in the way: the same container started unconfined, under the
   runtime's default seccomp profile, under it made without its CFS quota (set after the start, as a host does),
   and under the host's narrowed profile (``shim.shadowhost.seccomp``, as learnt by the host in part 1).

Exit codes as ``weft bench``: 0 measured, 1 failed, 130/143 stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from cri_api.v1 import api_pb2 as cri

from shim.bench import e2e, mesh
from shim.bench.running import guarded, report, right_aligned
from shim.core.stats import percentile
from shim.localfabric import pods

SIDES = {"opted in": "weft", "plain": ""}
# The host's log events of a rerouted container, and the parts each says its work took.
PARTS = {"shadow.created": ("pull_ms", "wait_ms", "find_ms", "admit_ms", "check_ms", "sandbox_ms", "create_ms",
                           "total_ms"),
         "shadow.started": ("find_ms", "start_ms", "status_ms")}


def _median(xs: list[float]) -> float:
    return round(percentile(xs, 50), 1)


def pod_steps(fabric, rt, starts: int, runtime_default: bool) -> dict[str, dict[str, float]]:
    """Median ms of each CRI call of the pod's start, per side (one unmeasured warm-up start each)."""
    seen: dict[str, dict[str, list[float]]] = {side: {} for side in SIDES}
    for i in range(starts + 1):
        for side in (list(SIDES) if i % 2 == 0 else list(reversed(SIDES))):
            name = f"steps-{'rd' if runtime_default else 'un'}-{side.replace(' ', '-')}-{i}"
            steps: dict[str, float] = {}
            e2e.stop_pod(rt, e2e.start_pod(fabric, rt, name, SIDES[side], runtime_default=runtime_default,
                                           steps=steps))
            if i:
                for step, s in steps.items():
                    seen[side].setdefault(step, []).append(s * 1e3)
    return {side: {step: _median(v) for step, v in steps.items()} for side, steps in seen.items()}


def host_parts(fabric, since: dict[str, int]) -> dict[str, dict[str, float]]:
    """Medians of the parts the hosts' ``shadow.created`` and ``shadow.started`` events give, from the lines their
    logs gained after ``since``."""
    parts: dict[str, dict[str, list[float]]] = {e: {p: [] for p in ps} for e, ps in PARTS.items()}
    for host in mesh.HOSTS:
        for line in fabric.agents[host].log_text()[since[host]:].splitlines():
            event = json.loads(line) if line.startswith("{") and '"shadow.' in line else {}
            for p in PARTS.get(event.get("event", ""), ()):
                parts[event["event"]][p].append(float(event[p]))
    return {e: {p: _median(v) for p, v in ps.items() if v} for e, ps in parts.items()}


# What a host's containerd starts directly, each a tenth of a core as the pod's ``prep``: unconfined; under
# RuntimeDefault; under RuntimeDefault made without its CFS quota (as a host makes a shadow: the quota follows the
# start); under the host's narrowed profile (the runtime's default for its own architecture only, with the quota
# at creation, as learnt by the host's agent in the pod starts before).
DIRECT = ("unconfined", "RuntimeDefault", "RuntimeDefault, quota after", "host's narrowed profile")


def direct_starts(fabric, starts: int) -> dict[str, float]:
    """Median ms of StartContainer on a host's containerd, the same container under each of ``DIRECT``."""
    node = fabric.node(mesh.HOSTS[0])
    ch, rt = fabric.direct(mesh.HOSTS[0])
    narrowed = sorted((fabric.agents[mesh.HOSTS[0]].state_dir / "seccomp").glob("runtime-default-*.json"))
    kinds = [k for k in DIRECT if k != DIRECT[3] or narrowed]
    seen: dict[str, list[float]] = {k: [] for k in kinds}
    updated: list[float] = []
    with ch:
        for i in range(starts + 1):
            for kind in (kinds if i % 2 == 0 else list(reversed(kinds))):
                config = mesh.cpu_container("prep", cpu=0.1, memory=32 << 20)
                seccomp = config.linux.security_context.seccomp
                if kind.startswith("RuntimeDefault"):
                    seccomp.profile_type = cri.SecurityProfile.RuntimeDefault
                elif kind == DIRECT[3]:
                    seccomp.profile_type, seccomp.localhost_ref = cri.SecurityProfile.Localhost, str(narrowed[0])
                quota = config.linux.resources.cpu_quota
                if kind == DIRECT[2]:
                    config.linux.resources.cpu_quota = 0
                sandbox = pods.sandbox_config(f"direct-{i}-{kinds.index(kind)}", node.containerd.pod_log_dir,
                                              cgroup_parent=node.containerd.cgroup_root)
                sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox),
                                       timeout=mesh.RPC_TIMEOUT).pod_sandbox_id
                cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                                    sandbox_config=sandbox),
                                         timeout=mesh.RPC_TIMEOUT).container_id
                t = time.perf_counter()
                rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=mesh.RPC_TIMEOUT)
                took = (time.perf_counter() - t) * 1e3
                if kind == DIRECT[2]:  # and the update a host makes after the start (off the start's answer)
                    rt.UpdateContainerResources(cri.UpdateContainerResourcesRequest(
                        container_id=cid, linux=cri.LinuxContainerResources(cpu_quota=quota, cpu_period=100000)),
                        timeout=mesh.RPC_TIMEOUT)
                    if i:
                        updated.append((time.perf_counter() - t) * 1e3)
                mesh.remove_pod(rt, sid)
                if i:
                    seen[kind].append(took)
    out = {kind: _median(v) for kind, v in seen.items()}
    out[f"{DIRECT[2]}, with the update"] = _median(updated)
    return out


def measure(starts: int, say) -> dict:
    with tempfile.TemporaryDirectory(prefix="weft-bench-start-steps-") as tmp:
        fabric = mesh.open_fabric(Path(tmp) / "fabric", cpusets=True)
        affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {int(c) for c in fabric.agents[mesh.ORIGIN].cpus.split(",")})
        try:
            ch, rt = mesh.origin(fabric)
            with ch:
                out: dict = {"starts": starts, "cpus": {n: a.cpus for n, a in fabric.agents.items()}}
                for runtime_default in (False, True):
                    key = "runtime_default" if runtime_default else "unconfined"
                    say(f"pod start, {starts} opted in and {starts} plain, containers {key}")
                    since = {h: len(fabric.agents[h].log_text()) for h in mesh.HOSTS}
                    out[key] = {"steps": pod_steps(fabric, rt, starts, runtime_default),
                                "host_parts": host_parts(fabric, since)}
            say(f"StartContainer on {mesh.HOSTS[0]}'s containerd directly, {starts} each: {', '.join(DIRECT)}")
            out["host_direct_start"] = direct_starts(fabric, starts)
            return out
        finally:
            os.sched_setaffinity(0, affinity)
            fabric.close()


def _table(f: dict) -> str:
    lines = []
    for key, title in (("unconfined", "containers asking for no seccomp profile"),
                       ("runtime_default", "containers under the runtime's default seccomp profile")):
        steps = f[key]["steps"]
        rows = [("step", "opted in", "plain", "added")]
        for step, ms in steps["opted in"].items():
            plain = steps["plain"][step]
            rows.append((step, f"{ms:.1f} ms", f"{plain:.1f} ms", f"{ms - plain:+.1f} ms"))
        lines += [f"pod start, medians of {f['starts']}, {title}:", *right_aligned(rows)]
        for event, what in (("shadow.created", "create"), ("shadow.started", "start")):
            parts = f[key]["host_parts"].get(event)
            if parts:
                lines.append(f"  the rerouted prep's {what} on its host: " +
                             ", ".join(f"{p.removesuffix('_ms')} {ms:.1f} ms" for p, ms in parts.items()))
        lines.append("")
    d = f["host_direct_start"]
    lines.append("StartContainer on a host's containerd directly (a tenth of a core): " +
                 ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in d.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.start_steps", description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=10, help="measured starts per side and part (default 10)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.starts < 1:
        ap.error("--starts: at least 1")

    def say(line: str) -> None:
        print(f"[start-steps] {line}", file=sys.stderr, flush=True)

    code, figures = guarded(say, lambda: measure(args.starts, say))
    if figures is None:
        return code
    return report(figures, args.json, args.output, _table)


if __name__ == "__main__":
    sys.exit(main())
