"""``rewrite_for_lease``: a GPU container's request is edited so it sees exactly its leased devices.

Whatever the device plugin gave the container (device nodes, CDI devices,
visible-devices variables) is replaced by what the broker leased; everything
unrelated to GPUs is left as the user wrote it.
"""

from __future__ import annotations

import pytest
from cri_api.v1 import api_pb2 as cri

from shim._pb import broker_pb2 as pb
from shim.cri.verbs.create_container import rewrite_for_lease

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
