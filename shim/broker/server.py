"""The broker's two endpoints: gRPC (``proto/broker.proto``) and the OCI hook's JSON socket.

gRPC serves the agent and ``weft status``. The hook endpoint
(``<socket>.hook``) speaks newline-delimited JSON so that ``weft-oci-hook``
needs only the standard library: importing grpc alone would take more than a
bind's whole time budget (docs/benchmarks.md, hook). Both call the same
``LeaseService``; weft's typed errors become gRPC statuses (or
``{"ok": false, "code": ..., "error": ...}``) here and nowhere else.
"""

from __future__ import annotations

import json
import os
import socketserver
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from shim import log
from shim._pb import broker_pb2 as pb
from shim._pb import broker_pb2_grpc as pb_grpc
from shim.broker.service import LeaseService
from shim.broker.simulated import SimulatedBackend
from shim.errors import WeftError
from shim.state.leases import LeaseRecord
from shim.unixsock import SocketClaim

_log = log.get("weft.broker")

# A hook request is a few hundred bytes; a longer line is refused (and skipped) rather than buffered whole.
MAX_HOOK_LINE = 64 << 10


def lease_pb(rec: LeaseRecord) -> pb.Lease:
    return pb.Lease(
        lease_id=rec.lease_id, key=rec.key, namespace=rec.namespace, pod=rec.pod, container=rec.container,
        sandbox_id=rec.sandbox_id, device_uuids=rec.device_uuids, device_indices=rec.device_indices,
        memory_bytes=rec.memory_bytes, compute_percent=rec.compute_percent, shared=rec.shared,
        state=rec.state.value, env=rec.env,
        mounts=[pb.Mount(host_path=h, container_path=c, readonly=ro) for h, c, ro in rec.mounts],
        device_nodes=rec.device_nodes, container_id=rec.container_id, pid=rec.pid, cgroup=rec.cgroup,
        created_at=rec.created_at, bound_at=rec.bound_at, reason=rec.reason, detail=rec.detail,
    )


def _mapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    def handler(self, request, context):
        try:
            return fn(self, request, context)
        except WeftError as exc:
            context.abort(exc.code, exc.message)

    handler.__name__ = fn.__name__
    return handler


class BrokerServicer(pb_grpc.BrokerServicer):
    def __init__(self, service: LeaseService) -> None:
        self.service = service

    def _devices(self) -> list[pb.Device]:
        leases = self.service.leases()
        out = []
        for d in self.service.devices:
            on = [r for r in leases if d.uuid in r.device_uuids]
            out.append(pb.Device(
                index=d.index, uuid=d.uuid, name=d.name, memory_total=d.memory_total, mig_enabled=d.mig_enabled,
                memory_leased=sum(r.memory_bytes if r.shared else d.memory_total for r in on),
                compute_leased=min(100, sum(r.compute_percent if r.shared else 100 for r in on)),
                leases=len(on), exclusive=any(not r.shared for r in on)))
        return out

    @_mapped
    def Devices(self, request, context):  # noqa: N802 - gRPC method names
        return pb.DevicesResponse(devices=self._devices(), backend=self.service.backend.name)

    @_mapped
    def Acquire(self, request, context):  # noqa: N802
        rec = self.service.acquire(
            key=request.key, namespace=request.namespace, pod=request.pod, pod_uid=request.pod_uid,
            container=request.container, sandbox_id=request.sandbox_id, memory_bytes=request.memory_bytes,
            compute_percent=request.compute_percent, count=request.count, allowed=request.allowed_uuids)
        return lease_pb(rec)

    @_mapped
    def Bind(self, request, context):  # noqa: N802
        return lease_pb(self.service.bind(request.lease_id, request.container_id, request.pid, request.cgroup))

    @_mapped
    def Release(self, request, context):  # noqa: N802
        return pb.ReleaseResponse(released=self.service.release(request.lease_id, request.reason))

    @_mapped
    def List(self, request, context):  # noqa: N802
        return pb.ListResponse(leases=[lease_pb(r) for r in self.service.leases()], devices=self._devices(),
                               backend=self.service.backend.name)

    @_mapped
    def Reconcile(self, request, context):  # noqa: N802
        return pb.ReconcileResponse(released=self.service.reconcile(request.live_keys))

    @_mapped
    def SimulateUsage(self, request, context):  # noqa: N802
        backend = self.service.backend
        if not isinstance(backend, SimulatedBackend):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"SimulateUsage needs --backend simulated; this broker runs {backend.name}")
        for old in backend.processes():
            backend.clear_process(old.pid)
        for p in request.processes:
            backend.set_process(p.pid, p.device_uuid, p.used_memory)
            if p.sm_percent:
                backend.set_process_utilization(p.pid, p.sm_percent)
        for uuid, pct in request.device_utilization.items():
            backend.set_utilization(uuid, pct)
        return pb.SimulateUsageResponse()


