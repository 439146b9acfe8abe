"""The pause image this node's containerd runs pod sandboxes from: what a reservation pod runs.

A reservation pod is bound to this node by name and must need no image the node would not otherwise have: a node
that pulls its pause image from a mirror, or has it preloaded, cannot pull ``registry.k8s.io``'s. ``weft install``
reads it from containerd's configuration files; an agent started by hand, with no ``kubernetes.reservation_image``,
asks the running containerd (CRI ``Status`` with ``verbose``: the configuration it runs on), as kubelet since 1.35
leaves the sandbox image to containerd altogether. containerd 2.x's Status no longer carries its image service's
configuration, so there the agent reads containerd's files as ``weft install`` does (``from_host``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim import log

# containerd 2.x's built-in default; used, and said, only while containerd does not answer.
FALLBACK = "registry.k8s.io/pause:3.10"

_log = log.get("weft.reservations")


def from_status(info: dict[str, str]) -> str | None:
    """The sandbox image in a verbose CRI ``Status``'s ``info`` (None where it names none): containerd 1.x and
    2.x put their CRI configuration, ``sandboxImage`` among it, under ``config``."""
    try:
        config = json.loads(info.get("config", ""))
    except ValueError:
        return None
    image = config.get("sandboxImage") if isinstance(config, dict) else None
    if not (isinstance(image, str) and image):
        pinned = config.get("pinnedImages") if isinstance(config, dict) else None
        image = pinned.get("sandbox") if isinstance(pinned, dict) else None
    return image if isinstance(image, str) and image else None


class SandboxImage:
    """``configured`` where the configuration names one; otherwise containerd's own, asked once it answers;
    ``from_host``: where its Status names none, what containerd's files say (None: unknown)."""

    def __init__(self, channel: grpc.Channel, configured: str = "", timeout: float = 5.0,
                 from_host: Callable[[], str | None] | None = None) -> None:
        self.channel, self.configured, self.timeout, self.from_host = channel, configured, timeout, from_host
        self._found: str | None = None
        self._lock = threading.Lock()

    def __call__(self) -> str:
        if self.configured:
            return self.configured
        with self._lock:
            if self._found is None:
                self._found = self._ask()
            return self._found or FALLBACK

    def _ask(self) -> str | None:
        try:
            status = cri_grpc.RuntimeServiceStub(self.channel).Status(cri.StatusRequest(verbose=True),
                                                                      timeout=self.timeout)
        except grpc.RpcError as exc:
            _log.warning("reservation.sandbox_image_unknown", fallback=FALLBACK,
                         error=f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
            return None  # asked again at the next reservation
        image = from_status(dict(status.info))
        if image is not None:
            _log.info("reservation.sandbox_image", image=image, source="containerd")
            return image
        image = self.from_host() if self.from_host is not None else None
        if image is None:
            _log.warning("reservation.sandbox_image_unknown", fallback=FALLBACK,
                         error="containerd's verbose Status names no sandbox image, nor do its files")
            return FALLBACK  # this containerd will not say: its default
        _log.info("reservation.sandbox_image", image=image, source="containerd-config")
        return image
