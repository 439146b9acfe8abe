"""CreateContainer: the containers of opted-in pods are classified, placed, leased and recorded; others pass.

``rewrite_for_lease`` first: a GPU container's request is edited so it sees
exactly its leased devices (device nodes, CDI devices, visible-devices
variables are replaced by what the broker leased; everything unrelated to
GPUs is left as the user wrote it). Then the verb as kubelet sees it, against
the recording containerd, the real broker over simulated GPUs and a fake mesh.
"""

from __future__ import annotations

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim._pb import broker_pb2 as pb
from shim.core.placement import (
    LEASE_ANNOTATION,
    PLACEMENT_ANNOTATION,
    PLACEMENT_REASON_ANNOTATION,
    PlacementReason,
    PlacementState,
)
from shim.cri.verbs import create_container
from shim.cri.verbs.create_container import rewrite_for_lease
from shim.errors import BadAnnotation, BrokerUnavailable, CreateInProgress, MalformedRequest, UpstreamError
from shim.origin.settings import OriginSettings
from tests.cri.verbs.fakes import OTHER_SANDBOX, ctx, opt_in

U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-00000000-0000-4000-8000-000000000001"
MPS_ENV = {"CUDA_MPS_PIPE_DIRECTORY": "/run/weft-mps", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}


def config(devices=(), cdi=(), envs=(), mounts=(), annotations=None) -> cri.ContainerConfig:
    c = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="app"), annotations=annotations or {})
    for host in devices:
        c.devices.add(container_path=host, host_path=host, permissions="rwm")
    for name in cdi:
        c.CDI_devices.add(name=name)
    for key, value in envs:
        c.envs.add(key=key, value=value)
    for host, ctr in mounts:
        c.mounts.add(host_path=host, container_path=ctr)
    return c


def lease(uuids=(U1,), nodes=(), env=None, mounts=()) -> pb.Lease:
    return pb.Lease(lease_id="lease-0123456789abcdef", device_uuids=list(uuids), device_nodes=list(nodes),
                    env=env or {}, mounts=[pb.Mount(host_path=h, container_path=c, readonly=r) for h, c, r in mounts])


def envs_of(c: cri.ContainerConfig) -> list[tuple[str, str]]:
    return [(e.key, e.value) for e in c.envs]


# -- device nodes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("before", "leased", "after"),
    [
        pytest.param(["/dev/nvidia0"], ["/dev/nvidia1"], ["/dev/nvidia1"], id="gpu-node-swapped-for-the-leased-one"),
        pytest.param(["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                      "/dev/nvidia-modeset", "/dev/nvidia-caps/nvidia-cap1"],
                     ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"],
                     ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"],
                     id="every-nvidia-node-replaced-control-nodes-from-the-lease"),
        pytest.param(["/dev/fuse", "/dev/nvidia0", "/dev/net/tun"], ["/dev/nvidia1"],
                     ["/dev/fuse", "/dev/net/tun", "/dev/nvidia1"], id="other-devices-kept"),
        pytest.param(["/dev/nvidia0", "/dev/nvidia1"], [], [], id="lease-without-nodes-removes-gpu-nodes"),
        pytest.param([], ["/dev/nvidia1", "/dev/nvidiactl"], ["/dev/nvidia1", "/dev/nvidiactl"],
                     id="nodes-added-when-the-request-had-none"),
    ],
)
def test_device_nodes_become_the_leased_ones(before: list[str], leased: list[str], after: list[str]) -> None:
    c = config(devices=before)
    rewrite_for_lease(c, lease(nodes=leased))
    assert [d.host_path for d in c.devices] == after


def test_kept_device_is_unchanged_and_leased_node_is_read_write() -> None:
    c = cri.ContainerConfig()
    c.devices.add(container_path="/dev/my-fuse", host_path="/dev/fuse", permissions="r")
    c.devices.add(container_path="/dev/nvidia0", host_path="/dev/nvidia0", permissions="rwm")
    rewrite_for_lease(c, lease(nodes=["/dev/nvidia1"]))
    assert [(d.container_path, d.host_path, d.permissions) for d in c.devices] == [
        ("/dev/my-fuse", "/dev/fuse", "r"), ("/dev/nvidia1", "/dev/nvidia1", "rw")]


