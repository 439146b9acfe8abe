"""The stitched pod network's kernel path on the three-node fabric, whose pod network is flat.

A rerouted container serves on 0.0.0.0:8080 and on 127.0.0.1:8081 only. In the
origin pod, 127.0.0.1:8080 is forwarded by nftables rules in the pod's
namespace straight to the shadow's pod IP (``weft explain`` says so), while
8081, which listens on loopback only, keeps the tunnel: it is never exposed on
the shadow's pod IP for this. The rules go with the container, and when the
agent was killed with -9, its next start removes what no longer has a
running remote container.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.crishared.netns import Netns, sandbox_netns
from shim.localfabric import pods
from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.waiting import wait_for

# The local container: 9090 on every address, 9091 on 127.0.0.1 only.
LOCAL = ("mkdir -p /www && echo local-ok > /www/index.html && httpd -p 9090 -h /www && "
         "exec httpd -f -p 127.0.0.1:9091 -h /www")
SERVE = ("mkdir -p /www && echo {text} > /www/index.html && httpd -p 8080 -h /www && "
         "exec httpd -f -p 127.0.0.1:8081 -h /www")


def _tables(ns: Netns) -> set[str]:
    def inside() -> set[str]:
        from pyroute2.nftables.main import NFTables

        nft = NFTables(nfgen_family=2)
        try:
            return {t.get_attr("NFTA_TABLE_NAME") for t in nft.get_tables()}
        finally:
            nft.close()

    return ns.run(inside)


def _route_localnet(ns: Netns) -> str:
    def inside() -> str:
        with open("/proc/sys/net/ipv4/conf/all/route_localnet") as f:
            return f.read().strip()

    return ns.run(inside)


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[Fabric3]:
    with Fabric3(tmp_path / "fabric") as f:
        yield f


def _start(f: Fabric3) -> dict:
    sid, sandbox = run_pod(f, "kernel")
    web = create(f, sid, sandbox, cpu_container("web", ["sh", "-c", SERVE.format(text="remote-ok")],
                                                memory=256 << 20))
    local = create(f, sid, sandbox, pods.container_config("gpu", ["sh", "-c", LOCAL],
                                                          envs={"NVIDIA_VISIBLE_DEVICES": "all"}))
    for cid in (web, local):
        wait_for(lambda c=cid: status(f, c).state == cri.CONTAINER_RUNNING, what="running")
    assert status(f, web).annotations[PLACEMENT].startswith("remote:")
    ch, _ = f.direct("gpu-1")
    with ch:
        path = sandbox_netns(lambda p, r, t: t.FromString(ch.unary_unary(p)(r.SerializeToString(), timeout=10)), sid)
    return {"sid": sid, "sandbox": sandbox, "web": web, "local": local, "ns": Netns(path, workers=2)}


def _get(f: Fabric3, cid: str, port: int) -> bytes:
    ch, rt = f.runtime("gpu-1")
    with ch:
        out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["wget", "-qO-", f"http://127.0.0.1:{port}/"],
                                              timeout=20), timeout=30)
    return out.stdout if out.exit_code == 0 else b""


def _explain(f: Fabric3, cid: str) -> dict:
    with f.agents["gpu-1"].channel() as ch:
        return json.loads(ch.unary_unary("/weft.agent.v1.Admin/Explain")(cid.encode(), timeout=10))


def _paths(f: Fabric3, cid: str) -> dict[str, str] | None:
    ports = _explain(f, cid).get("stitched_ports", {})
    return {p: v["path"] for p, v in ports.items()} if {"8080", "8081"} <= set(ports) else None


def test_localhost_goes_through_the_kernel_and_loopback_only_ports_keep_the_tunnel(fabric: Fabric3) -> None:
    f = fabric
    p = _start(f)
    try:
        assert wait_for(lambda: _paths(f, p["web"]), timeout=30, what="both ports' paths chosen") == {
            "8080": "kernel", "8081": "tunnel"}
        doc = _explain(f, p["web"])
        assert doc["stitched_ports"]["8081"]["reason"] == "not-reachable"
        assert any("port 8080 on localhost: kernel" in line for line in doc["why"])
        assert "weft_stitch" in _tables(p["ns"]) and _route_localnet(p["ns"]) == "1"
        # Both answer on the origin pod's localhost, whichever path carries them.
        assert wait_for(lambda: _get(f, p["local"], 8080) == b"remote-ok\n", timeout=20, what="8080 via the kernel")
        assert wait_for(lambda: _get(f, p["local"], 8081) == b"remote-ok\n", timeout=20, what="8081 via the tunnel")
        # The rules go with the container.
        ch, rt = f.runtime("gpu-1")
        with ch:
            rt.StopContainer(cri.StopContainerRequest(container_id=p["web"], timeout=0))
            rt.RemoveContainer(cri.RemoveContainerRequest(container_id=p["web"]))
        wait_for(lambda: "weft_stitch" not in _tables(p["ns"]), timeout=20, what="the rules removed")
        assert _route_localnet(p["ns"]) == "0"
    finally:
        p["ns"].close()


def _shadow_ns(f: Fabric3, host: str) -> Netns:
    ch, _ = f.direct(host)
    with ch:
        sid = f.shadows(host)[0].pod_sandbox_id
        path = sandbox_netns(lambda p, r, t: t.FromString(ch.unary_unary(p)(r.SerializeToString(), timeout=10)), sid)
    return Netns(path, workers=1)


def test_the_way_back_goes_through_the_kernel_too(fabric: Fabric3) -> None:
    f = fabric
    p = _start(f)
    host = status(f, p["web"]).annotations[PLACEMENT].removeprefix("remote:")
    shadow = _shadow_ns(f, host)
    try:
        # In the shadow, the pod's 9090 (every address) goes to the origin pod's IP through the kernel; 9091, on
        # the origin's loopback only, keeps the tunnel; both answer on the shadow's localhost.
        wait_for(lambda: "weft_stitch" in _tables(shadow), timeout=30, what="the host's kernel path set up")
        events = wait_for(lambda: {e["port"]: e["path"] for e in f.agents[host].events()
                                   if e.get("event") == "stitch.path" and e.get("port") in (9090, 9091)} or None,
                          timeout=30, what="the host's path choices")
        wait_for(lambda: len(events) == 2 or events.update({e["port"]: e["path"] for e in f.agents[host].events()
                                                            if e.get("event") == "stitch.path"}), timeout=10,
                 what="both ports chosen")
        assert events[9090] == "kernel" and events[9091] == "tunnel"
        assert wait_for(lambda: _get(f, p["web"], 9090) == b"local-ok\n", timeout=20, what="9090 via the kernel")
        assert wait_for(lambda: _get(f, p["web"], 9091) == b"local-ok\n", timeout=20, what="9091 via the tunnel")
        ch, rt = f.runtime("gpu-1")
        with ch:
            rt.StopContainer(cri.StopContainerRequest(container_id=p["web"], timeout=0))
            rt.RemoveContainer(cri.RemoveContainerRequest(container_id=p["web"]))
    finally:
        shadow.close()
        p["ns"].close()


def test_rules_a_killed_agent_left_are_removed_when_it_starts_again(fabric: Fabric3) -> None:
    f = fabric
    p = _start(f)
    try:
        wait_for(lambda: "weft_stitch" in _tables(p["ns"]), timeout=30, what="the kernel path set up")
        host = status(f, p["web"]).annotations[PLACEMENT].removeprefix("remote:")
        f.agents["gpu-1"].stop(signal.SIGKILL)
        # The rules outlive the agent: the kernel keeps forwarding while it is away.
        assert "weft_stitch" in _tables(p["ns"])
        # Meanwhile the rerouted container ends on its host.
        ch, rt = f.direct(host)
        with ch:
            shadow = f.shadows(host)[0].id
            rt.StopContainer(cri.StopContainerRequest(container_id=shadow, timeout=0))
        f.agents["gpu-1"].start()
        wait_for(lambda: "weft_stitch" not in _tables(p["ns"]), timeout=30,
                 what="the rules of a pod with no running remote container removed by the restarted agent")
        assert _route_localnet(p["ns"]) == "0"
    finally:
        p["ns"].close()


def test_switched_off_the_tunnel_carries_everything(tmp_path: Path) -> None:
    with Fabric3(tmp_path / "fabric", mesh_config="stitch_kernel_path = false\n") as f:
        p = _start(f)
        try:
            assert wait_for(lambda: _paths(f, p["web"]), timeout=30, what="both ports' paths chosen") == {
                "8080": "tunnel", "8081": "tunnel"}
            assert _explain(f, p["web"])["stitched_ports"]["8080"]["reason"] == "disabled"
            assert "weft_stitch" not in _tables(p["ns"])
            assert wait_for(lambda: _get(f, p["local"], 8080) == b"remote-ok\n", timeout=20, what="via the tunnel")
        finally:
            p["ns"].close()
