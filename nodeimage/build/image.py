"""The image itself: config, manifest, the OCI layout and its archive, from a base and the weft layer."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

from nodeimage.build.base import resolve_base
from nodeimage.build.common import _MT_LAYER, ARCHIVE_NAME, CACHE, DEFAULT_NAME, REPO, _digest, _json
from nodeimage.build.containerfile import Plan, parse_containerfile
from nodeimage.build.layer import weft_layer
from nodeimage.build.layout import write_layout


def image_config(base_config: dict, plan: Plan, layer: bytes) -> dict:
    """The base's config with the Containerfile's ENV/LABEL/USER/ENTRYPOINT/CMD and one more layer."""
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
    cfg["created"] = "1970-01-01T00:00:00Z"
    cfg["history"] = [*(cfg.get("history") or []),
                      {"created": "1970-01-01T00:00:00Z", "created_by": "nodeimage/build.py (nodeimage/Containerfile)"}]
    return cfg


def _archive(layout: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in sorted(layout.rglob("*")):
            info = tar.gettarinfo(str(p), p.relative_to(layout).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            with (open(p, "rb") if p.is_file() else io.BytesIO()) as f:
                tar.addfile(info, f if p.is_file() else None)
    os.replace(tmp, dest)


@dataclass(frozen=True)
class Built:
    archive: Path
    layout: Path
    name: str
    manifest_digest: str
    config: dict
    layer: bytes


def build(out: Path, *, base: str | None = None, name: str = DEFAULT_NAME, repo: Path = REPO,
          cache: Path = CACHE) -> Built:
    """Build the image into ``out`` (``out/layout/`` and ``out/weft-image.oci.tar``)."""
    plan = parse_containerfile((repo / "nodeimage" / "Containerfile").read_text(),
                               {"BASE": base} if base else None)
    base_layout = resolve_base(plan.base, cache)
    base_manifest, base_config = base_layout.image()
    layer = weft_layer(plan, repo, cache)
    config = image_config(base_config, plan, layer)
    layout = out / "layout"
    shutil.rmtree(layout, ignore_errors=True)
    manifest = write_layout(layout, [(_MT_LAYER, layer)], config, name, base_layout, base_manifest["layers"])
    archive = out / ARCHIVE_NAME
    _archive(layout, archive)
    return Built(archive, layout, name, _digest(_json(manifest)), config, layer)
