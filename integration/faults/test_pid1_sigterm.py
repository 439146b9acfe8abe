"""Every weft process a container runs ends within 2 s of SIGTERM, at any point of its life (shim/stopping.py).

The commands nodeimage/manifests and charts/weft run in containers: ``weft mesh-signer`` (the signer's
Deployment), ``weft mesh-identity`` with and without ``--once`` and ``weft kube-credentials`` (the DaemonSet),
``weft install`` and ``weft uninstall`` (the DaemonSet's init container, and the back-out's). Each runs here as
PID 1 of a new PID namespace (``unshare --pid --fork --mount-proc``; no container runtime), and SIGTERM comes
from outside it, as runc sends kubelet's StopContainer and systemd stops a container's scope at poweroff:

- at start, as the image runs it: its own ENTRYPOINT (read from nodeimage/Containerfile: tini, then weft), once
  the container has run 1, 3, 10, 30 and 100 ms of CPU since exec (its CPU time, not the wall clock's: on a busy
  machine a process may wait milliseconds before it runs at all), through tini's start, the interpreter's, weft's
  imports and its first calls; and weft itself as PID 1 the moment its handler is in place (its first statement
  sets it). Earlier than that first millisecond is tini's own start, before it blocks signals: tens to hundreds
  of microseconds, where a PID 1 discards a SIGTERM whatever program it is;
- while an API call hangs: the command's kubeconfig names a server that accepts and never answers;
- while serving: a fake API server answers what the command asks (a list and a watch that stays open, a CSR it
  signs, a TokenRequest), and SIGTERM comes once the command has done its first job; for the signer also twice,
  microseconds apart, as kubelet and systemd both send it at a node's poweroff (a handler that set an Event
  deadlocked on that Event's lock: the signer's 90 s hang).

Each must be gone within 2 s (the issue's bound, for correctness: nothing here waits on anything but the
signal), and its output directory must hold only whole files and no temporary one. Root: PID namespaces.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509

from nodeimage import build
from nodeimage.build import common, layer
from shim.mesh import certs, csr

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 2.0
NODE = "cpu-1"
UNSHARE = shutil.which("unshare") or "/usr/bin/unshare"


# -- the API servers ---------------------------------------------------------------------------------------------
class Hung:
    """A TCP server that accepts connections and never answers: every API call to it hangs."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = threading.Event()
        self._held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._held.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self._held:
            conn.close()


@dataclass
class FakeApi:
    """Answers what the three commands ask: the signer's list and watch (held open), mesh-identity's CSR (signed
    by a CA of its own) and kube-credentials' TokenRequest; a Node is not found."""

    url: str = ""
    watching: threading.Event = field(default_factory=threading.Event)
    closing: threading.Event = field(default_factory=threading.Event)
    ca: tuple[bytes, bytes] = field(default_factory=certs.generate_ca)
    csrs: dict[str, dict] = field(default_factory=dict)

    def __post_init__(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_args: object) -> None:
                pass

            def _json(self, code: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                path, _, query = self.path.partition("?")
                prefix = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
                if path == prefix and "watch=" in query:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.flush()
                    api.watching.set()
                    api.closing.wait()  # a watch with nothing to say, open until the server closes
                elif path == prefix:
                    self._json(200, {"apiVersion": "certificates.k8s.io/v1", "kind": "CertificateSigningRequestList",
                                     "metadata": {"resourceVersion": "1"}, "items": []})
                elif path.startswith(prefix + "/") and path.rsplit("/", 1)[1] in api.csrs:
                    self._json(200, api.issued(path.rsplit("/", 1)[1]))
                else:
                    self._json(404, {"apiVersion": "v1", "kind": "Status", "status": "Failure", "reason": "NotFound",
                                     "code": 404, "message": f"{path} not found"})

            def do_POST(self) -> None:
                doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/token"):
                    expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=doc["spec"]["expirationSeconds"])
                    self._json(201, {**doc, "status": {"token": "a-token-of-weft-s",
                                                       "expirationTimestamp": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}})
                else:
                    name = doc["metadata"]["generateName"] + str(len(api.csrs) + 1)
                    api.csrs[name] = {**doc, "metadata": {**doc["metadata"], "name": name}}
                    self._json(201, api.csrs[name])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def issued(self, name: str) -> dict:
        doc = self.csrs[name]
        request = base64.b64decode(doc["spec"]["request"])
        cert = certs.sign_node_cert(*self.ca, NODE, csr.public_key_of(request),
                                    not_after=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
        return {**doc, "status": {"certificate": base64.b64encode(cert + self.ca[1]).decode()}}

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": url}}],
        "users": [{"name": "t", "user": {"token": "t"}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}]}))
    return path


