"""The CPU weight of the cgroup a host's shadows share, kept at the sum of theirs.

Shadows live under one cgroup parent of the host's choosing (``mesh.shadow_cgroup_parent``), a sibling of
kubelet's pods cgroup. The kernel shares CPU between siblings by their own weight, so a shadow's weight
counts only within that group; the group's weight is what the host's own pods compete with. Left at the
default, all shadows together would get one default share however much they requested (little on a large
node, whose pods cgroup weighs its whole allocatable CPU). So the group weighs what its shadows do
(``shim.core.reservation.group_shares``), written whenever the hosted set changes.

The directory is runc's to make (with the first shadow sandbox); until it exists there is nothing to weigh.
"""

from __future__ import annotations

import threading
from pathlib import Path

from shim import log
from shim.core.reservation import group_shares, weight_of_shares

_log = log.get("weft.shadows")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def group_dirs(parent: str, root: Path = CGROUP_ROOT) -> tuple[list[Path], bool]:
    """(the parent's directories for the CPU controller, whether it is cgroup v2).

    Two spellings, as ``shim.shadowhost.lifecycle.shadow_cgroup`` makes them: a path with the cgroupfs driver,
    a slice at the root with the systemd one (the driver is the host containerd's, ``cgroup_driver``).
    """
    v2 = (root / "cgroup.controllers").exists()
    base = root if v2 else root / "cpu"
    slice_name = (parent.strip("/").removesuffix(".slice").replace("-", "_") or "weft_shadows") + ".slice"
    return [base / parent.strip("/"), base / slice_name], v2


class ShadowGroupWeight:
    def __init__(self, parent: str, root: Path = CGROUP_ROOT) -> None:
        self.dirs, self.v2 = group_dirs(parent, root)
        self._written: int | None = None
        self._lock = threading.Lock()

    def apply(self, shares: list[int]) -> int | None:
        """Weigh the group by the running shadows' ``shares``; returns the shares written (None: not written)."""
        total = group_shares(shares)
        name, value = ("cpu.weight", weight_of_shares(total)) if self.v2 else ("cpu.shares", total)
        with self._lock:
            # Written at every change of the running set, even to the same value: runc may have made the
            # directory afresh (at the default weight) since.
            written = []
            for d in self.dirs:
                try:
                    (d / name).write_text(f"{value}\n")
                except FileNotFoundError:
                    continue  # no shadow sandbox made there yet: runc makes the directory with the first
                except OSError as exc:
                    _log.warning("shadow.group_weight_failed", path=str(d / name), error=str(exc))
                    continue
                written.append(str(d / name))
            if not written:
                return None
            changed, self._written = total != self._written, total
        if changed:
            _log.info("shadow.group_weight", paths=written, shares=total, value=value)
        return total
