"""A watch of Pods that ends when the API server ends it, and closes its response when its reader stops.

lightkube's own watch restarts forever inside its generator and leaves the
response open when the generator is closed; a host agent that must stop in
bounded time, and that must not leak a connection, reads the stream itself.
Each call is one watch request of at most ``timeout`` seconds (the API
server's ``timeoutSeconds``) from ``version`` on; the caller lists again to get
a fresh version after 410 Gone.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx2

from shim import log
from shim.errors import WeftError
from shim.kube.access import KubeconfigNotYet

_log = log.get("weft.kube")


class WatchError(WeftError):
    """The watch failed: the API refused it, or it broke; the message says which."""


def _selector(pairs: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in pairs.items())


def _path(namespace: str | None) -> str:
    return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"


def list_pods(http: httpx2.Client, namespace: str | None, labels: Mapping[str, str],
              fields: Mapping[str, str]) -> tuple[list[dict[str, Any]], str]:
    """The matching Pods (as the API's JSON; in every namespace when ``namespace`` is None) and the list's
    resourceVersion."""
    try:
        r = http.get(_path(namespace), params={"labelSelector": _selector(labels), "fieldSelector": _selector(fields)})
        r.raise_for_status()
    except httpx2.HTTPError as exc:
        raise WatchError(f"list pods in {namespace or 'every namespace'}: {exc}") from exc
    doc = r.json()
    return doc.get("items") or [], doc.get("metadata", {}).get("resourceVersion", "")


def watch_pods(http: httpx2.Client, namespace: str | None, labels: Mapping[str, str], fields: Mapping[str, str],
               version: str, timeout: int, on_open: Callable[[socket.socket | None], None] | None = None,
               ) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, Pod) from ``version`` on, until the API server ends the watch.

    ``on_open`` is given the response's socket once the API server has answered (None: not to be had), so
    that another thread can end a watch that waits for its next event (``PodWatch.stop``).
    """
    params = {"watch": "1", "labelSelector": _selector(labels), "fieldSelector": _selector(fields),
              "timeoutSeconds": str(timeout), "allowWatchBookmarks": "true", "resourceVersion": version}
    try:
        with http.stream("GET", _path(namespace), params=params) as r:
            if on_open is not None:
                stream = r.extensions.get("network_stream")
                on_open(stream.get_extra_info("socket") if stream is not None else None)
            r.raise_for_status()
            for line in r.iter_lines():
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type", ""), event.get("object") or {}
                if kind == "ERROR":
                    raise WatchError(f"watch pods in {namespace}: {obj.get('code')} {obj.get('message')}")
                if kind != "BOOKMARK":
                    yield kind, obj
    except httpx2.HTTPError as exc:
        raise WatchError(f"watch pods in {namespace}: {exc}") from exc
    except ValueError as exc:
        raise WatchError(f"watch pods in {namespace}: a line that is not JSON ({exc})") from exc


class PodWatch:
    """List, then watch, the Pods a selector matches, until stopped: the loop both the origin's pod cache and a
    host's reservations run.

    ``on_list`` gets the whole list after every (re-)list, ``on_event`` each
    event after it. A failure (the API away, a version too old, a callback
    that raised) is logged as ``failed_event`` and retried after a wait
    doubling up to ``backoff_max``, with a fresh list.

    The watch's thread alone uses and closes its HTTP client: a client closed
    under a request in flight leaks that request's connection and fails it in
    a way nobody catches. ``stop`` ends a watch waiting for its next event by
    shutting its socket down (the thread sees the stream end, and stops), and
    the thread ends within one request otherwise.
    """

    def __init__(self, http_factory: Callable[[float], httpx2.Client], namespace: str | None,
                 labels: Mapping[str, str], fields: Mapping[str, str], *,
                 on_list: Callable[[list[dict[str, Any]]], None], on_event: Callable[[str, dict[str, Any]], None],
                 name: str, failed_event: str, watch_s: int = 30, backoff_max: float = 30.0) -> None:
        self.http_factory, self.namespace, self.labels, self.fields = http_factory, namespace, labels, fields
        self.on_list, self.on_event, self.name, self.failed_event = on_list, on_event, name, failed_event
        self.watch_s, self.backoff_max = watch_s, backoff_max
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None  # the socket of the watch in flight
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            sock = self._sock
        if sock is not None:
            _shut(sock)
        if self._thread is not None:
            self._thread.join(self.watch_s + 15)

    def _opened(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            stopped = self._stop.is_set()
        if stopped and sock is not None:  # stop came between the request and its answer
            _shut(sock)

    def _run(self) -> None:
        delay, version, waiting = 0.5, "", False
        http: httpx2.Client | None = None
        try:
            while not self._stop.is_set():
                try:
                    if http is None:
                        http = self.http_factory(self.watch_s + 10)
                    if not version:
                        pods, version = list_pods(http, self.namespace, self.labels, self.fields)
                        self.on_list(pods)
                    for kind, pod in watch_pods(http, self.namespace, self.labels, self.fields, version,
                                                self.watch_s, on_open=self._opened):
                        version = (pod.get("metadata") or {}).get("resourceVersion", version)
                        self.on_event(kind, pod)
                        if self._stop.is_set():
                            break
                    delay = 0.5
                except KubeconfigNotYet as exc:  # said once; looked for again shortly, not backed off
                    if not waiting:
                        _log.info("kube.kubeconfig_waiting", watch=self.name, error=exc.message, every=0.5)
                    waiting = True
                    self._stop.wait(0.5)
                except Exception as exc:  # noqa: BLE001 - the API's, or a callback's: the watch outlives both
                    version, waiting = "", False
                    if self._stop.is_set():
                        return
                    error = exc.message if isinstance(exc, WeftError) else f"{type(exc).__name__}: {exc}"
                    _log.warning(self.failed_event, error=error, retry_in=delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.backoff_max)
                finally:
                    with self._lock:
                        self._sock = None
        finally:
            if http is not None:
                http.close()


def _shut(sock: socket.socket) -> None:
    """End the reads waiting on ``sock`` without closing it (its owner does): the socket level's own shutdown,
    under TLS too, where ``SSLSocket.shutdown`` would also drop the TLS state the reading thread uses."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
