"""Where the Kubernetes binaries are: ``components/build.sh`` builds them once per set of pins into a cache.

What only the DRA tests run (kube-controller-manager, the test DRA driver) is built by
``components/dra/build.sh`` into a cache key of its own. With ``WEFT_KUBE=next`` (the smoke run on the newest
release, ``scripts/test.sh``), kubelet, kube-apiserver, kube-scheduler and kubectl are ``components/next/build.sh``'s
instead; etcd, crictl and critest stay the pinned set's. Helm, for the chart's tests, is ``components/helm/build.sh``'s.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from shim.localfabric import builds

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "components" / "build.sh"
DRA_BUILD = REPO / "components" / "dra" / "build.sh"
VERSIONS = REPO / "components" / "versions.env"
NEXT_BUILD = REPO / "components" / "next" / "build.sh"
HELM_BUILD = REPO / "components" / "helm" / "build.sh"
TOOLKIT_BUILD = REPO / "components" / "nvidia-toolkit" / "build.sh"
NEXT_BINARIES = ("kubelet", "kube-apiserver", "kube-scheduler", "kubectl")


def _built(script: Path) -> Path:
    """Run a build script (it waits on its lock while a background build runs, or builds) and return its bin
    directory, as its ``--bin-dir`` names it: the same cache its ``--cached`` check and its build use."""
    builds.run(script)
    return Path(builds.run(script, "--bin-dir"))


@functools.cache
def bin_dir() -> Path:
    """The cached bin directory, built first if it is not there (scripts/test.sh builds it before pytest)."""
    return _built(BUILD)


@functools.cache
def dra_bin_dir() -> Path:
    """kube-controller-manager and the test DRA driver, built first if they are not there."""
    return _built(DRA_BUILD)


@functools.cache
def next_bin_dir() -> Path:
    """The newest release's kubelet, API server, scheduler and kubectl, built first if they are not there."""
    return _built(NEXT_BUILD)


@functools.cache
def helm() -> str:
    """The helm command (components/helm/build.sh), built first if it is not there."""
    path = _built(HELM_BUILD) / "helm"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: components/helm/build.sh did not build helm")
    return str(path)


@functools.cache
def nvidia_toolkit(line: str) -> Path:
    """The bin directory of NVIDIA's container toolkit ``line`` (1.17 or 1.20), built first if it is not there."""
    builds.run(TOOLKIT_BUILD, line)
    return Path(builds.run(TOOLKIT_BUILD, "--bin-dir", line))


def next_release() -> bool:
    """Whether this run is the smoke run on the newest release (``WEFT_KUBE=next``)."""
    kube = os.environ.get("WEFT_KUBE", "")
    if kube not in ("", "next"):
        raise RuntimeError(f"WEFT_KUBE={kube!r}: expected 'next' or nothing (the pinned release)")
    return kube == "next"


def binary(name: str) -> str:
    path = (next_bin_dir() if name in NEXT_BINARIES and next_release() else bin_dir()) / name
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: components/build.sh did not build {name}")
    return str(path)


def dra_binary(name: str) -> str:
    path = dra_bin_dir() / name
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: components/dra/build.sh did not build {name}")
    return str(path)


def versions() -> dict[str, str]:
    """The pins from components/versions.env."""
    out = {}
    for line in VERSIONS.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out
