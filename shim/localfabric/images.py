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
from dataclasses import dataclass
from pathlib import Path

BUSYBOX = Path("/bin/busybox")

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


def files_layer(files: dict[str, bytes]) -> bytes:
    """A layer holding just these regular files (paths without a leading slash; their directories are made)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = sorted({str(Path(name).parent) for name in files} - {"."})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o755
            _add(tar, info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
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
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
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
