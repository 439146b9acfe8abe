"""Running a checkout's build scripts (``components/*/build.sh``, the test nodes' ``rootfs.sh``) for what they build.

Each script answers at once from its cache and otherwise builds under its cache's lock, so a caller waits here
for a background build (``scripts/test.sh`` starts ``components/build-all.sh``) or builds what it needs itself.
How long a caller waited is what a cold machine pays in the tests themselves: every wait over a second is
appended to the file ``WEFT_BUILD_WAITS`` names (``scripts/test.sh`` prints it at the end).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

WAITS_ENV = "WEFT_BUILD_WAITS"


class BuildError(RuntimeError):
    pass


def run(script: Path, *args: str, timeout: float = 3600) -> str:
    """Run ``script`` with ``args`` and return the last line it printed (where what it built is)."""
    started = time.monotonic()
    res = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout)
    seconds = time.monotonic() - started
    name = " ".join((_shown(script), *args))
    if res.returncode != 0 or not res.stdout.strip():
        raise BuildError(f"{name} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    if seconds > 1:
        _record(name, seconds)
    return res.stdout.strip().splitlines()[-1]


def _shown(script: Path) -> str:
    """The script as the checkout names it (components/helm/build.sh), else its path."""
    parts = script.resolve().parts
    for top in ("components", "integration"):
        if top in parts:
            return "/".join(parts[parts.index(top):])
    return str(script)


def _record(name: str, seconds: float) -> None:
    path = os.environ.get(WAITS_ENV)
    if not path:
        return
    with open(path, "a") as f:  # one short line each: appends from parallel workers do not interleave
        f.write(f"{name}\t{seconds:.0f}\t{os.getpid()}\n")
