"""A test node confined to CPUs of its own, as if it were a machine of its own.

Its processes (containerd, its shims, its agent) start under ``taskset`` and
inherit the CPUs; its pods' cgroups sit under the node's cgroup root, whose
cpuset holds the same CPUs, so runc gives every container of the node those
(a task moved into a cpuset takes the cpuset's CPUs, whatever it inherited).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


def pinned(argv: Sequence[str], cpus: str) -> list[str]:
    """``argv`` run on ``cpus`` (a list such as ``0`` or ``1-3``); unchanged for ``""``."""
    return ["taskset", "-c", cpus, *argv] if cpus else list(argv)


def confine_cgroup(cgroup: str, cpus: str) -> Path:
    """Make ``cgroup`` (a path under the hierarchy's root) a cpuset of ``cpus``; returns its directory.

    cgroup v1: the cpuset hierarchy's own directory, with the root's memory nodes. cgroup v2: the cpuset
    controller enabled for the root's children first.
    """
    v1 = CGROUP_FS / "cpuset"
    if (v1 / "cpuset.cpus").exists():
        d = v1 / cgroup.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpuset.mems").write_text((v1 / "cpuset.mems").read_text().strip())
        (d / "cpuset.cpus").write_text(cpus)
        return d
    if "cpuset" not in (CGROUP_FS / "cgroup.controllers").read_text().split():
        raise RuntimeError("this machine's cgroup v2 root offers no cpuset controller: cannot confine a node")
    control = CGROUP_FS / "cgroup.subtree_control"
    if "cpuset" not in control.read_text().split():
        control.write_text("+cpuset")
    d = CGROUP_FS / cgroup.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpuset.cpus").write_text(cpus)
    return d


def split(cpus: Sequence[int] | None = None) -> tuple[str, str]:
    """(the origins' CPUs, the hosts' CPUs): this machine's usable CPUs cut in two, the origins' half first.

    Every origin shares the first half and every host the second, so that the node a pod starts on and the
    node its CPU stage runs on never take each other's CPU, as on separate machines.
    """
    usable = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(usable) < 2:
        raise ValueError(f"confining origins and hosts apart needs at least 2 CPUs, this process has {len(usable)}")
    half = len(usable) // 2
    return ",".join(map(str, usable[:half])), ",".join(map(str, usable[half:]))