# -- CDI devices -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("before", "uuids", "after"),
    [
        pytest.param(["nvidia.com/gpu=0"], [U1], [f"nvidia.com/gpu={U1}"], id="cdi-index-becomes-leased-uuid"),
        pytest.param(["nvidia.com/gpu=all"], [U0, U1], [f"nvidia.com/gpu={U0}", f"nvidia.com/gpu={U1}"],
                     id="cdi-all-becomes-each-leased-uuid"),
        pytest.param(["vendor.com/fpga=1", "nvidia.com/gpu=0"], [U1], ["vendor.com/fpga=1", f"nvidia.com/gpu={U1}"],
                     id="non-gpu-cdi-kept"),
        pytest.param(["vendor.com/fpga=1"], [U1], ["vendor.com/fpga=1"], id="no-gpu-cdi-means-none-added"),
        pytest.param([], [U1], [], id="request-without-cdi-gets-none"),
    ],
)
def test_cdi_devices_name_the_leased_uuids_only_if_cdi_was_used(before: list[str], uuids: list[str],
                                                                after: list[str]) -> None:
    c = config(cdi=before)
    rewrite_for_lease(c, lease(uuids=uuids))
    assert [d.name for d in c.CDI_devices] == after


# -- environment ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("before", "uuids"),
    [
        pytest.param([("NVIDIA_VISIBLE_DEVICES", "0")], [U1], id="index-replaced-by-uuid"),
        pytest.param([("NVIDIA_VISIBLE_DEVICES", "all"), ("CUDA_VISIBLE_DEVICES", "0,1")], [U0, U1],
                     id="both-variables-replaced-comma-joined"),
        pytest.param([], [U1], id="set-when-absent"),
        pytest.param([("NVIDIA_VISIBLE_DEVICES", "0"), ("NVIDIA_VISIBLE_DEVICES", "1")], [U1],
                     id="duplicate-entries-collapse-to-one"),
    ],
)
def test_visible_devices_name_exactly_the_leased_uuids(before: list[tuple[str, str]], uuids: list[str]) -> None:
    c = config(envs=before)
    rewrite_for_lease(c, lease(uuids=uuids))
    env = envs_of(c)
    for var in ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        assert [v for k, v in env if k == var] == [",".join(uuids)]


def test_other_env_kept_in_order_and_lease_env_added() -> None:
    c = config(envs=[("PATH", "/bin"), ("NVIDIA_VISIBLE_DEVICES", "0"), ("MODEL", "llama")])
    rewrite_for_lease(c, lease(env=MPS_ENV))
    env = envs_of(c)
    assert env[:2] == [("PATH", "/bin"), ("MODEL", "llama")]
    assert dict(env) == {"PATH": "/bin", "MODEL": "llama", "NVIDIA_VISIBLE_DEVICES": U1,
                         "CUDA_VISIBLE_DEVICES": U1, **MPS_ENV}
    assert len(env) == len(dict(env)), "each variable appears once"


