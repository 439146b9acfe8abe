"""A pod cannot hide itself from kubelet by carrying the labels of a shadow.

On a host that runs shadows, the agent leaves them out of what kubelet
lists. A tenant's pod labelled ``weft.io/origin-node`` (any pod may carry any
label) must stay in kubelet's view, while the host's real shadows stay
hidden; so must it on a node that hosts nothing (no mesh at all).
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd


def test_a_pod_with_a_shadows_labels_stays_in_kubelets_view(mesh: MeshHost) -> None:
    key = "origin-sb-hide/tokenize/0"
    with mesh.channel("gpu-1") as peer, mesh.agent.channel() as kubelet:
        rt = cri_grpc.RuntimeServiceStub(kubelet)
        state = pb.ShadowState.FromString(peer.unary_unary(MESH + "RunShadow")(
            run_shadow_request(mesh.containerd, "gpu-1", key, sandbox="origin-sb-hide").SerializeToString(),
            timeout=120))
        sandbox = pods.sandbox_config("hiding", mesh.containerd.pod_log_dir, cgroup_parent=mesh.containerd.cgroup_root,
                                      labels={"weft.io/origin-node": "gpu-1", "weft.io/shadow-mark": "0" * 40})
        tenant = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox), timeout=120).pod_sandbox_id
        try:
            listed = {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items}
            stats = {s.attributes.id for s in rt.ListPodSandboxStats(cri.ListPodSandboxStatsRequest(),
                                                                       timeout=30).stats}
        finally:
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=tenant), timeout=60)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=tenant), timeout=60)
            peer.unary_unary(MESH + "RemoveShadow")(pb.ShadowRef(origin_node="gpu-1", key=key).SerializeToString(),
                                                    timeout=120)
    assert tenant in listed and tenant in stats
    assert state.shadow_sandbox_id not in listed and state.shadow_sandbox_id not in stats




def test_on_a_node_that_hosts_nothing_a_pod_with_a_shadows_labels_stays_in_view(containerd: Containerd,
                                                                                agent: AgentProcess) -> None:
    """The agent there notes at its start whether containerd holds shadows, and hides only what bears its mark."""
    sandbox = pods.sandbox_config("hiding-elsewhere", containerd.pod_log_dir, cgroup_parent=containerd.cgroup_root,
                                  labels={"weft.io/origin-node": "gpu-1", "weft.io/shadow-mark": "0" * 40})
    with agent.channel() as ch:
        tenant = cri_grpc.RuntimeServiceStub(ch).RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox),
                                                               timeout=120).pod_sandbox_id
    try:
        agent.stop()
        agent.start()  # finds the labelled sandbox in containerd as it starts
        with agent.channel() as ch:
            rt = cri_grpc.RuntimeServiceStub(ch)
            listed = {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items}
            stats = {s.attributes.id for s in rt.ListPodSandboxStats(cri.ListPodSandboxStatsRequest(),
                                                                       timeout=30).stats}
    finally:
        with agent.channel() as ch:
            rt = cri_grpc.RuntimeServiceStub(ch)
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=tenant), timeout=60)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=tenant), timeout=60)
    assert tenant in listed and tenant in stats
