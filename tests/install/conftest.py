"""Host roots laid out like nodes (``tests/data/hostroots``, its README says where each comes from), and a
byte-exact snapshot of a tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

HOSTROOTS = Path(__file__).resolve().parent.parent / "data" / "hostroots"
SHAPES = sorted(p.name for p in HOSTROOTS.iterdir() if p.is_dir())
# The shapes whose usr/bin/containerd is a 2.x (README.md says where each comes from).
SHAPES_2X = [s for s in SHAPES if s.startswith("ctrd2-")]
SHAPES_1X = [s for s in SHAPES if s not in SHAPES_2X]


def snapshot(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every file and directory under ``root``: kind, mode and bytes (what "byte-identical" means here)."""
    out: dict[str, tuple[str, int, bytes]] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs:
            p = Path(d, name)
            out[str(p.relative_to(root))] = ("dir", p.stat().st_mode, b"")
        for name in files:
            p = Path(d, name)
            out[str(p.relative_to(root))] = ("file", p.stat().st_mode, p.read_bytes())
    return out


def stamps(root: Path) -> dict[str, int]:
    return {str(Path(d, f).relative_to(root)): Path(d, f).stat().st_mtime_ns
            for d, _, files in os.walk(root) for f in files}


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """A small prepared weft tree for ``--source`` (the real bundle is tested on its own)."""
    src = tmp_path / "weft-src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "weft").write_text("#!/bin/sh\necho weft 0.0.0-test\n")
    (src / "bin" / "weft").chmod(0o755)
    return src


def copy_shape(name: str, dest: Path) -> Path:
    shutil.copytree(HOSTROOTS / name, dest, symlinks=True)
    return dest
