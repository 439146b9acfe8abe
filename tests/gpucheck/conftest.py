"""The fake libcuda (``fake_libcuda.c``), built once per session with the system's C compiler."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("fake_libcuda.c")


@pytest.fixture(scope="session")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (cc or gcc) builds the fake libcuda these tests load"
    out = tmp_path_factory.mktemp("fake-libcuda") / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(out), str(SOURCE)], check=True)
    return str(out)
