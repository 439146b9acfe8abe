"""The pure half of the stitched network: ports and plans."""

from __future__ import annotations

import pytest

from shim.core.stitch import Collision, HeldBy, attribute, declared_ports, loopback_only, plan


@pytest.mark.parametrize(("value", "expected"), [
    ("8080", {8080}),
    ("80, 443,8080", {80, 443, 8080}),
    ("", set()),
    ("9090,", {9090}),
], ids=["one", "several-with-spaces", "declared-none", "trailing-comma"])
def test_declared_ports_parse(value: str, expected: set[int]) -> None:
    assert declared_ports({"weft.io/ports.web": value}, "web") == expected


def test_a_port_is_loopback_only_when_every_server_on_it_keeps_to_loopback() -> None:
    listening = {
        6060: {1: "127.0.0.1", 2: "::1"},  # both loopbacks
        6061: {3: "::ffff:127.0.0.1"},  # an IPv4-mapped loopback
        8080: {4: "0.0.0.0"},
        8081: {5: "127.0.0.1", 6: "::"},  # one of them on every address
        8082: {7: "10.1.2.3", 8: "127.0.0.2"},  # the pod IP too
        9090: {9: "0.0.0.0", 10: "127.0.0.1"},  # weft's own mirror (9) on every address: left out
        9091: {11: "0.0.0.0"},  # only weft's own: nothing of the pod's listens
    }
    assert loopback_only(listening, own={9, 11}) == {6060, 6061, 9090}
    assert loopback_only({}) == frozenset()


def test_undeclared_ports_mean_discover() -> None:
    assert declared_ports({"weft.io/ports.other": "80"}, "web") is None


@pytest.mark.parametrize("value", ["http", "0", "65536", "-1", "80;81"],
                         ids=["name", "zero", "too-big", "negative", "wrong-separator"])
def test_bad_declared_ports_name_the_key(value: str) -> None:
    with pytest.raises(ValueError, match=r"weft.io/ports.web"):
        declared_ports({"weft.io/ports.web": value}, "web")


def test_plan_mirrors_each_shadow_port_into_the_origin_and_the_pod_into_each_shadow() -> None:
    p = plan({"web": frozenset({8080}), "api": frozenset({7000})}, frozenset({9090}))
    assert p.into_origin == {8080: "web", 7000: "api"}
    # Each shadow sees the local ports and the other shadows' ports, never its own.
    assert p.into_shadow == {"web": {9090, 7000}, "api": {9090, 8080}}
    assert p.collisions == ()


def test_a_port_held_locally_is_a_collision_not_a_mirror() -> None:
    p = plan({"web": frozenset({9090, 8080})}, frozenset({9090}))
    assert p.into_origin == {8080: "web"}
    assert p.collisions == (Collision(9090, "web", HeldBy.LOCAL),)
    assert p.into_shadow["web"] == frozenset()  # the pod has nothing on a port the shadow does not hold


def test_two_shadows_on_one_port_keep_the_first_owner() -> None:
    p = plan({"a": frozenset({80}), "b": frozenset({80})}, frozenset(), current={80: "b"})
    assert p.into_origin == {80: "b"}
    assert p.collisions == (Collision(80, "a", HeldBy.REMOTE, "b"),)


def test_a_mirror_goes_when_its_shadow_stops_listening() -> None:
    assert plan({"web": frozenset()}, frozenset(), current={8080: "web"}).into_origin == {}


def test_shadows_sharing_a_namespace_are_not_a_collision_between_them() -> None:
    # web and clash run on one host in the pod's shadow sandbox: each one's stream reports 8080 (web's server).
    spaces = {"web": "cpu-1/sb", "clash": "cpu-1/sb", "far": "cpu-2/sb2"}
    got = attribute({"web": frozenset({8080}), "clash": frozenset({8080}), "far": frozenset({8080})}, spaces)
    assert got == {"clash": frozenset({8080}), "web": frozenset(), "far": frozenset({8080})}
    p = plan(got, frozenset())
    # Once: the shadows in different namespaces do collide, the two sharing one do not.
    assert [(c.port, c.container) for c in p.collisions] == [(8080, "far")]


def test_a_shared_port_stays_with_the_container_it_is_mirrored_for() -> None:
    spaces = {"web": "cpu-1/sb", "clash": "cpu-1/sb"}
    got = attribute({"web": frozenset({8080, 7000}), "clash": frozenset({8080, 7000})}, spaces, {8080: "web"})
    assert got == {"web": frozenset({8080}), "clash": frozenset({7000})}
