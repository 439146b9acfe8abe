"""How a test node is confined to CPUs of its own."""

from __future__ import annotations

import pytest

from shim.localfabric import cpuset


def test_the_origin_and_the_hosts_get_halves_that_never_overlap() -> None:
    assert cpuset.split([0, 1]) == ("0", "1")
    assert cpuset.split([3, 0, 2, 1]) == ("0,1", "2,3")
    origin, hosts = cpuset.split(range(5))
    assert set(origin.split(",")).isdisjoint(hosts.split(",")) and origin and hosts


def test_one_cpu_cannot_be_split() -> None:
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        cpuset.split([0])


def test_a_pinned_command_runs_under_taskset_and_an_unpinned_one_unchanged() -> None:
    assert cpuset.pinned(["containerd", "--config", "c.toml"], "1") == ["taskset", "-c", "1", "containerd",
                                                                         "--config", "c.toml"]
    assert cpuset.pinned(["containerd"], "") == ["containerd"]
