"""The live test's cgroups: made under the hierarchy the watchdog reads, named as the kernel shows them, removed."""

from __future__ import annotations

from pathlib import Path

import pytest

from shim.gpucheck import cgroups


def _hierarchies(root: Path) -> None:
    for mount in (root / "memory", root / "unified", root):
        mount.mkdir(parents=True, exist_ok=True)
        (mount / "cgroup.procs").write_text("")


def test_the_parent_is_made_once_under_the_hierarchy_in_use_and_named_as_proc_shows_it(tmp_path: Path) -> None:
    _hierarchies(tmp_path)
    parent = cgroups.make_parent("weft-gpu-check-1", root=tmp_path)
    assert parent.is_dir() and parent.parent in (tmp_path / "memory", tmp_path / "unified")
    assert cgroups.as_seen(parent / "a", root=tmp_path) == "/weft-gpu-check-1/a"
    with pytest.raises(cgroups.NoCgroup, match="cannot make a cgroup at"):
        cgroups.make_parent("weft-gpu-check-1", root=tmp_path)  # a second test of the same tag never shares it


def test_without_a_hierarchy_it_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(cgroups.NoCgroup, match=f"no cgroup hierarchy to use under {tmp_path}"):
        cgroups.make_parent("t", root=tmp_path)


def test_removal_reports_a_cgroup_that_stays_and_passes_over_one_already_gone(tmp_path: Path) -> None:
    problems: list[str] = []
    cgroups.remove(tmp_path / "gone", problems, timeout=0.1)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "cgroup.procs").write_text("123\n")  # a directory that will not go: a cgroup with a process left
    cgroups.remove(busy, problems, timeout=0.1)
    assert len(problems) == 1 and problems[0].startswith(f"cgroup {busy} not removed")
