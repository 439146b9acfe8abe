"""Tiny OCI images built locally, because these machines cannot pull.

Each image is one uncompressed layer holding ``/bin/busybox`` (from Debian's
busybox-static) and a symlink per applet, plus a config and a manifest, packed
as an OCI archive that ``ctr images import`` takes. The archives are
deterministic (fixed mtimes, sorted entries), so the same inputs give the same
image ID on every instance and every run, and they are cached on disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# WEFT_BUSYBOX: a static busybox elsewhere (the GPU proof carries Debian's to a machine without one).
BUSYBOX = Path(os.environ.get("WEFT_BUSYBOX", "/bin/busybox"))

BUSYBOX_IMAGE = "docker.io/library/busybox:weft-test"
PAUSE_IMAGE = "registry.k8s.io/pause:weft-test"

# The pause container only has to hold the sandbox's namespaces and exit
# cleanly on TERM; busybox's shell does that.
_PAUSE_CMD = ["sh", "-c", 'trap "exit 0" TERM INT; while :; do sleep 3600 & wait; done']

_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class ImageSpec:
    name: str
    cmd: tuple[str, ...]
    user: str = ""  # the config's User ("1002", "www-data:1004"); "" runs as root
    env: tuple[str, ...] = ()  # the config's Env beside PATH ("NVIDIA_VISIBLE_DEVICES=all", as CUDA images set)


IMAGES = (
    ImageSpec(BUSYBOX_IMAGE, ("sh",)),
    ImageSpec(PAUSE_IMAGE, tuple(_PAUSE_CMD)),
)


def _applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True, text=True)
    return sorted(a for a in out.stdout.split() if a and a != "busybox")


def _add(tar: tarfile.TarFile, info: tarfile.TarInfo, data: bytes | None = None) -> None:
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _layer(passwd: str = "", group: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "etc", "tmp", "proc", "sys", "dev", "root", "var", "var/log"):
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            _add(tar, info)
        data = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size = len(data)
        info.mode = 0o755
        _add(tar, info, data)
        for applet in _applets():
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            info.mode = 0o777
            _add(tar, info)
        for name, text in (
            ("etc/passwd", "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n" + passwd),
            ("etc/group", "root:x:0:\nnogroup:x:65534:\n" + group),
        ):
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            info.mode = 0o644
            _add(tar, info, raw)
    return buf.getvalue()


def busybox_layer(passwd: str = "", group: str = "") -> bytes:
    """The busybox layer, with extra ``/etc/passwd`` and ``/etc/group`` lines if given."""
    return _layer(passwd, group)


def files_layer(files: dict[str, bytes | str], mode: int = 0o644) -> bytes:
    """A layer holding just these files (paths without a leading slash; their directories are made), each a
    regular file with ``mode``, or a symlink where its value is a str (the link's target)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(parent) for name in files for parent in Path(name).parents} - {"."})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            _add(tar, info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type = tarfile.SYMTYPE
                info.linkname = data
                info.mode = 0o777
                _add(tar, info)
            else:
                info.size = len(data)
                info.mode = mode
                _add(tar, info, data)
    return buf.getvalue()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def build_archive(spec: ImageSpec, dest: Path, layer: bytes | None = None,
                  extra_layers: tuple[bytes, ...] = ()) -> Path:
    """Write an OCI archive for ``spec`` to ``dest`` and return it: ``layer`` (busybox's by default) and
    ``extra_layers`` over it."""
    layers = [layer if layer is not None else _layer(), *extra_layers]
    image_config: dict = {
        "Cmd": list(spec.cmd),
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", *spec.env],
        "WorkingDir": "/",
    }
    if spec.user:
        image_config["User"] = spec.user
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": image_config,
            "rootfs": {"type": "layers", "diff_ids": [_digest(blob) for blob in layers]},
            "history": [{"created_by": "weft integration harness"}],
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": _OCI_MANIFEST,
            "config": {"mediaType": _OCI_CONFIG, "digest": _digest(config), "size": len(config)},
            "layers": [{"mediaType": _OCI_LAYER, "digest": _digest(blob), "size": len(blob)} for blob in layers],
        },
        sort_keys=True,
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": _OCI_MANIFEST,
                    "digest": _digest(manifest),
                    "size": len(manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": spec.name,
                        "org.opencontainers.image.ref.name": spec.name.rsplit(":", 1)[1],
                    },
                }
            ],
        },
        sort_keys=True,
    ).encode()
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, mode="w", format=tarfile.PAX_FORMAT) as tar:
        blobs = tarfile.TarInfo("blobs")
        blobs.type = tarfile.DIRTYPE
        blobs.mode = 0o755
        _add(tar, blobs)
        sha = tarfile.TarInfo("blobs/sha256")
        sha.type = tarfile.DIRTYPE
        sha.mode = 0o755
        _add(tar, sha)
        for blob in dict.fromkeys([*layers, config, manifest]):
            info = tarfile.TarInfo("blobs/sha256/" + _digest(blob).split(":", 1)[1])
            info.size = len(blob)
            info.mode = 0o644
            _add(tar, info, blob)
        for name, raw in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)):
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            info.mode = 0o644
            _add(tar, info, raw)
    os.replace(tmp, dest)
    return dest


