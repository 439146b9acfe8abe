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

import json
import queue
import threading
import time
from collections.abc import Callable, Mapping

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.crishared.labels import CPU_MAX_ANNOTATION, ORIGIN_LABEL
from shim.errors import UpstreamError, WeftError
from shim.shadowhost.runtime import RT, ShadowRuntime

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


# containerd not answering now (restarting, busy): the quota is tried again by the next ``Limiter.settle``
# rather than the shadow stopped.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})
REASON = "CPULimitNotSet"  # the stopped shadow's reason, as the origin's kubelet sees it
RECHECK_S = 0.2  # a refused update is asked again this long after, if the shadow still runs


class LimitNotSet(UpstreamError):
    """containerd refused a started shadow's deferred CPU quota."""


def apply(rt: ShadowRuntime, container_id: str, annotations: Mapping[str, str], what: str) -> None:
    """Set a started shadow's deferred CPU limit. containerd refusing it: the shadow is stopped (with the reason
    for its origin) and ``LimitNotSet`` raised; not answering now: ``UpstreamError``, left for a later try.

    A shadow that has already gone or exited is no error: the limit matters only while it runs."""
    cpu_max = deferred(annotations)
    if cpu_max is None:
        return
    quota, period = cpu_max
    request = cri.UpdateContainerResourcesRequest(
        container_id=container_id, linux=cri.LinuxContainerResources(cpu_quota=quota, cpu_period=period))
    for attempt in range(2):
        try:
            rt.call(RT + "UpdateContainerResources", request, cri.UpdateContainerResourcesResponse)
            return
        except UpstreamError as exc:
            if exc.code is grpc.StatusCode.NOT_FOUND:
                return
            if exc.code in TRANSIENT:
                _log.warning("shadow.limit_deferred", container_id=container_id, quota=quota, period=period,
                             error=exc.message)
                raise
            error = exc
        # A process that exits as it starts leaves runc no task to update before containerd has seen the exit:
        # looked at again a moment later, it is no refusal.
        status = rt.status(container_id)
        if status is None or status.state != cri.CONTAINER_RUNNING:
            return
        if attempt == 0:
            time.sleep(RECHECK_S)
    detail = (f"{what}: containerd did not set its CPU limit (cpu.max {quota} {period}) once it ran, so this "
              f"host stops it: {error.message}")
    rt.reasons[container_id] = (REASON, detail)
    stopped = True
    try:
        rt.stop(container_id)
    except WeftError:
        stopped = False  # tried again by the next settle
    _log.warning("shadow.limit_failed", container_id=container_id, quota=quota, period=period,
                 error=error.message, stopped=stopped)
    raise LimitNotSet(error.code, detail) from None


def _spec_quota(rt: ShadowRuntime, container_id: str) -> int | None:
    """The CFS quota in a container's OCI spec (0: none); None where containerd does not say."""
    resp = rt.call(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id, verbose=True),
                   cri.ContainerStatusResponse)
    try:
        spec = json.loads(resp.info.get("info", "{}")).get("runtimeSpec", {})
        return int(spec.get("linux", {}).get("resources", {}).get("cpu", {}).get("quota") or 0)
    except (ValueError, AttributeError, TypeError):
        return None