# -- the commands ------------------------------------------------------------------------------------------------
def _whole_pem(path: Path) -> None:
    data = path.read_bytes()
    if path.suffix == ".key":
        csr.load_key(data)
    else:
        x509.load_pem_x509_certificates(data)


def _only_whole_files(out: Path, allowed: dict[str, Callable[[Path], None]], together: list[set[str]]) -> None:
    """``out`` holds nothing but ``allowed`` files, each whole (its check passes), and of each set in
    ``together`` all or none."""
    names = {p.name for p in out.iterdir()}
    assert names <= set(allowed), f"{out}: {sorted(names - set(allowed))} left beside {sorted(allowed)}"
    for name in names:
        allowed[name](out / name)
    for group in together:
        assert names >= group or not names & group, f"{out}: {sorted(names & group)} without the rest of {group}"


def _token(path: Path) -> None:
    text = path.read_text()
    assert text.endswith("\n") and text.strip(), f"{path}: {text!r}"


def _no_temporary_files(root: Path) -> None:
    left = [str(p) for p in root.rglob("*") if p.name.endswith((".tmp", ".weft-tmp"))]
    assert not left, f"temporary files left: {left}"


@dataclass
class Command:
    name: str
    args: list[str]
    out: Path
    check: Callable[[], None]
    done: Callable[[], bool]  # for "while serving": it has done its first job
    env: dict[str, str] = field(default_factory=dict)


def _command(which: str, url: str, tmp: Path) -> Command:
    tmp.mkdir(parents=True, exist_ok=True)
    kc = _kubeconfig(tmp / "kubeconfig.json", url)
    out = tmp / "out"
    out.mkdir()
    if which == "mesh-signer":
        key, cert = certs.generate_ca()
        (out / "ca.key").write_bytes(key)
        (out / "ca.crt").write_bytes(cert)

        def unchanged() -> None:
            assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "ca.key"]
            assert (out / "ca.key").read_bytes() == key and (out / "ca.crt").read_bytes() == cert

        return Command(which, ["mesh-signer", "--ca-dir", str(out), "--kubeconfig", str(kc)], out, unchanged,
                       lambda: False)
    if which.startswith("mesh-identity"):
        files = {f"{NODE}.key": _whole_pem, "ca.crt": _whole_pem, f"{NODE}.crt": _whole_pem}
        return Command(which, ["mesh-identity", "--dir", str(out), "--node-name", NODE, "--kubeconfig", str(kc),
                               *(["--once"] if which.endswith("--once") else [])], out,
                       lambda: _only_whole_files(out, files, [{"ca.crt", f"{NODE}.crt"}]),
                       lambda: (out / f"{NODE}.crt").exists())
    if which == "kube-credentials":
        files = {"token": _token, "kubeconfig": lambda p: json.loads(p.read_text())}
        return Command(which, ["kube-credentials", "--dir", str(out), "--kubeconfig", str(kc), "--namespace",
                               "weft-system", "--service-account", "weft"], out,
                       lambda: _only_whole_files(out, files, [{"token", "kubeconfig"}]),
                       lambda: (out / "kubeconfig").exists())
    if which == "install":
        # In its pod (WEFT_POD_NAME) it first reads its Node's labels, with KUBECONFIG's credentials.
        return Command(which, ["install", "--root", str(out), "--node-name", "node-1"], out,
                       lambda: _no_temporary_files(out), lambda: False,
                       env={"WEFT_POD_NAME": "weft-x", "KUBECONFIG": str(kc)})
    assert which == "uninstall"
    return Command(which, ["uninstall", "--root", str(out), "--purge"], out, lambda: _no_temporary_files(out),
                   lambda: False)