def test_lease_env_replaces_a_users_value_of_the_same_variable() -> None:
    c = config(envs=[("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")])
    rewrite_for_lease(c, lease(env=MPS_ENV))
    assert [v for k, v in envs_of(c) if k == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == ["50"]


# -- mounts and annotation ------------------------------------------------------------------
def test_lease_mounts_added_after_the_users_mounts() -> None:
    c = config(mounts=[("/data", "/data")])
    rewrite_for_lease(c, lease(mounts=[("/run/weft/mps/GPU-1", "/run/weft-mps", False)]))
    assert [(m.host_path, m.container_path, m.readonly) for m in c.mounts] == [
        ("/data", "/data", False), ("/run/weft/mps/GPU-1", "/run/weft-mps", False)]


def test_lease_annotation_set_and_other_annotations_kept() -> None:
    c = config(annotations={"io.kubernetes.container.name": "app"})
    rewrite_for_lease(c, lease())
    assert dict(c.annotations) == {"io.kubernetes.container.name": "app", "weft.io/lease": "lease-0123456789abcdef"}


def test_rewritten_config_survives_serialisation() -> None:
    c = config(devices=["/dev/nvidia0"], cdi=["nvidia.com/gpu=0"], envs=[("NVIDIA_VISIBLE_DEVICES", "0")])
    rewrite_for_lease(c, lease(nodes=["/dev/nvidia1"], env=MPS_ENV, mounts=[("/a", "/b", True)]))
    assert cri.ContainerConfig.FromString(c.SerializeToString()) == c


# -- no lease, no GPU --------------------------------------------------------------------
# Under the weft handler a container may run through NVIDIA's runtime (containerd's default on a GPU Operator's
# node): one that holds no lease must ask it for nothing, whatever its image's environment says.
def test_a_container_without_a_lease_asks_for_no_gpu_by_any_way_the_runtime_reads() -> None:
    c = config(devices=["/dev/nvidia0", "/dev/nvidiactl", "/dev/fuse"], cdi=["nvidia.com/gpu=all", "vendor.com/net=a"],
               envs=[("NVIDIA_VISIBLE_DEVICES", "all"), ("HOME", "/root")],
               mounts=[("/dev/null", "/var/run/nvidia-container-devices/all"), ("/data", "/data")],
               annotations={"cdi.k8s.io/nvidia-device-plugin_0": "nvidia.com/gpu=0", "team": "a"})
    taken = create_container.rewrite_without_gpus(c)
    assert [d.host_path for d in c.devices] == ["/dev/fuse"]
    assert [d.name for d in c.CDI_devices] == ["vendor.com/net=a"]
    assert [m.container_path for m in c.mounts] == ["/data"]
    assert dict(c.annotations) == {"team": "a"}
    assert envs_of(c) == [("HOME", "/root"), ("NVIDIA_VISIBLE_DEVICES", "void")]
    assert set(taken) == {"/dev/nvidia0", "/dev/nvidiactl", "nvidia.com/gpu=all",
                          "/var/run/nvidia-container-devices/all", "cdi.k8s.io/nvidia-device-plugin_0",
                          "NVIDIA_VISIBLE_DEVICES=all"}


def test_a_plain_container_without_a_lease_gets_only_the_void_over_its_image_s_variable() -> None:
    """A CUDA base image sets NVIDIA_VISIBLE_DEVICES=all in its own environment, which the request does not show."""
    c = config(envs=[("PORT", "9000")])
    assert create_container.rewrite_without_gpus(c) == []
    assert envs_of(c) == [("PORT", "9000"), ("NVIDIA_VISIBLE_DEVICES", "void")]


def test_a_claims_cdi_devices_go_from_a_container_that_holds_no_lease() -> None:
    c = config(cdi=["gpu.weft.test/claim=abc-gpu-0"])
    create_container.rewrite_without_gpus(c, {"gpu.weft.test/claim=abc-gpu-0": frozenset({U0})})
    assert list(c.CDI_devices) == []


def test_a_leased_container_s_device_list_mounts_name_its_lease_alone_and_cdi_annotations_go() -> None:
    c = config(mounts=[("/dev/null", f"/var/run/nvidia-container-devices/{U0}"), ("/data", "/data")],
               annotations={"cdi.k8s.io/nvidia-device-plugin_0": f"nvidia.com/gpu={U0}"})
    rewrite_for_lease(c, lease(uuids=[U1]))
    assert [(m.host_path, m.container_path) for m in c.mounts] == [
        ("/data", "/data"), ("/dev/null", f"/var/run/nvidia-container-devices/{U1}")]
    assert "cdi.k8s.io/nvidia-device-plugin_0" not in c.annotations


# == the verb ========================================================================================
# What kubelet sees of CreateContainer: a pod that did not opt in is containerd's alone; a container of an
# opted-in pod is classified, placed, leased and recorded before kubelet gets its ID, and a failure on the
# way leaves no lease and no record behind.

SANDBOX_ID = "5b" * 32
CONTAINER_ID = "c1" * 32
KEY = f"{SANDBOX_ID}/app/0"


def create_request(sandbox_id: str = SANDBOX_ID, devices=(), annotations=None, pod_annotations=None,
                   privileged: bool = False) -> cri.CreateContainerRequest:
    c = config(devices=devices, annotations=annotations)
    c.image.image = "busybox:1.36"
    c.log_path = "app/0.log"
    res = c.linux.resources
    res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100_000, 50_000, 1 << 30
    c.linux.security_context.privileged = privileged
    sandbox = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="infer", namespace="default", uid="uid-1"),
                                   annotations=pod_annotations or {}, log_directory="/var/log/pods/infer")
    return cri.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=c, sandbox_config=sandbox)


