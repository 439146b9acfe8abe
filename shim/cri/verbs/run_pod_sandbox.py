"""RunPodSandbox: the opt-in point.

A sandbox whose runtime handler is ``weft`` (the handler of the ``weft``
RuntimeClass) is forwarded unchanged to containerd, whose ``weft`` handler is
runc plus weft's OCI hooks, and remembered as opted in: written to the state
store before kubelet gets the sandbox ID; on a node with a mesh, a host is
asked at once to prepare the pod's shadow sandbox (``shim.origin.prepare``).
Every other sandbox passes through byte for byte.
"""

from __future__ import annotations

import sqlite3
import time

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.fabric import WEFT_HANDLER, Fabric
from shim.cri.instrument import note_pod
from shim.cri.route import Route
from shim.state.agent import SandboxRecord
from shim.state.db import StateError

PATH = "/runtime.v1.RuntimeService/RunPodSandbox"
_log = log.get("weft.cri")


def route(fabric: Fabric) -> Route:
    def run_pod_sandbox(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            req = cri.RunPodSandboxRequest.FromString(request)
        except DecodeError:  # containerd words the error, as it would without us
            return fabric.upstream.unary(PATH, request, context)
        note_pod(req.config.metadata.name, req.config.metadata.namespace)
        if req.runtime_handler != WEFT_HANDLER:
            return fabric.upstream.unary(PATH, request, context)
        prepared = fabric.origin.prepared if fabric.origin is not None else None
        if prepared is not None:
            # The likeliest host makes the pod's shadow sandbox while containerd makes this one; in the
            # background, and never a reason for this call to fail.
            try:
                prepared.begin(req.config)
            except Exception as exc:  # noqa: BLE001 - a hint only; the container's RunShadow makes it anyway
                _log.warning("remote.prepare_failed", pod=req.config.metadata.name, error=str(exc))
        response = fabric.upstream.unary(PATH, request, context)
        sandbox_id = cri.RunPodSandboxResponse.FromString(response).pod_sandbox_id
        meta = req.config.metadata
        try:
            fabric.remember(SandboxRecord(
                id=sandbox_id, name=meta.name, namespace=meta.namespace, uid=meta.uid,
                runtime_handler=req.runtime_handler, opted_in=True, annotations=dict(req.config.annotations),
                created_at=time.time()))
        except (StateError, sqlite3.Error) as exc:
            # Unrecorded, weft would pass its containers through unplaced: the sandbox goes, kubelet retries.
            # Any failure of the store counts, not only a full disk (a read-only or failing file too).
            _remove_quietly(fabric, sandbox_id)
            if isinstance(exc, StateError):
                raise
            raise StateError(f"weft: sandbox {sandbox_id[:13]} could not be recorded as opted in ({exc}); "
                             "it was removed, and kubelet retries") from exc
        fabric.metrics.sandbox_opted_in(meta.namespace, meta.name, time.time())
        _log.info("sandbox.opted_in", sandbox_id=sandbox_id, pod=meta.name, namespace=meta.namespace)
        return response

    return Route(run_pod_sandbox)


def _remove_quietly(fabric: Fabric, sandbox_id: str) -> None:
    for verb, request, response in (
            ("StopPodSandbox", cri.StopPodSandboxRequest, cri.StopPodSandboxResponse),
            ("RemovePodSandbox", cri.RemovePodSandboxRequest, cri.RemovePodSandboxResponse)):
        try:
            fabric.upstream.channel.unary_unary(
                f"/runtime.v1.RuntimeService/{verb}", request_serializer=request.SerializeToString,
                response_deserializer=response.FromString)(request(pod_sandbox_id=sandbox_id), timeout=60)
        except grpc.RpcError as exc:
            _log.warning("sandbox.undo_failed", sandbox_id=sandbox_id, step=verb, code=exc.code().name,
                         error=exc.details())
            return
    _log.info("sandbox.undone", sandbox_id=sandbox_id)
