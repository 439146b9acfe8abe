"""A host's shadows stay out of its kubelet's lists; a node without shadows pays nothing for it.

Shadows are made here directly through containerd with the ``weft.io/origin-node``
label and the agent's own mark (as a host's agent makes them for another
node's pod, ``shim.crishared.mark``, with the key in its state directory); kubelet's
view is the agent's socket.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.crishared.labels import KEY_LABEL
from shim.crishared.mark import MARK_LABEL, ShadowMark
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for

ORIGIN = {"weft.io/origin-node": "gpu-1"}


def _pod(rt, node: Containerd, name: str, mark: ShadowMark | None = None) -> tuple[str, str]:
    """A pod with one running container; with ``mark``, a shadow of gpu-1's as the host holding ``mark`` makes."""
    cfg = pods.sandbox_config(name, node.pod_log_dir, cgroup_parent=node.cgroup_root)
    labels: dict[str, str] = {}
    if mark is not None:
        origin = ORIGIN["weft.io/origin-node"]
        cfg.labels.update({**ORIGIN, MARK_LABEL: mark.sandbox(origin, cfg.metadata.uid)})
        key = f"origin-sb/{name}/0"
        labels = {**ORIGIN, KEY_LABEL: key, MARK_LABEL: mark.container(origin, key)}
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    ccfg = pods.container_config("main", ["sleep", "3600"], labels=labels)
    req = cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)
    cid = rt.CreateContainer(req).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    return sb, cid


def _lists(ch: grpc.Channel) -> dict[str, set[str]]:
    rt = cri_grpc.RuntimeServiceStub(ch)
    return {
        "sandboxes": {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items},
        "containers": {c.id for c in rt.ListContainers(cri.ListContainersRequest()).containers},
        "container_stats": {s.attributes.id for s in rt.ListContainerStats(cri.ListContainerStatsRequest()).stats},
        "sandbox_stats": {s.attributes.id for s in rt.ListPodSandboxStats(cri.ListPodSandboxStatsRequest()).stats},
    }


def test_shadows_are_hidden_from_kubelet_and_plain_pods_are_not(containerd: Containerd, tmp_path: Path) -> None:
    with containerd.channel() as direct_ch:
        direct = cri_grpc.RuntimeServiceStub(direct_ch)
        agent = AgentProcess(containerd, tmp_path / "agent")
        own_sb, own_c = _pod(direct, containerd, "own")
        shadow_sb, shadow_c = _pod(direct, containerd, "shadow", ShadowMark.load(agent.state_dir))
        with agent, agent.channel() as ch:
            # Hidden from the agent's first answer, before its reconciler has looked at containerd (a kubelet
            # that lists then would kill them), and still once it has.
            hidden = {"sandboxes": {own_sb}, "containers": {own_c}, "container_stats": {own_c},
                      "sandbox_stats": {own_sb}}
            assert _lists(ch) == hidden
            time.sleep(1.5)  # the reconciler's first round, which finds the shadows and leaves them hidden
            assert _lists(ch) == hidden
            assert not any(e.get("event") == "shadows.none" for e in agent.events())
            everything = _lists(direct_ch)  # containerd itself still has both
            assert {shadow_sb, own_sb} <= everything["sandboxes"] and shadow_c in everything["containers"]
            assert 'kind="intercepted",method="ListPodSandbox"' in agent.metrics_text()


def test_without_shadows_lists_stay_pass_through(containerd: Containerd, agent: AgentProcess,
                                                 agent_channel: grpc.Channel) -> None:
    # Until its reconciler has found no shadow, a (re)started agent hides what bears its mark; then it steps aside.
    wait_for(lambda: any(e.get("event") == "shadows.none" for e in agent.events()),
             what="the agent to find no shadow")
    with containerd.channel() as direct_ch:
        own_sb, _ = _pod(cri_grpc.RuntimeServiceStub(direct_ch), containerd, "own")
    assert own_sb in _lists(agent_channel)["sandboxes"]
    text = agent.metrics_text()
    assert 'kind="passthrough",method="ListPodSandbox"' in text
    assert 'kind="intercepted",method="ListPodSandbox"' not in text
