"""The README's first command does what it says: three nodes, a two-stage pod across them, then nothing left.

``weft demo --json`` ends with one JSON line (the interface outside checks
rely on); ``--keep`` leaves the fabric up for another process, and
``--down`` removes it from there, also when the keeper was killed outright,
and is a no-op when there is nothing to remove.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shim.localfabric.containerd import cgroup_hierarchies, lock_held

REPO = Path(__file__).resolve().parents[2]


def weft(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "shim", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, f"weft {' '.join(argv)}: {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def check_description(doc: dict) -> None:
    assert [(n["name"], n["role"]) for n in doc["nodes"]] == [("gpu-1", "gpu"), ("cpu-1", "cpu"), ("cpu-2", "cpu")]
    for n in doc["nodes"]:
        assert n["netns"].startswith("weftnode") and n["containerd_socket"].endswith("containerd.sock")
        assert n["weft_socket"].endswith(f"{n['name']}.sock")
    assert len(doc["sandbox_id"]) == 64
    by = {c["name"]: c for c in doc["containers"]}
    assert set(by) == {"prepare", "serve"}
    assert by["serve"]["placement"] == "local" and by["serve"]["node"] == "gpu-1"
    assert by["prepare"]["placement"] == f"remote:{by['prepare']['node']}"
    assert by["prepare"]["node"] in ("cpu-1", "cpu-2")
    assert all(len(c["id"]) == 64 for c in doc["containers"])


def test_demo_runs_the_two_stage_pod_across_three_nodes_and_cleans_up() -> None:
    out = weft("demo", "--json").stdout
    doc = json.loads(out.splitlines()[-1])
    check_description(doc)
    for line in ("weft.io/placement-reason=rerouted", "weft.io/placement-reason=gpu-leased", "GPU lease lease-",
                 "sent batch-5", "served as request 5", "metrics before -> after", "weft_remote_containers",
                 "weft_shadows_hosted", "leases left: 0; shadows left on hosts: 0", "cleaned up", "summary"):
        assert line in out, f"demo output lacks {line!r}:\n{out}"
    # The CPU stage on a host reached the GPU stage on localhost, through the stitched pod network.
    assert "via localhost:9000" in out and "data path\n    localhost" in out, out
    assert_gone(doc, workdirs_from(out))


def test_keep_leaves_it_up_for_another_process_and_down_removes_it(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    res = weft("demo", "--keep", "--json", "--state-file", str(state))
    doc = json.loads(res.stdout.splitlines()[-1])
    check_description(doc)
    assert "crictl -r unix://" in res.stdout and "weft status --socket" in res.stdout
    kept = json.loads(state.read_text())
    assert {k: kept[k] for k in doc} == doc
    try:
        # Up, and usable from this process: the origin answers status with the remote placement.
        origin = doc["nodes"][0]["weft_socket"]
        status = json.loads(weft("status", "--socket", origin, "--json").stdout)
        assert {p["placement"] for p in status["placements"]} == {"local", f"remote:{doc['containers'][1]['node']}"}
        assert all(Path(f"/var/run/netns/{n['netns']}").exists() for n in doc["nodes"])
        # A second kept demo is refused while this one runs.
        again = subprocess.run([sys.executable, "-m", "shim", "demo", "--keep", "--state-file", str(state)],
                               cwd=REPO, capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "weft demo --down" in again.stderr
    finally:
        down = weft("demo", "--down", "--state-file", str(state))
    assert "demo removed" in down.stdout and not state.exists()
    assert_gone(doc, kept["keeper"]["fabric"])
    assert not _running(kept["keeper"]["pid"])
    assert "nothing to remove" in weft("demo", "--down", "--state-file", str(state)).stdout


def test_down_removes_a_kept_demo_whose_keeper_was_killed(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    weft("demo", "--keep", "--state-file", str(state))
    kept = json.loads(state.read_text())
    os.kill(kept["keeper"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _running(kept["keeper"]["pid"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    down = weft("demo", "--down", "--state-file", str(state))
    assert "the keeper is gone" in down.stdout and not state.exists()
    assert_gone(kept, kept["keeper"]["fabric"])


def workdirs_from(out: str) -> dict:
    """The fabric's directories as the demo's output names them (the sockets' directories)."""
    doc = json.loads(out.splitlines()[-1])
    sockets = [Path(n["weft_socket"]) for n in doc["nodes"]]
    return {"workdir": str(sockets[0].parent.parent), "cluster_workdir": None,
            "nodes": [{"name": n["name"], "slot": int(n["netns"].removeprefix("weftnode")),
                       "containerd_workdir": str(Path(n["containerd_socket"]).parent)} for n in doc["nodes"]]}


def assert_gone(doc: dict, fabric: dict) -> None:
    """No directory, process, namespace or cgroup of the demo's is left (a slot claimed since is someone else's)."""
    dirs = [fabric["workdir"], *(n["containerd_workdir"] for n in fabric["nodes"])]
    if fabric.get("cluster_workdir"):
        dirs.append(fabric["cluster_workdir"])
    for d in dirs:
        assert not Path(d).exists(), f"{d} left behind"
        procs = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _mentions(p, d)]
        assert not procs, f"processes left behind from {d}: {procs}"
    for n in fabric["nodes"]:
        if lock_held(f"slot{n['slot']}"):
            continue
        assert not Path(f"/var/run/netns/weftnode{n['slot']}").exists(), f"netns of {n['name']} left behind"
        for h in cgroup_hierarchies():
            assert not (h / f"weft-harness{n['slot']}").exists(), f"cgroup of {n['name']} left in {h}"
    if "mesh_slot" in fabric and not lock_held(f"mesh{fabric['mesh_slot']}"):
        assert not Path(f"/sys/class/net/weftmesh{fabric['mesh_slot']}").exists(), "bridge left behind"


def _running(pid: int) -> bool:
    """Alive and not a zombie (the keeper's parent, ``weft demo --keep``, is gone: whoever adopts it reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _mentions(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
