"""One opted-in CreateContainer as the verb has read it: what leasing, placing on a peer and recording it need.

Made once by ``shim.cri.verbs.create_container`` and handed whole to the
lease, to the local create and to ``shim.origin.place``, in place of the
long argument lists each step took. ``LocalBecause`` is placing's answer when
the container stays on this node.
"""

from __future__ import annotations

from dataclasses import dataclass

from cri_api.v1 import api_pb2 as cri

from shim.core.classify import Classification, ContainerAsk
from shim.core.placement import PlacementReason
from shim.state.agent import SandboxRecord


@dataclass(frozen=True)
class CreateAttempt:
    req: cri.CreateContainerRequest
    # The opted-in pod's record (this node's sandbox).
    sandbox: SandboxRecord
    # sandbox/name/attempt: the placement's key in the state store, the lease's at the broker, the shadow's on a host.
    key: str
    ask: ContainerAsk
    # The pod's annotations (the sandbox config's, or the record's when kubelet sent none).
    pod_annotations: dict[str, str]
    classification: Classification

    @property
    def config(self) -> cri.ContainerConfig:
        return self.req.config

    @property
    def name(self) -> str:
        return self.req.config.metadata.name

    @property
    def attempt(self) -> int:
        return self.req.config.metadata.attempt


@dataclass(frozen=True)
class LocalBecause:
    """The container stays here, and why."""

    reason: PlacementReason
    detail: str