# -- PID 1 ---------------------------------------------------------------------------------------------------------
def _weft() -> list[str]:
    return [sys.executable, str(REPO / "nodeimage" / "bin" / "weft")]


def _entrypoint() -> list[str]:
    """The image's ENTRYPOINT with its files as they are here: weft's launcher run by this Python, and what
    the init stage copies in (tini) as the build takes it."""
    plan = build.parse_containerfile(build.CONTAINERFILE.read_text())
    staged = {dest: src for _stage, src, dest in plan.copies_from}
    try:
        init = layer.init_stage() if common.INIT_STAGE in plan.stages else {}
    except build.BuildError as exc:
        pytest.fail(f"the image's init stage cannot be had here (it needs apt's package index): {exc}")
    argv: list[str] = []
    for word in plan.entrypoint:
        if word == "/opt/weft/bin/weft":
            argv += _weft()
        elif staged.get(word) in init:
            argv.append(str(init[staged[word]]))
        else:
            argv.append(word)
    return argv


@dataclass
class Pid1:
    unshare: subprocess.Popen
    pid: int  # the namespace's PID 1, as this namespace numbers it
    log: Path

    def exe(self) -> str:
        try:
            return os.readlink(f"/proc/{self.pid}/exe")
        except FileNotFoundError:
            return ""

    def cpu_ns(self) -> int:
        """CPU time PID 1 and its descendants have run, every thread's, in ns (what is gone counts no more)."""
        total, todo = 0, [self.pid]
        while todo:
            pid = todo.pop()
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    total += int((task / "schedstat").read_text().split()[0])
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):  # gone meanwhile
                continue
        return total

    def catches_sigterm(self) -> bool:
        try:
            status = Path(f"/proc/{self.pid}/status").read_text()
        except FileNotFoundError:
            return True  # gone already: nothing left to wait for
        caught = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("SigCgt:")), 16)
        return bool(caught & (1 << (signal.SIGTERM - 1)))

    def sigterm(self, *, again_after_us: float | None = None) -> float:
        """SIGTERM from outside the namespace (twice, ``again_after_us`` apart); seconds until PID 1 is gone,
        failing after ``GONE_WITHIN_S``, or if it ended otherwise than as SIGTERM ends it (0, or 143: 128 +
        SIGTERM, where it was in no state to end in order)."""
        t0 = time.monotonic()
        try:
            os.kill(self.pid, signal.SIGTERM)
            if again_after_us is not None:
                until = time.monotonic() + again_after_us / 1e6
                while time.monotonic() < until:
                    pass
                os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:  # it ended (and was reaped) by itself first
            pass
        try:
            self.unshare.wait(GONE_WITHIN_S)
        except subprocess.TimeoutExpired:
            threads = {t.name: (t / "wchan").read_text() for t in Path(f"/proc/{self.pid}/task").iterdir()}
            pytest.fail(f"PID 1 ({self.pid}) still there {GONE_WITHIN_S} s after SIGTERM; its threads wait in "
                        f"{threads}; its log:\n{self.log.read_text()[-3000:]}")
        assert self.unshare.returncode in (0, 128 + signal.SIGTERM), \
            f"PID 1 exited {self.unshare.returncode} after SIGTERM: {self.log.read_text()[-3000:]}"
        return time.monotonic() - t0


@pytest.fixture
def pid1(tmp_path: Path) -> Iterator[Callable[..., Pid1]]:
    started: list[Pid1] = []

    def start(argv: list[str], env: dict[str, str] | None = None) -> Pid1:
        log = tmp_path / f"pid1-{len(started)}.log"
        with open(log, "wb") as f:
            u = subprocess.Popen([UNSHARE, "--pid", "--fork", "--mount-proc", "--", *argv], stdout=f, stderr=f,
                                 env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})
        children = Path(f"/proc/{u.pid}/task/{u.pid}/children")
        deadline = time.monotonic() + 10
        while not (kids := children.read_text().split() if children.exists() else []):
            assert time.monotonic() < deadline and u.poll() is None, f"unshare made no PID 1: {log.read_text()}"
        p = Pid1(u, int(kids[0]), log)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.unshare.poll() is None:
            os.kill(p.pid, signal.SIGKILL)  # the namespace's other processes go with its PID 1
            p.unshare.wait(10)


