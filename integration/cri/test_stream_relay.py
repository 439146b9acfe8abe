"""Exec, attach, port-forward and the streaming relay on a rerouted container, compared with a local one.

Two real clients use the URLs that the origin's CRI socket returns, from
inside the origin node's network namespace where kubelet would: for a local
container that is containerd's own server, for a rerouted one the origin's
relay, which tunnels to the host's containerd.

- a WebSocket client (``shim.localfabric.streams``, ``v4.channel.k8s.io``);
- kubectl 1.20 over SPDY (``harness.kubectl``: its API server and
  kubelet played by the test, which redirects it to the CRI's URL): ``exec
  -it`` on a terminal with a resize, exec with separate stdout and stderr,
  ``attach``, and ``port-forward`` to the rerouted container's HTTP server
  (reached through the stitched pod network) and to the local one's.

Both must behave the same: TTY with resize, separate stdout and stderr, exit
codes, attach to a running container, port-forward, and a client that
vanishes mid-session leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from cri_api.v1 import api_pb2 as cri

from harness.kubectl import KubeApi, Terminal
from integration.procfs import sockets
from shim.crishared.netns import Netns
from shim.localfabric import pods
from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.streams import ChannelStream
from shim.localfabric.waiting import wait_for

# Each container serves HTTP (for port-forward) and writes a tick every 0.2 s (for attach).
TICKER = ("mkdir -p /www && echo {text} > /www/index.html && httpd -p {port} -h /www; "
          "i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done")
PORTS = {"remote": 8080, "local": 9090}


class Pod(NamedTuple):
    f: Fabric3
    remote: str
    local: str
    sid: str
    sandbox: cri.PodSandboxConfig


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fabric3, str, str]]:
    with Fabric3(tmp_path_factory.mktemp("streams") / "fabric") as f:
        sid, sandbox = run_pod(f)
        remote = create(f, sid, sandbox, cpu_container("ticker", [
            "sh", "-c", TICKER.format(text="remote-ok", port=PORTS["remote"])]))
        local = create(f, sid, sandbox, pods.container_config(
            "gpu", ["sh", "-c", TICKER.format(text="local-ok", port=PORTS["local"])],
            envs={"NVIDIA_VISIBLE_DEVICES": "all"}))
        for cid in (remote, local):
            wait_for(lambda c=cid: status(f, c).state == cri.CONTAINER_RUNNING, what="running")
        assert status(f, remote).annotations[PLACEMENT].startswith("remote:")
        assert status(f, local).annotations[PLACEMENT] == "local"
        yield Pod(f, remote, local, sid, sandbox)


def _netns(f: Fabric3) -> str:
    return str(f.node("gpu-1").containerd.netns_path)


def _open(f: Fabric3, verb: str, request) -> ChannelStream:
    ch, rt = f.runtime("gpu-1")
    with ch:
        url = getattr(rt, verb)(request).url
    return ChannelStream(url, _netns(f))


WHICH = pytest.mark.parametrize("which", ["remote", "local"])


@contextlib.contextmanager
def _session(pod: Pod, which: str, verb: str, request: Callable[[str], object]) -> Iterator[ChannelStream]:
    """A stream session with the pod's ``which`` container (``request`` of its ID), closed on leaving."""
    s = _open(pod.f, verb, request(pod.remote if which == "remote" else pod.local))
    try:
        yield s
    finally:
        s.close()


@WHICH
def test_interactive_exec_with_a_tty_and_resize(pod, which: str) -> None:
    with _session(pod, which, "Exec", lambda cid: cri.ExecRequest(container_id=cid, cmd=["sh"], tty=True,
                                                                   stdin=True, stdout=True)) as s:
        s.resize(100, 30)
        time.sleep(0.2)
        s.send(0, b"stty size; echo hi-$((40+2))\n")
        out = s.read_until(1, b"hi-42")
        assert b"30 100" in out
        s.send(0, b"exit 7\n")
        assert s.exit_code() == 7


@WHICH
def test_exec_without_a_tty_keeps_stdout_stderr_and_the_exit_code(pod, which: str) -> None:
    with _session(pod, which, "Exec", lambda cid: cri.ExecRequest(
            container_id=cid, cmd=["sh", "-c", "echo out; echo err >&2; exit 3"], stdout=True, stderr=True)) as s:
        assert s.exit_code() == 3
        assert s.out.get(1) == b"out\n" and s.out.get(2) == b"err\n"


@WHICH
def test_attach_to_a_running_container(pod, which: str) -> None:
    with _session(pod, which, "Attach", lambda cid: cri.AttachRequest(container_id=cid, stdout=True,
                                                                       stderr=True)) as s:
        out = s.read_until(1, b"tick", timeout=10)
        first = int(out.split(b"tick ")[1].split(b"\n")[0])
        s.read_until(1, f"tick {first + 2}\n".encode(), timeout=10)


# -- kubectl over SPDY ------------------------------------------------------------------
NAMES = {"remote": "ticker", "local": "gpu"}


@pytest.fixture(scope="module")
def api(pod, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KubeApi, Path]]:
    f, remote, local, sid, sandbox = pod
    home = tmp_path_factory.mktemp("kubectl-home")
    with KubeApi(_netns(f), lambda: f.runtime("gpu-1"), sandbox.metadata.name, sid,
                 {"ticker": remote, "gpu": local}) as server:
        yield server, home


