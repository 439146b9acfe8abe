"""A watch of Pods that ends when the API server ends it, and closes its response when its reader stops.

lightkube's own watch restarts forever inside its generator and leaves the
response open when the generator is closed; a host agent that must stop in
bounded time, and that must not leak a connection, reads the stream itself.
Each call is one watch request of at most ``timeout`` seconds (the API
server's ``timeoutSeconds``) from ``version`` on; the caller lists again to get
a fresh version after 410 Gone.
"""

from __future__ import annotations

import json
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
               version: str, timeout: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event type, Pod) from ``version`` on, until the API server ends the watch."""
    params = {"watch": "1", "labelSelector": _selector(labels), "fieldSelector": _selector(fields),
              "timeoutSeconds": str(timeout), "allowWatchBookmarks": "true", "resourceVersion": version}
    try:
        with http.stream("GET", _path(namespace), params=params) as r:
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
    event after it. A failure (the API away, a version too old) is logged as
    ``failed_event`` and retried after a wait doubling up to ``backoff_max``,
    with a fresh list. ``stop`` closes the HTTP client, and the thread ends
    within one watch request (``watch_s``).
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
        self._http: httpx2.Client | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            http = self._http
        if http is not None:
            http.close()
        if self._thread is not None:
            self._thread.join(self.watch_s + 5)

    def _run(self) -> None:
        delay, version, waiting = 0.5, "", False
        try:
            while not self._stop.is_set():
                try:
                    with self._lock:
                        if self._http is None:
                            self._http = self.http_factory(self.watch_s + 10)
                        http = self._http
                    if not version:
                        pods, version = list_pods(http, self.namespace, self.labels, self.fields)
                        self.on_list(pods)
                    for kind, pod in watch_pods(http, self.namespace, self.labels, self.fields, version,
                                                self.watch_s):
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
                except WeftError as exc:
                    version, waiting = "", False
                    if self._stop.is_set():
                        return
                    _log.warning(self.failed_event, error=exc.message, retry_in=delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.backoff_max)
        finally:
            with self._lock:
                http, self._http = self._http, None
            if http is not None:
                http.close()
