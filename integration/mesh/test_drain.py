"""``weft drain`` on the three-node fabric: a drained host takes nothing new and keeps what it hosts.

The next container of the origin's pod goes to the other host; the one the
drained host already runs keeps running until kubelet removes it through the
origin, and ``weft drain`` returns then. The drain outlives a restart of the
host's agent and ends with ``--undo``. ``weft status`` shows it on both sides.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric3]:
    with Fabric3(tmp_path / "fabric") as f:
        yield f


def weft(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([sys.executable, "-m", "shim", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    if check:
        assert res.returncode == 0, f"weft {' '.join(argv)}: {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res


def origin_sees(f: Fabric3, host: str, draining: bool) -> bool:
    return any(p["node"] == host and p["healthy"] and p["draining"] is draining for p in f.status("gpu-1")["peers"])


def test_a_drained_host_takes_nothing_new_and_drain_returns_when_its_shadows_are_gone(fabric: Fabric3) -> None:
    f = fabric
    sid, sandbox = run_pod(f)
    first = create(f, sid, sandbox, cpu_container("first", ["sleep", "3600"]))
    host = wait_for(lambda: (s := status(f, first)).state == cri.CONTAINER_RUNNING and s,
                    what="first running remotely").annotations[PLACEMENT].removeprefix("remote:")
    other = "cpu-2" if host == "cpu-1" else "cpu-1"
    sock = str(f.agents[host].socket)

    # Too short a wait: it says what is left, exits 1, and the host stays draining.
    short = weft("drain", "--socket", sock, "--timeout", "1", check=False)
    assert short.returncode == 1 and "still hosting" in short.stdout and "first" in short.stdout
    assert f.status(host)["node"]["draining"]
    wait_for(lambda: origin_sees(f, host, True), what=f"gpu-1 to see {host} draining")
    text = weft("status", "--socket", sock).stdout
    assert "DRAINING" in text.splitlines()[0] and "HOSTED (1)" in text
    assert "draining" in next(line for line in weft("status", "--socket", str(f.agents["gpu-1"].socket)).stdout
                              .splitlines() if line.strip().startswith(host))

    # The drain survives a restart of the host's agent.
    f.agents[host].stop()
    f.agents[host].start()
    f.wait_meshed()
    wait_for(lambda: origin_sees(f, host, True), what=f"gpu-1 to see {host} still draining after its restart")

    drain = subprocess.Popen([sys.executable, "-m", "shim", "drain", "--socket", sock, "--timeout", "120", "--json",
                              "--interval", "0.2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        second = create(f, sid, sandbox, cpu_container("second", ["sleep", "3600"]))
        assert status(f, second).annotations[PLACEMENT] == f"remote:{other}"
        # What the drained host runs goes on, and drain waits for it.
        time.sleep(1.0)
        assert status(f, first).state == cri.CONTAINER_RUNNING
        assert [c.state for c in f.shadows(host)] == [cri.CONTAINER_RUNNING]
        assert drain.poll() is None
        ch, rt = f.runtime("gpu-1")
        with ch:
            rt.StopContainer(cri.StopContainerRequest(container_id=first, timeout=1))
            removed = time.monotonic()
            rt.RemoveContainer(cri.RemoveContainerRequest(container_id=first))
        out, err = drain.communicate(timeout=30)
    finally:
        if drain.poll() is None:
            drain.kill()
            drain.wait()
    assert drain.returncode == 0, err
    assert time.monotonic() - removed < 10
    done = json.loads(out.splitlines()[-1])
    assert done == {"node": host, "draining": True, "hosted": [], "done": True}
    assert not f.shadows(host)
    # Still draining until undone: a third container goes to the other host as well.
    third = create(f, sid, sandbox, cpu_container("third", ["sleep", "3600"]))
    assert status(f, third).annotations[PLACEMENT] == f"remote:{other}"

    assert "no longer draining" in weft("drain", "--socket", sock, "--undo").stdout
    wait_for(lambda: origin_sees(f, host, False), what=f"gpu-1 to see {host} admitting again")
    fourth = create(f, sid, sandbox, cpu_container("fourth", ["sleep", "3600"]))
    assert status(f, fourth).annotations[PLACEMENT] == f"remote:{host}"  # the host with the most room again
    events = [e["event"] for e in f.agents[host].events()]
    assert "mesh.draining" in events and "mesh.undrained" in events


def test_drain_on_a_node_that_hosts_nothing_is_refused(fabric: Fabric3) -> None:
    res = weft("drain", "--socket", str(fabric.agents["gpu-1"].socket), check=False)
    assert res.returncode == 2 and "nothing to drain" in res.stderr
    assert not fabric.status("gpu-1")["node"]["draining"]
