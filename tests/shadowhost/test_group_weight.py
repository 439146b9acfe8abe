"""The shadows' shared cgroup weighs what its running shadows do, in the cgroup version the node has."""

from __future__ import annotations

import time
from pathlib import Path

from cri_api.v1 import api_pb2 as cri

from shim.core.reservation import group_shares, weight_of_shares
from shim.shadowhost.capacity import HostedCapacity
from shim.shadowhost.group_weight import ShadowGroupWeight


def test_the_group_weighs_the_sum_of_its_shadows_within_the_kernel_s_bounds() -> None:
    assert group_shares([512, 1024]) == 1536
    assert group_shares([]) == 2  # no shadow running: the floor, so the host's own pods win
    assert group_shares([200_000, 200_000]) == 262144
    # runc's conversion for cgroup v2: the floor is weight 1, 1024 shares about 39, the most 10000
    assert (weight_of_shares(2), weight_of_shares(1024), weight_of_shares(262144)) == (1, 39, 10000)


def test_cgroup_v1_gets_cpu_shares_in_the_cpu_hierarchy(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "weft-shadows"
    group.mkdir(parents=True)
    assert ShadowGroupWeight("/weft-shadows", root=tmp_path).apply([512, 512]) == 1024
    assert (group / "cpu.shares").read_text() == "1024\n"


def test_cgroup_v2_gets_cpu_weight_and_a_systemd_slice_is_found(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    group = tmp_path / "weft_shadows.slice"  # the systemd driver's spelling of /weft-shadows
    group.mkdir()
    assert ShadowGroupWeight("/weft-shadows", root=tmp_path).apply([1024]) == 1024
    assert (group / "cpu.weight").read_text() == "39\n"


def test_nothing_is_written_before_runc_made_the_group(tmp_path: Path) -> None:
    weight = ShadowGroupWeight("/weft-shadows", root=tmp_path)
    assert weight.apply([512]) is None
    assert not (tmp_path / "cpu").exists()  # never made by weft: runc makes it with the first shadow sandbox


class _Runtime:
    def __init__(self, containers: list[cri.Container]) -> None:
        self.list = containers

    def containers(self, state: int | None = None) -> list[cri.Container]:
        return [c for c in self.list if state is None or c.state == state]


class _Metrics:
    class shadows_hosted:  # noqa: N801 - stands in for a Gauge
        @staticmethod
        def set(value: int) -> None:
            pass


def _shadow(shares: str | None, state: int = cri.CONTAINER_RUNNING) -> cri.Container:
    annotations = {"weft.io/hosted-cpu-limit": "1"} | ({"weft.io/hosted-cpu-shares": shares} if shares else {})
    return cri.Container(labels={"weft.io/origin-node": "gpu-1"}, annotations=annotations, state=state)


def test_the_running_shadows_weigh_the_group_when_the_hosted_set_changes(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "weft-shadows"
    group.mkdir(parents=True)
    rt = _Runtime([_shadow("512"), _shadow("1024"), _shadow(None), _shadow("4096", cri.CONTAINER_EXITED),
                   cri.Container(state=cri.CONTAINER_RUNNING, annotations={"weft.io/hosted-cpu-shares": "9999"})])
    capacity = HostedCapacity(rt, _Metrics())  # type: ignore[arg-type]
    capacity.group = ShadowGroupWeight("/weft-shadows", root=tmp_path)
    capacity.reweigh()
    # running shadows only (an exited one and the host's own container left out); one made before the
    # annotation existed counts at the floor
    assert (group / "cpu.shares").read_text() == f"{512 + 1024 + 2}\n"
    rt.list = rt.list[:1]
    capacity.reweigh()
    assert (group / "cpu.shares").read_text() == "512\n"


def test_a_shadow_made_and_not_yet_started_holds_its_room_but_weighs_nothing(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "weft-shadows"
    group.mkdir(parents=True)
    made = _shadow("1024", cri.CONTAINER_CREATED)
    made.created_at = time.time_ns()
    never_started = _shadow("2048", cri.CONTAINER_CREATED)
    never_started.created_at = time.time_ns() - 120 * 10**9  # its origin never started it: it holds nothing
    rt = _Runtime([_shadow("512"), made, never_started, _shadow("256", cri.CONTAINER_EXITED)])
    capacity = HostedCapacity(rt, _Metrics())  # type: ignore[arg-type]
    capacity.group = ShadowGroupWeight("/weft-shadows", root=tmp_path)
    capacity.reweigh()
    # Room: the running one and the one made (a second RunShadow before its start must not take it again).
    assert capacity.hosted_limits().cpu_cores == 2.0
    assert (group / "cpu.shares").read_text() == "512\n"  # weight: what runs
