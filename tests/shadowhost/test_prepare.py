"""The sweep of shadow sandboxes no container uses (a fake containerd here)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from cri_api.v1 import api_pb2 as cri

from shim.crishared.labels import ORIGIN_LABEL
from shim.shadowhost.prepare import Preparer, pod_label, sandbox_unsafe
from shim.shadowhost.runtime import ShadowRuntime

S = 1_000_000_000


class FakeRuntime:
    def __init__(self, sandboxes: list[cri.PodSandbox], containers: list[cri.Container]) -> None:
        self.sandboxes, self._containers = sandboxes, containers
        self.removed: list[str] = []

    def call(self, path: str, request, response_type):
        verb = path.rsplit("/", 1)[1]
        if verb == "ListPodSandbox":
            return cri.ListPodSandboxResponse(items=self.sandboxes)
        if verb == "RemovePodSandbox":
            self.removed.append(request.pod_sandbox_id)
        return response_type()

    def containers(self) -> list[cri.Container]:
        return self._containers

    # The real one, through the fake's call: a sweep stops and removes a sandbox as the host does.
    remove_sandbox = ShadowRuntime.remove_sandbox


def _sweep(sandboxes, containers, now_s: float, ttl: float = 60.0) -> list[str]:
    rt = FakeRuntime(sandboxes, containers)
    lifecycle = SimpleNamespace(rt=rt, lock=threading.Lock())
    removed = Preparer(lifecycle, ttl).sweep(now_ns=int(now_s * S))
    assert removed == rt.removed
    return removed


def test_only_shadow_sandboxes_without_a_container_older_than_the_ttl_are_removed() -> None:
    shadow = {ORIGIN_LABEL: "gpu-1"}
    sandboxes = [
        cri.PodSandbox(id="old-empty", labels=shadow, created_at=0),
        cri.PodSandbox(id="young-empty", labels=shadow, created_at=50 * S),
        cri.PodSandbox(id="old-used", labels=shadow, created_at=0),
        cri.PodSandbox(id="own-pod", labels={}, created_at=0),  # the host's own pod: never touched
    ]
    containers = [cri.Container(id="c", pod_sandbox_id="old-used")]
    assert _sweep(sandboxes, containers, now_s=100.0) == ["old-empty"]
    assert _sweep(sandboxes, containers, now_s=200.0) == ["old-empty", "young-empty"]


def test_a_sandbox_is_found_by_its_pod_and_attempt_and_an_unsafe_one_is_named() -> None:
    a = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(uid="u1", attempt=0))
    b = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(uid="u1", attempt=1))
    assert pod_label(a) != pod_label(b) and pod_label(a) == pod_label(cri.PodSandboxConfig(metadata=a.metadata))
    assert sandbox_unsafe(a) == ""
    a.linux.security_context.namespace_options.network = cri.NODE
    assert sandbox_unsafe(a) == "host namespaces"
    b.linux.security_context.privileged = True
    assert sandbox_unsafe(b) == "privileged"
