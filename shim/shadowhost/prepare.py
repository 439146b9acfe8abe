"""Prepared shadow sandboxes: made before any container asks, removed when none comes.

An origin that sees RunPodSandbox of an opted-in pod may ask this host at
once (``RunShadow`` with ``sandbox_only``) to make the pod's shadow sandbox,
in parallel with its own sandbox, so the pod's first rerouted container finds
it ready (``Lifecycle`` looks a pod's shadow sandbox up by the origin's
sandbox ID and by the pod, ``POD_LABEL``).

Nothing is leaked whatever happens next: a shadow sandbox with no container
(prepared and never used, its pod gone, its origin dead or restarted, or left
by a RunShadow that failed half-way) is removed by the host once it is older
than ``mesh.prepared_sandbox_ttl``. The sweep takes the lifecycle lock, so it
never races a RunShadow about to use the sandbox.
"""

from __future__ import annotations

import time

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.crishared.labels import ORIGIN_LABEL, POD_LABEL
from shim.errors import BadAnnotation, UpstreamError, WeftError
from shim.periodic import Periodic
from shim.shadowhost.runtime import RT, label

_log = log.get("weft.shadows")


def pod_label(sandbox: cri.PodSandboxConfig) -> str:
    """The value of ``POD_LABEL`` for the origin's sandbox: its pod UID and attempt, digested."""
    return label(f"{sandbox.metadata.uid}/{sandbox.metadata.attempt}")


def sandbox_unsafe(sandbox: cri.PodSandboxConfig) -> str:
    sc = sandbox.linux.security_context
    if sc.privileged:
        return "privileged"
    o = sc.namespace_options
    if o.network == cri.NODE or o.pid == cri.NODE or o.ipc == cri.NODE:
        return "host namespaces"
    return ""


class Preparer:
    """RunShadow with ``sandbox_only``, and the sweep of shadow sandboxes no container uses."""

    def __init__(self, lifecycle, ttl_s: float) -> None:
        self.lifecycle, self.ttl_s = lifecycle, ttl_s
        self.rt = lifecycle.rt
        self._loop = Periodic("weft-shadow-sweep", max(1.0, ttl_s / 4), self._round, failed="shadow.sweep_crashed")

    def open(self) -> None:
        self._loop.start()

    def close(self) -> None:
        self._loop.stop()

    def prepare(self, origin: str, req: pb.RunShadowRequest) -> pb.ShadowState:
        try:
            sandbox = cri.PodSandboxConfig.FromString(req.sandbox_config)
        except DecodeError as exc:
            raise BadAnnotation(f"RunShadow (sandbox only): malformed sandbox config from {origin}: {exc}") from None
        unsafe = sandbox_unsafe(sandbox)
        if unsafe:
            from shim.shadowhost.lifecycle import UnsafeShadow

            raise UnsafeShadow(f"RunShadow (sandbox only): this host never runs a shadow sandbox with {unsafe}")
        labels = {ORIGIN_LABEL: origin, POD_LABEL: pod_label(sandbox)}
        lc = self.lifecycle
        t0 = time.monotonic()
        with lc.lock:
            shadow = lc._shadow_sandbox(origin, req, sandbox, labels)
            sandbox_id = lc._sandbox(shadow, labels)
        _log.info("shadow.sandbox_prepared", origin=origin, sandbox_id=sandbox_id, pod=sandbox.metadata.name,
                  namespace=sandbox.metadata.namespace, ms=round((time.monotonic() - t0) * 1000, 1))
        return pb.ShadowState(key=req.key, shadow_sandbox_id=sandbox_id)

    def _round(self) -> None:
        try:
            self.sweep()
        except WeftError as exc:
            _log.warning("shadow.sweep_failed", error=exc.message)

    def sweep(self, now_ns: int | None = None) -> list[str]:
        """Remove shadow sandboxes without a container older than the TTL; their IDs."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        removed = []
        lc = self.lifecycle
        with lc.lock:
            sandboxes = [s for s in self.rt.call(RT + "ListPodSandbox", cri.ListPodSandboxRequest(),
                                                 cri.ListPodSandboxResponse).items if ORIGIN_LABEL in s.labels]
            if not sandboxes:
                return removed
            used = {c.pod_sandbox_id for c in self.rt.containers()}
            for s in sandboxes:
                if s.id in used or now_ns - s.created_at < self.ttl_s * 1e9:
                    continue
                try:
                    self.rt.remove_sandbox(s.id)
                except UpstreamError as exc:
                    if exc.code is not grpc.StatusCode.NOT_FOUND:
                        _log.warning("shadow.sweep_failed", sandbox_id=s.id, error=exc.message)
                        continue
                removed.append(s.id)
                _log.info("shadow.sandbox_swept", origin=s.labels.get(ORIGIN_LABEL, ""), sandbox_id=s.id,
                          age_s=round((now_ns - s.created_at) / 1e9, 1))
        return removed
