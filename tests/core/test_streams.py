"""The pure half of the streaming relay: one-time tokens and request heads."""

from __future__ import annotations

import pytest

from shim.core.streams import BadRequest, StreamTokens, head_end, parse_head


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
