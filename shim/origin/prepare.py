"""The origin's side of prepared shadow sandboxes: ask a host for one as RunPodSandbox arrives.

RunPodSandbox of an opted-in pod (``shim.cri.verbs.run_pod_sandbox``) calls
``Prepared.begin`` before it forwards the call to containerd: the decision
(``shim.core.prepare``) is made at once, and a thread asks the chosen host
for the pod's shadow sandbox (``RunShadow`` with ``sandbox_only``) while
this node makes its own. Placement then tries that host first
(``prefer``). Nothing waits on the answer: a container's RunShadow on that
host finds the sandbox ready, or waits for it on the host's lock, or makes
it itself if the prepare failed. The host removes a prepared sandbox no
container used within ``mesh.prepared_sandbox_ttl`` (``shim.shadowhost.prepare``),
so what the origin keeps here is a hint, in memory only, and forgetting it
(a restart) loses nothing.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from cri_api.v1 import api_pb2 as cri

from shim import log
from shim._pb import mesh_pb2 as pb
from shim.core.prepare import PrepareDecision, PrepareReason, decide_prepare, prefer
from shim.errors import WeftError
from shim.origin.settings import OriginSettings

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode

_log = log.get("weft.cri")

# How long the hint that a pod's sandbox is prepared on a host is kept here (the host's TTL is its own).
HINT_S = 600.0
# A prepare that takes longer than this is left to finish, or fail, on its own.
PREPARE_TIMEOUT_S = 60.0


def _pod(config: cri.PodSandboxConfig) -> tuple[str, int]:
    return (config.metadata.uid, config.metadata.attempt)


class Prepared:
    def __init__(self, mesh: MeshNode, settings: OriginSettings) -> None:
        self.mesh, self.settings = mesh, settings
        self._lock = threading.Lock()
        self._hosts: dict[tuple[str, int], tuple[str, float]] = {}  # pod -> (host, monotonic time asked)

    def decide(self, config: cri.PodSandboxConfig) -> PrepareDecision:
        sc = config.linux.security_context
        o = sc.namespace_options
        return decide_prepare(dict(config.annotations), self.mesh.views(),
                              enabled=self.settings.prepare_shadow_sandbox,
                              host_namespaces=cri.NODE in (o.network, o.pid, o.ipc), privileged=sc.privileged,
                              max_age_s=self.settings.peer_max_age_s,
                              spread=self.mesh.spread(f"{config.metadata.uid}/{config.metadata.attempt}"))

    def begin(self, config: cri.PodSandboxConfig) -> PrepareDecision:
        """Decide, and when a host is chosen ask it in the background; the decision, for the log."""
        decision = self.decide(config)
        meta = config.metadata
        if decision.reason is not PrepareReason.PREPARED:
            _log.debug("remote.sandbox_not_prepared", pod=meta.name, namespace=meta.namespace,
                       reason=decision.reason.value, detail=decision.detail)
            return decision
        now = time.monotonic()
        with self._lock:
            for pod in [p for p, (_, t) in self._hosts.items() if now - t > HINT_S]:
                del self._hosts[pod]
            self._hosts[_pod(config)] = (decision.node, now)
        threading.Thread(target=self._ask, args=(decision.node, config), name="weft-prepare", daemon=True).start()
        return decision

    def _ask(self, node: str, config: cri.PodSandboxConfig) -> None:
        mesh = self.mesh
        meta = config.metadata
        client = mesh.client(node)
        t0 = time.monotonic()
        try:
            if client is None:
                raise WeftError(f"{node} is no longer a peer")
            state = client.run_shadow(pb.RunShadowRequest(
                origin_node=mesh.node, key=f"{meta.uid}/{meta.attempt}", sandbox_config=config.SerializeToString(),
                sandbox_only=True), timeout=PREPARE_TIMEOUT_S)
        except WeftError as exc:
            with self._lock:
                self._hosts.pop(_pod(config), None)
            _log.warning("remote.prepare_failed", node=node, pod=meta.name, namespace=meta.namespace,
                         error=exc.message)
            return
        _log.info("remote.sandbox_prepared", node=node, pod=meta.name, namespace=meta.namespace,
                  shadow_sandbox_id=state.shadow_sandbox_id, ms=round((time.monotonic() - t0) * 1000, 1))

    def host_of(self, config: cri.PodSandboxConfig) -> str | None:
        with self._lock:
            found = self._hosts.get(_pod(config))
        return found[0] if found else None

    def order(self, candidates: tuple[str, ...], config: cri.PodSandboxConfig) -> tuple[str, ...]:
        return prefer(candidates, self.host_of(config))

    def forget(self, config: cri.PodSandboxConfig) -> None:
        with self._lock:
            self._hosts.pop(_pod(config), None)
