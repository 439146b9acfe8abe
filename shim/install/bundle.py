"""A self-contained weft for the host: the running Python, its standard library, weft, its dependencies and the
shared libraries they need beyond the C library.

The DaemonSet's image has Python; the host may not (or not the same one), and
systemd must run weft without the image. So ``/opt/weft`` gets::

    bin/python3                 the interpreter binary
    bin/weft, bin/weft-oci-hook launchers (sh) that find their own directory, so the tree can live anywhere;
                                bin/weft-oci-hook is the native hook itself where weft's hooks carry one (the
                                node image builds it), a static program that needs nothing of the copy
    lib/*.so*                   libpython where it is shared, and every library the interpreter, the standard
                                library's extension modules and the dependencies' link that is not part of the C
                                library (libsqlite3, libssl, libffi, libstdc++, ...): a minimal node has few of them
    lib/python3.X/              the standard library, less tests, IDLE, Tk and ensurepip
    lib/weft/                   weft (shim, hooks) and its dependencies
    lib/weft-main.py            what bin/weft runs: puts lib/weft first on the path, then weft's command line

Python finds its prefix from the binary's location (the ``lib/python3.X/os.py``
landmark), so the copy uses nothing of the image. weft lives in a directory
of its own rather than in ``site-packages`` because where ``site`` looks
depends on who built the interpreter (Debian's looks in ``dist-packages``):
the entry script names the directory itself. The dependencies are weft's
requirement closure where weft's package metadata is installed (a virtual
environment), else every distribution installed beside ``shim`` (the node
image installs them with ``pip --target`` into a directory of weft's own).
The copy still needs the host's C library (glibc, as every mainstream node OS
has); :func:`check_argv` is the installer's proof that it runs there. Without
the native hook, the hook launcher runs the Python one with ``-S -I``: it
imports only the standard library.
``--source DIR`` copies a prepared tree instead (a CI-built bundle, or a small
one in tests).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import os
import re
import shutil
import struct
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import shim
from hooks import native

MARKER = ".weft-bundle"
_SKIP_STDLIB = {"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip",
                "lib2to3", "__pycache__"}
PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
APP = "lib/weft"  # weft and its dependencies, in the bundle
ENTRY = "lib/weft-main.py"
NATIVE_HOOK = f"{APP}/hooks/{native.NAME}"  # where the node image puts the native hook, beside the Python one
# The C library's own objects: the host's are the ones that must be used (they go with its loader).
_GLIBC = re.compile(r"^(ld-linux.*|libc|libm|libmvec|libpthread|libdl|librt|libutil|libresolv|libanl|libnsl"
                    r"|libBrokenLocale|libthread_db|libnss_\w+|libc_malloc_debug|libmemusage|libpcprofile)"
                    r"\.so(\.\d+)*$")

ENTRY_PY = """# weft's command line in the copy under /opt/weft (written by weft install), run by bin/weft.
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "weft"))
# The launcher put the copy's libraries on the loader's path for this process alone: what weft starts (systemctl,
# nsenter, ip, ...) is the host's and gets the host's path back.
was = os.environ.pop("WEFT_HOST_LD_LIBRARY_PATH", None)
if was is None:
    os.environ.pop("LD_LIBRARY_PATH", None)
else:
    os.environ["LD_LIBRARY_PATH"] = was
from shim.cli import main  # noqa: E402

sys.exit(main())
"""
WEFT_SH = """#!/bin/sh
# weft, self-contained (written by weft install)
here=$(dirname "$(readlink -f "$0")")
[ -n "${LD_LIBRARY_PATH+set}" ] && export WEFT_HOST_LD_LIBRARY_PATH="$LD_LIBRARY_PATH"
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \\
  exec "$here/python3" -I "$here/../lib/weft-main.py" "$@"
"""
HOOK_SH = """#!/bin/sh
# weft's OCI hook, self-contained (written by weft install): standard library only (-S -I)
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH="$here/../lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \\
  exec "$here/python3" -S -I "$here/../lib/weft/hooks/weft_oci_hook.py" "$@"
"""
# What the services import, and the standard library's extension modules that they load on the way: run by the
# copied interpreter on the host before any service is started (check_argv).
CHECK_IMPORTS = ("shim.agent", "shim.brokerd", "shim.cli", "sqlite3", "ssl", "ctypes", "grpc")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _distributions() -> list[md.Distribution]:
    """weft's requirement closure, as installed; without weft's metadata, what is installed beside ``shim``."""
    if not _has("weft"):
        home = str(Path(shim.__file__).resolve().parent.parent)
        return [d for d in md.distributions(path=[home]) if _norm(d.metadata["Name"] or "") != "weft"]
    seen: dict[str, md.Distribution] = {}
    todo = [str(r) for r in (md.distribution("weft").requires or [])]
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


# -- the shared libraries the copy needs ----------------------------------------------------------------------
def _elf(path: Path) -> tuple[bytes, str, list[tuple[int, int, int, int]]] | None:
    """A 64-bit ELF file's bytes, byte order and program headers (type, offset, address, size in the file)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if data[:5] != b"\x7fELF\x02" or len(data) < 64:
        return None
    end = "<" if data[5] == 1 else ">"
    phoff, = struct.unpack_from(end + "Q", data, 32)
    phentsize, phnum = struct.unpack_from(end + "HH", data, 54)
    headers = []
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(end + "IIQQQQ", data, phoff + i * phentsize)
        headers.append((p_type, p_offset, p_vaddr, p_filesz))
    return data, end, headers


