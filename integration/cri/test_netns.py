"""``shim.crishared.netns`` in a namespace of its own: the loopback listeners the shadow side of the stitch uses."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.crishared.netns import Netns


@pytest.fixture
def ns() -> Iterator[Netns]:
    name = f"weft-t-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        n = Netns(f"/run/netns/{name}")
        try:
            yield n
        finally:
            n.close()
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


def _sysctl(ns: Netns, key: str, value: str) -> None:
    ns.run(Path(f"/proc/sys/{key.replace('.', '/')}").write_text, value)  # /proc/sys/net is the caller's namespace


def test_loopback_listeners_take_both_loopbacks_and_nothing_else(ns: Netns) -> None:
    socks = ns.listen_loopback(7301)
    try:
        assert sorted(s.getsockname()[0] for s in socks) == ["127.0.0.1", "::1"]
        assert set(ns.listening()) == {7301}
        for host in ("127.0.0.1", "::1"):
            ns.connect(host, 7301, 5).close()
    finally:
        for s in socks:
            s.close()


def test_a_port_taken_on_one_loopback_is_refused_and_nothing_is_left_listening(ns: Netns) -> None:
    held = ns.run(lambda: socket.create_server(("::1", 7302), family=socket.AF_INET6))
    try:
        with pytest.raises(OSError) as err:
            ns.listen_loopback(7302)
        assert err.value.errno == errno.EADDRINUSE
        assert ns.listening()[7302] == {os.fstat(held.fileno()).st_ino}
    finally:
        held.close()
    assert 7302 not in ns.listening()  # the 127.0.0.1 listener made first was closed


def test_with_ipv6_off_the_namespace_gets_127_0_0_1_only(ns: Netns) -> None:
    _sysctl(ns, "net.ipv6.conf.all.disable_ipv6", "1")
    _sysctl(ns, "net.ipv6.conf.lo.disable_ipv6", "1")
    socks = ns.listen_loopback(7303)
    try:
        assert [s.getsockname()[0] for s in socks] == ["127.0.0.1"]
    finally:
        for s in socks:
            s.close()