def _size_seen(term: Terminal, size: bytes, within: float = 10.0) -> bool:
    """Ask ``stty size`` until it answers ``size``.

    kubectl sends the first size on its resize stream, which containerd applies
    beside the process's start, not before it (so a plain pod races the same
    way): a line typed at once can meet a terminal with no size yet.
    """
    deadline = time.monotonic() + within
    for attempt in range(1000, 2000):  # a marker per attempt; the typed line holds it only as a sum
        start = len(term.out)
        term.type(b"stty size; echo size-$((%d+1))\r" % (attempt - 1))
        answer = term.read_until(b"size-%d\r\n" % attempt)[start:]
        if re.search(rb"%s\r\n(.*\r\n)?size-%d" % (size, attempt), answer):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return False


@WHICH
def test_kubectl_exec_on_a_terminal_with_a_resize(pod, api, which: str) -> None:
    server, home = api
    term = Terminal(server, "exec", "-it", server.pod, "-c", NAMES[which], "--", "sh", home=home, rows=30, cols=100)
    try:
        assert _size_seen(term, b"30 100"), "the terminal's first size never reached the container"
        term.resize(40, 120)
        time.sleep(0.3)  # kubectl sends the new size on its resize stream, not in band
        start = len(term.out)
        term.type(b"stty size; echo hi-$((40+3))\r")
        assert b"40 120" in term.read_until(b"hi-43\r\n")[start:]
        term.type(b"exit 7\r")
        assert term.wait() == 7
    finally:
        term.close()


@WHICH
def test_kubectl_exec_keeps_stdout_stderr_and_the_exit_code(pod, api, which: str) -> None:
    server, home = api
    p = server.kubectl("exec", server.pod, "-c", NAMES[which], "--", "sh", "-c", "echo out; echo err >&2; exit 3",
                       home=home, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 3
    assert out == b"out\n"
    assert b"err\n" in err and b"command terminated with exit code 3" in err


@WHICH
def test_kubectl_attach_to_a_running_container(pod, api, which: str) -> None:
    server, home = api
    p = server.kubectl("attach", server.pod, "-c", NAMES[which], home=home, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL)
    try:
        ticks = []
        deadline = time.monotonic() + 20
        while len(ticks) < 3 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            ticks += [int(n) for n in re.findall(rb"^tick (\d+)$", line.strip())]
        assert len(ticks) == 3 and ticks == list(range(ticks[0], ticks[0] + 3)), ticks
    finally:
        p.kill()
        p.communicate(timeout=10)


@WHICH
def test_kubectl_port_forward(pod, api, which: str) -> None:
    f = pod.f
    server, home = api
    p = server.kubectl("port-forward", f"pod/{server.pod}", f":{PORTS[which]}", home=home, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL)
    ns = Netns(_netns(f))
    try:
        line = p.stdout.readline().decode()
        m = re.match(rf"Forwarding from 127\.0\.0\.1:(\d+) -> {PORTS[which]}", line)
        assert m, line
        for _ in range(3):  # a connection each, one after the other, through one SPDY session
            sock = ns.connect("127.0.0.1", int(m.group(1)), 10)
            sock.settimeout(20)
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            sock.close()
            assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(f"{which}-ok\n".encode()), reply[-200:]
    finally:
        p.kill()
        p.communicate(timeout=10)
        ns.close()


def _shells(f: Fabric3, cid: str) -> int:
    ch, rt = f.runtime("gpu-1")
    with ch:
        ps = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["ps"], timeout=10)).stdout.decode()
    return ps.count(" sh\n")


def test_a_client_that_vanishes_leaves_what_it_leaves_locally_and_no_socket(pod) -> None:
    f, remote, local, _, _ = pod
    agent = f.agents["gpu-1"].pid
    left = {}
    for cid in (remote, local):
        before, shells = sockets(agent), _shells(f, cid)
        for _ in range(3):
            s = _open(f, "Exec", cri.ExecRequest(container_id=cid, cmd=["sh"], tty=True, stdin=True, stdout=True))
            s.send(0, b"echo alive\n")
            s.read_until(1, b"alive")
            s.ws.socket.close()  # gone without a close frame, as a killed kubectl
            s.ns.close()
        wait_for(lambda b=before: sockets(agent) <= b, timeout=15, what=f"origin sockets back to {before}")
        time.sleep(1)
        left[cid] = _shells(f, cid) - shells
    # containerd 1.6 does not hang up an exec's terminal when its client goes; the relay changes nothing.
    assert left[remote] == left[local]


def test_an_unknown_or_used_session_is_refused(pod) -> None:
    f, remote, *_ = pod
    ch, rt = f.runtime("gpu-1")
    with ch:
        url = rt.Exec(cri.ExecRequest(container_id=remote, cmd=["true"], stdout=True)).url
    host, port = url.split("/")[2].split(":")
    ns = Netns(_netns(f))
    try:
        for path in ("/exec/nosuchtoken", "/attach/" + url.rsplit("/", 1)[1], "/"):
            sock = ns.connect(host, int(port), 5)
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert sock.recv(100).startswith(b"HTTP/1.1 404"), path
            sock.close()
        s = ChannelStream(url, _netns(f))
        assert s.exit_code() == 0
        s.close()
        sock = ns.connect(host, int(port), 5)  # the token was used
        sock.sendall(f"GET /{url.split('/', 3)[3]} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(100).startswith(b"HTTP/1.1 404")
        sock.close()
        # A client that sends half a head and stalls is let go, not held.
        sock = ns.connect(host, int(port), 5)
        sock.sendall(b"GET /exec/")
        sock.settimeout(20)
        assert sock.recv(100).startswith(b"HTTP/1.1 400")
        sock.close()
    finally:
        ns.close()
