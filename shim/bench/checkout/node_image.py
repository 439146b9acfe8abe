"""The node image per architecture, measured: size, build time, SBOM components, and two builds' digests.

``python -m bench.node_image [--cold] [--json] [--output FILE]``, from a checkout after ``scripts/setup.sh``
(the cross compiler and qemu-user-static; syft is built by ``components/syft/build.sh`` if it is not). For
linux/amd64, linux/arm64 and both in one index, it builds the image twice into caches of its own that share
only the downloads (Debian's ``.deb`` files, the wheels, tini, arm64's package index) with
``/var/cache/weft/nodeimage``: first with the base made again from the ``.deb`` files, then warm; the two digests
must be equal (the build is reproducible) or the benchmark fails. It reports each architecture's image size (its
layers, uncompressed), the archive's size, both build times and each architecture's SBOM component count.
``--cold`` also builds both architectures once into an empty cache, downloads included (network needed). Exit
codes as ``weft bench``: 0 measured, 1 failed, 130 stopped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from nodeimage import build
from nodeimage.build.layout import Layout
from nodeimage.build.sbom import make_sbom
from shim.bench.running import run_in_scratch

PLATFORMS = ("linux/amd64", "linux/arm64", "linux/amd64,linux/arm64")
SHARED = ("debs", "wheels", "init", "apt")  # downloads only: each checked against its pin or hash


def _timed_build(out: Path, cache: Path, platforms: str) -> tuple[build.Built, float]:
    started = time.monotonic()
    built = build.build(out, cache=cache, platforms=platforms)
    return built, round(time.monotonic() - started, 1)


def measure(work: Path, cold: bool, say) -> dict:
    figures: dict = {"benchmark": "node-image", "when": time.strftime("%Y-%m-%d %H:%M"), "builds": {}}
    for platforms in PLATFORMS:
        cache = work / f"cache-{len(figures['builds'])}"
        cache.mkdir()
        for shared in SHARED:
            (build.CACHE / shared).mkdir(parents=True, exist_ok=True)
            (cache / shared).symlink_to(build.CACHE / shared, target_is_directory=True)
        say(f"{platforms}: base made again")
        first, fresh_s = _timed_build(work / "fresh", cache, platforms)
        say(f"{platforms}: warm")
        second, warm_s = _timed_build(work / "warm", cache, platforms)
        if first.manifest_digest != second.manifest_digest:
            raise RuntimeError(f"{platforms}: two builds of the same tree differ: {first.manifest_digest} vs "
                               f"{second.manifest_digest}")
        layout = Layout(second.layout)
        figures["builds"][platforms] = {
            "digest": second.manifest_digest, "digests_equal": True, "base_made_again_s": fresh_s, "warm_s": warm_s,
            "archive_mb": round(second.archive.stat().st_size / 1e6, 1),
            "image_mb": {i.arch: round(sum(d["size"] for d in layout.image(i.arch)[0]["layers"]) / 1e6, 1)
                         for i in second.images}}
        if len(second.images) > 1:
            figures["sbom_components"] = {}
            for image in second.images:
                say(f"SBOM of linux/{image.arch}")
                doc = json.loads(make_sbom(second.archive, work / f"{image.arch}.cdx.json", arch=image.arch)
                                 .read_text())
                figures["sbom_components"][image.arch] = len(doc["components"])
        for d in ("fresh", "warm"):
            shutil.rmtree(work / d, ignore_errors=True)
    if cold:
        say("both, every cache empty (downloads included)")
        empty = work / "empty"
        empty.mkdir()
        built, figures["cold_both_s"] = _timed_build(work / "cold", empty, PLATFORMS[-1])
        figures["cold_digest_equal"] = built.manifest_digest == figures["builds"][PLATFORMS[-1]]["digest"]
    return figures


def _table(f: dict) -> str:
    rows = ["| platforms | image MB (uncompressed layers) | archive MB | build, base made again / warm | two builds |",
            "| --- | --- | --- | --- | --- |"]
    for platforms, b in f["builds"].items():
        sizes = ", ".join(f"{a} {mb}" for a, mb in b["image_mb"].items())
        rows.append(f"| {platforms} | {sizes} | {b['archive_mb']} | {b['base_made_again_s']} s / {b['warm_s']} s | "
                    f"same digest {b['digest'][:19]}… |")
    text = "\n".join(rows)
    text += "\n\nSBOM components: " + ", ".join(f"{a} {n}" for a, n in f.get("sbom_components", {}).items())
    if "cold_both_s" in f:
        text += (f"\nboth, every cache empty: {f['cold_both_s']} s "
                 f"({'the same digest' if f['cold_digest_equal'] else 'ANOTHER digest'})")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.node_image", description=__doc__.splitlines()[0])
    ap.add_argument("--cold", action="store_true", help="also build both architectures into an empty cache")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)

    def say(line: str) -> None:
        print(f"[node-image] {line}", file=sys.stderr, flush=True)

    return run_in_scratch("weft-bench-image-", say, lambda work: measure(work, args.cold, say), args.json,
                          args.output, _table)


if __name__ == "__main__":
    sys.exit(main())
