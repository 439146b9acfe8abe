"""The origin's cache of the Pods bound to its node: one list and watch, not a GET per CreateContainer.

Placement reads a container's pod spec from here (``spec_of``). The cache is
kept by a watch with ``spec.nodeName`` as field selector, re-listed after any
failure; a pod kubelet has just been told about may not be in it yet, so a
miss waits briefly for the list or the watch to catch up before placement falls
back to its own rules.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from shim import log
from shim.errors import WeftError
from shim.kube.access import ApiAccess
from shim.kube.watch import list_pods, watch_pods

_log = log.get("weft.kube")
WATCH_S = 30


class PodCache:
    def __init__(self, api: ApiAccess, node: str, *, miss_wait: float = 1.0, backoff_max: float = 30.0,
                 watch_s: int = WATCH_S) -> None:
        self.api, self.node, self.miss_wait, self.backoff_max = api, node, miss_wait, backoff_max
        self.watch_s = watch_s  # each watch request ends after this long, so a stop waits at most that
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = False
        self._http = None  # the watch's client, which stop closes

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="weft-pod-cache", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
            http = self._http
        if http is not None:
            http.close()
        if self._thread is not None:
            self._thread.join(self.watch_s + 5)

    def spec_of(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API has it; None when the cache does not have it (after a short wait for the watch)."""
        deadline = time.monotonic() + self.miss_wait
        with self._cond:
            while (pod := self._pods.get((namespace, name))) is None:  # not listed yet, or not watched yet
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    break
                self._cond.wait(left)
            return pod

    def _put(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        with self._cond:
            if kind == "DELETED":
                self._pods.pop(key, None)
            else:
                self._pods[key] = pod
            self._cond.notify_all()

    def _run(self) -> None:
        delay, version, http = 0.5, "", None
        fields = {"spec.nodeName": self.node}
        try:
            while not self._stop.is_set():
                try:
                    if http is None:
                        http = self.api.http(read_timeout=self.watch_s + 10)
                        with self._cond:
                            self._http = http
                    if not version:
                        pods, version = list_pods(http, None, {}, fields)
                        with self._cond:
                            self._pods = {((p.get("metadata") or {}).get("namespace", ""),
                                           (p.get("metadata") or {}).get("name", "")): p for p in pods}
                            self.synced = True
                            self._cond.notify_all()
                    for kind, pod in watch_pods(http, None, {}, fields, version, self.watch_s):
                        version = (pod.get("metadata") or {}).get("resourceVersion", version)
                        self._put(kind, pod)
                        if self._stop.is_set():
                            break
                    delay = 0.5
                except WeftError as exc:
                    version = ""
                    if self._stop.is_set():
                        return
                    _log.warning("kube.pods_watch_failed", error=exc.message, retry_in=delay)
                    self._stop.wait(delay)
                    delay = min(delay * 2, self.backoff_max)
        finally:
            if http is not None:
                http.close()
