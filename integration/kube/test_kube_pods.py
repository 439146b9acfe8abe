"""The origin's cache of its node's Pods, against a real kube-apiserver: one list and watch, current within moments."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from harness.controlplane import ControlPlane
from shim.core.podspec import spec_facts
from shim.kube import access
from shim.kube.pods import PodCache
from shim.localfabric.waiting import wait_for

NODE = "gpu-1"


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    cp = ControlPlane(tmp_path_factory.mktemp("api"), "127.0.0.1", [])
    try:
        cp.start()
        yield cp
    finally:
        cp.stop()


def _pod(name: str, node: str, containers: list[dict], volumes: list[dict] = ()) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
                       "spec": {"nodeName": node, "containers": containers, "volumes": list(volumes)}})


@pytest.fixture
def cache(api: ControlPlane) -> Iterator[PodCache]:
    c = PodCache(access.resolve(api.kubeconfig("admin")), NODE, miss_wait=5.0, backoff_max=2.0, watch_s=2)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        api.kubectl("delete", "pods", "--all", "--grace-period=0", "--force", check=False)


def test_a_pod_bound_to_the_node_is_there_with_its_spec_and_others_are_not(api: ControlPlane, cache) -> None:
    api.kubectl("apply", "-f", "-", stdin=_pod(
        "two-stage", NODE,
        [{"name": "prep", "image": "busybox", "resources": {"requests": {"cpu": "250m", "memory": "64Mi"}},
          "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}]},
         {"name": "model", "image": "busybox"}],
        [{"name": "scratch", "emptyDir": {"sizeLimit": "100Mi"}}]))
    api.kubectl("apply", "-f", "-", stdin=_pod("elsewhere", "cpu-1", [{"name": "c", "image": "busybox"}]))
    pod = wait_for(lambda: cache.spec_of("default", "two-stage"), timeout=30, what="the pod in the cache")
    facts = spec_facts(pod, "prep")
    assert facts.private_empty_dirs == {"scratch": 100 << 20} and facts.requests.cpu_cores == 0.25
    assert cache.spec_of("default", "elsewhere") is None  # bound to another node: not in this node's cache


def test_a_deleted_pod_leaves_the_cache(api: ControlPlane, cache) -> None:
    api.kubectl("apply", "-f", "-", stdin=_pod("short-lived", NODE, [{"name": "c", "image": "busybox"}]))
    wait_for(lambda: cache.spec_of("default", "short-lived"), timeout=30, what="the pod in the cache")
    api.kubectl("delete", "pod", "short-lived", "--grace-period=0", "--force")
    cache.miss_wait = 0.0
    wait_for(lambda: cache.spec_of("default", "short-lived") is None, timeout=30, what="the pod gone")


def test_the_cache_keeps_working_across_an_api_server_restart(api: ControlPlane, cache) -> None:
    wait_for(lambda: cache.synced, timeout=30, what="the first list")
    api.stop_apiserver()
    api.start_apiserver()
    api.kubectl("apply", "-f", "-", stdin=_pod("after-restart", NODE, [{"name": "c", "image": "busybox"}]))
    wait_for(lambda: cache.spec_of("default", "after-restart"), timeout=60, what="a pod made after the restart")
