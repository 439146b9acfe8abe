"""``python -m nodeimage.build``: build the image, or rewrite the lock file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nodeimage.build.common import DEFAULT_NAME, REPO, BuildError
from nodeimage.build.image import build
from nodeimage.build.lock import write_lock


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeimage.build", description=__doc__.split("\n\n")[0])
    p.add_argument("command", nargs="?", choices=("image", "lock"), default="image")
    p.add_argument("--out", type=Path, default=REPO / "nodeimage" / "out", help="output directory")
    p.add_argument("--base", help="debian-packages, oci:DIR or a registry ref by digest (default: the Containerfile's)")
    p.add_argument("--name", default=DEFAULT_NAME, help="image name recorded for ctr import")
    args = p.parse_args(argv)
    try:
        if args.command == "lock":
            print(f"wrote {write_lock()}")
            return 0
        built = build(args.out, base=args.base, name=args.name)
    except BuildError as exc:
        print(f"nodeimage.build: {exc}", file=sys.stderr)
        return 2
    print(f"{built.archive}\n{built.name} {built.manifest_digest}\n"
          f"import: ctr -n k8s.io images import {built.archive}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
