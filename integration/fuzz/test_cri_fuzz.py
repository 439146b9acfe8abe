"""Bad input on every verb weft intercepts, through a real agent, containerd, hook and broker.

For each intercepted method the agent's socket gets raw request bytes that
hypothesis makes from a valid request: random bytes, small corruptions,
unknown field numbers, invalid UTF-8 in label and annotation maps, strings of
up to 5 MiB, and (CreateContainer) random values in weft's own annotations.
After every example: the agent and the broker still run and answer, the
status was a clear one (a message; never a hang, never the agent's own
crash), and everything the call made is undone by the ordinary verbs, leaving
containerd, the broker's leases and the agent's state rows as they were.
After each method, the agent holds no more file descriptors or threads than
after its warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError
from hypothesis import assume, event, given
from hypothesis import strategies as st

from integration.fuzz import wire
from integration.fuzz.agent_fixture import GPU_ENV, FuzzFabric, assert_clear, call, fuzz_fabric
from shim.localfabric import pods

RT = "/runtime.v1.RuntimeService/"


@pytest.fixture(scope="module")
def fab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzFabric]:
    yield from fuzz_fabric(tmp_path_factory.mktemp("cri-fuzz"))


@dataclass
class Verb:
    path: str
    request_type: type
    valid: Callable[[FuzzFabric], bytes]
    maps: list[str] = field(default_factory=list)
    strings: list[str] = field(default_factory=list)
    # Strings made megabytes long (``strings`` unless given).
    huge: list[str] | None = None
    # Examples per kind of bad input; "mutated" gets three times as many.
    examples: int = 6

    def inputs(self, fab: FuzzFabric) -> dict[str, st.SearchStrategy[bytes]]:
        paths = [wire.number_of(self.request_type, p) for p in self.maps]
        strings = [wire.number_of(self.request_type, p) for p in self.strings]
        huge = None if self.huge is None else [wire.number_of(self.request_type, p) for p in self.huge]
        return wire.bad_inputs(self.valid(fab), paths, strings, huge)


def _sandbox_request(fab: FuzzFabric) -> bytes:
    cfg = pods.sandbox_config("fuzz-run", fab.containerd.pod_log_dir, cgroup_parent=fab.containerd.cgroup_root)
    return cri.RunPodSandboxRequest(config=cfg, runtime_handler="weft").SerializeToString()


def _container_request(fab: FuzzFabric) -> bytes:
    ccfg = pods.container_config("fz", ["sleep", "3600"], envs=GPU_ENV)
    return cri.CreateContainerRequest(pod_sandbox_id=fab.sandbox_id, config=ccfg,
                                      sandbox_config=fab.sandbox_config).SerializeToString()


VERBS = [
    Verb(RT + "RunPodSandbox", cri.RunPodSandboxRequest, _sandbox_request,
         maps=["config.labels", "config.annotations"],
         strings=["runtime_handler", "config.metadata.name", "config.hostname"],
         # containerd itself runs a pod with a megabyte name and then cannot tear its network down (the
         # CNI plugin's environment is too long): a containerd limit, kubelet never sends such a name.
         huge=["runtime_handler"], examples=4),
    Verb(RT + "CreateContainer", cri.CreateContainerRequest, _container_request,
         maps=["config.labels", "config.annotations", "sandbox_config.annotations"],
         strings=["pod_sandbox_id", "config.metadata.name", "config.image.image"], examples=8),
    Verb(RT + "RemoveContainer", cri.RemoveContainerRequest,
         lambda fab: cri.RemoveContainerRequest(container_id="f" * 64).SerializeToString(), strings=["container_id"]),
    Verb(RT + "RemovePodSandbox", cri.RemovePodSandboxRequest,
         lambda fab: cri.RemovePodSandboxRequest(pod_sandbox_id="f" * 64).SerializeToString(),
         strings=["pod_sandbox_id"]),
    Verb(RT + "ListPodSandbox", cri.ListPodSandboxRequest,
         lambda fab: cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(
             label_selector={"io.kubernetes.pod.name": "fuzz"})).SerializeToString(),
         maps=["filter.label_selector"], strings=["filter.id"], examples=4),
    Verb(RT + "ListContainers", cri.ListContainersRequest,
         lambda fab: cri.ListContainersRequest(filter=cri.ContainerFilter(
             pod_sandbox_id=fab.sandbox_id, label_selector={"a": "b"})).SerializeToString(),
         maps=["filter.label_selector"], strings=["filter.id", "filter.pod_sandbox_id"], examples=4),
    Verb(RT + "ListContainerStats", cri.ListContainerStatsRequest,
         lambda fab: cri.ListContainerStatsRequest(filter=cri.ContainerStatsFilter(
             pod_sandbox_id=fab.sandbox_id)).SerializeToString(),
         maps=["filter.label_selector"], strings=["filter.id"], examples=4),
    Verb(RT + "ListPodSandboxStats", cri.ListPodSandboxStatsRequest,
         lambda fab: cri.ListPodSandboxStatsRequest(filter=cri.PodSandboxStatsFilter(
             id=fab.sandbox_id)).SerializeToString(),
         maps=["filter.label_selector"], strings=["filter.id"], examples=4),
]


def _undo(fab: FuzzFabric, verb: Verb, response: bytes) -> None:
    """Take back, through the agent, whatever a successful call made."""
    if verb.path.endswith("/RunPodSandbox"):
        fab.remove_sandbox(cri.RunPodSandboxResponse.FromString(response).pod_sandbox_id)
    elif verb.path.endswith("/CreateContainer"):
        fab.remove_container(cri.CreateContainerResponse.FromString(response).container_id)


def _removes_a_fixture(fab: FuzzFabric, verb: Verb, raw: bytes) -> bool:
    """A Remove* whose ID happens to be a prefix of the fixture's own sandbox: not bad input, just unlucky."""
    if not verb.path.endswith(("/RemoveContainer", "/RemovePodSandbox")):
        return False
    try:
        msg = verb.request_type.FromString(raw)
    except DecodeError:
        return False
    ident = getattr(msg, "container_id", "") or getattr(msg, "pod_sandbox_id", "")
    assert fab.baseline is not None
    return bool(ident) and any(x.startswith(ident) for x in fab.baseline.sandboxes | fab.baseline.containers)


