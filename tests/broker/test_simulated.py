"""The simulated backend: what --simulated-devices accepts, and what tests drive shows up."""

import pytest

from shim.broker.backend import GpuProcess
from shim.broker.simulated import SimulatedBackend, parse_spec

GI = 1 << 30


@pytest.mark.parametrize(
    ("spec", "sizes"),
    [
        pytest.param("1x80Gi", [80 * GI], id="kubernetes-suffix"),
        pytest.param("2x80GiB", [80 * GI, 80 * GI], id="trailing-B-means-the-same"),
        pytest.param("2x80GiB,1x40GiB", [80 * GI, 80 * GI, 40 * GI], id="mixed-devices-keep-spec-order"),
        pytest.param("1x40Gi,1x80Gi", [40 * GI, 80 * GI], id="smaller-first-stays-first"),
        pytest.param(" 1 x 512Mi , 1X1Ti ", [512 << 20, 1 << 40], id="spaces-and-capital-X"),
        pytest.param("1x16Ki", [16 << 10], id="kibibytes"),
        pytest.param("3x1024", [1024] * 3, id="plain-bytes"),
    ],
)
def test_spec_gives_device_sizes_in_order(spec: str, sizes: list[int]) -> None:
    assert parse_spec(spec) == sizes


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        pytest.param("2x80XB", "'2x80XB'", id="unknown-unit"),
        pytest.param("2x80GB", "'2x80GB'", id="decimal-unit-refused"),
        pytest.param("2x80GiB,1y40GiB", "'1y40GiB'", id="names-the-bad-part-only"),
        pytest.param("80Gi", "'80Gi'", id="missing-count"),
        pytest.param("2x", "'2x'", id="missing-size"),
        pytest.param("0x80Gi", "count of zero", id="zero-devices"),
        pytest.param("1x0Gi", "size of zero", id="zero-bytes"),
        pytest.param("1x80Gi,", "''", id="trailing-comma"),
        pytest.param("", "empty", id="empty"),
        pytest.param("-1x80Gi", "'-1x80Gi'", id="negative-count"),
        pytest.param("1x1.5Gi", "'1x1.5Gi'", id="fractional-size"),
    ],
)
def test_bad_spec_names_flag_and_part(spec: str, names: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_spec(spec)
    assert "--simulated-devices" in str(err.value)
    assert names in str(err.value)


def test_devices_follow_spec_with_stable_uuids() -> None:
    first = SimulatedBackend("2x80Gi,1x40Gi").devices()
    again = SimulatedBackend("2x80Gi,1x40Gi").devices()
    assert [d.memory_total for d in first] == [80 * GI, 80 * GI, 40 * GI]
    assert [d.uuid for d in first] == [d.uuid for d in again], "a restarted broker must see the same UUIDs"
    assert first[2].uuid == "GPU-5e1a0000-0000-4000-8000-000000000002"
    assert {(d.name, d.mig_enabled, d.minor) for d in first} == {("Simulated GPU", False, None)}


@pytest.fixture
def sim() -> SimulatedBackend:
    return SimulatedBackend("2x80Gi")


def test_processes_set_by_tests_show_up_and_clear(sim: SimulatedBackend) -> None:
    gpu0, gpu1 = (d.uuid for d in sim.devices())
    sim.set_process(100, gpu0, 5 * GI)
    sim.set_process(100, gpu1, 1 * GI)
    sim.set_process(200, gpu0, 2 * GI)
    sim.set_process(200, gpu0, 3 * GI)
    assert sorted(sim.processes(), key=lambda p: (p.pid, p.device_uuid)) == [
        GpuProcess(100, gpu0, 5 * GI),
        GpuProcess(100, gpu1, 1 * GI),
        GpuProcess(200, gpu0, 3 * GI),
    ]
    sim.set_process_utilization(100, 40)
    sim.clear_process(100)
    assert sim.processes() == [GpuProcess(200, gpu0, 3 * GI)]
    assert 100 not in sim.process_utilization(), "an exited process uses no SM time"


def test_clearing_an_unknown_process_is_harmless(sim: SimulatedBackend) -> None:
    sim.clear_process(12345)
    assert sim.processes() == []


def test_utilization_set_by_tests_shows_up(sim: SimulatedBackend) -> None:
    gpu0, gpu1 = (d.uuid for d in sim.devices())
    assert sim.utilization() == {}
    sim.set_utilization(gpu0, 70)
    sim.set_utilization(gpu1, 0)
    sim.set_process_utilization(100, 35)
    assert sim.utilization() == {gpu0: 70, gpu1: 0}
    assert sim.process_utilization() == {100: 35}


def test_answers_are_copies(sim: SimulatedBackend) -> None:
    gpu0 = sim.devices()[0].uuid
    sim.set_utilization(gpu0, 10)
    sim.utilization()[gpu0] = 99
    sim.devices().clear()
    assert sim.utilization() == {gpu0: 10}
    assert len(sim.devices()) == 2


@pytest.mark.parametrize(
    "drive",
    [
        pytest.param(lambda s: s.set_process(1, "GPU-nope", 1), id="set_process"),
        pytest.param(lambda s: s.set_utilization("GPU-nope", 1), id="set_utilization"),
        pytest.param(lambda s: s.device_nodes("GPU-nope"), id="device_nodes"),
    ],
)
def test_unknown_device_is_refused_by_name(sim: SimulatedBackend, drive) -> None:
    with pytest.raises(ValueError, match="GPU-nope"):
        drive(sim)


@pytest.mark.parametrize(
    "drive",
    [
        pytest.param(lambda s, u: s.set_utilization(u, 101), id="device-over-100"),
        pytest.param(lambda s, u: s.set_utilization(u, -1), id="device-negative"),
        pytest.param(lambda s, u: s.set_process_utilization(1, 101), id="process-over-100"),
        pytest.param(lambda s, u: s.set_process(1, u, -1), id="negative-memory"),
    ],
)
def test_out_of_range_values_are_refused(sim: SimulatedBackend, drive) -> None:
    with pytest.raises(ValueError):
        drive(sim, sim.devices()[0].uuid)


def test_no_device_nodes_to_mount(sim: SimulatedBackend) -> None:
    assert sim.device_nodes(sim.devices()[0].uuid) == []
    assert sim.control_nodes() == []
