"""An OCI image layout on disk: content-addressed blobs, an index, read and written; and a reproducible layer tar."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path

from nodeimage.build.common import (
    _DOCKER_LIST,
    _MT_CONFIG,
    _MT_INDEX,
    _MT_LAYER,
    _MT_MANIFEST,
    BuildError,
    _digest,
    _json,
)


class Layout:
    """An OCI image layout directory (``oci-layout``, ``index.json``, ``blobs/sha256/``)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def blob_path(self, digest: str) -> Path:
        algo, _, hexd = digest.partition(":")
        return self.root / "blobs" / algo / hexd

    def read_blob(self, digest: str) -> bytes:
        data = self.blob_path(digest).read_bytes()
        if _digest(data) != digest:
            raise BuildError(f"OCI layout {self.root}: blob {digest} is corrupt; remove {self.root} and build again")
        return data

    def write_blob(self, data: bytes) -> dict:
        d = _digest(data)
        p = self.blob_path(d)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not p.exists():
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        return {"digest": d, "size": len(data)}

    def image(self, arch: str = "amd64") -> tuple[dict, dict]:
        """The linux/``arch`` image manifest and its config (through an index of several, if that is what the
        layout holds)."""
        index = json.loads((self.root / "index.json").read_text())
        desc = self._pick(index.get("manifests") or [], arch)
        doc = json.loads(self.read_blob(desc["digest"]))
        while doc.get("mediaType") in (_MT_INDEX, _DOCKER_LIST) or "manifests" in doc:
            desc = self._pick(doc["manifests"], arch)
            doc = json.loads(self.read_blob(desc["digest"]))
        config = json.loads(self.read_blob(doc["config"]["digest"]))
        if config.get("architecture", arch) != arch:
            raise BuildError(f"OCI layout {self.root} holds a linux/{config['architecture']} image, not linux/{arch}")
        return doc, config

    def _pick(self, manifests: list[dict], arch: str) -> dict:
        for m in manifests:
            plat = m.get("platform")
            if plat is None or (plat.get("os"), plat.get("architecture")) == ("linux", arch):
                return m
        raise BuildError(f"OCI layout {self.root} has no linux/{arch} image")


def layer_tar(entries: Iterable[tuple[tarfile.TarInfo, bytes | None]], mtime: int = 0) -> bytes:
    """A layer tar that depends on nothing but the entries' names, types, modes, link targets and contents:
    sorted by name (parents first, added where missing), owner root, every time ``mtime``, no extended headers
    (a pax header carries times and owners of its own)."""
    by_name = {info.name: (info, data) for info, data in entries}
    for name in list(by_name):
        parts = name.split("/")
        for i in range(1, len(parts)):
            parent = "/".join(parts[:i])
            if parent not in by_name:
                d = tarfile.TarInfo(parent)
                d.type, d.mode = tarfile.DIRTYPE, 0o755
                by_name[parent] = (d, None)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(by_name):
            info, data = by_name[name]
            info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, 0, 0, "root", "root"
            info.pax_headers = {}
            if info.isfile():
                info.size = len(data or b"")
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    return buf.getvalue()


def write_layout(root: Path, layers: list[tuple[str, bytes]], config: dict, name: str | None,
                  base: Layout | None = None, base_layers: list[dict] | None = None, arch: str = "amd64") -> dict:
    """A layout of one image: its manifest, named in ``index.json``."""
    manifest, desc = write_image(root, layers, config, base, base_layers, arch)
    write_index(root, [desc], name)
    return manifest


def write_image(root: Path, layers: list[tuple[str, bytes]], config: dict, base: Layout | None = None,
                base_layers: list[dict] | None = None, arch: str = "amd64") -> tuple[dict, dict]:
    """One image's blobs (the base's layers, ``layers``, config, manifest) into the layout at ``root``:
    (manifest, its descriptor with its platform)."""
    out = Layout(root)
    root.mkdir(parents=True, exist_ok=True)
    descs = []
    for desc in base_layers or []:
        assert base is not None
        out.write_blob(base.read_blob(desc["digest"]))
        descs.append({"mediaType": _oci_media_type(desc["mediaType"]), "digest": desc["digest"], "size": desc["size"]})
    for mt, data in layers:
        descs.append({"mediaType": mt, **out.write_blob(data)})
    cfg_desc = {"mediaType": _MT_CONFIG, **out.write_blob(_json(config))}
    manifest = {"schemaVersion": 2, "mediaType": _MT_MANIFEST, "config": cfg_desc, "layers": descs}
    man_desc = {"mediaType": _MT_MANIFEST, **out.write_blob(_json(manifest)),
                "platform": {"architecture": arch, "os": "linux"}}
    return manifest, man_desc


def write_index(root: Path, images: list[dict], name: str | None) -> dict:
    """``index.json``, naming the image: one image's manifest itself, several through an image index of them (a
    multi-architecture image, as registries and ``ctr images import`` take it); the descriptor it names."""
    if len(images) == 1:
        desc = dict(images[0])
    else:
        index = {"schemaVersion": 2, "mediaType": _MT_INDEX, "manifests": images}
        desc = {"mediaType": _MT_INDEX, **Layout(root).write_blob(_json(index))}
    if name:
        desc["annotations"] = {"io.containerd.image.name": name,
                               "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "mediaType": _MT_INDEX,
                                                 "manifests": [desc]}, sort_keys=True))
    return desc


def _oci_media_type(mt: str) -> str:
    return {"application/vnd.docker.image.rootfs.diff.tar.gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
            "application/vnd.docker.image.rootfs.diff.tar": _MT_LAYER}.get(mt, mt)
