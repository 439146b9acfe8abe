"""Building the native ``weft-oci-hook`` (``weft_oci_hook.c``): the same contract as ``weft_oci_hook.py``.

runc waits for the hook at every start of a container of the ``weft`` handler,
and most of the Python hook's time there is the interpreter's start-up; the C
program does the same work without one. It is built static, with the C
compiler alone (standard C and POSIX, no library beyond libc), so the binary
runs on any Linux host of the build's architecture. Where no compiler is
found, callers fall back to the Python hook, which stays the reference.

The build is cached by the source's digest: ``build()`` returns the same file
until ``weft_oci_hook.c`` changes. ``arch`` names the machine the binary is for
(the image's architectures: amd64, arm64); one other than this host's is built
with Debian's cross compiler for it and, on this host, runs under qemu-user
(``runner()``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("weft_oci_hook.c")
NAME = "weft-oci-hook"
CACHE = Path(os.environ.get("WEFT_CACHE_ROOT") or "/var/cache/weft") / "hook"
CFLAGS = ("-O2", "-static", "-std=c11", "-Wall", "-Wextra", "-Werror")
# OCI's architecture names -> (uname -m, Debian's cross compiler for it, qemu-user's static emulator of it).
ARCHES = {"amd64": ("x86_64", "x86_64-linux-gnu-gcc", "qemu-x86_64-static"),
          "arm64": ("aarch64", "aarch64-linux-gnu-gcc", "qemu-aarch64-static")}


def host_arch() -> str:
    """This host's architecture by OCI's name (amd64, arm64)."""
    machine = platform.machine()
    return next((a for a, (m, _, _) in ARCHES.items() if m == machine), machine)


def _known(arch: str) -> None:
    if arch not in ARCHES:
        raise NativeHookUnavailable(f"no native hook for architecture {arch!r} (known: {', '.join(ARCHES)})")


class NativeHookUnavailable(Exception):
    """No native hook here (no C compiler, or the build failed): the message says which."""


def compiler(arch: str | None = None) -> str | None:
    """This host's C compiler (``$CC``, ``cc`` or ``gcc``), or, for another ``arch``, Debian's cross compiler."""
    if arch is not None and arch != host_arch():
        _known(arch)
        return shutil.which(ARCHES[arch][1])
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def runner(arch: str) -> list[str]:
    """The argv prefix that runs an ``arch`` binary here: none for this host's, else qemu-user's emulator."""
    if arch == host_arch():
        return []
    _known(arch)
    qemu = shutil.which(ARCHES[arch][2])
    if qemu is None:
        raise NativeHookUnavailable(f"no {ARCHES[arch][2]} to run an {arch} binary here "
                                    "(scripts/setup.sh installs qemu-user-static)")
    return [qemu]


def compile_to(dest: Path, source: Path = SOURCE, arch: str | None = None) -> Path:
    """Compile the hook (``source``: this checkout's by default) for ``arch`` (this host's by default) to
    ``dest``, static; raises NativeHookUnavailable naming what went wrong."""
    cc = compiler(arch)
    if cc is None:
        if arch is not None and arch != host_arch():
            raise NativeHookUnavailable(f"no {ARCHES[arch][1]} to build the native OCI hook for {arch} "
                                        "(scripts/setup.sh installs gcc-aarch64-linux-gnu)")
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


def build(cache: Path = CACHE, arch: str | None = None) -> Path:
    """The native hook for ``arch`` (this host's by default), built once per source under ``cache``; raises
    NativeHookUnavailable."""
    other = arch is not None and arch != host_arch()
    dest = cache / (f"{digest()}-{arch}" if other else digest()) / NAME
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    return compile_to(dest, arch=arch)
