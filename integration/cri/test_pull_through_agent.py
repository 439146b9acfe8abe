"""Real image pulls through the agent, with and without credentials, from a real registry.

PullImage is a pass-through: kubelet's AuthConfig must reach containerd
unchanged (weft neither stores nor logs it), and a refused pull must fail
with the same code and message as a direct one.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness.registry import Registry
from shim.localfabric import images
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import IMAGE_CACHE, Containerd


@pytest.fixture
def registry(containerd: Containerd) -> Iterator[Registry]:
    with Registry(containerd) as reg:
        yield reg


def _pull(ch: grpc.Channel, ref: str, auth: cri.AuthConfig | None) -> tuple[str, str]:
    try:
        resp = cri_grpc.ImageServiceStub(ch).PullImage(
            cri.PullImageRequest(image=cri.ImageSpec(image=ref), auth=auth), timeout=60)
    except grpc.RpcError as e:
        return e.code().name, e.details()
    return "OK", resp.image_ref


def test_pull_with_credentials_through_agent(containerd: Containerd, registry: Registry, agent: AgentProcess,
                                             agent_channel: grpc.Channel) -> None:
    archive = next(a for a in images.cached_archives(IMAGE_CACHE) if "busybox" in a.name)
    ref = registry.push(archive, "weft/pull-test:1")
    auth = cri.AuthConfig(username=registry.user, password=registry.password)

    code, image_ref = _pull(agent_channel, ref, auth)
    assert code == "OK" and image_ref.startswith("sha256:")
    status = cri_grpc.ImageServiceStub(agent_channel).ImageStatus(
        cri.ImageStatusRequest(image=cri.ImageSpec(image=ref)))
    assert ref in status.image.repo_tags
    # The secret passed through and was not kept: not in the agent's log or state.
    assert registry.password not in agent.log_text()
    for f in agent.state_dir.rglob("*"):
        if f.is_file():
            assert registry.password.encode() not in f.read_bytes()


@pytest.mark.parametrize(
    "auth",
    [None, cri.AuthConfig(username="weft", password="wrong")],
    ids=["no-credentials", "wrong-password"],
)
def test_refused_pull_fails_as_direct(containerd: Containerd, registry: Registry, agent_channel: grpc.Channel,
                                      auth) -> None:
    archive = next(a for a in images.cached_archives(IMAGE_CACHE) if "busybox" in a.name)
    ref = registry.push(archive, "weft/private:1")
    with containerd.channel() as direct:
        want = _pull(direct, ref, auth)
    assert want[0] != "OK"
    assert _pull(agent_channel, ref, auth) == want
