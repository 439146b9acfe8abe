"""Attacks on the stitched pod network: an on-path reader, and a pod reaching a loopback-only server.

An on-path attacker between nodes reads the stitched network's tunnel: it
sees only TLS. On the three-node fabric with the kernel path off (so the agents' user-space
tunnel carries every stitched port), a rerouted container serves a page
holding a random marker on 127.0.0.1:8080, and the origin pod's local
container one on 127.0.0.1:9091. Each side fetches the other's page through
its own localhost while a raw packet socket in the origin node's network
namespace, where the tunnel leaves for the host, records every byte on every
interface. The same marker fetched across the pod network directly (the
shadow's pod IP, no weft in the path) is in the capture, which shows the
capture sees what crosses the node; through the tunnel it never is.

A rerouted container's server that listens on 127.0.0.1 only is mirrored on
the origin pod's loopback only: another pod (here the origin node itself,
which reaches every pod IP) cannot reach it on the origin pod's IP, while the
server on every address can be, as it could be on the shadow's.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
from cri_api.v1 import api_pb2 as cri

from shim.crishared.netns import Netns
from shim.localfabric import pods
from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.waiting import wait_for

ETH_P_ALL = 0x0003
MARKER = f"weft-on-path-{secrets.token_hex(12)}"
REMOTE = (f"mkdir -p /www && echo remote-{MARKER} > /www/index.html && httpd -p 8080 -h /www && "
          "exec httpd -f -p 127.0.0.1:8081 -h /www")
LOCAL = f"mkdir -p /www && echo local-{MARKER} > /www/index.html && exec httpd -f -p 127.0.0.1:9091 -h /www"


SOL_PACKET, PACKET_STATISTICS, SO_RCVBUFFORCE = 263, 6, 33  # <linux/if_packet.h>, <asm/socket.h>


class Capture:
    """Every frame on every interface of a network namespace, from ``start`` until ``stop``: what the kernel
    queued before the stop is read too (a reader starved by a busy machine falls behind, it loses nothing), and
    frames the kernel dropped for want of room are counted (``drops``)."""

    def __init__(self, netns: str) -> None:
        self._ns = Netns(netns, workers=1)
        self._sock = self._ns.run(socket.socket, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        self._sock.settimeout(0.2)
        self._frames = bytearray()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self.drops = 0

    def _read(self) -> None:
        stopped = None
        while True:
            try:
                self._frames += self._sock.recv(1 << 16)
            except TimeoutError:
                if self._stop.is_set():  # stopped, and nothing more queued
                    return
            if self._stop.is_set():
                stopped = stopped or time.monotonic()
                if time.monotonic() - stopped > 5:  # what came in the last seconds before the stop is read
                    return

    def __enter__(self) -> Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        _packets, drops = struct.unpack("II", self._sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
        self.drops += drops
        self._sock.close()
        self._ns.close()

    def saw(self, text: str) -> bool:
        return text.encode() in self._frames


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric3]:
    # The default for mesh.tunnel_tls: on. The kernel path off makes the tunnel carry every port.
    with Fabric3(tmp_path_factory.mktemp("stitched") / "fabric", mesh_config="stitch_kernel_path = false\n") as f:
        yield f


def _fetch(f: Fabric3, cid: str, url: str) -> bytes:
    ch, rt = f.runtime("gpu-1")
    with ch:
        out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["wget", "-qO-", url], timeout=20), timeout=30)
    return out.stdout if out.exit_code == 0 else b""


@contextlib.contextmanager
def _pod(f: Fabric3, name: str) -> Iterator[tuple[str, str, str, str]]:
    """A two-stage pod: its sandbox, rerouted and local container, and the rerouted one's host; removed after."""
    sid, sandbox = run_pod(f, name)
    try:
        remote = create(f, sid, sandbox, cpu_container("web", ["sh", "-c", REMOTE], memory=256 << 20))
        local = create(f, sid, sandbox, pods.container_config("gpu", ["sh", "-c", LOCAL],
                                                              envs={"NVIDIA_VISIBLE_DEVICES": "all"}))
        for cid in (remote, local):
            wait_for(lambda c=cid: status(f, c).state == cri.CONTAINER_RUNNING, what="running")
        host = status(f, remote).annotations[PLACEMENT].removeprefix("remote:")
        assert host.startswith("cpu-"), host
        yield sid, remote, local, host
    finally:
        ch, rt = f.runtime("gpu-1")
        with ch:
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=60)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=60)


