"""The stitched pod network on the three-node fabric: a rerouted container on localhost, both ways.

One pod on ``gpu-1``: ``web`` (rerouted to a CPU host) serves HTTP on 8080 and
checksums what it is sent on 7000; ``gpu`` (local) serves HTTP on 9090, and on
[::1]:9093 (IPv6 loopback only). With no configuration, each reaches the other
on localhost (127.0.0.1 and ::1), a Service-like client reaches ``web`` at the
pod IP, 1 GiB goes each way with its checksum intact, 200 connections run at
once, a port the local container holds already is reported and left alone,
and a cut link ends a transfer with an error (not a hang) while new
connections work once it is back. A second pod declares its containers'
ports (``weft.io/ports.<name>``): only those are mirrored.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri

from integration.procfs import sockets
from shim.crishared.netns import Netns, sandbox_netns
from shim.localfabric import pods
from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.waiting import wait_for

GIB = 1 << 30
WEB = ("mkdir -p /www && echo {text} > /www/index.html && httpd -p {port} -h /www && "
       "exec nc -ll -p 7000 -e sha256sum")


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    # Long fence and loss timeouts: the link flap below must not fence the shadow.
    with Fabric3(tmp_path_factory.mktemp("stitch") / "fabric", fence_s=30.0, loss_s=60.0) as f:
        sid, sandbox = run_pod(f)
        web = create(f, sid, sandbox, cpu_container("web", ["sh", "-c", WEB.format(text="remote-ok", port=8080)],
                                                    memory=256 << 20))
        gpu = create(f, sid, sandbox, pods.container_config(
            "gpu", ["sh", "-c", "mkdir -p /www && echo local-ok > /www/index.html && httpd -p [::1]:9093 -h /www && "
                    "exec httpd -f -p 9090 -h /www"],
            envs={"NVIDIA_VISIBLE_DEVICES": "all"}))
        for cid in (web, gpu):
            wait_for(lambda c=cid: status(f, c).state == cri.CONTAINER_RUNNING, what="running")
        assert status(f, web).annotations[PLACEMENT].startswith("remote:")
        ch, direct = f.direct("gpu-1")
        with ch:
            call = lambda path, req, typ: typ.FromString(  # noqa: E731
                ch.unary_unary(path)(req.SerializeToString(), timeout=10))
            netns = sandbox_netns(call, sid)
            ip = direct.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid)).status.network.ip
        ns = Netns(netns, workers=8)
        host = status(f, web).annotations[PLACEMENT].removeprefix("remote:")
        wait_for(lambda: {8080, 7000} <= set(ns.listening()), timeout=20, what="the shadow's ports mirrored")
        baseline = {n: sockets(f.agents[n].pid) for n in ("gpu-1", host)}
        try:
            yield {"f": f, "sid": sid, "sandbox": sandbox, "web": web, "gpu": gpu, "ns": ns, "ip": ip,
                   "host": host, "baseline": baseline}
        finally:
            ns.close()


def _exec(f: Fabric3, cid: str, cmd: str, timeout: int = 30) -> cri.ExecSyncResponse:
    ch, rt = f.runtime("gpu-1")
    with ch:
        return rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["sh", "-c", cmd], timeout=timeout),
                           timeout=timeout + 10)


def _get(f: Fabric3, cid: str, port: int) -> bytes:
    out = _exec(f, cid, f"wget -qO- http://127.0.0.1:{port}/")
    return out.stdout if out.exit_code == 0 else b""


def test_localhost_both_ways_and_the_pod_ip(pod) -> None:
    f = pod["f"]
    assert wait_for(lambda: _get(f, pod["gpu"], 8080) == b"remote-ok\n", timeout=20,
                    what="the local container reaching the rerouted one on localhost")
    assert wait_for(lambda: _get(f, pod["web"], 9090) == b"local-ok\n", timeout=20,
                    what="the rerouted container reaching the local one on localhost")
    # IPv6 loopback: a client that dials ::1 reaches the mirror, on either side; a server on ::1 only is reached
    # from the shadow.
    assert _exec(f, pod["gpu"], "wget -qO- http://[::1]:8080/").stdout == b"remote-ok\n"
    assert _exec(f, pod["web"], "wget -qO- http://[::1]:9090/").stdout == b"local-ok\n"
    assert wait_for(lambda: _get(f, pod["web"], 9093) == b"local-ok\n", timeout=20,
                    what="the rerouted container reaching a server on ::1 only in the origin pod")
    # A Service's client: the pod IP, from outside the pod (the root namespace routes to every pod subnet).
    with urllib.request.urlopen(f"http://{pod['ip']}:8080/", timeout=10) as resp:
        assert resp.read() == b"remote-ok\n"


def _connect(pod, port: int) -> socket.socket:
    s = pod["ns"].connect("127.0.0.1", port, 10)
    s.settimeout(60)
    return s


def _send_gib(sock: socket.socket, block: bytes) -> str:
    h = hashlib.sha256()
    for _ in range(GIB // len(block)):
        sock.sendall(block)
        h.update(block)
    return h.hexdigest()


def test_a_gib_each_way_with_its_checksum(pod) -> None:
    f = pod["f"]
    wait_for(lambda: _get(f, pod["gpu"], 8080) == b"remote-ok\n", timeout=20, what="stitched")
    block = hashlib.sha256(b"weft").digest() * (1 << 15)  # 1 MiB, not all zeros
    # Origin -> shadow: sha256sum in the rerouted container reads to our half-close and answers.
    sock = _connect(pod, 7000)
    sent = _send_gib(sock, block)
    sock.shutdown(socket.SHUT_WR)
    answer = b""
    while chunk := sock.recv(4096):
        answer += chunk
    sock.close()
    assert answer.split()[0].decode() == sent
    # Shadow -> origin: a listener in the origin pod (as a local container's) is mirrored into the shadow.
    server = pod["ns"].listen("127.0.0.1", 7100)
    got: dict[str, object] = {}

    def serve() -> None:
        conn, _ = server.accept()
        h, n = hashlib.sha256(), 0
        while chunk := conn.recv(1 << 20):
            h.update(chunk)
            n += len(chunk)
        got.update(sha=h.hexdigest(), n=n)
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        out = wait_for(lambda: (r := _exec(f, pod["web"], "dd if=/dev/zero bs=1048576 count=1024 2>/dev/null | "
                                           "nc 127.0.0.1 7100 && echo sent", timeout=120)).stdout == b"sent\n" and r,
                       timeout=30, what="the shadow reaching the origin's listener")
        assert out
        t.join(60)
        assert got == {"sha": hashlib.sha256(bytes(GIB)).hexdigest(), "n": GIB}
    finally:
        server.close()


def test_two_hundred_connections_at_once(pod) -> None:
    wait_for(lambda: _get(pod["f"], pod["gpu"], 8080) == b"remote-ok\n", timeout=20, what="stitched")

    def one(_: int) -> bytes:
        s = _connect(pod, 8080)
        try:
            s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            return data
        finally:
            s.close()

    socks = [_connect(pod, 8080) for _ in range(200)]  # all open at once
    for s in socks:
        s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
    answers = []
    for s in socks:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        answers.append(data)
        s.close()
    assert all(a.endswith(b"remote-ok\n") for a in answers), {a[:40] for a in answers}
    with ThreadPoolExecutor(50) as pool:
        assert all(a.endswith(b"remote-ok\n") for a in pool.map(one, range(200)))


def test_refused_and_reset_behave_as_direct(pod) -> None:
    # Nothing listens on 7300 in the pod: refused at once, as on a direct connection.
    with pytest.raises(ConnectionRefusedError):
        pod["ns"].connect("127.0.0.1", 7300, 5)
    # A client that resets mid-request: the next one is served as usual.
    s = _connect(pod, 8080)
    s.sendall(b"GET / HTTP/1.0\r\n")
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    assert _get(pod["f"], pod["gpu"], 8080) == b"remote-ok\n"


def test_a_port_the_local_container_holds_is_reported_not_taken(pod) -> None:
    f = pod["f"]
    # A second rerouted container that also serves 9090, which the local container holds.
    clash = create(f, pod["sid"], pod["sandbox"], cpu_container(
        "clash", ["sh", "-c", "mkdir -p /www && echo clash > /www/index.html && exec httpd -f -p 9090 -h /www"]))

    # Two outcomes, by which bind comes first in the shadow: clash's httpd takes 9090 there, and the origin
    # reports the collision and mirrors nothing; or the host has mirrored the pod's 9090 into the shadow
    # already, and clash's httpd is refused it, as a second container of a local pod would be.
    def outcome() -> str | None:
        if [e for e in f.agents["gpu-1"].events() if e.get("event") == "stitch.port_collision"
                and e.get("port") == 9090 and e.get("container") == "clash"]:
            return "reported"
        st = status(f, clash)
        return "refused" if st.state == cri.CONTAINER_EXITED else None

    seen = wait_for(outcome, timeout=60, what="the collision logged, or clash refused the port")
    if seen == "reported":
        (event,) = [e for e in f.agents["gpu-1"].events() if e.get("event") == "stitch.port_collision"
                    and e.get("port") == 9090 and e.get("container") == "clash"][:1]
        assert "httpd" in event["holder"] and event["side"] == "origin"
        assert status(f, clash).state == cri.CONTAINER_RUNNING
    else:
        st = status(f, clash)
        assert st.exit_code != 0, st
        wait_for(lambda: "in use" in Path(st.log_path).read_text(errors="replace"), timeout=20,
                 what="clash's log saying its port is in use")
    assert _get(f, pod["gpu"], 9090) == b"local-ok\n"  # the local one keeps its port
    ch, rt = f.runtime("gpu-1")
    with ch:
        rt.StopContainer(cri.StopContainerRequest(container_id=clash, timeout=0))
        rt.RemoveContainer(cri.RemoveContainerRequest(container_id=clash))


def test_a_link_flap_mid_transfer_is_an_error_then_new_connections_work(pod) -> None:
    f = pod["f"]
    wait_for(lambda: _get(f, pod["gpu"], 8080) == b"remote-ok\n", timeout=20, what="stitched")
    i = [n.name for n in f.cluster.nodes].index(pod["host"])
    sock = _connect(pod, 7000)
    sock.settimeout(30)
    block = bytes(1 << 20)
    for _ in range(16):
        sock.sendall(block)
    f.cluster.cut(i)
    started = time.monotonic()
    try:
        with pytest.raises(OSError):
            while time.monotonic() - started < 60:
                sock.sendall(block)
        assert time.monotonic() - started < 30, "the error came late"
    finally:
        sock.close()
        f.cluster.heal(i)
    f.wait_meshed()
    assert wait_for(lambda: _get(f, pod["gpu"], 8080) == b"remote-ok\n", timeout=30,
                    what="a new connection after the flap")


def test_nothing_leaks_in_either_agent(pod) -> None:
    """After every connection above (1 GiB, 400 at once, resets, the flap): the agents' sockets as at the start."""
    f = pod["f"]
    for name, before in pod["baseline"].items():
        pid = f.agents[name].pid
        wait_for(lambda p=pid, b=before: sockets(p) <= b + 2, timeout=20,
                 what=f"{name}'s sockets back to {before} (now {sockets(pid)})")
    # Listeners in the pod: the shadow's two mirrors and the local container's own, nothing else.
    assert set(pod["ns"].listening()) == {8080, 7000, 9090, 9093}