class Limiter:
    """Sets started shadows' deferred limits in a thread of its own, in the order they started, and makes sure
    none runs on without one (``settle``, at the agent's start and at every upkeep round).

    An UpdateContainerResources of the origin's (kubelet resizing the pod) or a removal ``drop``s the shadow
    first: what it sets wins, whether it comes before the start's ``later`` (which then queues nothing) or
    while that shadow's update is under way (``drop`` waits for that one, not for others'). Queueing never
    waits for an update."""

    DROPPED_KEPT = 4096  # dropped IDs remembered, for a start that comes after its container's resize

    def __init__(self, rt: ShadowRuntime) -> None:
        self.rt = rt
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[dict[str, str], str]] = {}
        self._applying: set[str] = set()  # the shadows whose update is under way (the thread's, settle's)
        self._dropped: dict[str, None] = {}  # insertion-ordered: the oldest forgotten first
        self._settled: set[str] = set()  # running shadows known to have their quota
        self._queue: queue.SimpleQueue[str | Callable[[], object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False

    def later(self, container_id: str, annotations: Mapping[str, str], what: str) -> None:
        if deferred(annotations) is None:
            return
        with self._cond:
            if self._closed or container_id in self._dropped:
                return
            self._pending[container_id] = (dict(annotations), what)
            self._started()
        self._queue.put(container_id)

    def after(self, work: Callable[[], object]) -> None:
        """Run ``work`` in this thread once what is queued before it is done (what a start may leave to
        follow its answer: the shadows' group weighed again)."""
        with self._cond:
            if self._closed:
                return
            self._started()
        self._queue.put(work)

    def _started(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="weft-shadow-limits", daemon=True)
            self._thread.start()

    def drop(self, container_id: str) -> None:
        with self._cond:
            self._pending.pop(container_id, None)
            self._settled.discard(container_id)
            self._dropped[container_id] = None
            while len(self._dropped) > self.DROPPED_KEPT:
                del self._dropped[next(iter(self._dropped))]
            while container_id in self._applying:  # its update lands before the caller's
                self._cond.wait()

    def undrop(self, container_id: str) -> None:
        """The caller's update failed: the deferred quota is ``settle``'s to set again (containerd kept none)."""
        with self._cond:
            self._dropped.pop(container_id, None)

    def pending(self) -> list[str]:
        with self._cond:
            return list(self._pending)

    def close(self, timeout: float = 10.0) -> None:
        """Set what is queued, then stop (what is left is set by ``settle`` at the next start)."""
        with self._cond:
            self._closed = True
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _apply(self, container_id: str, annotations: Mapping[str, str], what: str) -> None:
        """One update, with ``container_id`` marked as under way; never raises."""
        try:
            apply(self.rt, container_id, annotations, what)
            with self._cond:
                if container_id not in self._dropped:
                    self._settled.add(container_id)
        except WeftError:
            pass  # stopped, or left for the next settle: apply said which
        except Exception as exc:  # noqa: BLE001 - this thread sets every shadow's limit: it must go on
            _log.error("shadow.limit_failed", container_id=container_id, error=repr(exc), stopped=False)
        finally:
            with self._cond:
                self._applying.discard(container_id)
                self._cond.notify_all()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if callable(item):
                try:
                    item()
                except Exception as exc:  # noqa: BLE001 - as above
                    _log.error("shadow.after_start_failed", error=repr(exc))
                continue
            with self._cond:
                pending = self._pending.pop(item, None)
                if pending is None:
                    continue
                self._applying.add(item)
            self._apply(item, *pending)

    def settle(self, ours: Callable[[Mapping[str, str]], bool]) -> int:
        """Give every running shadow of this host's (``ours``: by its labels) still without its deferred quota
        that quota: one started while the agent was away, whose start's answer was lost, whose update failed
        or was refused and could not be stopped, or whose resize failed (``undrop``). One with a quota in its
        spec (set, or resized since) is left as it is and not looked at again, nor one resized. Returns how
        many were set."""
        count = 0
        running = self.rt.containers(cri.CONTAINER_RUNNING)
        with self._cond:
            self._settled &= {c.id for c in running}
            look = [c for c in running if c.id not in self._settled and c.id not in self._pending
                    and c.id not in self._applying and c.id not in self._dropped]
        for c in look:
            if ORIGIN_LABEL not in c.labels or deferred(c.annotations) is None or not ours(c.labels):
                continue
            try:
                quota = _spec_quota(self.rt, c.id)
            except WeftError:
                continue  # asked again at the next round
            if quota is None:
                continue
            if quota != 0:
                with self._cond:
                    self._settled.add(c.id)
                continue
            with self._cond:
                if c.id in self._pending or c.id in self._applying or c.id in self._dropped:
                    continue
                self._applying.add(c.id)
            self._apply(c.id, c.annotations, f"shadow {c.id}")
            with self._cond:
                count += c.id in self._settled
        return count
