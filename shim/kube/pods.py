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

from shim.kube.access import ApiAccess
from shim.kube.watch import PodWatch

WATCH_S = 30


class PodCache:
    def __init__(self, api: ApiAccess, node: str, *, miss_wait: float = 1.0, backoff_max: float = 30.0,
                 watch_s: int = WATCH_S) -> None:
        self.node, self.miss_wait = node, miss_wait
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._cond = threading.Condition()
        self.synced = False
        self._stopping = False
        self._watch = PodWatch(lambda read: api.http(read_timeout=read), None, {}, {"spec.nodeName": node},
                               on_list=self._listed, on_event=self._put, name="weft-pod-cache",
                               failed_event="kube.pods_watch_failed", watch_s=watch_s, backoff_max=backoff_max)

    def start(self) -> None:
        self._watch.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._watch.stop()

    def spec_of(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod as the API has it; None when the cache does not have it (after a short wait for the watch)."""
        deadline = time.monotonic() + self.miss_wait
        with self._cond:
            while (pod := self._pods.get((namespace, name))) is None:  # not listed yet, or not watched yet
                left = deadline - time.monotonic()
                if left <= 0 or self._stopping:
                    break
                self._cond.wait(left)
            return pod

    def _listed(self, pods: list[dict[str, Any]]) -> None:
        with self._cond:
            self._pods = {_key(p): p for p in pods}
            self.synced = True
            self._cond.notify_all()

    def _put(self, kind: str, pod: dict[str, Any]) -> None:
        with self._cond:
            if kind == "DELETED":
                self._pods.pop(_key(pod), None)
            else:
                self._pods[_key(pod)] = pod
            self._cond.notify_all()


def _key(pod: dict[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")
