"""Random valid call sequences of pass-through CRI verbs: direct to containerd and through the agent, compared.

hypothesis writes a sequence over two pods (not opted in) and three
containers: run, create, start, stop, remove, status and list (with and
without filters), image status, including calls on what does not exist (yet,
or any more). The sequence runs against containerd directly, everything is
removed, then it runs again through a real agent in front of the same
containerd. Every answer, errors included (code and words), must be the same
once IDs, timestamps and addresses are set aside
(``integration.cri.test_differential``'s normaliser).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc
from hypothesis import given
from hypothesis import strategies as st

from integration.cri.test_differential import recorder
from integration.fuzz import wire
from shim.localfabric import images, pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd

PODS, CONTAINERS = 2, 3

OPS = st.one_of(
    st.tuples(st.just("run_pod"), st.integers(0, PODS - 1)),
    st.tuples(st.just("create"), st.integers(0, PODS - 1), st.integers(0, CONTAINERS - 1)),
    st.tuples(st.sampled_from(["start", "stop", "remove", "status"]), st.integers(0, CONTAINERS - 1)),
    st.tuples(st.sampled_from(["stop_pod", "remove_pod", "pod_status"]), st.integers(0, PODS - 1)),
    st.tuples(st.just("list_containers"), st.sampled_from(["all", "pod0", "pod1", "running", "exited", "label"])),
    st.tuples(st.just("list_pods"), st.sampled_from(["all", "ready", "notready", "label", "id0"])),
    st.tuples(st.just("image_status"), st.sampled_from([images.BUSYBOX_IMAGE, "docker.io/library/nope:1"])),
)


@pytest.fixture(scope="module")
def node(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
        tuple[Containerd, AgentProcess]]:
    with AgentProcess(containerd_session, tmp_path_factory.mktemp("diff-fuzz")) as agent:
        yield containerd_session, agent


def _clear(containerd: Containerd) -> None:
    with containerd.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        for sb in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items:
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)


def _run(channel: grpc.Channel, ops: list[tuple], configs: list[cri.PodSandboxConfig]) -> list[tuple[str, object]]:
    rt = cri_grpc.RuntimeServiceStub(channel)
    im = cri_grpc.ImageServiceStub(channel)
    pods_ids: dict[int, str] = {}
    containers: dict[int, str] = {}
    out: list[tuple[str, object]] = []
    call = recorder(out, timeout=60)
    pod = lambda p: pods_ids.get(p, f"missing-pod-{p}")  # noqa: E731
    ctr = lambda c: containers.get(c, f"missing-container-{c}")  # noqa: E731
    for op in ops:
        name = "/".join(map(str, op))
        match op:
            case ("run_pod", p):
                r = call(name, rt.RunPodSandbox, cri.RunPodSandboxRequest(config=configs[p]))
                if r is not None:
                    pods_ids[p] = r.pod_sandbox_id
            case ("create", p, c):
                ccfg = pods.container_config(f"c{c}", ["sleep", "3600"], labels={"fuzz": str(c % 2)})
                r = call(name, rt.CreateContainer, cri.CreateContainerRequest(
                    pod_sandbox_id=pod(p), config=ccfg, sandbox_config=configs[p]))
                if r is not None:
                    containers[c] = r.container_id
            case ("start", c):
                call(name, rt.StartContainer, cri.StartContainerRequest(container_id=ctr(c)))
            case ("stop", c):
                call(name, rt.StopContainer, cri.StopContainerRequest(container_id=ctr(c), timeout=0))
            case ("remove", c):
                call(name, rt.RemoveContainer, cri.RemoveContainerRequest(container_id=ctr(c)))
            case ("status", c):
                call(name, rt.ContainerStatus, cri.ContainerStatusRequest(container_id=ctr(c)))
            case ("stop_pod", p):
                call(name, rt.StopPodSandbox, cri.StopPodSandboxRequest(pod_sandbox_id=pod(p)))
            case ("remove_pod", p):
                call(name, rt.RemovePodSandbox, cri.RemovePodSandboxRequest(pod_sandbox_id=pod(p)))
            case ("pod_status", p):
                call(name, rt.PodSandboxStatus, cri.PodSandboxStatusRequest(pod_sandbox_id=pod(p)))
            case ("list_containers", f):
                flt = {"all": cri.ContainerFilter(), "pod0": cri.ContainerFilter(pod_sandbox_id=pod(0)),
                       "pod1": cri.ContainerFilter(pod_sandbox_id=pod(1)),
                       "running": cri.ContainerFilter(state=cri.ContainerStateValue(state=cri.CONTAINER_RUNNING)),
                       "exited": cri.ContainerFilter(state=cri.ContainerStateValue(state=cri.CONTAINER_EXITED)),
                       "label": cri.ContainerFilter(label_selector={"fuzz": "1"})}[f]
                call(name, rt.ListContainers, cri.ListContainersRequest(filter=flt))
            case ("list_pods", f):
                flt = {"all": cri.PodSandboxFilter(),
                       "ready": cri.PodSandboxFilter(state=cri.PodSandboxStateValue(state=cri.SANDBOX_READY)),
                       "notready": cri.PodSandboxFilter(state=cri.PodSandboxStateValue(state=cri.SANDBOX_NOTREADY)),
                       "label": cri.PodSandboxFilter(label_selector={"io.kubernetes.pod.name": "fz-1"}),
                       "id0": cri.PodSandboxFilter(id=pod(0))}[f]
                call(name, rt.ListPodSandbox, cri.ListPodSandboxRequest(filter=flt))
            case ("image_status", image):
                call(name, im.ImageStatus, cri.ImageStatusRequest(image=cri.ImageSpec(image=image)))
    return out


@wire.fuzz_settings(10)
@given(ops=st.lists(OPS, min_size=3, max_size=10))
def test_random_call_sequences_answer_the_same_direct_and_through_the_agent(node, ops: list[tuple]) -> None:
    containerd, agent = node
    configs = [pods.sandbox_config(f"fz-{p}", Path(containerd.pod_log_dir), cgroup_parent=containerd.cgroup_root)
               for p in range(PODS)]
    # Always some live objects, so the lists and statuses have something to show.
    ops = [("run_pod", 0), ("create", 0, 0), ("start", 0), *ops]
    try:
        with containerd.channel() as direct:
            want = _run(direct, ops, configs)
        _clear(containerd)
        with agent.channel() as through:
            got = _run(through, ops, configs)
    finally:
        _clear(containerd)
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, expected), (_, have) in zip(want, got, strict=True):
        assert have == expected, f"{name} differs through the agent (sequence {ops})"
    assert agent.proc is not None and agent.proc.poll() is None
