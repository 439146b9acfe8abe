"""What both ends of a mesh connection hold to: message sizes, each method's request limit, keepalive.

Message sizes: gRPC reads a request message whole before a handler runs, so
whatever a unary request may hold is read before the peer-list check. The
transport refuses a message over ``MAX_MESSAGE_BYTES`` from its length
prefix, without reading it (and with BDP probing off, its flow-control window
does not grow for one); each method then has a limit of its own
(``REQUEST_LIMITS``), checked before the request is parsed. Copied volumes,
the one thing that may be large, come in client streams of small parts
(``shim.mesh.upload``), whose handler checks the peer before reading any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from shim.config import STREAM_KEEPALIVE_S
from shim.errors import WeftError


class MessageTooLarge(WeftError):
    """A request larger than its method takes (``REQUEST_LIMITS``)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class Oversized:
    """What a request over its method's limit is handed to the handler as, unparsed: refused after the peer's
    checks, so a stranger is told it is a stranger."""

    method: str
    size: int
    limit: int

    def refuse(self) -> MessageTooLarge:
        return MessageTooLarge(f"{self.method}: a message of {self.size} bytes, over the {self.limit} this host "
                               f"takes for it")


# The largest request the mesh reads. The largest unary request is a RunShadow without volumes: kubelet's
# sandbox and container configs, whose environment and arguments must fit the kernel's ARG_MAX (2 MiB with the
# default stack) for the container to start at all, and whose annotations the API server holds to 256 KiB.
# Copied volumes, which may be larger, come in parts (shim.mesh.upload).
MAX_MESSAGE_BYTES = 4 << 20
# The largest answer: a ShadowCall carries the host's containerd's response, which containerd sends up to
# 16 MiB (its default max_send_message_size, and kubelet's CRI client reads no more), in a small wrapper.
MAX_RESPONSE_BYTES = (16 << 20) + (64 << 10)
# Requests that are small by nature are held to less than MAX_MESSAGE_BYTES: a Watch lists the keys of an
# origin's shadows here, a Stitch a pod's ports.
SMALL_REQUEST_BYTES = 256 << 10
REQUEST_LIMITS = {
    "Hello": SMALL_REQUEST_BYTES,
    "Admit": SMALL_REQUEST_BYTES,
    "RunShadow": MAX_MESSAGE_BYTES,
    "RunShadowChunked": MAX_MESSAGE_BYTES,  # the first part is a RunShadow; the rest hold 1 MiB of data each
    "StartShadow": SMALL_REQUEST_BYTES,
    "ShadowStatus": SMALL_REQUEST_BYTES,
    "RemoveShadow": SMALL_REQUEST_BYTES,
    "Watch": 1 << 20,
    "ShadowCall": MAX_MESSAGE_BYTES,  # kubelet's request: an ExecSync's command, an update's resources
    "StreamLog": SMALL_REQUEST_BYTES,
    "SyncVolumes": MAX_MESSAGE_BYTES,  # with volumes from an older origin only
    "SyncVolumesChunked": (1 << 20) + SMALL_REQUEST_BYTES,
    "OpenTunnel": SMALL_REQUEST_BYTES,
    "Stitch": 1 << 20,
}


def deserializer(method: str, message: Any, limit: int) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        return Oversized(method, len(data), limit) if len(data) > limit else message.FromString(data)

    return parse


# A cut link must end the streams on both sides within seconds, not after TCP's own timeouts. Pings go only
# while a call or stream is open: an idle connection (a candidate host between Hellos, of thousands) costs
# nothing, and a call on one that died fails by its deadline.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", int(STREAM_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(STREAM_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_pings_without_data", 0),
)
