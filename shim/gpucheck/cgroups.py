"""The live test's cgroups: one per lease, under the hierarchy the broker's watchdog reads.

The watchdog reads memory use per cgroup (the memory controller on cgroup
v1, the unified hierarchy on v2), so the leases' holders and clients live
under a parent made there for the test and removed after it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from shim.broker.watchdog import CGROUP_ROOT


class NoCgroup(Exception):
    """No cgroup could be made for the test (the message says where and why)."""


def make_parent(tag: str, root: Path = CGROUP_ROOT) -> Path:
    """A cgroup named ``tag`` for the test's leases, under the memory hierarchy (v1) or the unified one (v2)."""
    v1 = any("memory" in line.split(":")[1].split(",")
             for line in Path("/proc/self/cgroup").read_text().splitlines() if line.count(":") >= 2)
    mounts = [root / "memory"] if v1 else [root / "unified", root]
    for mount in mounts:
        if (mount / "cgroup.procs").exists():
            parent = mount / tag
            try:
                parent.mkdir()
            except OSError as exc:
                raise NoCgroup(f"cannot make a cgroup at {parent}: {exc}") from None
            return parent
    raise NoCgroup(f"no cgroup hierarchy to use under {root} (memory or unified)")


def as_seen(cg_dir: Path, root: Path = CGROUP_ROOT) -> str:
    """The cgroup as /proc/<pid>/cgroup shows it (what the broker binds a lease to)."""
    for mount in (root / "memory", root / "unified", root):
        with contextlib.suppress(ValueError):
            return "/" + str(cg_dir.relative_to(mount))
    return str(cg_dir)


def remove(path: Path, problems: list[str], timeout: float = 5.0) -> None:
    """Remove an emptied cgroup, waiting out the kernel's lag after its last process; a failure goes to
    ``problems``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                problems.append(f"cgroup {path} not removed: {exc}")
                return
            time.sleep(0.05)
