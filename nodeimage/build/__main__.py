"""``python -m nodeimage.build``: build the image, or rewrite the lock file or the Debian pins."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nodeimage.build.common import (
    CONTAINERFILE_BASE,
    DEFAULT_BASE,
    DEFAULT_NAME,
    DEFAULT_PLATFORMS,
    REPO,
    BuildError,
)
from nodeimage.build.image import build
from nodeimage.build.lock import write_lock
from nodeimage.build.pins import write_pins
from nodeimage.build.sbom import make_sbom


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeimage.build", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("image", "lock", "pins"), default="image",
                   help="image (the default), lock (rewrite nodeimage/requirements.lock from the venv's versions) or "
                        "pins (rewrite nodeimage/debian-packages.pins from apt's candidates: run apt-get update first)")
    p.add_argument("--out", type=Path, default=REPO / "nodeimage" / "out", help="output directory")
    p.add_argument("--base", default=DEFAULT_BASE,
                   help=f"{DEFAULT_BASE} (the default: Debian's packages at the pinned versions, the base the tests "
                        f"use), {CONTAINERFILE_BASE} (the Containerfile's ARG BASE, from Docker Hub: not tested "
                        "here), oci:DIR, or a registry reference pinned by digest")
    p.add_argument("--name", default=DEFAULT_NAME, help="image name recorded for ctr import")
    p.add_argument("--platform", default=",".join(DEFAULT_PLATFORMS),
                   help="linux/amd64 (the default: the image the tests import and run), linux/arm64, or both "
                        "(linux/amd64,linux/arm64: one multi-architecture image, an index of the two, each the "
                        "same as a build of it alone)")
    p.add_argument("--sbom", action="store_true",
                   help="also write the image's CycloneDX SBOM beside the archive (weft-image.cdx.json; for arm64 "
                        "weft-image.arm64.cdx.json), made with syft (components/syft/build.sh builds it if it is not "
                        "built)")
    args = p.parse_args(argv)
    try:
        if args.command == "lock":
            print(f"wrote {write_lock()}")
            return 0
        if args.command == "pins":
            print(f"wrote {write_pins()}")
            return 0
        built = build(args.out, base=args.base, name=args.name, platforms=args.platform)
        sboms = [make_sbom(built.archive, arch=i.arch) for i in built.images] if args.sbom else []
    except BuildError as exc:
        print(f"nodeimage.build: {exc}", file=sys.stderr)
        return 2
    print(f"{built.archive}\n{built.name} {built.manifest_digest}\n"
          f"import: ctr -n k8s.io images import {built.archive}")
    if len(built.images) > 1:
        for image in built.images:
            print(f"linux/{image.arch} {image.manifest_digest}")
    for sbom in sboms:
        print(f"sbom: {sbom}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