def elf_needs(path: Path) -> tuple[list[str], list[str]] | None:
    """An ELF file's DT_NEEDED names and its RPATH/RUNPATH entries; None for a file that is not a 64-bit ELF."""
    elf = _elf(path)
    if elf is None:
        return None
    data, end, headers = elf
    loads = [(vaddr, offset, size) for kind, offset, vaddr, size in headers if kind == 1]  # PT_LOAD
    dynamic = next(((offset, size) for kind, offset, _, size in headers if kind == 2), None)  # PT_DYNAMIC
    if dynamic is None:
        return [], []
    entries, strtab = [], None
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from(end + "qQ", data, off)
        if tag == 0:
            break
        if tag == 5:
            strtab = val
        elif tag in (1, 15, 29):  # DT_NEEDED, DT_RPATH, DT_RUNPATH
            entries.append((tag, val))
    base = next((o + strtab - v for v, o, n in loads if strtab is not None and v <= strtab < v + n), None)
    if base is None:
        return [], []

    def string(at: int) -> str:
        return data[base + at:data.index(b"\0", base + at)].decode()

    needed = [string(v) for t, v in entries if t == 1]
    paths = [p for t, v in entries if t != 1 for p in string(v).split(":") if p]
    return needed, paths


def elf_interpreter(path: Path) -> str | None:
    """The dynamic loader an ELF executable names (PT_INTERP), if any."""
    elf = _elf(path)
    if elf is None:
        return None
    data, _, headers = elf
    return next((data[offset:offset + size].rstrip(b"\0").decode()
                 for kind, offset, _, size in headers if kind == 3), None)


def _system_lib_dirs() -> list[Path]:
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [f"/lib/{arch}", f"/usr/lib/{arch}", "/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib"]
    return [Path(d) for d in dirs if d and Path(d).is_dir()]


def native_libraries(objects: list[Path]) -> list[Path]:
    """The shared libraries ``objects`` need, transitively, that are not the C library's nor found next to them
    (a wheel's own ``<name>.libs``, through its $ORIGIN run path): what a host may lack."""
    system = _system_lib_dirs()
    out: dict[str, Path] = {}
    todo = list(objects)
    while todo:
        obj = todo.pop()
        found = elf_needs(obj)
        if found is None:
            continue
        needed, paths = found
        own = [Path(p.replace("$ORIGIN", str(obj.parent)).replace("${ORIGIN}", str(obj.parent))) for p in paths]
        for name in needed:
            if _GLIBC.match(name) or name in out or any((d / name).exists() for d in own):
                continue
            lib = next((d / name for d in system if (d / name).exists()), None)
            if lib is not None:
                out[name] = lib
                todo.append(lib.resolve())
    return [out[n] for n in sorted(out)]


def manifest() -> list[tuple[Path, str]]:
    """(source file, path in the bundle) for a bundle of the running interpreter and weft."""
    python = Path(sys.executable).resolve()
    out: list[tuple[Path, str]] = [(python, "bin/python3")]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir = Path(sysconfig.get_config_var("LIBDIR"))
        for lib in sorted(libdir.glob(f"libpython{sys.version_info.major}.{sys.version_info.minor}*.so*")):
            out.append((lib.resolve(), f"lib/{lib.name}"))
    out += [(p, rel) for p, rel in _tree(Path(sysconfig.get_paths()["stdlib"]), f"lib/{PYVER}", _SKIP_STDLIB | {
        d for d in os.listdir(sysconfig.get_paths()["stdlib"]) if d.startswith("config-")})
        if not p.name.startswith("_tkinter")]  # Tk, and the X libraries it links, with tkinter
    for pkg in ("shim", "hooks"):
        mod = sys.modules.get(pkg) or __import__(pkg)
        out += _tree(Path(mod.__file__).parent, f"{APP}/{pkg}", {"__pycache__"})  # type: ignore[arg-type]
    for dist in _distributions():
        for f in dist.files or []:
            if ".." in f.parts or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            p = Path(str(dist.locate_file(f)))
            if p.is_file():
                out.append((p, f"{APP}/{f.as_posix()}"))
    have = {rel.rsplit("/", 1)[-1] for _, rel in out if rel.startswith("lib/") and rel.count("/") == 1}
    objects = [src for src, rel in out if rel == "bin/python3" or ".so" in rel.rsplit("/", 1)[-1]]
    out += [(lib.resolve(), f"lib/{lib.name}") for lib in native_libraries(objects) if lib.name not in have]
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
        (dest / ENTRY).write_text(ENTRY_PY)
        (dest / "bin").mkdir(parents=True, exist_ok=True)
        for name, text in (("weft", WEFT_SH), ("weft-oci-hook", HOOK_SH)):
            if name == "weft-oci-hook" and (dest / NATIVE_HOOK).is_file():
                shutil.copy2(dest / NATIVE_HOOK, dest / "bin" / name)
            else:
                (dest / "bin" / name).write_text(text)
            (dest / "bin" / name).chmod(0o755)
    (dest / MARKER).write_text(stamp + "\n")


def check_argv(opt: str) -> list[str]:
    """A command, run on the host (``opt`` as the host sees it), that exits 0 only where the copy's services
    can start: the copied interpreter imports what they import, each library it loads found."""
    code = f"import sys; sys.path.insert(0, {opt + '/' + APP!r}); " + "; ".join(f"import {m}" for m in CHECK_IMPORTS)
    return ["/usr/bin/env", f"LD_LIBRARY_PATH={opt}/lib", f"{opt}/bin/python3", "-I", "-c", code]
