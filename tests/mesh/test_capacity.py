"""Free capacity as the mesh reports it: the lesser of books and measurement, less the reserve, never negative."""

from __future__ import annotations

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shim._pb import mesh_pb2 as pb
from shim.core.reroute import Resources
from shim.errors import ConfigError
from shim.mesh.capacity import DRAINING, MIB, CapacityProbe, FixedHost, PsutilHost

GI = 2**30


def _probe(role: str = "cpu", *, busy: float = 0.0, available: int = 16 * GI, own=(0.0, 0), hosted=(0.0, 0),
           reserve_cpu: float = 0.5, reserve_memory: int = 512 * MIB) -> CapacityProbe:
    host = FixedHost(cores=8, memory_total=16 * GI, memory_available=available, busy=busy)
    return CapacityProbe(role, reserve_cpu, reserve_memory, own_requests=lambda: own, hosted_limits=lambda: hosted,
                         host=host, clock=lambda: 1234.5)


def _free(state: pb.PeerState) -> tuple[float, int]:
    return round(state.free.cpu_cores, 6), state.free.memory_bytes


@pytest.mark.parametrize(("probe", "free"), [
    pytest.param(_probe(), (7.5, 16 * GI - 512 * MIB), id="idle-empty-node-offers-all-but-the-reserve"),
    pytest.param(_probe(own=(6.0, 10 * GI)), (1.5, 6 * GI - 512 * MIB), id="own-pods-requests-are-taken"),
    pytest.param(_probe(own=(2.0, 2 * GI), hosted=(3.0, 4 * GI)), (2.5, 10 * GI - 512 * MIB),
                 id="what-it-already-hosts-is-taken-too"),
    pytest.param(_probe(busy=0.9, available=3 * GI), (0.3, 2 * GI + 512 * MIB),
                 id="measured-use-beyond-the-books-is-taken"),
    pytest.param(_probe(own=(9.0, 20 * GI)), (0.0, 0), id="overcommitted-books-give-zero-not-negative"),
    pytest.param(_probe(busy=1.0, available=0), (0.0, 0), id="saturated-node-gives-zero-not-negative"),
    pytest.param(_probe(reserve_cpu=10, reserve_memory=32 * GI), (0.0, 0), id="reserve-beyond-the-node-gives-zero"),
])
def test_free_capacity(probe: CapacityProbe, free: tuple[float, int]) -> None:
    assert _free(probe.sample()) == free


def test_sample_reports_the_books_and_the_measurement() -> None:
    state = _probe(busy=0.25, available=12 * GI, own=(1.0, GI), hosted=(2.0, 2 * GI)).sample()
    assert (state.allocatable.cpu_cores, state.allocatable.memory_bytes) == (8.0, 16 * GI)
    assert (state.measured_used.cpu_cores, state.measured_used.memory_bytes) == (2.0, 4 * GI)
    assert (state.own_requests.cpu_cores, state.hosted_limits.memory_bytes) == (1.0, 2 * GI)
    assert (state.role, state.healthy, state.sampled_at, state.node) == ("cpu", True, 1234.5, "")


@given(
    cores=st.integers(1, 256), busy=st.floats(0, 1), total=st.integers(1, 2**42), avail_frac=st.floats(0, 1),
    own=st.tuples(st.floats(0, 512), st.integers(0, 2**43)), hosted=st.tuples(st.floats(0, 512), st.integers(0, 2**43)),
    reserve=st.tuples(st.floats(0, 8), st.integers(0, 2**33)),
)
def test_free_is_never_negative_and_never_more_than_books_or_measurement(cores, busy, total, avail_frac, own, hosted,
                                                                         reserve) -> None:
    host = FixedHost(cores=cores, memory_total=total, memory_available=int(total * avail_frac), busy=busy)
    state = CapacityProbe("cpu", *reserve, own_requests=lambda: own, hosted_limits=lambda: hosted, host=host).sample()
    free, used = state.free, state.measured_used
    assert free.cpu_cores >= 0 and free.memory_bytes >= 0
    assert free.cpu_cores <= max(0.0, cores - own[0] - hosted[0] - reserve[0]) + 1e-9
    assert free.cpu_cores <= max(0.0, cores - used.cpu_cores - reserve[0]) + 1e-9
    assert free.memory_bytes <= max(0, total - own[1] - hosted[1] - reserve[1])
    assert free.memory_bytes <= max(0, total - used.memory_bytes - reserve[1])