def unreadable_request(sandbox_id: str) -> bytes:
    """A request protobuf refuses (invalid UTF-8 in the config's working_dir) that containerd would take."""
    working_dir = cri.ContainerConfig.DESCRIPTOR.fields_by_name["working_dir"].number
    config_field = cri.CreateContainerRequest.DESCRIPTOR.fields_by_name["config"].number
    inner = bytes([working_dir << 3 | 2, 2]) + b"\xff\xfe"
    return (cri.CreateContainerRequest(pod_sandbox_id=sandbox_id).SerializeToString()
            + bytes([config_field << 3 | 2, len(inner)]) + inner)


def sent_config(containerd) -> cri.ContainerConfig:
    return cri.CreateContainerRequest.FromString(containerd.only_request("CreateContainer")).config


@pytest.fixture
def create(fabric, containerd):
    containerd.answer("CreateContainer", cri.CreateContainerResponse(container_id=CONTAINER_ID))
    route = create_container.route(fabric)
    opt_in(fabric, SANDBOX_ID)
    return route


def test_a_container_of_a_pod_that_did_not_opt_in_passes_byte_for_byte(fabric, containerd, create) -> None:
    body = create_request(OTHER_SANDBOX, devices=["/dev/nvidia0"]).SerializeToString()
    answer = create.handle(body, ctx(("x-request-id", "5")))
    assert containerd.only_request("CreateContainer") == body
    assert containerd.calls[0].metadata["x-request-id"] == "5"
    assert cri.CreateContainerResponse.FromString(answer).container_id == CONTAINER_ID
    assert fabric.store.placements() == []


def test_a_cpu_container_of_an_opted_in_pod_is_placed_here_and_recorded_before_kubelet_gets_its_id(
        fabric, containerd, create) -> None:
    answer = create.handle(create_request().SerializeToString(), ctx())
    assert cri.CreateContainerResponse.FromString(answer).container_id == CONTAINER_ID
    sent = sent_config(containerd)
    assert sent.annotations[PLACEMENT_ANNOTATION] == "local"
    assert sent.annotations[PLACEMENT_REASON_ANNOTATION] == PlacementReason.NO_MESH.value
    assert sent.image.image == "busybox:1.36" and sent.linux.resources.cpu_quota == 50_000, "the rest as kubelet sent"
    rec = fabric.store.placement(CONTAINER_ID)
    assert (rec.key, rec.state, rec.stage, rec.placement, rec.lease_id) == (
        KEY, PlacementState.CREATED, "cpu", "local", "")
    assert fabric.metrics.registry.get_sample_value(
        "weft_placements_total", {"stage": "cpu", "placement": "local", "reason": "no-mesh"}) == 1


def test_a_lease_annotation_the_user_set_never_reaches_a_cpu_container(containerd, create) -> None:
    create.handle(create_request(annotations={LEASE_ANNOTATION: "someone-elses-lease"}).SerializeToString(), ctx())
    assert LEASE_ANNOTATION not in sent_config(containerd).annotations


def test_a_cpu_container_of_an_opted_in_pod_is_sent_with_its_gpus_voided(containerd, create) -> None:
    req = create_request(pod_annotations={"weft.io/stage.app": "cpu"}, devices=["/dev/nvidia0"])
    req.config.envs.add(key="NVIDIA_VISIBLE_DEVICES", value="all")
    create.handle(req.SerializeToString(), ctx())
    sent = sent_config(containerd)
    assert [(e.key, e.value) for e in sent.envs] == [("NVIDIA_VISIBLE_DEVICES", "void")]
    assert list(sent.devices) == []