def cached_archives(cache_dir: Path) -> list[Path]:
    """Build (once) and return the archives of every test image."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()[:16]
    wanted = [cache_dir / f"{spec.name.replace('/', '_').replace(':', '_')}-{key}.tar" for spec in IMAGES]
    if not all(p.exists() for p in wanted):
        layer = _layer()
        for spec, path in zip(IMAGES, wanted, strict=True):
            build_archive(spec, path, layer)
    return wanted


# Parts of the standard library a scripted client never imports: left out of a Python image.
_STDLIB_SKIP = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "site-packages",
                          "dist-packages", "__pycache__", "lib2to3", "pydoc_data"})
_PYTHON_PATHS = ("import json, os, sys, sysconfig, _ctypes; print(json.dumps({'exe': os.path.realpath(sys.executable), "
                 "'stdlib': sysconfig.get_paths()['stdlib'], 'dynload': os.path.dirname(_ctypes.__file__)}))")


def _shared_libraries(binaries: list[str]) -> set[str]:
    """The shared libraries (and loader) these ELF files load, as ``ldd`` finds them on this machine."""
    found: set[str] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", binary], capture_output=True, text=True).stdout
        for line in out.splitlines():
            words = line.split()
            path = words[2] if len(words) >= 3 and words[1] == "=>" else words[0] if words else ""
            if path.startswith("/"):
                found.add(path)
    return found


def python_layer(python: str, files: dict[str, bytes], libraries_of: Sequence[str] = ()) -> bytes:
    """A layer with this machine's Python (its interpreter as ``/usr/bin/python3``, its standard library and
    the shared libraries they load, from this machine) and ``files``: an image that runs a standard-library
    script where no registry can be reached. ``libraries_of``: libraries the container gets from elsewhere (a
    driver's libcuda, mounted by CDI) whose own dependencies the image must hold (libdl, librt: glibc's, but
    files of their own that Python alone does not load)."""
    paths = json.loads(subprocess.run([python, "-I", "-S", "-c", _PYTHON_PATHS], check=True, capture_output=True,
                                      text=True).stdout)
    entries: dict[str, bytes | str] = {}  # path in the image -> content, or a symlink's target
    stdlib = Path(paths["stdlib"])
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP and not d.startswith("config-"))
        for name in names:
            path = Path(root, name)
            if path.is_file():
                entries[str(path).lstrip("/")] = path.read_bytes()
    dynload = Path(paths["dynload"])
    extensions = sorted(str(p) for p in dynload.glob("*.so")) if dynload != stdlib else []
    for ext in extensions:
        entries[ext.lstrip("/")] = Path(ext).read_bytes()
    for lib in sorted(_shared_libraries([paths["exe"], *extensions, *libraries_of]) - set(libraries_of)):
        entries[lib.lstrip("/")] = Path(lib).read_bytes()  # read through any symlink: the file the loader opens
    entries[paths["exe"].lstrip("/")] = Path(paths["exe"]).read_bytes()
    if paths["exe"] != "/usr/bin/python3":
        entries["usr/bin/python3"] = paths["exe"]
    entries.update(files)
    return files_layer(entries, mode=0o755)
