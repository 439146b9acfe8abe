"""The agent's client of the GPU broker, with weft's errors instead of gRPC's.

A broker that does not answer gives ``BrokerUnavailable`` naming its socket;
the agent maps that to UNAVAILABLE for GPU containers of opted-in pods only.
Calls have short deadlines: a hung broker must not hold a CRI call for long.
"""

from __future__ import annotations

import grpc

from shim._pb import broker_pb2 as pb
from shim._pb import broker_pb2_grpc as pb_grpc
from shim.errors import BadAnnotation, BrokerUnavailable, LeaseConflictError, LeaseNotFound, LeaseRefused, WeftError

_BY_CODE: dict[grpc.StatusCode, type[WeftError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: BadAnnotation,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LeaseRefused,
    grpc.StatusCode.NOT_FOUND: LeaseNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseConflictError,
}


class BrokerClient:
    def __init__(self, socket: str, timeout: float = 5.0) -> None:
        self.socket = socket
        self.timeout = timeout
        self._channel = grpc.insecure_channel(f"unix://{socket}", options=(
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)))
        self._stub = pb_grpc.BrokerStub(self._channel)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details() or ""  # type: ignore[attr-defined]
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise BrokerUnavailable(f"weft: GPU broker unavailable at {self.socket}: {details}") from None
            raise _BY_CODE.get(code, WeftError)(details) from None

    def devices(self) -> pb.DevicesResponse:
        return self._call(self._stub.Devices, pb.DevicesRequest())

    def acquire(self, request: pb.AcquireRequest) -> pb.Lease:
        return self._call(self._stub.Acquire, request)

    def release(self, lease_id: str, reason: str) -> bool:
        return self._call(self._stub.Release, pb.ReleaseRequest(lease_id=lease_id, reason=reason)).released

    def list(self) -> pb.ListResponse:
        return self._call(self._stub.List, pb.ListRequest())

    def reconcile(self, live_keys: list[str]) -> list[str]:
        return list(self._call(self._stub.Reconcile, pb.ReconcileRequest(live_keys=live_keys)).released)

    def close(self) -> None:
        self._channel.close()