class HookEndpoint:
    """``<socket>.hook``: one JSON request per line, one JSON answer per line."""

    def __init__(self, path: Path, service: LeaseService) -> None:
        self.claim = SocketClaim(path, what="broker hook endpoint")
        svc = service

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                while line := self.rfile.readline(MAX_HOOK_LINE + 1):
                    if len(line) > MAX_HOOK_LINE and not line.endswith(b"\n"):
                        while (rest := self.rfile.readline(MAX_HOOK_LINE)) and not rest.endswith(b"\n"):
                            pass  # the rest of the line, never held whole
                        answer = {"ok": False, "code": "INVALID_ARGUMENT",
                                  "error": f"hook request longer than {MAX_HOOK_LINE} bytes"}
                    else:
                        answer = _answer(svc, line)
                    self.wfile.write(json.dumps(answer).encode() + b"\n")
                    self.wfile.flush()

        self.claim.acquire()
        old = os.umask(0o177)
        try:
            self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        finally:
            os.umask(old)
        self._server.daemon_threads = True
        self.claim.bound()
        self._thread = threading.Thread(target=self._server.serve_forever, name="weft-hook", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.claim.release()


# Only a pod's own containers hold leases, and containerd names the sandbox and the container of each; a
# request without both (a pause container, which has no container name, or a hand-made line) could otherwise
# bind or release any lease.
_NO_OWNER = {"ok": False, "code": "PERMISSION_DENIED",
             "error": "hook request names no owner (sandbox_id and container are both required)"}


def _answer(service: LeaseService, line: bytes) -> dict[str, Any]:
    try:
        req = json.loads(line)
        op = req["op"]
        owner = (str(req.get("sandbox_id", "")), str(req.get("container", "")))
        if op == "bind":
            args = (str(req["lease_id"]), str(req.get("container_id", "")), int(req.get("pid", 0)),
                    str(req.get("cgroup", "")))
            if not all(owner):
                return dict(_NO_OWNER)
            rec = service.bind(*args, owner=owner)
            return {"ok": True, "state": rec.state.value, "devices": list(rec.device_uuids)}
        if op == "release":
            lease_id, reason = str(req["lease_id"]), str(req.get("reason", "poststop"))
            if not all(owner):
                return dict(_NO_OWNER)
            return {"ok": True, "released": service.release(lease_id, reason, owner=owner)}
        return {"ok": False, "code": "INVALID_ARGUMENT", "error": f"unknown op {op!r} (bind, release)"}
    except WeftError as exc:
        return {"ok": False, "code": exc.code.name, "error": exc.message}
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError) as exc:
        return {"ok": False, "code": "INVALID_ARGUMENT", "error": f"malformed hook request: {exc!r}"}
    except RecursionError:  # JSON nested deeper than the parser goes: not a hook request
        return {"ok": False, "code": "INVALID_ARGUMENT", "error": "malformed hook request: nested too deeply"}
    except sqlite3.Error as exc:
        return {"ok": False, "code": "INTERNAL", "error": f"the broker's state store failed: {exc}"}


class BrokerServer:
    def __init__(self, socket_path: Path, service: LeaseService) -> None:
        self.socket_path = socket_path
        self.claim = SocketClaim(socket_path, what="broker")
        self._server = grpc.server(ThreadPoolExecutor(max_workers=16, thread_name_prefix="weft-broker"))
        pb_grpc.add_BrokerServicer_to_server(BrokerServicer(service), self._server)
        self.hook = None
        self._service = service

    def start(self) -> None:
        self.claim.acquire()
        old = os.umask(0o177)
        try:
            if self._server.add_insecure_port(f"unix:{self.socket_path}") == 0:
                raise WeftError(f"could not bind the broker socket {self.socket_path}")
        finally:
            os.umask(old)
        self.claim.bound()
        self.hook = HookEndpoint(self.socket_path.with_name(self.socket_path.name + ".hook"), self._service)
        self._server.start()
        self.hook.start()

    def stop(self, grace: float = 2.0) -> None:
        if self.hook is not None:
            self.hook.stop()
        self._server.stop(grace).wait()
        self.claim.release()
