"""Builds the fake libcuda (``fake_libcuda.c``) with the system's C compiler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_libcuda.c")


def build(directory: Path) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc or gcc) builds the fake libcuda these tests load"
    out = directory / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out), str(SOURCE)], check=True)
    return str(out)
