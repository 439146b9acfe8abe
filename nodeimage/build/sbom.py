"""The image's SBOM: a CycloneDX document of what ``weft-image.oci.tar`` holds, written beside it.

``syft`` (Anchore's, built from the Go module proxy by ``components/syft/build.sh``) scans the archive itself
(``syft scan oci-archive:PATH -o cyclonedx-json``): the Python packages under ``/opt/weft/lib`` (their
``*.dist-info``), the binaries it knows, the image's layers. It finds Debian packages through dpkg's database,
which an image made without dpkg does not have (the base is unpacked from Debian's packages, without their
maintainer scripts), and it has no package to put weft's own native hook under. So the document is completed,
from the image alone where the image says it, each added component marked with where it came from
(the property ``weft:sbom:source``):

- the Debian packages of the base, at the versions its layer's history names (what it was made of), with
  each ``.deb``'s SHA-256 where the build's cache still holds it, and tini from ``debian-packages.pins``'
  ``[init]`` (its static binary is ``/opt/weft/bin/tini``);
- the native OCI hook (``/opt/weft/bin/weft-oci-hook``), with its SHA-256 read from the image's layer;
- the SHA-256 of each Python package's wheel, from ``nodeimage/requirements.lock`` (the hashes pip checked),
  on the component syft found for it, and any locked package syft did not find.

``python -m nodeimage.build --sbom`` writes ``weft-image.cdx.json`` beside the archive;
``python -m nodeimage.build.sbom ARCHIVE`` does the same for an archive already built.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from hooks import native
from nodeimage.build.common import ARCHIVE_NAME, CACHE, LOCKFILE, PINFILE, REPO, BuildError
from nodeimage.build.pins import read_pins

SBOM_NAME = "weft-image.cdx.json"
SYFT_BUILD = REPO / "components" / "syft" / "build.sh"
HOOK_PATH = "opt/weft/bin/weft-oci-hook"
SOURCE = "weft:sbom:source"
# The base's layer's history: "nodeimage/build.py: Debian bookworm NAME=VERSION NAME=VERSION ...".
_BASE_HISTORY = re.compile(r"Debian (\w+) ((?:\S+=\S+ ?)+)$")
_DISTROS = {"bookworm": "debian-12", "trixie": "debian-13"}  # purl's distro qualifier for the release's name
_LOCK_LINE = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)((?:\s+--hash=sha256:[0-9a-f]{64})+)")


def sbom_path(archive: Path, arch: str = "amd64") -> Path:
    """Where the SBOM of ``archive`` goes: beside it, ``weft-image.cdx.json`` for ``weft-image.oci.tar``'s amd64
    image, ``weft-image.arm64.cdx.json`` for its arm64 one."""
    stem = archive.name.removesuffix(".oci.tar") if archive.name.endswith(".oci.tar") else archive.stem
    stem = "weft-image" if archive.name == ARCHIVE_NAME else stem
    return archive.with_name(f"{stem}.cdx.json" if arch == "amd64" else f"{stem}.{arch}.cdx.json")


def archive_arches(archive: Path) -> list[str]:
    """The architectures ``archive`` holds an image for (one, or those of its index)."""
    return _Archive(archive).arches


def syft_binary(timeout: float = 3600) -> Path:
    """The syft that ``components/syft/build.sh`` built (built now, or waited for under its cache's lock)."""
    res = subprocess.run(["bash", str(SYFT_BUILD)], capture_output=True, text=True, timeout=timeout)
    lines = res.stdout.strip().splitlines()
    if res.returncode != 0 or not lines:
        raise BuildError(f"building syft ({SYFT_BUILD.relative_to(REPO)}) failed ({res.returncode}): "
                         f"{res.stderr.strip()[-2000:]}")
    return Path(lines[-1]) / "syft"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_wheels(lockfile: Path = LOCKFILE) -> dict[str, tuple[str, str, list[str]]]:
    """requirements.lock's packages: normalised name -> (name, version, wheel SHA-256s)."""
    out = {}
    for line in lockfile.read_text().splitlines():
        if m := _LOCK_LINE.match(line.strip()):
            out[_normalise(m[1])] = (m[1], m[2], re.findall(r"sha256:([0-9a-f]{64})", m[3]))
    return out


class _Archive:
    """An OCI archive's image for ``arch`` (through the index of a multi-architecture one; None: its first, or its
    one): its config and the files of its layers, read without unpacking it."""

    def __init__(self, path: Path, arch: str | None = None) -> None:
        self.path = path
        with tarfile.open(path) as tar:
            (desc,) = json.loads(self._member(tar, "index.json"))["manifests"]
            doc = json.loads(self._blob(tar, desc["digest"]))
            if "manifests" in doc:  # an index of several architectures' images
                self.arches = [(d.get("platform") or {}).get("architecture", "") for d in doc["manifests"]]
                if (arch or self.arches[0]) not in self.arches:
                    raise BuildError(f"{path} holds no linux/{arch} image (it holds: {', '.join(self.arches)})")
                desc = doc["manifests"][self.arches.index(arch or self.arches[0])]
                doc = json.loads(self._blob(tar, desc["digest"]))
            self.digest = desc["digest"]
            self.manifest = doc
            self.config = json.loads(self._blob(tar, self.manifest["config"]["digest"]))
        self.arch = self.config.get("architecture", "amd64")
        self.arches = getattr(self, "arches", [self.arch])
        if arch is not None and self.arch != arch:
            raise BuildError(f"{path} holds a linux/{self.arch} image, not linux/{arch}")

    @staticmethod
    def _member(tar: tarfile.TarFile, name: str) -> bytes:
        f = tar.extractfile(name)
        if f is None:
            raise BuildError(f"{name} is not a file in the archive")
        return f.read()

    def _blob(self, tar: tarfile.TarFile, digest: str) -> bytes:
        return self._member(tar, "blobs/" + digest.replace(":", "/"))

    def file(self, path: str) -> bytes | None:
        """The file at ``path`` in the image (the top layer that has it), or None."""
        found = None
        with tarfile.open(self.path) as tar:
            for layer in self.manifest["layers"]:
                f = tar.extractfile("blobs/" + layer["digest"].replace(":", "/"))
                assert f is not None
                with tarfile.open(fileobj=f, mode="r:*") as ltar:
                    for m in ltar:
                        if m.name.removeprefix("./").lstrip("/") == path and m.isfile():
                            data = ltar.extractfile(m)
                            found = data.read() if data else None
        return found

    def base_packages(self) -> tuple[str, dict[str, str]]:
        """(Debian release, {package: version}) from the history of the base's layer, or ("", {})."""
        for h in self.config.get("history") or []:
            if m := _BASE_HISTORY.search(h.get("created_by", "")):
                return m[1], dict(p.split("=", 1) for p in m[2].split())
        return "", {}


def _deb_file(debs: Path, name: str, version: str, arch: str = "amd64") -> Path | None:
    v = version.replace(":", "%3a")
    found = sorted(debs.glob(f"{name}_{v}_{arch}.deb")) or sorted(debs.glob(f"{name}_{v}_all.deb"))
    return found[0] if found else None


def _wheel_arches(cache: Path) -> dict[str, str]:
    """SHA-256 -> the machine a cached wheel is for (``x86_64``, ``aarch64``, or ``any``), from its file name."""
    out = {}
    for w in (cache / "wheels").rglob("*.whl"):
        tag = w.name.removesuffix(".whl").rsplit("-", 1)[-1]
        machine = "any" if tag == "any" else ("aarch64" if "aarch64" in tag else "x86_64" if "x86_64" in tag
                                               else tag)
        out.setdefault(_sha256_file(w), machine)
    return out


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _prop(source: str, **more: str) -> list[dict]:
    return [{"name": SOURCE, "value": source}, *({"name": k, "value": v} for k, v in more.items())]


def _debian_component(name: str, version: str, release: str, debs: Path, source: str,
                      arch: str = "amd64") -> dict:
    """A Debian package's component; its purl as syft's dpkg cataloger writes one (arch where the .deb says)."""
    deb = _deb_file(debs, name, version, arch)
    arch = deb.name.rsplit("_", 1)[1].removesuffix(".deb") if deb else ""
    distro = _DISTROS.get(release, "debian")
    purl = f"pkg:deb/debian/{name}@{version}?" + (f"arch={arch}&" if arch else "") + f"distro={distro}"
    comp = {"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
            "properties": _prop(source, **({"weft:sbom:deb": deb.name} if deb else {}))}
    if deb:
        comp["hashes"] = [{"alg": "SHA-256", "content": _sha256_file(deb)}]
    return comp


def complete(doc: dict, image: _Archive, *, lockfile: Path = LOCKFILE, pinfile: Path = PINFILE,
             cache: Path = CACHE) -> dict:
    """Add to syft's document what it cannot see in this image (see the module's doc); returns ``doc``."""
    comps: list[dict] = doc.setdefault("components", [])
    purls = {c.get("purl", "").split("?")[0] for c in comps}
    # Debian packages: the base's, as its history names them, and tini.
    release, base = image.base_packages()
    debs = cache / "debs"
    for name, version in sorted(base.items()):
        comp = _debian_component(name, version, release, debs, "base layer history", image.arch)
        if comp["purl"].split("?")[0] not in purls:
            comps.append(comp)
    section = "init" if image.arch == "amd64" else f"init-{image.arch}"
    for name, version in sorted(read_pins(pinfile).of("init", image.arch).items()):
        comp = _debian_component(name, version, release, debs, f"{pinfile.name} [{section}]", image.arch)
        comp["properties"].append({"name": "weft:sbom:path", "value": "/opt/weft/bin/tini"})
        if comp["purl"].split("?")[0] not in purls:
            comps.append(comp)
    # The native OCI hook: a file of the weft layer, no package's.
    hook = image.file(HOOK_PATH)
    if hook is None:
        raise BuildError(f"{image.path} has no /{HOOK_PATH}")
    comps.append({"type": "application", "bom-ref": "weft-oci-hook", "name": "weft-oci-hook",
                  "description": "weft's native OCI hook (hooks/weft_oci_hook.c, static)",
                  "hashes": [{"alg": "SHA-256", "content": hashlib.sha256(hook).hexdigest()}],
                  "properties": _prop("image layer", **{"weft:sbom:path": "/" + HOOK_PATH})})
    # Python packages: the lock's wheel hashes on syft's components, and any it missed; where the lock holds a
    # wheel per architecture, the one for this image's (known from the build's wheel cache; all where unknown).
    locked = locked_wheels(lockfile)
    machines, machine = _wheel_arches(cache), native.ARCHES[image.arch][0]
    for key, (name, version, hashes) in list(locked.items()):
        mine = [h for h in hashes if machines.get(h) in (machine, "any")]
        locked[key] = (name, version, mine or hashes)
    seen = set()
    for c in comps:
        m = re.match(r"pkg:pypi/([^@]+)@([^?#]+)", c.get("purl", ""))
        if not m or _normalise(m[1]) not in locked:
            continue
        name, version, hashes = locked[_normalise(m[1])]
        if version != m[2]:
            continue
        seen.add(_normalise(name))
        have = {h.get("content") for h in c.get("hashes", [])}
        c.setdefault("hashes", []).extend({"alg": "SHA-256", "content": h} for h in hashes if h not in have)
        c.setdefault("properties", []).append({"name": SOURCE + ":hashes", "value": lockfile.name})
    for key, (name, version, hashes) in sorted(locked.items()):
        if key not in seen:
            purl = f"pkg:pypi/{_normalise(name)}@{version}"
            comps.append({"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl,
                          "hashes": [{"alg": "SHA-256", "content": h} for h in hashes],
                          "properties": _prop(lockfile.name)})
    return doc


def make_sbom(archive: Path, out: Path | None = None, *, syft: Path | None = None, cache: Path = CACHE,
              timeout: float = 600, arch: str = "amd64") -> Path:
    """Write the CycloneDX SBOM of ``archive``'s ``arch`` image to ``out`` (default: beside it, ``sbom_path``);
    returns it."""
    out = out or sbom_path(archive, arch)
    syft = syft or syft_binary()
    env = {**os.environ, "SYFT_CHECK_FOR_APP_UPDATE": "false"}
    res = subprocess.run([str(syft), "scan", f"oci-archive:{archive}", "--platform", f"linux/{arch}",
                          "-o", "cyclonedx-json", "-q"], capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        raise BuildError(f"syft scan oci-archive:{archive} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
    doc = complete(json.loads(res.stdout), _Archive(archive, arch), cache=cache)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nodeimage.build.sbom", description=__doc__.split("\n\n")[0])
    p.add_argument("archive", type=Path, help="the image's OCI archive (weft-image.oci.tar)")
    p.add_argument("--out", type=Path, help="where to write the SBOM (default: beside the archive)")
    p.add_argument("--arch", default="amd64", help="the image's architecture, in a multi-architecture archive")
    args = p.parse_args(argv)
    try:
        print(make_sbom(args.archive, args.out, arch=args.arch))
    except BuildError as exc:
        print(f"nodeimage.build.sbom: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
