"""The host's tunnel port, reachable from any pod, cannot be held or killed by connections to it.

Attacks on a real CPU host agent: a handshake trickled a byte a second (each
read well inside the handshake timeout) must be cut when the handshake's
deadline passes; sixty idle connections while the agent cannot start more
than a few threads (a pids cgroup, as a task limit would) must not end the
accept loop: once they are gone, a valid token is answered and ``/healthz``
names no dead loop. And 300 idle connections held open, from one address or
from many that are no mesh peer's, do not keep an origin from its tunnel: a
page comes through within 2 s while they are held.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cri_api.v1 import api_pb2 as cri

from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim.mesh.tunnel import TunnelError, contexts, dial

PIDS = Path("/sys/fs/cgroup/pids")


@pytest.fixture(scope="module")
def tunnel(mesh: MeshHost) -> Iterator[tuple[str, pb.TunnelGrant]]:
    """The tunnel port's address, and a way to get fresh grants there (a shadow of gpu-1's to tunnel to)."""
    key = "origin-sb-1/tunnel-target/0"
    with mesh.channel("gpu-1") as ch:
        ch.unary_unary(MESH + "RunShadow")(run_shadow_request(mesh.containerd, "gpu-1", key).SerializeToString(),
                                             timeout=120)
        try:
            yield key, _grant(mesh, key)
        finally:
            ch.unary_unary(MESH + "RemoveShadow")(pb.ShadowRef(origin_node="gpu-1", key=key).SerializeToString(),
                                                  timeout=120)


def _grant(mesh: MeshHost, key: str) -> pb.TunnelGrant:
    with mesh.channel("gpu-1") as ch:
        raw = ch.unary_unary(MESH + "OpenTunnel")(
            pb.TunnelRequest(origin_node="gpu-1", key=key, port=8080).SerializeToString(), timeout=30)
    return pb.TunnelGrant.FromString(raw)


def _addr(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def test_a_trickled_handshake_is_cut_at_its_deadline(tunnel) -> None:
    _, grant = tunnel
    with socket.create_connection(_addr(grant.address), timeout=5) as s:
        s.settimeout(1.0)
        header = b"WEFT-TUNNEL/1 " + b"00" * 8  # 30 bytes, a second apart: far past any handshake timeout
        sent = 0
        for b in header:
            try:
                s.sendall(bytes([b]))
                if s.recv(100) is not None:  # EOF or an ERR line: the server let go
                    break
            except TimeoutError:
                sent += 1  # still held open
            except OSError:
                break
    assert sent < len(header), "the server held a trickled handshake open for all of it"


@contextlib.contextmanager
def _task_limit(pid: int, extra: int) -> Iterator[None]:
    """``pid`` in a pids cgroup that lets it start only ``extra`` more threads."""
    group = PIDS / f"weft-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(pid))
        threads = len(os.listdir(f"/proc/{pid}/task"))
        (group / "pids.max").write_text(str(threads + extra))
        yield
    finally:
        (group / "pids.max").write_text("max")
        with contextlib.suppress(OSError):
            (PIDS / "cgroup.procs").write_text(str(pid))
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def _healthz(mesh: MeshHost) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(mesh.agent.metrics_url + "/healthz", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_idle_connections_under_a_task_limit_do_not_kill_the_tunnel_port(mesh: MeshHost, tunnel) -> None:
    key, grant = tunnel
    assert mesh.agent.proc is not None
    idle: list[socket.socket] = []
    with _task_limit(mesh.agent.proc.pid, extra=8):
        try:
            for _ in range(60):
                with contextlib.suppress(OSError):
                    idle.append(socket.create_connection(_addr(grant.address), timeout=5))
            time.sleep(3)  # the agent tries to start a thread for each
        finally:
            for s in idle:
                s.close()
    time.sleep(1)
    fresh = _grant(mesh, key)
    try:
        # A port's tunnel is TLS with the origin's certificate (mesh.tunnel_tls, on by default).
        assert fresh.tls
        end = dial(fresh.address, fresh.token, tls=contexts(mesh.cert_dir, "gpu-1")[1], node="cpu-1", timeout=10)
        end.close()
        answered = "OK"
    except TunnelError as exc:
        answered = str(exc)
    # Nothing listens on 8080 in the shadow: the host answers with the target's refusal, not silence.
    assert answered == "OK" or "nothing listens on port 8080" in answered, answered
    status, body = _healthz(mesh)
    assert (status, body.get("dead")) == (200, None), body




PAGE = b"page-of-the-shadow"


@pytest.fixture(scope="module")
def web_shadow(mesh: MeshHost) -> Iterator[str]:
    """A running shadow of gpu-1's serving ``PAGE`` on its port 8080 (busybox httpd); its key."""
    key = "origin-sb-web/web/0"
    req = run_shadow_request(mesh.containerd, "gpu-1", key, sandbox="origin-sb-web")
    config = cri.ContainerConfig.FromString(req.container_config)
    config.command[:] = ["sh", "-c", f"mkdir -p /www && echo {PAGE.decode()} > /www/index.html && "
                                     "exec httpd -f -p 8080 -h /www"]
    req.container_config = config.SerializeToString()
    req.start = True
    with mesh.channel("gpu-1") as ch:
        ch.unary_unary(MESH + "RunShadow")(req.SerializeToString(), timeout=120)
        try:
            deadline = time.monotonic() + 30
            while _page(mesh, key, timeout=5) is None:  # httpd starts listening
                assert time.monotonic() < deadline, "the shadow's httpd never served its page"
                time.sleep(0.2)
            yield key
        finally:
            ch.unary_unary(MESH + "RemoveShadow")(pb.ShadowRef(origin_node="gpu-1", key=key).SerializeToString(),
                                                  timeout=120)


def _page(mesh: MeshHost, key: str, timeout: float) -> bytes | None:
    """The shadow's page through a fresh tunnel as its origin opens one, each step within ``timeout``; None:
    refused."""
    grant = _grant(mesh, key)
    try:
        end = dial(grant.address, grant.token, tls=contexts(mesh.cert_dir, "gpu-1")[1], node="cpu-1",
                   timeout=timeout)
    except TunnelError:
        return None
    try:
        end.sock.settimeout(timeout)
        end.sendall(b"GET / HTTP/1.0\r\n\r\n")
        body, buf = b"", bytearray(65536)
        while n := end.recv_into(buf):
            body += bytes(buf[:n])
        return body
    finally:
        end.close()


@pytest.mark.parametrize("sources", [1, 150], ids=["one-address", "many-addresses"])
def test_idle_connections_from_strangers_do_not_keep_an_origin_from_its_tunnel(mesh: MeshHost, web_shadow: str,
                                                                               sources: int) -> None:
    # The peers file has the origins at 127.0.0.1; the flood comes from other loopback addresses, as a tenant
    # pod's would from the pod network.
    host, port = _addr(_grant(mesh, web_shadow).address)
    idle: list[socket.socket] = []
    try:
        for i in range(300):
            with contextlib.suppress(OSError):
                idle.append(socket.create_connection((host, port), timeout=5,
                                                     source_address=(f"127.0.1.{i % sources + 1}", 0)))
        time.sleep(0.5)  # every one accepted, and held or closed
        started = time.monotonic()
        page = _page(mesh, web_shadow, timeout=2)
        took = time.monotonic() - started
    finally:
        for s in idle:
            s.close()
    assert page is not None and PAGE in page, page
    assert took < 2, took