def test_a_gpu_container_gets_a_lease_and_sees_only_its_leased_device(fabric, containerd, broker, create) -> None:
    create.handle(create_request(devices=["/dev/nvidia1", "/dev/nvidiactl"]).SerializeToString(), ctx())
    [lease] = broker.leases()
    assert lease.key == KEY and lease.device_uuids == (broker.devices[1].uuid,), "the device the plugin gave"
    sent = sent_config(containerd)
    assert sent.annotations[LEASE_ANNOTATION] == lease.lease_id
    assert sent.annotations[PLACEMENT_REASON_ANNOTATION] == PlacementReason.GPU_LEASED.value
    assert [e.value for e in sent.envs if e.key == "NVIDIA_VISIBLE_DEVICES"] == [lease.device_uuids[0]]
    assert [d.host_path for d in sent.devices] == list(lease.device_nodes), "the plugin's nodes are gone"
    assert fabric.store.placement(CONTAINER_ID).lease_id == lease.lease_id


def _kai_request(broker, pod_annotations: dict[str, str], device: int = 1) -> cri.CreateContainerRequest:
    """A container as KAI's binder leaves it: the reserved GPU's UUID and the portion, from its ConfigMap."""
    req = create_request(pod_annotations={"received-resource-type": "Fraction", **pod_annotations})
    req.config.envs.add(key="NVIDIA_VISIBLE_DEVICES", value=broker.devices[device].uuid)
    req.config.envs.add(key="GPU_PORTION", value="0.50")
    return req


def test_a_kai_fraction_is_leased_on_the_gpu_kai_chose_with_its_memory_as_a_hard_limit(
        fabric, containerd, broker, create) -> None:
    create.handle(_kai_request(broker, {"gpu-fraction": "0.5"}).SerializeToString(), ctx())
    [lease] = broker.leases()
    assert lease.device_uuids == (broker.devices[1].uuid,), "the GPU KAI's binder reserved, not the emptiest"
    assert (lease.memory_bytes, lease.compute_percent, lease.shared) == (40 << 30, 50, True)
    rec = fabric.store.placement(CONTAINER_ID)
    assert rec.reason == "gpu-leased" and "share kai-fraction: gpu-fraction=0.5" in rec.detail


def test_weft_s_own_share_wins_over_kai_s(fabric, containerd, broker, create) -> None:
    create.handle(_kai_request(broker, {"gpu-fraction": "0.5", "weft.io/gpu-memory.app": "10Gi"}).SerializeToString(),
                  ctx())
    [lease] = broker.leases()
    assert lease.memory_bytes == 10 << 30 and lease.device_uuids == (broker.devices[1].uuid,)
    assert "share weft-annotation" in fabric.store.placement(CONTAINER_ID).detail


@pytest.mark.parametrize("annotations", [{"gpu-fraction": "1.5"}, {"gpu-memory": "90000"}], ids=["fraction", "memory"])
def test_a_kai_share_no_lease_can_honour_is_refused_naming_the_pod_and_leases_nothing(
        fabric, containerd, broker, create, annotations: dict[str, str]) -> None:
    with pytest.raises(BadAnnotation) as err:
        create.handle(_kai_request(broker, annotations).SerializeToString(), ctx())
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "pod default/infer" in err.value.message
    assert broker.leases() == [] and containerd.calls == [] and fabric.store.placements() == []


def test_a_gpu_container_without_a_broker_is_unavailable_and_containerd_is_not_asked(fabric, containerd,
                                                                                    create) -> None:
    with pytest.raises(BrokerUnavailable) as err:
        create.handle(create_request(devices=["/dev/nvidia0"]).SerializeToString(), ctx())
    assert err.value.code is grpc.StatusCode.UNAVAILABLE
    assert containerd.calls == [] and fabric.store.placements() == []


