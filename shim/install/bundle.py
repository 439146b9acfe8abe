"""A self-contained weft for the host: the running Python, its standard library, weft and its dependencies.

The DaemonSet's image has Python; the host may not (or not the same one), and
systemd must run weft without the image. So ``/opt/weft`` gets::

    bin/python3                 the interpreter binary (lib/libpython3.X.so* beside it when shared)
    bin/weft, bin/weft-oci-hook launchers (sh) that find their own directory, so the tree can live anywhere
    lib/python3.X/              the standard library, less tests, IDLE, Tk and ensurepip
    lib/python3.X/site-packages weft (shim, hooks) and the installed distributions its requirements pull in

Python finds its prefix from the binary's location (the ``lib/python3.X/os.py``
landmark), so the copy uses nothing of the image. It still needs the host's
libc (glibc, as every mainstream node OS has). The hook launcher runs with
``-S -I``: the hook imports only the standard library. ``--source DIR``
copies a prepared tree instead (a CI-built bundle, or a small one in tests).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import shim

MARKER = ".weft-bundle"
_SKIP_STDLIB = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
                "lib2to3", "__pycache__"}
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"

WEFT_SH = """#!/bin/sh
# weft, self-contained (written by weft install)
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/python3" -I -m shim "$@"
"""
HOOK_SH = f"""#!/bin/sh
# weft's OCI hook, self-contained (written by weft install): standard library only (-S -I)
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" \\
  exec "$here/python3" -S -I "$here/../lib/{PYVER}/site-packages/hooks/weft_oci_hook.py" "$@"
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distributions() -> list[md.Distribution]:
    """weft's requirement closure, as installed (a requirement that is not installed is not needed here)."""
    seen: dict[str, md.Distribution] = {}
    todo = [str(r) for r in (md.distribution("weft").requires or [])] if _has("weft") else []
    while todo:
        req = todo.pop()
        if "extra ==" in req:
            continue
        name = _norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0))  # type: ignore[union-attr]
        if name in seen or not _has(name):
            continue
        seen[name] = md.distribution(name)
        todo += [r for r in seen[name].requires or [] if "extra ==" not in r]
    return list(seen.values())


def _has(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def _tree(src: Path, rel: str, skip: set[str]) -> Iterator[tuple[Path, str]]:
    for d, dirs, files in os.walk(src):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        for f in sorted(files):
            if not f.endswith(".pyc"):
                p = Path(d) / f
                yield p, f"{rel}/{p.relative_to(src)}"


def manifest() -> list[tuple[Path, str]]:
    """(source file, path in the bundle) for a bundle of the running interpreter and weft."""
    out: list[tuple[Path, str]] = [(Path(sys.executable).resolve(), "bin/python3")]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir = Path(sysconfig.get_config_var("LIBDIR"))
        for lib in sorted(libdir.glob(f"libpython{sys.version_info.major}.{sys.version_info.minor}*.so*")):
            out.append((lib.resolve(), f"lib/{lib.name}"))
    out += _tree(Path(sysconfig.get_paths()["stdlib"]), f"lib/{PYVER}", _SKIP_STDLIB | {
        d for d in os.listdir(sysconfig.get_paths()["stdlib"]) if d.startswith("config-")})
    site = f"lib/{PYVER}/site-packages"
    for pkg in ("shim", "hooks"):
        mod = sys.modules.get(pkg) or __import__(pkg)
        out += _tree(Path(mod.__file__).parent, f"{site}/{pkg}", {"__pycache__"})  # type: ignore[arg-type]
    for dist in _distributions():
        for f in dist.files or []:
            if ".." in f.parts or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                out.append((p, f"{site}/{f.as_posix()}"))
    return out


def digest(files: list[tuple[Path, str]]) -> str:
    h = hashlib.sha256(shim.__version__.encode())
    for src, rel in files:
        st = src.stat()
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def source_files(source: Path | None) -> list[tuple[Path, str]]:
    if source is None:
        return manifest()
    return list(_tree(source, ".", set()))


def build(files: list[tuple[Path, str]], dest: Path, stamp: str, launchers: bool) -> None:
    """Copy ``files`` into ``dest`` (which must not exist) and write the launchers and the marker."""
    for src, rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    if launchers:
        for name, text in (("weft", WEFT_SH), ("weft-oci-hook", HOOK_SH)):
            (dest / "bin" / name).write_text(text)
            (dest / "bin" / name).chmod(0o755)
    (dest / MARKER).write_text(stamp + "\n")

