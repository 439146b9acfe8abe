"""PodWatch against a small API server of its own (plain HTTP and TLS): it lists, watches, comes back after the
API's errors and cut streams, and stops at once without leaking a connection or raising in its thread."""

from __future__ import annotations

import contextlib
import gc
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx2
import pytest

from shim.kube.watch import PodWatch
from shim.mesh.certs import write_mesh_certs

ETCD_AWAY = {"kind": "Status", "code": 500, "message": "etcd away"}


def _pod(name: str, version: str) -> dict:
    return {"metadata": {"name": name, "resourceVersion": version}}


class FakeApi(ThreadingHTTPServer):
    """Answers ``/api/v1/pods``: a list, then watches as ``script`` says, one entry per watch request (the last
    entry for every later one): ``hold`` (an event, then nothing until the server stops), ``gone`` (a 410 ERROR
    event), ``cut`` (an event, then the connection dropped mid-stream), ``500`` (an error status)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, script: list[str], lists: list[str] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.script, self.list_answers = script, lists or ["ok"]
        self.lists = self.watches = 0
        self.open_streams = 0
        self.closing = threading.Event()
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeApi

    def log_message(self, *args) -> None:
        pass

    def _next(self, answers: list[str], counter: str) -> str:
        """This call's answer: each list (or watch) takes the next one, and the last one stays."""
        with self.server.lock:
            n = getattr(self.server, counter)
            setattr(self.server, counter, n + 1)
        return answers[min(n, len(answers) - 1)]

    def do_GET(self) -> None:
        query = parse_qs(urlsplit(self.path).query)
        if "watch" not in query:
            if self._next(self.server.list_answers, "lists") == "500":
                self._json(500, ETCD_AWAY)
                return
            self._json(200, {"metadata": {"resourceVersion": "10"}, "items": [_pod("a", "10")]})
            return
        step = self._next(self.server.script, "watches")
        if step == "500":
            self._json(500, ETCD_AWAY)
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if step == "gone":
            self._chunk({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}})
            self._chunk(None)
            return
        self._chunk({"type": "ADDED", "object": _pod(f"b{self.server.watches}", str(10 + self.server.watches))})
        self.close_connection = True
        if step == "cut":
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        with self.server.lock:
            self.server.open_streams += 1
        try:
            # Held until the server stops or the client goes (a watch's client sends nothing more: anything
            # readable is its close).
            while not self.server.closing.is_set() and not select.select([self.connection], [], [], 0.05)[0]:
                pass
        finally:
            with self.server.lock:
                self.server.open_streams -= 1

    def _json(self, code: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunk(self, doc: dict | None) -> None:
        data = (json.dumps(doc) + "\n").encode() if doc is not None else b""
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    write_mesh_certs(d, ["apiserver"])
    return d


@contextlib.contextmanager
def _api(script: list[str], tls: Path | None, lists: list[str] | None = None) -> Iterator[tuple[FakeApi, str]]:
    api = FakeApi(script, lists)
    url = api.url
    if tls is not None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(tls / "apiserver.crt", tls / "apiserver.key")
        api.socket = ctx.wrap_socket(api.socket, server_side=True)
        url = url.replace("http://", "https://")
    thread = threading.Thread(target=api.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield api, url
    finally:
        api.closing.set()
        api.shutdown()
        api.server_close()


def _client(url: str, tls: Path | None):
    def make(read: float) -> httpx2.Client:
        verify: ssl.SSLContext | bool = False
        if tls is not None:
            verify = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            verify.check_hostname = False
        return httpx2.Client(base_url=url, verify=verify, timeout=httpx2.Timeout(5.0, read=read))
    return make


class Seen:
    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []
        self.changed = threading.Condition()

    def on_list(self, pods: list[dict]) -> None:
        with self.changed:
            self.lists.append([p["metadata"]["name"] for p in pods])
            self.changed.notify_all()

    def on_event(self, kind: str, pod: dict) -> None:
        with self.changed:
            self.events.append((kind, pod["metadata"]["name"]))
            self.changed.notify_all()

    def wait(self, what, timeout: float = 10.0) -> None:
        with self.changed:
            assert self.changed.wait_for(what, timeout), (self.lists, self.events)


def _watch(url: str, tls: Path | None, seen: Seen, watch_s: int = 60) -> PodWatch:
    return PodWatch(_client(url, tls), None, {}, {"spec.nodeName": "n"}, on_list=seen.on_list,
                    on_event=seen.on_event, name="test-watch", failed_event="test.watch_failed", watch_s=watch_s,
                    backoff_max=0.2)


@pytest.fixture(params=["plain", "tls"])
def tls(request: pytest.FixtureRequest, certs: Path) -> Path | None:
    return certs if request.param == "tls" else None


def _settled() -> None:
    """Whatever was left unclosed warns now (an error in this suite), not in some later test."""
    for _ in range(3):
        gc.collect()


def test_stop_ends_a_watch_waiting_for_its_next_event_and_leaves_nothing_open(tls: Path | None) -> None:
    with _api(["hold"], tls) as (api, url):
        seen = Seen()
        watch = _watch(url, tls, seen, watch_s=60)
        watch.start()
        seen.wait(lambda: seen.events)
        started = time.monotonic()
        watch.stop()
        took = time.monotonic() - started
        assert watch._thread is not None and not watch._thread.is_alive()
        # Not the 60 s the API server would hold the watch for: the watch was ended, not waited out.
        assert took < 30, took
        deadline = time.monotonic() + 5
        while api.open_streams and time.monotonic() < deadline:
            time.sleep(0.05)
        assert api.open_streams == 0  # the server saw the connection go
    _settled()


def test_stop_right_after_start_leaves_nothing_open(tls: Path | None) -> None:
    with _api(["hold"], tls) as (_, url):
        for _ in range(5):
            watch = _watch(url, tls, Seen())
            watch.start()
            watch.stop()
            assert watch._thread is not None and not watch._thread.is_alive()
    _settled()


@pytest.mark.parametrize("script", [["gone", "hold"], ["cut", "hold"], ["500", "hold"]],
                         ids=["410-error-event", "cut-mid-stream", "error-status"])
def test_a_watch_the_api_ends_badly_comes_back_with_a_fresh_list(tls: Path | None, script: list[str],
                                                                 capsys) -> None:
    with _api(script, tls) as (_, url):
        seen = Seen()
        watch = _watch(url, tls, seen)
        watch.start()
        try:
            seen.wait(lambda: len(seen.lists) >= 2 and seen.events and seen.events[-1][1].startswith("b2"))
        finally:
            watch.stop()
    assert seen.lists == [["a"], ["a"]]
    _settled()


def test_an_api_that_refuses_the_list_is_asked_again(tls: Path | None) -> None:
    with _api(["hold"], tls, lists=["500", "500", "ok"]) as (api, url):
        seen = Seen()
        watch = _watch(url, tls, seen)
        watch.start()
        try:
            seen.wait(lambda: seen.events)
        finally:
            watch.stop()
        assert api.lists == 3 and seen.lists == [["a"]]
    _settled()


def test_a_callback_that_raises_does_not_end_the_watch(tls: Path | None) -> None:
    with _api(["hold"], tls) as (_, url):
        seen = Seen()
        failures = [1]

        def on_list(pods: list[dict]) -> None:
            if failures[0]:
                failures[0] -= 1
                raise KeyError("metadata")
            seen.on_list(pods)

        watch = PodWatch(_client(url, tls), None, {}, {}, on_list=on_list, on_event=seen.on_event,
                         name="test-watch", failed_event="test.watch_failed", backoff_max=0.2)
        watch.start()
        try:
            seen.wait(lambda: seen.events)
        finally:
            watch.stop()
        assert seen.lists == [["a"]]
    _settled()
