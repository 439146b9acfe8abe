"""The mesh's control plane across a fleet placing at once (``weft simulate mesh``), at a size a test affords.

The promises the agent's rules keep there: placements spread over many hosts
with about one Admit each, none runs locally while some host has room, a
nearly full fleet fills, a host that lies about its room or half the fleet
cut off does not set off a storm.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shim.core.reroute import Resources
from shim.sim import cli
from shim.sim.mesh import GIB, RESERVE, SCENARIOS, Fleet, Scenario, simulate, table

SMALL = {"hosts": 300, "origins": 60}


def _run(name: str, **change) -> dict:
    s = replace(SCENARIOS[name], **({"hosts": 300, "origins": 60, "placements": 120, "warmup_s": 20.0} | change))
    return Fleet(s, seed=3).run()


def test_a_burst_spreads_over_many_hosts_with_about_one_admit_each() -> None:
    f = _run("burst-85")
    assert f["placements"] == f["remote"] == 120
    assert f["local_while_room"] == 0
    assert f["admits_per_placement_mean"] <= 1.3
    assert f["hosts_used"] >= 40 and f["fullest_host_share"] <= 0.1


def test_a_fleet_with_a_slot_or_so_per_host_fills_nearly_all_of_it_without_overcommitting() -> None:
    s = replace(SCENARIOS["burst-85"], hosts=300, origins=60, placements=500, warmup_s=20.0, fill=0.97,
                fill_spread=0.01)
    fleet = Fleet(s, seed=3)
    slots = sum(int(h.free().cpu_cores // s.stage.cpu_cores) for h in fleet.hosts.values())
    f = fleet.run()
    assert f["remote"] >= 0.9 * slots, (slots, f)


def test_a_host_that_claims_room_it_lacks_gets_few_admits() -> None:
    f = _run("liar", fill=0.97, fill_spread=0.01)
    assert f["liar_admits"] <= 0.1 * f["placements"], f


def test_half_the_hosts_cut_off_the_placements_go_to_the_rest_without_a_storm() -> None:
    f = _run("partition")
    assert f["remote"] == f["placements"]
    # An origin's first placement after the cut may ask each of its candidates cut off once (about half of
    # its 16): each one silent is then skipped until a Hello reaches it.
    assert f["admits_per_placement_mean"] <= 2 and f["admits_per_placement_p99"] <= 10, f


def test_the_same_seed_gives_the_same_figures() -> None:
    assert simulate(["churn"], seed=5, **SMALL) == simulate(["churn"], seed=5, **SMALL)


def test_the_table_has_a_row_per_scenario() -> None:
    text = table(simulate(["burst-50", "slow-host"], **SMALL))
    assert [line.split()[0] for line in text.splitlines()] == ["scenario", "burst-50", "slow-host"]


@pytest.mark.parametrize(("flags", "said"), [(["--hosts", "0"], "--hosts"), (["--origins", "x"], "--origins")])
def test_a_bad_size_is_named(flags: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["mesh", *flags]) == 2
    assert said in capsys.readouterr().err


# -- a fleet given exactly, as a real one is set up (bench/sim_validation.py) -----------------------------------
STAGE = Resources(0.5, 64 << 20)


def _fill(room: int) -> float:
    """A 4-CPU host's fill that leaves room for ``room`` stages of 0.5 CPU and a quarter CPU over."""
    return (4.0 - RESERVE.cpu_cores - STAGE.cpu_cores * (room + 0.5)) / 4.0


def _given(rooms: tuple[int, ...], arrivals: list[tuple[float, int]], **change) -> Scenario:
    return Scenario("given", hosts=len(rooms), origins=2, host_cpu=4.0, host_memory=8 * GIB, stage=STAGE,
                    fills=tuple(_fill(r) for r in rooms), arrivals=tuple(arrivals), warmup_s=10.0, **change)


def test_each_host_takes_the_fill_it_is_given() -> None:
    fleet = Fleet(_given((2, 3, 1), []), seed=1)
    assert [h.free().cpu_cores for h in fleet.hosts.values()] == [1.25, 1.75, 0.75]
    assert fleet.slots_left() == 6


def test_a_small_fleet_placing_at_once_fills_the_roomiest_host_then_the_next_one_admit_more_each() -> None:
    fleet = Fleet(_given((2, 3, 1), [(0.0, i % 2) for i in range(7)]), seed=1)
    f = fleet.run()
    # Ranked by room alone, every placement asks cpu-1 first, then cpu-0, then cpu-2; the seventh finds none.
    assert fleet.hosted() == {"cpu-1": 3, "cpu-0": 2, "cpu-2": 1}
    assert sorted(fleet.tally.admits) == [1, 1, 1, 2, 2, 3, 3]
    assert (f["placements"], f["local"], f["local_while_room"]) == (7, 1, 0)
    assert fleet.slots_left() == 0 and f["hosts_overcommitted"] == 0


def test_the_arrivals_given_are_the_placements_whatever_the_burst_size_says() -> None:
    fleet = Fleet(_given((4, 4), [(0.5, 1), (7.0, 0)], placements=2000), seed=1)
    f = fleet.run()
    assert f["placements"] == f["remote"] == 2
    assert sum(fleet.hosted().values()) == 2


@pytest.mark.parametrize(("change", "said"), [
    ({"fills": (0.5,)}, "1 fills for 2 hosts"),
    ({"fills": (0.5, 1.5)}, "fill outside"),
    ({"arrivals": ((0.0, 2),)}, "no origin"),
    ({"arrivals": ((-1.0, 0),)}, "before the window"),
])
def test_a_fleet_given_wrongly_is_refused(change: dict, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        Scenario("bad", hosts=2, origins=2, **change)


def _large_burst(seed: int, by_seed: bool) -> tuple[tuple[str, int], ...]:
    fleet = Fleet(_given((3,) * 40, [(0.0, i % 2) for i in range(10)], keys_by_seed=by_seed), seed=seed)
    fleet.run()
    return tuple(sorted(fleet.hosted().items()))


def test_with_keys_by_seed_each_seed_draws_its_own_two_choices_as_new_pods_would() -> None:
    assert len({_large_burst(seed, by_seed=False) for seed in range(1, 6)}) == 1
    assert len({_large_burst(seed, by_seed=True) for seed in range(1, 6)}) > 1
