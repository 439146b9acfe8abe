"""What the broker may rely on from any GPU backend, run against every implementation.

``simulated`` always runs. ``nvml`` runs on a host with an NVIDIA driver and is
skipped, naming why, only where NVML says there is no library or no driver.
``nvml-fake-library`` runs the NVML backend's translation code everywhere, over
a stand-in for pynvml that answers the way the driver does (bytes, missing
memory figures, NotSupported); ``nvml-fake-mig`` is the same with the A100's
MIG on and two instances; the tests after the contract pin that translation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from shim.broker.backend import Backend, DeviceNodesUnknown, GpuProcess
from shim.broker.nvml import CONTROL_NODES, NvmlBackend, NvmlError, NvmlUnavailable
from shim.broker.simulated import SimulatedBackend
from tests.broker.fakes import (
    A100,
    GI,
    MIG_A,
    MIG_B,
    T4,
    FakeMig,
    FakeNvml,
    proc,
    sample,
    two_instances,
    write_mig_caps,
)

# -- the contract -------------------------------------------------------------


def make_backend(kind: str, proc_root: Path | None = None) -> Backend:
    """A backend of ``kind``; the stand-ins carry the same small workload on their first device (MIG: instance)."""
    if kind == "simulated":
        sim = SimulatedBackend("2x80Gi,1x40Gi")
        gpu0, gpu1, _ = (d.uuid for d in sim.devices())
        sim.set_process(4242, gpu0, 3 * GI)
        sim.set_process(4243, gpu1, 0)
        sim.set_utilization(gpu0, 42)
        sim.set_process_utilization(4242, 55)
        return sim
    if kind == "nvml":
        try:
            return NvmlBackend()
        except NvmlUnavailable as exc:
            pytest.skip(f"no NVIDIA driver: {exc}")
    fake = FakeNvml()
    fake.graphics["h1"] = [proc(4243, None)]
    if kind == "nvml-fake-mig":
        assert proc_root is not None
        fake.enable_mig(two_instances())
        write_mig_caps(proc_root, 0, 7, 0, 66, 67)
        write_mig_caps(proc_root, 0, 2, 0, 21, 22)
        fake.compute["h0"] = [proc(4242, 3 * GI, 7, 0)]
        # Under MIG the driver keeps no utilization samples; the T4 has them.
        fake.samples["h1"] = [sample(4242, 1_000, 55)]
        return NvmlBackend(library=fake, proc_root=proc_root)
    fake.compute["h0"] = [proc(4242, 3 * GI)]
    fake.samples["h0"] = [sample(4242, 1_000, 55)]
    return NvmlBackend(library=fake)


@pytest.fixture(params=["simulated", "nvml", "nvml-fake-library", "nvml-fake-mig"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    made = make_backend(request.param, tmp_path / "proc")
    yield made
    made.close()


def test_devices_are_indexed_in_order_with_unique_uuids(backend: Backend) -> None:
    devices = backend.devices()
    assert devices, "a backend with no devices has nothing to broker"
    assert [d.index for d in devices] == list(range(len(devices)))
    assert len({d.uuid for d in devices}) == len(devices)
    for d in devices:
        assert d.uuid.startswith(("GPU-", "MIG-")), d.uuid
        assert isinstance(d.uuid, str) and isinstance(d.name, str) and d.name
        assert d.memory_total > 0
        assert isinstance(d.mig_enabled, bool)
        assert d.minor is None or d.minor >= 0


def test_mig_instances_name_a_mig_enabled_gpu_listed_before_them(backend: Backend) -> None:
    devices = backend.devices()
    position = {d.uuid: n for n, d in enumerate(devices)}
    for n, d in enumerate(devices):
        if d.parent_uuid is None:
            assert d.leasable is not d.mig_enabled
            continue
        parent = devices[position[d.parent_uuid]]
        assert parent.mig_enabled and parent.parent_uuid is None and position[parent.uuid] < n
        assert d.leasable and not d.mig_enabled and d.minor == parent.minor
        assert d.memory_total <= parent.memory_total


def test_processes_are_on_known_devices(backend: Backend) -> None:
    uuids = {d.uuid for d in backend.devices()}
    for p in backend.processes():
        assert isinstance(p, GpuProcess)
        assert p.device_uuid in uuids
        assert p.pid > 0 and p.used_memory >= 0
    seen = [(p.pid, p.device_uuid) for p in backend.processes()]
    assert len(seen) == len(set(seen)), "one entry per process per device"


def test_utilization_is_a_percent_per_known_device(backend: Backend) -> None:
    uuids = {d.uuid for d in backend.devices()}
    busy = backend.utilization()
    assert set(busy) <= uuids
    assert all(isinstance(v, int) and 0 <= v <= 100 for v in busy.values())


def test_process_utilization_is_a_percent_per_pid(backend: Backend) -> None:
    per_pid = backend.process_utilization()
    assert all(isinstance(pid, int) and pid > 0 for pid in per_pid)
    assert all(isinstance(v, int) and 0 <= v <= 100 for v in per_pid.values())


def test_device_nodes_are_paths(backend: Backend) -> None:
    for d in backend.devices():
        if d.mig_enabled:  # never leased; its nodes are its instances'
            continue
        nodes = backend.device_nodes(d.uuid)
        assert isinstance(nodes, list) and all(isinstance(n, str) and n.startswith("/dev/") for n in nodes)
    assert all(isinstance(n, str) and n.startswith("/dev/") for n in backend.control_nodes())


def test_device_nodes_of_an_unknown_device_is_refused_by_name(backend: Backend) -> None:
    with pytest.raises(ValueError, match="GPU-00000000-0000-0000-0000-000000000000"):
        backend.device_nodes("GPU-00000000-0000-0000-0000-000000000000")


@pytest.mark.parametrize("kind", ["simulated", "nvml-fake-library", "nvml-fake-mig"])
def test_stand_ins_report_the_workload_they_were_given(kind: str, tmp_path: Path) -> None:
    # The contract checks above are only as good as the data they run over;
    # this pins that the stand-ins really carry some.
    backend = make_backend(kind, tmp_path)
    first = MIG_A if kind == "nvml-fake-mig" else backend.devices()[0].uuid
    assert GpuProcess(4242, first, 3 * GI) in backend.processes()
    assert [p.used_memory for p in backend.processes() if p.pid == 4243] == [0]
    if kind == "nvml-fake-mig":
        assert backend.utilization() == {T4: 7}, "a MIG-enabled GPU reports no utilization; that is tolerated"
    else:
        assert backend.utilization()[first] == 42
    assert backend.process_utilization() == {4242: 55}
    backend.close()


def test_close_can_be_called_twice(backend: Backend) -> None:
    backend.close()
    backend.close()


# -- NVML translation, over the fake library ----------------------------------


@pytest.fixture
def fake() -> FakeNvml:
    return FakeNvml()


@pytest.fixture
def nvml(fake: FakeNvml) -> Iterator[NvmlBackend]:
    backend = NvmlBackend(library=fake)
    yield backend
    backend.close()


def test_nvml_devices_decode_bytes_and_read_mig_not_supported_as_off(nvml: NvmlBackend) -> None:
    a100, t4 = nvml.devices()
    assert (a100.uuid, a100.name, a100.memory_total, a100.minor) == (A100, "NVIDIA A100-SXM4-80GB", 80 * GI, 0)
    assert (t4.uuid, t4.name, t4.mig_enabled, t4.minor) == (T4, "Tesla T4", False, 3)


def test_nvml_mig_mode_reads_current_not_pending(fake: FakeNvml) -> None:
    fake.mig["h0"] = [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    backend = NvmlBackend(library=fake)
    assert [d.mig_enabled for d in backend.devices()] == [False, False], "pending MIG needs a reset to take effect"
    backend.close()
    fake.mig["h0"] = [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE]
    backend = NvmlBackend(library=fake)
    assert [d.mig_enabled for d in backend.devices()] == [True, False]
    backend.close()


def test_nvml_processes_merge_compute_and_graphics(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.compute["h0"] = [proc(10, 2 * GI), proc(11, None)]
    fake.graphics["h0"] = [proc(10, 1 * GI)]
    fake.graphics["h1"] = [proc(10, 5 * GI)]
    assert sorted(nvml.processes(), key=lambda p: (p.pid, p.device_uuid)) == [
        GpuProcess(10, A100, 2 * GI),
        GpuProcess(10, T4, 5 * GI),
        GpuProcess(11, A100, 0),
    ]


def test_nvml_processes_skip_a_list_the_device_does_not_keep(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.compute["h0"] = [proc(10, GI)]
    fake.broken["nvmlDeviceGetGraphicsRunningProcesses"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml.processes() == [GpuProcess(10, A100, GI)]


def test_nvml_process_utilization_reads_only_newer_samples(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.samples["h0"] = [sample(10, 100, 30), sample(10, 200, 60), sample(11, 150, 101)]
    fake.samples["h1"] = [sample(10, 120, 80)]
    assert nvml.process_utilization() == {10: 80}, "busiest device; 101 is the driver's 'not available'"
    assert nvml.process_utilization() == {}, "nothing newer than what was read"
    asked = [args for name, args in fake.calls if name == "nvmlDeviceGetProcessUtilization"]
    assert asked[-2:] == [("h0", 200), ("h1", 120)]
    fake.samples["h0"].append(sample(10, 300, 20))
    assert nvml.process_utilization() == {10: 20}


def test_nvml_process_utilization_tolerates_devices_without_samples(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.broken["nvmlDeviceGetProcessUtilization"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml.process_utilization() == {}


def test_nvml_device_nodes_follow_the_minor_number(nvml: NvmlBackend) -> None:
    assert nvml.device_nodes(T4) == ["/dev/nvidia3"]
    assert set(nvml.control_nodes()) <= set(CONTROL_NODES)


@pytest.mark.parametrize(
    ("code", "unavailable"),
    [
        pytest.param(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, True, id="no-library-is-unavailable"),
        pytest.param(pynvml.NVML_ERROR_DRIVER_NOT_LOADED, True, id="no-driver-is-unavailable"),
        pytest.param(pynvml.NVML_ERROR_NO_PERMISSION, False, id="no-permission-is-a-failure-not-a-skip"),
        pytest.param(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, False, id="version-mismatch-is-a-failure-not-a-skip"),
    ],
)
def test_nvml_init_failure_says_whether_nvml_is_absent(fake: FakeNvml, code: int, unavailable: bool) -> None:
    fake.init_error = code
    with pytest.raises(NvmlError, match="nvmlInit") as err:
        NvmlBackend(library=fake)
    assert isinstance(err.value, NvmlUnavailable) is unavailable
    assert isinstance(err.value.__cause__, pynvml.NVMLError)


def test_nvml_failure_names_the_call_and_device(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.broken["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(NvmlError, match=f"nvmlDeviceGetUtilizationRates on {A100}: GPU is lost"):
        nvml.utilization()


def test_nvml_close_shuts_nvml_down_once(fake: FakeNvml) -> None:
    backend = NvmlBackend(library=fake)
    assert fake.initialised == 1
    backend.close()
    backend.close()
    assert fake.initialised == 0


def test_nvml_tells_mps_clients_from_contexts_of_their_own(fake: FakeNvml) -> None:
    fake.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: fake.mps[h]
    fake.compute["h0"] = [proc(50, GI), proc(60, 2 * GI)]  # 50: the MPS server; 60: a context of its own
    fake.mps["h0"] = [proc(51, GI // 2)]
    backend = NvmlBackend(library=fake)
    try:
        assert sorted(backend.processes(), key=lambda p: p.pid) == [
            GpuProcess(50, A100, GI, mps_client=False), GpuProcess(51, A100, GI // 2, mps_client=True),
            GpuProcess(60, A100, 2 * GI, mps_client=False)]
    finally:
        backend.close()


def test_nvml_without_the_mps_list_says_it_cannot_tell(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.compute["h0"] = [proc(60, GI)]
    assert [p.mps_client for p in nvml.processes()] == [None]


def test_nvml_inventory_reads_driver_and_device_settings(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.compute_mode["h1"] = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    fake.persistence["h1"] = pynvml.NVML_FEATURE_DISABLED
    fake.mig["h0"] = [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    fake.used["h0"] = 3 * GI
    inv = nvml.inventory()
    assert (inv.driver_version, inv.cuda_driver_version) == ("550.54.15", 12040)
    a100, t4 = inv.devices
    assert (a100.device.uuid, a100.memory_used, a100.mig_pending, a100.compute_mode, a100.persistence,
            a100.compute_capability) == (A100, 3 * GI, True, "Default", True, (8, 0))
    assert (t4.device.uuid, t4.mig_pending, t4.compute_mode, t4.persistence, t4.compute_capability) == (
        T4, False, "Exclusive_Process", False, (7, 5))
    reads = {name for name, _ in fake.calls}
    assert not {n for n in reads if "Set" in n}, "an inventory reads, it never sets"


# -- MIG, over the fake library ----------------------------------------------------


@pytest.fixture
def mig_fake(tmp_path: Path) -> FakeNvml:
    fake = FakeNvml()
    fake.enable_mig(two_instances())
    write_mig_caps(tmp_path / "proc", 0, 7, 0, 66, 67)
    write_mig_caps(tmp_path / "proc", 0, 2, 0, 21, 22)
    return fake


@pytest.fixture
def mig(mig_fake: FakeNvml, tmp_path: Path) -> Iterator[NvmlBackend]:
    backend = NvmlBackend(library=mig_fake, proc_root=tmp_path / "proc")
    yield backend
    backend.close()


def test_nvml_lists_a_mig_gpus_instances_after_every_gpu_skipping_empty_slots(mig: NvmlBackend) -> None:
    a100, t4, inst_a, inst_b = mig.devices()
    assert (a100.uuid, a100.index, a100.mig_enabled, a100.leasable) == (A100, 0, True, False)
    assert (t4.uuid, t4.index, t4.mig_enabled, t4.minor) == (T4, 1, False, 3)
    assert (inst_a.uuid, inst_a.index, inst_a.name, inst_a.memory_total, inst_a.minor, inst_a.parent_uuid) == (
        MIG_A, 2, "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10 * GI, 0, A100)
    assert (inst_b.uuid, inst_b.index, inst_b.memory_total, inst_b.parent_uuid) == (MIG_B, 3, 40 * GI, A100)
    assert [(i.device.uuid, i.gpu_instance_id, i.compute_instance_id, i.multiprocessors)
            for i in mig.mig_instances(A100)] == [(MIG_A, 7, 0, 14), (MIG_B, 2, 0, 42)]
    assert mig.mig_instances(T4) == []


def test_nvml_mig_instance_without_attributes_has_no_sm_count(tmp_path: Path) -> None:
    fake = FakeNvml()
    fake.enable_mig({0: FakeMig(MIG_A, 1, 0, 20 * GI, sms=None)})
    backend = NvmlBackend(library=fake)
    try:
        assert [i.multiprocessors for i in backend.mig_instances(A100)] == [None]
    finally:
        backend.close()


def test_nvml_mig_gpu_with_no_instances_is_listed_and_leases_nothing(fake: FakeNvml) -> None:
    fake.enable_mig({})
    backend = NvmlBackend(library=fake)
    try:
        assert [(d.uuid, d.mig_enabled, d.leasable) for d in backend.devices()] == [(A100, True, False),
                                                                                   (T4, False, True)]
        assert backend.mig_instances(A100) == []
        slots = [args[1] for name, args in fake.calls if name == "nvmlDeviceGetMigDeviceHandleByIndex"]
        assert slots == list(range(7)), "every slot looked at"
    finally:
        backend.close()


def test_nvml_processes_on_a_mig_gpu_are_on_their_instances(mig_fake: FakeNvml, mig: NvmlBackend) -> None:
    mig_fake.nvmlDeviceGetMPSComputeRunningProcesses = lambda h: mig_fake.mps[h]
    mig_fake.compute["h0"] = [proc(10, GI, 7, 0), proc(11, 2 * GI, 2, 0), proc(12, GI, 5, 0)]
    mig_fake.mps["h0"] = [proc(13, GI // 2, 2, 0)]
    assert sorted(mig.processes(), key=lambda p: p.pid) == [
        GpuProcess(10, MIG_A, GI, mps_client=False), GpuProcess(11, MIG_B, 2 * GI, mps_client=False),
        # An instance the backend did not see at start: left on the GPU, which no lease holds.
        GpuProcess(12, A100, GI, mps_client=False), GpuProcess(13, MIG_B, GI // 2, mps_client=True)]


def test_nvml_processes_without_instance_ids_stay_on_the_gpu(mig_fake: FakeNvml, mig: NvmlBackend) -> None:
    from types import SimpleNamespace

    mig_fake.compute["h0"] = [SimpleNamespace(pid=20, usedGpuMemory=GI)]  # an older driver's structure
    assert mig.processes() == [GpuProcess(20, A100, GI)]


def test_nvml_mig_utilization_not_supported_is_tolerated(mig_fake: FakeNvml, mig: NvmlBackend) -> None:
    mig_fake.samples["h1"] = [sample(10, 100, 30)]
    assert mig.utilization() == {T4: 7}
    assert mig.process_utilization() == {10: 30}


def test_nvml_mig_instance_device_nodes_are_the_gpus_and_its_capabilities(mig: NvmlBackend) -> None:
    assert mig.device_nodes(MIG_A) == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap66",
                                       "/dev/nvidia-caps/nvidia-cap67"]
    assert mig.device_nodes(MIG_B) == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap21",
                                       "/dev/nvidia-caps/nvidia-cap22"]
    with pytest.raises(ValueError, match="MIG-00000000"):
        mig.device_nodes("MIG-00000000-0000-0000-0000-000000000000")


@pytest.mark.parametrize("missing", ["gi7/access", "gi7/ci0/access"])
def test_nvml_mig_capability_file_missing_is_named(mig: NvmlBackend, tmp_path: Path, missing: str) -> None:
    path = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig" / missing
    path.unlink()
    with pytest.raises(DeviceNodesUnknown, match=f"{MIG_A}: cannot read {path}"):
        mig.device_nodes(MIG_A)


def test_nvml_mig_capability_file_without_a_minor_is_named(mig: NvmlBackend, tmp_path: Path) -> None:
    path = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig/gi2/ci0/access"
    path.write_text("DeviceFileMode: 292\n")
    with pytest.raises(DeviceNodesUnknown, match=f"{path} has no 'DeviceFileMinor: N' line"):
        mig.device_nodes(MIG_B)


def test_nvml_mig_read_only(mig_fake: FakeNvml, mig: NvmlBackend) -> None:
    mig.devices()
    mig.processes()
    mig.inventory()
    mig.device_nodes(MIG_A)
    assert not [name for name, _ in mig_fake.calls if "Set" in name or "Create" in name or "Destroy" in name]


def test_nvml_inventory_lists_a_mig_gpus_instances_under_it(mig_fake: FakeNvml, mig: NvmlBackend) -> None:
    mig_fake.instances["h0"][2].used = 3 * GI
    a100, t4 = mig.inventory().devices
    assert (a100.device.uuid, a100.device.mig_enabled, a100.mig_pending) == (A100, True, True)
    assert [(i.instance.device.uuid, i.memory_used) for i in a100.instances] == [(MIG_A, 0), (MIG_B, 3 * GI)]
    assert (t4.device.uuid, t4.instances) == (T4, ())
