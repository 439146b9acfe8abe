"""The mesh's control plane across a fleet placing at once (``weft simulate mesh``), at a size a test affords.

The promises the agent's rules keep there: placements spread over many hosts
with about one Admit each, none runs locally while some host has room, a
nearly full fleet fills, a host that lies about its room or half the fleet
cut off does not set off a storm.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from shim.sim import cli
from shim.sim.mesh import SCENARIOS, Fleet, simulate, table

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