def _get(ns: Netns, ip: str, port: int) -> bytes | OSError:
    """An HTTP GET of / from inside ``ns``: the body, or the error connecting."""
    try:
        s = ns.connect(ip, port, 5)
    except OSError as exc:
        return exc
    with s:
        s.sendall(f"GET / HTTP/1.0\r\nHost: {ip}\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data.partition(b"\r\n\r\n")[2]


def test_pod_bytes_in_the_tunnel_are_encrypted_both_ways(fabric: Fabric3) -> None:
    f = fabric
    with _pod(f, "onpath") as (_sid, remote, local, host):
        ch, rt = f.direct(host)
        with ch:
            shadow_sid = f.shadows(host)[0].pod_sandbox_id
            shadow_ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=shadow_sid)).status.network.ip

        # The capture sees a page that crosses the node in the clear (the pod network, no weft in the path).
        with Capture(str(f.node("gpu-1").netns_path)) as direct:
            assert wait_for(lambda: _fetch(f, local, f"http://{shadow_ip}:8080/") == f"remote-{MARKER}\n".encode(),
                            timeout=20, what="the shadow's page on its pod IP")
        assert direct.saw(f"remote-{MARKER}"), "the capture missed a page that crossed the node in the clear"

        # Through the tunnel, each way, the pages arrive and the capture never holds them.
        with Capture(str(f.node("gpu-1").netns_path)) as tunnelled:
            assert wait_for(lambda: _fetch(f, local, "http://127.0.0.1:8080/") == f"remote-{MARKER}\n".encode(),
                            timeout=30, what="the shadow's page on the origin pod's localhost, through the tunnel")
            assert wait_for(lambda: _fetch(f, remote, "http://127.0.0.1:9091/") == f"local-{MARKER}\n".encode(),
                            timeout=30, what="the origin pod's page on the shadow's localhost, through the tunnel")
        assert not tunnelled.saw(MARKER), "pod bytes crossed the node network in the clear through weft's tunnel"
        assert tunnelled.drops == 0, f"the capture lost {tunnelled.drops} frames: it cannot tell"
        events = [e for e in f.agents[host].events() if e.get("event") == "tunnel.refused"]
        assert not events, events


def test_a_server_on_loopback_only_is_not_reachable_on_the_origin_pods_ip(fabric: Fabric3) -> None:
    f = fabric
    with _pod(f, "loopback") as (sid, _remote, local, _host):
        ch, rt = f.direct("gpu-1")
        with ch:
            pod_ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid)).status.network.ip
        # Both are mirrored into the origin pod and answer on its localhost.
        for port in (8080, 8081):
            assert wait_for(lambda p=port: _fetch(f, local, f"http://127.0.0.1:{p}/") == f"remote-{MARKER}\n".encode(),
                            timeout=30, what=f"the shadow's {port} on the origin pod's localhost")
        node = Netns(str(f.node("gpu-1").netns_path), workers=1)
        try:
            # From outside the pod: the server on every address answers on the pod IP, the loopback-only one is refused.
            assert wait_for(lambda: _get(node, pod_ip, 8080) == f"remote-{MARKER}\n".encode(), timeout=10,
                            what="8080 (every address) on the origin pod's IP")
            answer = _get(node, pod_ip, 8081)
            assert isinstance(answer, ConnectionRefusedError), (
                f"a server on the shadow's 127.0.0.1 answered on the origin pod's IP: {answer!r}")
        finally:
            node.close()