def _wait(what: str, cond: Callable[[], bool], p: Pid1, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert p.unshare.poll() is None, f"PID 1 ended before {what}: {p.log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s: {p.log.read_text()[-3000:]}"
        time.sleep(0.005)


ALL = ["mesh-signer", "mesh-identity", "mesh-identity --once", "kube-credentials", "install", "uninstall"]


# -- at start ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ALL)
def test_sigterm_within_milliseconds_of_exec_ends_the_image_s_entrypoint(which: str, pid1, tmp_path: Path) -> None:
    entry = _entrypoint()
    first = os.path.realpath(entry[0])
    api = FakeApi()
    try:
        for i, after_ms in enumerate((1, 3, 10, 30, 100)):
            cmd = _command(which, api.url, tmp_path / f"at-{i}")
            p = pid1([*entry, *cmd.args], cmd.env)
            deadline = time.monotonic() + 10
            while p.exe() != first:  # exec'd: the image's first program runs as PID 1
                assert time.monotonic() < deadline and p.unshare.poll() is None, p.log.read_text()
            ran = p.cpu_ns()
            deadline = time.monotonic() + 5  # or sooner, for a command that waits (or ends) before it has run that long
            while p.cpu_ns() - ran < after_ms * 1e6 and time.monotonic() < deadline and p.unshare.poll() is None:
                pass
            p.sigterm()
            cmd.check()
    finally:
        api.close()


@pytest.mark.parametrize("which", ALL)
def test_sigterm_as_soon_as_weft_handles_it_ends_weft_as_pid_1(which: str, pid1, tmp_path: Path) -> None:
    api = FakeApi()
    try:
        cmd = _command(which, api.url, tmp_path)
        p = pid1([*_weft(), *cmd.args], cmd.env)
        deadline = time.monotonic() + 30
        while not p.catches_sigterm():
            assert time.monotonic() < deadline, p.log.read_text()
        p.sigterm()
        cmd.check()
    finally:
        api.close()


# -- while an API call hangs ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["mesh-signer", "mesh-identity", "mesh-identity --once", "kube-credentials",
                                   "install"])
def test_sigterm_while_an_api_call_hangs_ends_weft_as_pid_1(which: str, pid1, tmp_path: Path) -> None:
    hung = Hung()
    try:
        cmd = _command(which, hung.url, tmp_path)
        p = pid1([*_weft(), *cmd.args], cmd.env)
        _wait("API call", hung.accepted.is_set, p)
        time.sleep(0.3)  # the request sent; its answer awaited
        p.sigterm()
        cmd.check()
    finally:
        hung.close()


# -- while serving -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["mesh-signer", "mesh-identity", "kube-credentials"])
def test_sigterm_while_serving_ends_weft_as_pid_1(which: str, pid1, tmp_path: Path) -> None:
    api = FakeApi()
    try:
        cmd = _command(which, api.url, tmp_path)
        p = pid1([*_weft(), *cmd.args], cmd.env)
        _wait("first job done", api.watching.is_set if which == "mesh-signer" else cmd.done, p)
        time.sleep(0.2)  # settled in its wait (a watch's read; the time to renew)
        p.sigterm()
        cmd.check()
        if which != "mesh-signer":
            assert cmd.done()  # what it wrote before the signal is there, whole
    finally:
        api.close()


def test_two_sigterms_microseconds_apart_end_the_serving_signer(pid1, tmp_path: Path) -> None:
    """kubelet's StopContainer and systemd's stop of the container's scope both send SIGTERM at a poweroff."""
    for i in range(10):
        api = FakeApi()
        try:
            cmd = _command("mesh-signer", api.url, tmp_path / f"run-{i}")
            p = pid1([*_weft(), *cmd.args], cmd.env)
            _wait("watch", api.watching.is_set, p)
            time.sleep(0.05 * (i % 4))
            p.sigterm(again_after_us=20 * i)
            cmd.check()
        finally:
            api.close()