def _admit(cpu: float, mem: int) -> pb.AdmitRequest:
    return pb.AdmitRequest(origin_node="gpu-1", key="sb/app/0", limits=pb.Resources(cpu_cores=cpu, memory_bytes=mem))


@pytest.mark.parametrize(("probe", "request_", "admitted", "reason"), [
    pytest.param(_probe("gpu"), _admit(0.1, MIB), False, "not-a-cpu-host", id="gpu-only-node-hosts-no-cpu-work"),
    pytest.param(_probe("gpu,cpu"), _admit(1, GI), True, "admitted", id="gpu-and-cpu-node-hosts"),
    pytest.param(_probe(own=(6.0, 0)), _admit(2, GI), False, "insufficient-cpu", id="cpu-limit-over-free"),
    pytest.param(_probe(available=2 * GI), _admit(1, 2 * GI), False, "insufficient-memory",
                 id="memory-limit-over-free"),
    pytest.param(_probe(), _admit(7.5, 16 * GI - 512 * MIB), True, "admitted", id="exactly-free-fits"),
    pytest.param(_probe(), _admit(0, GI), False, "no-limits", id="unlimited-cpu-is-never-admitted"),
])
def test_default_admit_by_limits_against_free(probe: CapacityProbe, request_: pb.AdmitRequest, admitted: bool,
                                              reason: str) -> None:
    answer = probe.admit(request_)
    assert (answer.admitted, answer.reason) == (admitted, reason)


def test_admitted_answer_says_what_stays_free() -> None:
    answer = _probe().admit(_admit(1.5, 4 * GI))
    assert (answer.free_after.cpu_cores, answer.free_after.memory_bytes) == (6.0, 12 * GI - 512 * MIB)


def test_books_may_be_given_as_resources() -> None:
    probe = CapacityProbe("cpu", 0, 0, own_requests=lambda: Resources(2.0, GI), host=FixedHost(4, 4 * GI, 4 * GI))
    assert _free(probe.sample()) == (2.0, 3 * GI)


def test_refusal_says_why_in_numbers() -> None:
    answer = _probe(own=(6.0, 0)).admit(_admit(2, GI))
    assert answer.detail == "2 CPU asked, 1.5 free"


@pytest.mark.parametrize("kwargs", [{"role": "storage"}, {"role": "cpu", "reserve_cpu": -1}],
                         ids=["unknown-role", "negative-reserve"])
def test_bad_probe_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        CapacityProbe(**kwargs, host=FixedHost(1, GI, GI))


def test_psutil_host_reads_this_machine() -> None:
    probe = CapacityProbe("cpu", reserve_cpu=0, reserve_memory=0, host=PsutilHost())
    sum(range(200_000))  # some CPU time between the two readings
    state = probe.sample()
    assert state.allocatable.cpu_cores == psutil.cpu_count()
    assert state.allocatable.memory_bytes == psutil.virtual_memory().total
    assert 0 <= state.measured_used.cpu_cores <= state.allocatable.cpu_cores
    assert 0 < state.measured_used.memory_bytes < state.allocatable.memory_bytes
    assert 0 <= state.free.cpu_cores <= state.allocatable.cpu_cores
    assert 0 < state.free.memory_bytes < state.allocatable.memory_bytes


def test_a_draining_node_says_so_in_hello_stays_healthy_and_refuses_every_admit() -> None:
    probe = _probe()
    request = pb.AdmitRequest(limits=pb.Resources(cpu_cores=1.0, memory_bytes=GI))
    assert probe.sample().health_detail == "" and probe.admit(request).admitted
    probe.draining = True
    state = probe.sample()
    assert state.healthy and state.health_detail == DRAINING
    answer = probe.admit(request)
    assert not answer.admitted and answer.reason == "draining" and "weft drain" in answer.detail
    probe.draining = False
    assert probe.admit(request).admitted


def test_a_cordoned_node_is_skipped_as_a_draining_one_and_takes_new_containers_again_once_uncordoned() -> None:
    probe = _probe()
    request = pb.AdmitRequest(limits=pb.Resources(cpu_cores=1.0, memory_bytes=GI))
    probe.cordoned = True  # its Node unschedulable: kubectl cordon, or kubectl drain's first step
    assert probe.sample().health_detail == DRAINING
    answer = probe.admit(request)
    assert not answer.admitted and answer.reason == "draining" and "cordoned" in answer.detail
    probe.cordoned = False
    assert probe.sample().health_detail == "" and probe.admit(request).admitted
