"""What the broker may rely on from any GPU backend, run against every implementation.

``simulated`` always runs. ``nvml`` runs on a host with an NVIDIA driver and is
skipped, naming why, only where NVML says there is no library or no driver.
``nvml-fake-library`` runs the NVML backend's translation code everywhere, over
a stand-in for pynvml that answers the way the driver does (bytes, missing
memory figures, NotSupported); the tests after the contract pin that translation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest

from shim.broker.backend import Backend, GpuProcess
from shim.broker.nvml import CONTROL_NODES, NvmlBackend, NvmlError, NvmlUnavailable
from shim.broker.simulated import SimulatedBackend
from tests.broker.fakes import A100, GI, T4, FakeNvml, proc, sample

# -- the contract -------------------------------------------------------------


def make_backend(kind: str) -> Backend:
    """A backend of ``kind``; the two stand-ins carry the same small workload on their first device."""
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
    fake.compute["h0"] = [proc(4242, 3 * GI)]
    fake.graphics["h1"] = [proc(4243, None)]
    fake.samples["h0"] = [sample(4242, 1_000, 55)]
    return NvmlBackend(library=fake)


@pytest.fixture(params=["simulated", "nvml", "nvml-fake-library"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    made = make_backend(request.param)
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
        nodes = backend.device_nodes(d.uuid)
        assert isinstance(nodes, list) and all(isinstance(n, str) and n.startswith("/dev/") for n in nodes)
    assert all(isinstance(n, str) and n.startswith("/dev/") for n in backend.control_nodes())


def test_device_nodes_of_an_unknown_device_is_refused_by_name(backend: Backend) -> None:
    with pytest.raises(ValueError, match="GPU-00000000-0000-0000-0000-000000000000"):
        backend.device_nodes("GPU-00000000-0000-0000-0000-000000000000")


@pytest.mark.parametrize("kind", ["simulated", "nvml-fake-library"])
def test_stand_ins_report_the_workload_they_were_given(kind: str) -> None:
    # The contract checks above are only as good as the data they run over;
    # this pins that the stand-ins really carry some.
    backend = make_backend(kind)
    first = backend.devices()[0].uuid
    assert GpuProcess(4242, first, 3 * GI) in backend.processes()
    assert [p.used_memory for p in backend.processes() if p.pid == 4243] == [0]
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


def test_nvml_mig_mode_reads_current_not_pending(fake: FakeNvml, nvml: NvmlBackend) -> None:
    fake.nvmlDeviceGetMigMode = lambda h: [pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    assert [d.mig_enabled for d in nvml.devices()] == [False, False], "pending MIG needs a reset to take effect"
    fake.nvmlDeviceGetMigMode = lambda h: [pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_ENABLE]
    assert [d.mig_enabled for d in nvml.devices()] == [True, True]


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
