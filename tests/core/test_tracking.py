"""Which peers an agent says Hello to: bounded by the candidates, whatever the fleet's size.

The promises: a small fleet is said Hello to whole, as before; in a large one
a round never names more than the candidates, the probes and the peers the
node has business with; the probes go round the whole fleet; candidates are
the roomiest live hosts; and an on-demand refresh asks every cold host in
turn, none twice.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from shim.core import tracking
from shim.core.reroute import PeerView, Resources
from shim.core.tracking import (
    ANY_ROOM,
    Known,
    TrackReason,
    candidate_every,
    choose_candidates,
    fits,
    plan_round,
    refresh_order,
    rotation,
    start_cursor,
)

GI = 1 << 30


def fleet(n: int, *, gpu: int = 0) -> list[Known]:
    return [Known(f"gpu-{i:04d}", False) for i in range(gpu)] + [Known(f"cpu-{i:04d}", True) for i in range(n)]


def view(node: str, cpu: float = 2.0, mem: int = 4 * GI, **kw) -> PeerView:
    args = {"cpu_host": True, "healthy": True, "sampled_age_s": 1.0, "draining": False} | kw
    return PeerView(node, args["cpu_host"], args["healthy"], Resources(cpu, mem), args["sampled_age_s"],
                    args["draining"])


def test_a_small_fleet_is_said_hello_to_whole_as_before() -> None:
    known = fleet(10, gpu=2)
    plan = plan_round(known, set(), set(), placing=False, limit=16)
    assert set(plan.nodes) == {k.node for k in known}
    assert {why for _, why in plan.hello} == {TrackReason.FLEET}


def test_a_host_only_node_of_a_large_fleet_says_hello_only_to_its_business() -> None:
    plan = plan_round(fleet(5000), set(), {"cpu-0042"}, placing=False, limit=16)
    assert plan.hello == (("cpu-0042", TrackReason.BUSINESS),)


def test_an_origin_fills_its_candidates_at_once_then_probes_a_few_each_round() -> None:
    known = fleet(5000, gpu=3)
    first = plan_round(known, set(), set(), placing=True, limit=16, probes=2)
    assert len(first.nodes) == 18 and all(why is TrackReason.PROBE for _, why in first.hello)
    assert all(n.startswith("cpu-") for n in first.nodes)  # a GPU-only peer is never a candidate
    candidates = set(first.nodes[:16])
    second = plan_round(known, candidates, {"cpu-4999"}, placing=True, limit=16, probes=2, cursor=first.cursor)
    reasons = dict(second.hello)
    assert sum(1 for r in reasons.values() if r is TrackReason.CANDIDATE) == 16
    assert [n for n, r in reasons.items() if r is TrackReason.PROBE] == ["cpu-0018", "cpu-0019"]
    assert reasons["cpu-4999"] is TrackReason.BUSINESS
    off = plan_round(known, candidates, set(), placing=True, limit=16, probes=1, cursor=second.cursor,
                     candidates_due=False)
    assert off.hello == (("cpu-0020", TrackReason.PROBE),)  # candidates every few rounds, probes every round


@given(n=st.integers(17, 400), business=st.integers(0, 5), rounds=st.integers(1, 30))
def test_a_round_is_bounded_whatever_the_fleet(n: int, business: int, rounds: int) -> None:
    known = fleet(n)
    mine = {k.node for k in known[:business]}
    candidates: set[str] = set()
    cursor = ""
    for _ in range(rounds):
        plan = plan_round(known, candidates, mine, placing=True, limit=16, probes=2, cursor=cursor)
        assert len(plan.nodes) <= 16 + 2 + business
        assert len(set(plan.nodes)) == len(plan.nodes)
        candidates = set(choose_candidates([view(x) for x in plan.nodes], limit=16))
        cursor = plan.cursor


def test_probes_go_round_the_whole_fleet() -> None:
    known = fleet(50)
    seen: set[str] = set()
    cursor = ""
    candidates = {k.node for k in known[:16]}
    for _ in range(40):
        plan = plan_round(known, candidates, set(), placing=True, limit=16, probes=2, cursor=cursor)
        seen |= {n for n, why in plan.hello if why is TrackReason.PROBE}
        cursor = plan.cursor
    assert seen == {k.node for k in known[16:]}


def test_the_rotation_is_stable_when_peers_come_and_go() -> None:
    known = fleet(10)
    picked, cursor = rotation(known, exclude=set(), start="", count=3)
    assert picked == ("cpu-0000", "cpu-0001", "cpu-0002") and cursor == "cpu-0002"
    fewer = [k for k in known if k.node != "cpu-0003"]
    assert rotation(fewer, exclude={"cpu-0004"}, start=cursor, count=2)[0] == ("cpu-0005", "cpu-0006")
    assert rotation(known, exclude=set(), start="cpu-0008", count=3)[0] == ("cpu-0009", "cpu-0000", "cpu-0001")
    assert rotation([], exclude=set(), start="x", count=3) == ((), "x")


def test_candidates_are_the_roomiest_live_hosts() -> None:
    views = [view("a", 1.0), view("b", 3.0), view("c", 3.0, 8 * GI), view("dead", 9.0, healthy=False),
             view("old", 9.0, sampled_age_s=99.0), view("draining", 9.0, draining=True),
             view("gpu", 9.0, cpu_host=False), view("d", 0.0)]
    assert choose_candidates(views, limit=3) == ("c", "b", "a")
    assert choose_candidates(views, limit=10) == ("c", "b", "a", "d")


def test_fits_is_placements_rule() -> None:
    views = [view("a", 1.0, GI), view("b", 4.0, GI // 2)]
    assert fits(Resources(1.0, GI), views)
    assert not fits(Resources(2.0, GI), views)
    assert fits(ANY_ROOM, [view("z", 0.01, 2)])
    assert not fits(ANY_ROOM, [view("z", 0.0, 0)])


def test_a_refresh_asks_every_cold_host_once_from_the_cursor() -> None:
    known = fleet(6, gpu=1)
    order = refresh_order(known, {"cpu-0001"}, start="cpu-0003")
    assert order == ("cpu-0004", "cpu-0005", "cpu-0000", "cpu-0002", "cpu-0003")


def test_candidates_are_said_hello_to_about_every_ten_seconds() -> None:
    assert candidate_every(2.0) == 5 and candidate_every(0.3) == 33
    assert candidate_every(10.0) == 1 and candidate_every(30.0) == 1


def test_each_origin_starts_its_rotation_at_a_host_of_its_own() -> None:
    known = fleet(1000, gpu=3)
    starts = {start_cursor(known, f"gpu-{o:04d}") for o in range(200)}
    assert len(starts) > 150 and all(s.startswith("cpu-") for s in starts)
    assert start_cursor(known, "gpu-0001") == start_cursor(list(reversed(known)), "gpu-0001")
    assert start_cursor(fleet(0, gpu=2), "gpu-0001") == ""


def test_room_is_pushed_when_it_moved_by_a_step_not_by_every_wobble() -> None:
    big = Resources(32.0, 128 * GI)
    told = Resources(10.0, 64 * GI)
    assert not tracking.room_moved(told, Resources(10.5, 64 * GI), big)  # under 5 % of 32 cores
    assert tracking.room_moved(told, Resources(8.0, 64 * GI), big)
    assert not tracking.room_moved(told, Resources(10.0, 60 * GI), big)  # under 5 % of 128 GiB
    assert tracking.room_moved(told, Resources(10.0, 50 * GI), big)
    small = Resources(2.0, 4 * GI)
    assert tracking.room_moved(Resources(1.0, GI), Resources(0.85, GI), small)  # 0.1 core at least
    assert tracking.room_moved(Resources(0.05, GI), Resources(0.0, GI), small)  # room gone, however little it was
