"""The image itself: config, manifest, the OCI layout and its archive, from a base and the weft layer."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from nodeimage.build.base import resolve_base
from nodeimage.build.common import (
    _MT_LAYER,
    ARCHIVE_NAME,
    CACHE,
    CONTAINERFILE_BASE,
    DEFAULT_BASE,
    DEFAULT_NAME,
    DEFAULT_PLATFORMS,
    PINFILE,
    REPO,
    BuildError,
    _digest,
    _json,
    parse_platforms,
    rfc3339,
    source_date_epoch,
)
from nodeimage.build.containerfile import Plan, parse_containerfile
from nodeimage.build.layer import weft_layer
from nodeimage.build.layout import write_image, write_index
from nodeimage.build.pins import read_pins


def image_config(base_config: dict, plan: Plan, layer: bytes, created: int = 0) -> dict:
    """The base's config with the Containerfile's ENV/LABEL/USER/ENTRYPOINT/CMD and one more layer, dated
    ``created`` (seconds since 1970: the source's date, never the build's)."""
    cfg = json.loads(json.dumps(base_config))
    c = cfg.setdefault("config", {})
    env = dict(e.split("=", 1) for e in c.get("Env") or [])
    env.update(plan.env)
    c["Env"] = [f"{k}={v}" for k, v in env.items()]
    if plan.labels:
        c["Labels"] = {**(c.get("Labels") or {}), **plan.labels}
    if plan.user:
        c["User"] = plan.user
    if plan.entrypoint:
        c["Entrypoint"] = plan.entrypoint
        c["Cmd"] = plan.cmd or None  # an ENTRYPOINT resets the base's CMD, as in a real build
    elif plan.cmd:
        c["Cmd"] = plan.cmd
    cfg["rootfs"] = {"type": "layers", "diff_ids": [*cfg["rootfs"]["diff_ids"], _digest(layer)]}
    cfg["created"] = rfc3339(created)
    cfg["history"] = [*(cfg.get("history") or []),
                      {"created": rfc3339(created), "created_by": "nodeimage/build.py (nodeimage/Containerfile)"}]
    return cfg


def _archive(layout: Path, dest: Path) -> None:
    """The layout as one tar, its bytes fixed by the layout's names and contents alone: sorted, owner root,
    mtime 0, modes 0644/0755 (not the umask's), no extended headers."""
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(layout.rglob("*"), key=lambda p: p.relative_to(layout).as_posix()):
            info = tarfile.TarInfo(p.relative_to(layout).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            if p.is_dir():
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.mode, info.size = 0o644, p.stat().st_size
                with open(p, "rb") as f:
                    tar.addfile(info, f)
    os.replace(tmp, dest)


def archive_digest(archive: Path) -> str:
    """The image's digest as the archive records it (its ``index.json``'s manifest, or the index of a
    multi-architecture image): what ``skopeo copy oci-archive:...`` pushes and ``ctr images import`` names."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise BuildError(f"{archive} holds no index.json")
        (desc,) = json.loads(member.read())["manifests"]
    return desc["digest"]


@dataclass(frozen=True)
class Image:
    """One architecture's image of a build."""

    arch: str
    manifest_digest: str
    config: dict
    layer: bytes


@dataclass(frozen=True)
class Built:
    archive: Path
    layout: Path
    name: str
    manifest_digest: str  # what index.json names: the one image's manifest, or the index of several
    config: dict  # the first platform's (amd64's by default), as ``layer``
    layer: bytes
    images: tuple[Image, ...] = ()


def build(out: Path, *, base: str | None = DEFAULT_BASE, name: str = DEFAULT_NAME, repo: Path = REPO,
          cache: Path = CACHE, platforms: tuple[str, ...] | str = DEFAULT_PLATFORMS) -> Built:
    """Build the image into ``out`` (``out/layout/`` and ``out/weft-image.oci.tar``).

    ``base``: ``debian-packages`` (the default, also for None: Debian's packages at the versions
    ``nodeimage/debian-packages.pins`` names), ``containerfile`` (the Containerfile's ``ARG BASE``, a registry
    image, not tested here), ``oci:DIR`` or a registry reference pinned by digest. ``platforms``: ``linux/amd64``
    (the default) and/or ``linux/arm64``; several make one multi-architecture image (an index), each
    architecture's image in it the same, byte for byte, as a build of that one alone. The same tree (``repo``),
    pins and base give the same image, byte for byte; its date is ``common.source_date_epoch(repo)``."""
    base = base or DEFAULT_BASE
    arches = parse_platforms(platforms if isinstance(platforms, str) else ",".join(platforms))
    pins = read_pins(repo / "nodeimage" / PINFILE.name)
    plan = parse_containerfile((repo / "nodeimage" / "Containerfile").read_text(),
                               None if base == CONTAINERFILE_BASE else {"BASE": base})
    epoch = source_date_epoch(repo)
    layout = out / "layout"
    shutil.rmtree(layout, ignore_errors=True)
    images, descs = [], []
    for arch in arches:
        base_layout = resolve_base(plan.base, cache, pins, arch)
        base_manifest, base_config = base_layout.image(arch)
        layer = weft_layer(plan, repo, cache, pins, mtime=epoch, arch=arch)
        config = image_config(base_config, plan, layer, created=epoch)
        manifest, desc = write_image(layout, [(_MT_LAYER, layer)], config, base_layout, base_manifest["layers"],
                                     arch)
        images.append(Image(arch, _digest(_json(manifest)), config, layer))
        descs.append(desc)
    top = write_index(layout, descs, name)
    archive = out / ARCHIVE_NAME
    _archive(layout, archive)
    return Built(archive, layout, name, top["digest"], images[0].config, images[0].layer, tuple(images))