def _run(fab: FuzzFabric, verb: Verb, kind: str, raw: bytes) -> None:
    assume(not _removes_a_fixture(fab, verb, raw))
    what = (verb.path, wire.describe(kind, raw))
    out = call(fab.channel, verb.path, raw)
    event(f"{kind}: {out.code.name}")
    assert_clear(out, what)
    if out.response is not None:
        _undo(fab, verb, out.response)
    fab.alive()
    fab.assert_nothing_left(what)


def _warm(fab: FuzzFabric, verb: Verb) -> None:
    """One valid call first (and undone), so pools and connections the agent keeps are counted as baseline."""
    out = call(fab.channel, verb.path, verb.valid(fab))
    assert out.code is grpc.StatusCode.OK or verb.path.endswith(("/RemoveContainer", "/RemovePodSandbox")), out
    if out.response is not None:
        _undo(fab, verb, out.response)
    proc = fab.process()
    fab.resources = (proc.num_fds(), proc.num_threads())


def _kinds(verb: Verb) -> list[str]:
    return [k for k in wire.KINDS if (verb.maps or "map" not in k) and (verb.strings or "string" not in k)]


CASES = [pytest.param(verb, kind, id=f"{verb.path.rsplit('/', 1)[1]}-{kind}")
         for verb in VERBS for kind in _kinds(verb)]


@pytest.mark.parametrize(("verb", "kind"), CASES)
def test_bad_requests_get_a_clear_status_and_leave_nothing_behind(fab: FuzzFabric, verb: Verb, kind: str) -> None:
    _warm(fab, verb)

    @wire.fuzz_settings(verb.examples * (3 if kind == "mutated" else 1))
    @given(raw=verb.inputs(fab)[kind])
    def check(raw: wire.Raw) -> None:
        _run(fab, verb, kind, raw.data)

    check()
    fab.settle_resources()
    assert fab.state_dir_doc() == fab.baseline.state


@wire.fuzz_settings(40)
@given(name=st.sampled_from(["gpu-memory", "gpu-compute", "stage"]),
       value=st.one_of(st.text(max_size=40), st.sampled_from(["20Gi", "512m", "1e999999", "-1", "101", "0", "50%",
                                                              "cpu", "gpu", "local", "9" * 5000, " 1Gi\n"])))
def test_weft_annotations_of_an_opted_in_pod_are_accepted_or_refused_by_name(fab: FuzzFabric, name: str,
                                                                             value: str) -> None:
    cfg = cri.PodSandboxConfig()
    cfg.CopyFrom(fab.sandbox_config)
    annotation = f"weft.io/{name}.fz"
    cfg.annotations[annotation] = value
    ccfg = pods.container_config("fz", ["sleep", "3600"], envs=GPU_ENV)
    raw = cri.CreateContainerRequest(pod_sandbox_id=fab.sandbox_id, config=ccfg, sandbox_config=cfg)
    out = call(fab.channel, RT + "CreateContainer", raw.SerializeToString())
    assert_clear(out, (annotation, value))
    if out.response is not None:
        fab.remove_container(cri.CreateContainerResponse.FromString(out.response).container_id)
    elif out.code is grpc.StatusCode.INVALID_ARGUMENT:
        assert annotation in out.details
    else:
        # Asks no device can hold are refused by the broker, by name too.
        assert out.code is grpc.StatusCode.RESOURCE_EXHAUSTED, (out.code, out.details, annotation, value)
    fab.alive()
    fab.assert_nothing_left((annotation, value))


@wire.fuzz_settings(30)
@given(body=st.one_of(st.binary(max_size=256), wire.INVALID_UTF8, st.text(max_size=64).map(str.encode),
                      wire.HUGE.map(lambda n: b"c" * n)))
def test_admin_calls_answer_any_body(fab: FuzzFabric, body: bytes) -> None:
    status = call(fab.channel, "/weft.agent.v1.Admin/Status", body)
    assert status.code is grpc.StatusCode.OK, status
    explain = call(fab.channel, "/weft.agent.v1.Admin/Explain", body)
    assert_clear(explain, body[:64])
    assert explain.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED), explain
    fab.alive()


def test_the_fuzzed_agent_still_runs_a_gpu_container(fab: FuzzFabric, tmp_path: Path) -> None:
    """After all of it, the ordinary path still works end to end: lease, hook bind, release."""
    from cri_api.v1 import api_pb2_grpc as cri_grpc

    rt = cri_grpc.RuntimeServiceStub(fab.channel)
    ccfg = pods.container_config("fz", ["sleep", "3600"], envs=GPU_ENV)
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=fab.sandbox_id, config=ccfg,
                                                        sandbox_config=fab.sandbox_config), timeout=60).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
    [lease] = fab.broker.leases()
    assert (lease.state, lease.container_id) == ("bound", cid)
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=1), timeout=60)
    fab.remove_container(cid)
    fab.assert_nothing_left("an ordinary GPU container")
