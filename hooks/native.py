"""Building the native ``weft-oci-hook`` (``weft_oci_hook.c``): the same contract as ``weft_oci_hook.py``.

runc waits for the hook at every start of a container of the ``weft`` handler,
and most of the Python hook's time there is the interpreter's start-up; the C
program does the same work without one. It is built static, with the C
compiler alone (standard C and POSIX, no library beyond libc), so the binary
runs on any Linux host of the build's architecture. Where no compiler is
found, callers fall back to the Python hook, which stays the reference.

The build is cached by the source's digest: ``build()`` returns the same file
until ``weft_oci_hook.c`` changes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("weft_oci_hook.c")
NAME = "weft-oci-hook"
CACHE = Path(os.environ.get("WEFT_CACHE_ROOT") or "/var/cache/weft") / "hook"
CFLAGS = ("-O2", "-static", "-std=c11", "-Wall", "-Wextra", "-Werror")


class NativeHookUnavailable(Exception):
    """No native hook here (no C compiler, or the build failed): the message says which."""


def compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def compile_to(dest: Path, source: Path = SOURCE) -> Path:
    """Compile the hook (``source``: this checkout's by default) to ``dest``, static; raises
    NativeHookUnavailable naming what went wrong."""
    cc = compiler()
    if cc is None:
        raise NativeHookUnavailable("no C compiler (cc, gcc or $CC) to build the native OCI hook")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        out = Path(tmp) / NAME
        res = subprocess.run([cc, *CFLAGS, "-o", str(out), str(source)], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0:
            raise NativeHookUnavailable(f"{cc} could not build {source}: {res.stderr.strip()[-2000:]}")
        out.chmod(0o755)
        os.replace(out, dest)  # whole or not at all: a half-written hook would fail every container
    return dest


def digest() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build(cache: Path = CACHE) -> Path:
    """The native hook, built once per source under ``cache``; raises NativeHookUnavailable."""
    dest = cache / digest() / NAME
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    return compile_to(dest)
