"""Where the Kubernetes binaries are: ``kube/build.sh`` builds them once per set of pins into a cache."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "kube" / "build.sh"
VERSIONS = REPO / "kube" / "versions.env"


@functools.cache
def bin_dir() -> Path:
    """The cached bin directory, built first if it is not there (scripts/test.sh builds it before pytest)."""
    res = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"kube/build.sh failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return Path(res.stdout.strip().splitlines()[-1])


def binary(name: str) -> str:
    path = bin_dir() / name
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: kube/build.sh did not build {name}")
    return str(path)


def versions() -> dict[str, str]:
    """The pins from kube/versions.env."""
    out = {}
    for line in VERSIONS.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out
