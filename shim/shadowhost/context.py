"""What the host side needs of its own node: its containerd, its metrics, and the mark on its shadows.

Narrower than the verbs' ``Fabric``: a host runs shadows for its peers and
never needs this node's opted-in pods, leases or remote containers.
"""

from __future__ import annotations

from dataclasses import dataclass

from shim.crishared.containerd import Containerd
from shim.crishared.mark import ShadowMark, ShadowsSeen
from shim.metrics import Metrics


@dataclass(frozen=True)
class HostContext:
    upstream: Containerd
    metrics: Metrics
    # Shared with the list verbs: the host sets ``present`` as it makes a shadow, the verbs hide what bears the mark.
    shadows: ShadowsSeen

    def __post_init__(self) -> None:
        if self.shadows.mark is None:
            raise ValueError("a host marks the shadows it makes: HostContext needs ShadowsSeen with a mark")

    @property
    def mark(self) -> ShadowMark:
        assert self.shadows.mark is not None  # checked at construction
        return self.shadows.mark