def test_declared_ports_replace_discovery(pod) -> None:
    """``weft.io/ports.<name>`` on the pod: each side mirrors what is declared, not what listens."""
    f = pod["f"]
    serve = "mkdir -p /www && echo {text} > /www/index.html && httpd -p {a} -h /www && exec httpd -f -p {b} -h /www"
    sid, sandbox = run_pod(f, "declared", annotations={"weft.io/ports.web2": "8081", "weft.io/ports.side": "9091"})
    try:
        web2 = create(f, sid, sandbox, cpu_container(
            "web2", ["sh", "-c", serve.format(text="web2-ok", a=8081, b=8082)]))
        # No limits: stays local (a peer admits by limits).
        side = create(f, sid, sandbox, pods.container_config(
            "side", ["sh", "-c", serve.format(text="side-ok", a=9091, b=9092)]))
        for cid in (web2, side):
            wait_for(lambda c=cid: status(f, c).state == cri.CONTAINER_RUNNING, what="running")
        assert status(f, web2).annotations[PLACEMENT].startswith("remote:")
        assert status(f, side).annotations[PLACEMENT] == "local"
        ch, _ = f.direct("gpu-1")
        with ch:
            ns = Netns(sandbox_netns(lambda path, req, typ: typ.FromString(
                ch.unary_unary(path)(req.SerializeToString(), timeout=10)), sid))
        try:
            wait_for(lambda: _get(f, side, 8081) == b"web2-ok\n", timeout=20, what="web2's declared port on localhost")
            wait_for(lambda: _get(f, web2, 9091) == b"side-ok\n", timeout=20,
                     what="side's declared port on localhost in the shadow")
            time.sleep(2)  # four rounds of the stitch: an undeclared port would be mirrored by now
            assert 8082 not in ns.listening()
            assert _get(f, side, 8082) == b""
            assert _get(f, web2, 9092) == b""
        finally:
            ns.close()
    finally:
        ch, rt = f.runtime("gpu-1")
        with ch:
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid))
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
