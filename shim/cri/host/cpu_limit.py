"""A shadow's CPU limit, set once it runs rather than when it is made.

runc sets up a container from inside the container's own cgroup: the seccomp
filter a host gives every rerouted container is compiled there, by runc's
init, under the container's CFS quota. A CPU stage with a small limit (a
tenth of a core) has its start throttled for a period or more by work that is
the host's, not the tenant's. So a host makes each shadow without its CFS
quota, keeps the quota in ``CPU_MAX_ANNOTATION``, and sets it with
UpdateContainerResources as soon as StartContainer returns, off the start's
path (``Limiter``: the start's answer does not wait for runc's update). The
shadow runs without its quota for that one call; its memory limit and its CPU
weight (which the shadows' group caps) hold from the start. A shadow whose
limit cannot be set is stopped: none runs on without it.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import Callable, Mapping

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.cri.host.runtime import RT, ShadowRuntime
from shim.cri.labels import CPU_MAX_ANNOTATION, ORIGIN_LABEL
from shim.errors import UpstreamError, WeftError

_log = log.get("weft.shadows")


def defer(config: cri.ContainerConfig) -> None:
    """Take the CFS quota out of a shadow's config, into its annotation (none asked: no annotation)."""
    res = config.linux.resources
    config.annotations.pop(CPU_MAX_ANNOTATION, None)
    if res.cpu_quota > 0:
        config.annotations[CPU_MAX_ANNOTATION] = f"{res.cpu_quota} {res.cpu_period or 100000}"
        res.cpu_quota = res.cpu_period = 0


def deferred(annotations: Mapping[str, str]) -> tuple[int, int] | None:
    """(quota, period) a shadow is to be given once it runs; None: none (or a shadow made before this)."""
    try:
        quota, period = (int(x) for x in annotations[CPU_MAX_ANNOTATION].split())
    except (KeyError, ValueError):
        return None
    return (quota, period) if quota > 0 and period > 0 else None


def apply(rt: ShadowRuntime, container_id: str, annotations: Mapping[str, str], what: str) -> None:
    """Set a started shadow's deferred CPU limit; if containerd will not, stop the shadow and say why.

    A shadow that has already exited is no error: containerd keeps the limit in its spec for a restart."""
    cpu_max = deferred(annotations)
    if cpu_max is None:
        return
    quota, period = cpu_max
    try:
        rt.call(RT + "UpdateContainerResources", cri.UpdateContainerResourcesRequest(
            container_id=container_id, linux=cri.LinuxContainerResources(cpu_quota=quota, cpu_period=period)),
            cri.UpdateContainerResourcesResponse)
    except UpstreamError as exc:
        if exc.code is grpc.StatusCode.NOT_FOUND:
            return
        with contextlib.suppress(WeftError):
            rt.stop(container_id)
        _log.warning("shadow.limit_failed", container_id=container_id, quota=quota, period=period,
                     error=exc.message)
        raise UpstreamError(exc.code, f"{what}: containerd did not set its CPU limit (cpu.max {quota} {period}) once "
                                      f"it ran, so this host stopped it: {exc.message}") from None


def _spec_quota(rt: ShadowRuntime, container_id: str) -> int | None:
    """The CFS quota in a container's OCI spec (0: none); None where containerd does not say."""
    resp = rt.call(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id, verbose=True),
                   cri.ContainerStatusResponse)
    try:
        spec = json.loads(resp.info.get("info", "{}")).get("runtimeSpec", {})
        return int(spec.get("linux", {}).get("resources", {}).get("cpu", {}).get("quota") or 0)
    except (ValueError, AttributeError, TypeError):
        return None


def settle(rt: ShadowRuntime, ours: Callable[[Mapping[str, str]], bool]) -> int:
    """At the agent's start: give every running shadow of this host's (``ours``: by its labels) still without
    its deferred limit that limit (an agent stopped between a StartContainer and its update); one that has a
    quota (set, or resized since) is left as it is. Returns how many were set."""
    count = 0
    for c in rt.containers(cri.CONTAINER_RUNNING):
        if ORIGIN_LABEL not in c.labels or deferred(c.annotations) is None or not ours(c.labels):
            continue
        try:
            quota = _spec_quota(rt, c.id)
        except WeftError as exc:
            _log.warning("shadow.limit_failed", container_id=c.id, error=exc.message)
            continue
        if quota != 0:
            continue
        with contextlib.suppress(WeftError):  # apply stopped it and said why
            apply(rt, c.id, c.annotations, f"shadow {c.id}")
            count += 1
    return count


class Limiter:
    """Sets started shadows' deferred limits in a thread of its own, in the order they started.

    An UpdateContainerResources of the origin's (kubelet resizing the pod) or a removal that comes first
    ``drop``s the shadow: what it sets wins (one whose update is under way is waited for, so the caller's
    lands after it). Queueing a shadow never waits for an update."""

    def __init__(self, rt: ShadowRuntime) -> None:
        self.rt = rt
        self.applying = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[dict[str, str], str]] = {}
        self._queue: queue.SimpleQueue[str | Callable[[], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def later(self, container_id: str, annotations: Mapping[str, str], what: str) -> None:
        if deferred(annotations) is None:
            return
        with self._lock:
            self._pending[container_id] = (dict(annotations), what)
            self._started()
        self._queue.put(container_id)

    def after(self, work: Callable[[], object]) -> None:
        """Run ``work`` in this thread once what is queued before it is done (what a start may leave to
        follow its answer: the shadows' group weighed again)."""
        with self._lock:
            self._started()
        self._queue.put(work)

    def _started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="weft-shadow-limits", daemon=True)
            self._thread.start()

    def drop(self, container_id: str) -> None:
        with self._lock:
            if self._pending.pop(container_id, None) is not None:
                return
        with self.applying:  # its update may be under way: it lands before the caller's
            pass

    def pending(self) -> list[str]:
        with self._lock:
            return list(self._pending)

    def close(self, timeout: float = 10.0) -> None:
        """Set what is queued, then stop (what is left is set by ``settle`` at the next start)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while (container_id := self._queue.get()) is not None:
            if callable(container_id):
                with contextlib.suppress(WeftError):
                    container_id()
                continue
            with self.applying:
                with self._lock:
                    item = self._pending.pop(container_id, None)
                if item is not None:
                    with contextlib.suppress(WeftError):  # apply stopped it and said why
                        apply(self.rt, container_id, *item)