def test_a_create_containerd_refuses_releases_the_lease_and_leaves_no_record(fabric, containerd, broker,
                                                                           create) -> None:
    containerd.refuse("CreateContainer", grpc.StatusCode.NOT_FOUND, "image not found")
    with pytest.raises(UpstreamError) as err:
        create.handle(create_request(devices=["/dev/nvidia0"]).SerializeToString(), ctx())
    assert (err.value.code, err.value.message) == (grpc.StatusCode.NOT_FOUND, "image not found")
    assert broker.leases() == [] and fabric.store.placements() == []


def test_a_retry_of_a_create_that_succeeded_is_containerds_to_answer_and_keeps_the_lease(fabric, containerd,
                                                                                        broker, create) -> None:
    body = create_request(devices=["/dev/nvidia0"]).SerializeToString()
    create.handle(body, ctx())
    [lease] = broker.leases()
    containerd.refuse("CreateContainer", grpc.StatusCode.ALREADY_EXISTS, 'name "app" is reserved')
    with pytest.raises(UpstreamError) as err:
        create.handle(body, ctx())
    assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    assert broker.leases() == [lease] and fabric.store.placement(CONTAINER_ID).lease_id == lease.lease_id


def test_a_create_already_in_progress_for_the_same_container_is_aborted(fabric, containerd, create) -> None:
    assert fabric.begin(KEY)
    with pytest.raises(CreateInProgress) as err:
        create.handle(create_request().SerializeToString(), ctx())
    assert err.value.code is grpc.StatusCode.ABORTED and "default/infer/app" in err.value.message
    assert containerd.calls == []


def test_a_bad_stage_annotation_is_invalid_argument(fabric, containerd, create) -> None:
    body = create_request(pod_annotations={"weft.io/stage.app": "quantum"}).SerializeToString()
    with pytest.raises(BadAnnotation) as err:
        create.handle(body, ctx())
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "weft.io/stage.app" in err.value.message
    assert containerd.calls == []


def test_an_unreadable_request_in_an_opted_in_pod_is_refused(fabric, containerd, create) -> None:
    with pytest.raises(MalformedRequest) as err:
        create.handle(unreadable_request(SANDBOX_ID), ctx())
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert containerd.calls == [], "never created without weft placing it"


def test_an_unreadable_request_in_any_other_pod_is_containerds_to_answer(containerd, create) -> None:
    body = unreadable_request(OTHER_SANDBOX)
    create.handle(body, ctx())
    assert containerd.only_request("CreateContainer") == body


# -- on a node with a mesh ----------------------------------------------------------------------------
@pytest.fixture
def meshed(fabric, mesh, tmp_path):
    fabric.origin.settings = OriginSettings(pods_dir=str(tmp_path / "pods"))
    return mesh


def test_a_cpu_container_is_rerouted_to_a_host_and_kubelet_gets_a_virtual_id(fabric, containerd, meshed,
                                                                            create) -> None:
    answer = create.handle(create_request().SerializeToString(), ctx())
    vid = cri.CreateContainerResponse.FromString(answer).container_id
    assert len(vid) == 64 and vid != CONTAINER_ID
    assert containerd.calls == [], "this node's containerd never has it"
    assert meshed.hosts["cpu-1"].methods() == ["Admit", "RunShadow"]
    r = fabric.remotes.get(vid)
    assert r is not None and (r.node, r.key) == ("cpu-1", KEY)
    assert fabric.store.placement(vid).placement == "remote:cpu-1"


def test_a_retry_of_a_rerouted_create_gets_the_same_virtual_id_without_asking_again(fabric, meshed,
                                                                                    create) -> None:
    body = create_request().SerializeToString()
    first = create.handle(body, ctx())
    assert create.handle(body, ctx()) == first
    assert meshed.hosts["cpu-1"].methods() == ["Admit", "RunShadow"]


def test_an_unsafe_container_stays_here_with_the_reason_shown(fabric, containerd, meshed, create) -> None:
    create.handle(create_request(privileged=True).SerializeToString(), ctx())
    sent = sent_config(containerd)
    assert sent.annotations[PLACEMENT_ANNOTATION] == "local"
    assert sent.annotations[PLACEMENT_REASON_ANNOTATION] == PlacementReason.UNSAFE.value
    assert meshed.hosts["cpu-1"].calls == []
