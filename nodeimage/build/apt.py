"""apt for the image's Debian packages of an architecture: this host's own apt for its own architecture; for
another (arm64 on an amd64 build host), a private apt state under the build's cache that reads the same sources
for that architecture alone, so the host's dpkg is never told of a foreign architecture."""

from __future__ import annotations

import shutil
from pathlib import Path

from hooks import native
from nodeimage.build.common import CACHE, _run


def options(arch: str, cache: Path = CACHE, refresh: bool = False) -> list[str]:
    """apt's ``-o`` options for ``arch``'s packages (none for this host's); the private index is fetched the
    first time (``apt-get update``: apt's mirror once), or again with ``refresh``."""
    if arch == native.host_arch():
        return []
    root = cache / "apt" / arch
    opts = ["-o", f"APT::Architecture={arch}", "-o", f"APT::Architectures::={arch}",
            "-o", f"Dir::State::Lists={root}/lists", "-o", f"Dir::State::status={root}/status",
            "-o", f"Dir::Cache={root}/cache", "-o", f"Dir::Cache::Archives={root}/cache/archives",
            "-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache="]
    if refresh or not any((root / "lists").glob("*_Packages*")):
        for d in (root / "lists" / "partial", root / "cache" / "archives" / "partial"):
            d.mkdir(parents=True, exist_ok=True)
        (root / "status").touch()
        try:
            _run(["apt-get", *opts, "-q", "update"], f"fetch Debian's {arch} package index (apt-get update)",
                 timeout=900)
        except Exception:
            shutil.rmtree(root / "lists", ignore_errors=True)  # half an index would be taken for a whole one
            raise
    return opts
