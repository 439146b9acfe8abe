"""The pure half of the stitched network and the streaming relay: ports, plans, tokens, request heads."""

from __future__ import annotations

import pytest

from shim.core.stitch import (
    BadRequest,
    Collision,
    HeldBy,
    StreamTokens,
    attribute,
    declared_ports,
    head_end,
    loopback_only,
    parse_head,
    plan,
)


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


def test_stream_tokens_are_one_time_kind_bound_and_expire() -> None:
    now = [0.0]
    tokens: StreamTokens[str] = StreamTokens(ttl=60, clock=lambda: now[0])
    t = tokens.add("exec", "target")
    assert tokens.take("attach", t) is None  # an exec token is no attach token
    assert tokens.take("exec", t).target == "target"
    assert tokens.take("exec", t) is None  # used
    t2 = tokens.add("exec", "late")
    now[0] = 61
    assert tokens.take("exec", t2) is None
    tokens.add("exec", "new")
    assert len(tokens) == 1  # expired ones are swept on add


def test_a_request_head_is_rewritten_to_the_hosts_path_with_everything_else_kept() -> None:
    raw = (b"POST /exec/tok?x=1 HTTP/1.1\r\nHost: 127.0.0.1:1\r\nConnection: Upgrade\r\n"
           b"Upgrade: SPDY/3.1\r\nX-Stream-Protocol-Version: v4.channel.k8s.io\r\n\r\nrest")
    end = head_end(raw)
    assert raw[end:] == b"rest"
    head = parse_head(raw[:end])
    assert head.route == ("exec", "tok")
    out = head.rewritten("/exec/HOSTTOKEN", "127.0.0.1:2")
    assert out.startswith(b"POST /exec/HOSTTOKEN?x=1 HTTP/1.1\r\nHost: 127.0.0.1:2\r\n")
    assert b"Upgrade: SPDY/3.1\r\n" in out and out.endswith(b"v4.channel.k8s.io\r\n\r\n")


@pytest.mark.parametrize("raw", [b"GET /\r\n\r\n", b"GET / SPDY/3\r\n\r\n", b"GET / HTTP/1.1\r\nno colon\r\n\r\n",
                                 b"GET / HTTP/1.1\r\n bad: x\r\n\r\n"],
                         ids=["no-version", "not-http", "header-without-colon", "header-name-with-space"])
def test_bad_heads_are_refused(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_head(raw[:head_end(raw)])


def test_an_endless_head_is_refused_and_a_partial_one_waits() -> None:
    assert head_end(b"GET / HTTP/1.1\r\n") == -1
    with pytest.raises(BadRequest):
        head_end(b"x" * (17 << 10))


@pytest.mark.parametrize(("path", "route"), [("/exec/abc", ("exec", "abc")), ("/attach/abc", ("attach", "abc")),
                                              ("/", ("", "")), ("/exec/", ("", "")), ("/exec/a/b", ("", "")),
                                              ("/other/abc", ("", ""))],
                         ids=["exec", "attach", "root", "no-token", "too-deep", "unknown-kind"])
def test_routes(path: str, route: tuple[str, str]) -> None:
    assert parse_head(f"GET {path} HTTP/1.1\r\n\r\n".encode()).route == route


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
