"""The cgroup a process is in, as the broker and the OCI hook read it: what their tests bind a lease to."""

from __future__ import annotations

from pathlib import Path


def own_cgroup(pid: int | str = "self") -> str:
    """The memory controller's cgroup path of ``pid`` (this process by default); cgroup v2's one line where there
    is no v1 memory line."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
    return lines[-1].split(":", 2)[2]
