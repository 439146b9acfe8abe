"""``nodeimage.build.sbom`` completes syft's document from the image itself, without running syft.

A small OCI archive stands in for the image (its base's history naming the Debian packages it was made of, a
layer holding the hook), a small syft document for syft's answer; the real thing, syft on the built image, is
``integration/install/test_image_supply_chain.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from nodeimage.build import sbom
from nodeimage.build.__main__ import main as build_main

LOCK = """# weft's runtime dependencies
anyio==4.16.0 --hash=sha256:{a}
grpcio==1.80.0 --hash=sha256:{b} --hash=sha256:{c}
""".format(a="a" * 64, b="b" * 64, c="c" * 64)
PINS = ("[base]\nlibc6=2.36-9+deb12u13\npython3.11=3.11.2-6+deb12u6\n"
        "[init]\ntini=0.19.0-1+b3\n[host]\ngcc-12=12.2.0-14\n")
HOOK = b"\x7fELF the hook"


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _archive(path: Path, history: str) -> Path:
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d

    layers = [blob(_tar({"usr/bin/python3.11": b"py"})), blob(_tar({sbom.HOOK_PATH: HOOK}))]
    config = blob(json.dumps({"history": [{"created_by": history}, {"created_by": "nodeimage/build.py"}]}).encode())
    manifest = blob(json.dumps({"config": {"digest": config}, "layers": [{"digest": d} for d in layers]}).encode())
    index = json.dumps({"manifests": [{"digest": manifest}]}).encode()
    files = {"index.json": index, **{"blobs/" + d.replace(":", "/"): b for d, b in blobs.items()}}
    path.write_bytes(_tar(files))
    return path


def _syft_doc() -> dict:
    return {"bomFormat": "CycloneDX", "specVersion": "1.6", "components": [
        {"type": "library", "name": "anyio", "version": "4.16.0", "purl": "pkg:pypi/anyio@4.16.0"},
        {"type": "library", "name": "grpcio", "version": "1.80.0", "purl": "pkg:pypi/grpcio@1.80.0",
         "hashes": [{"alg": "SHA-256", "content": "b" * 64}]},
    ]}


def test_the_document_gets_the_debian_packages_the_hook_and_the_locks_hashes(tmp_path: Path) -> None:
    (tmp_path / "requirements.lock").write_text(LOCK)
    (tmp_path / "debian-packages.pins").write_text(PINS)
    (tmp_path / "debs").mkdir()
    deb = tmp_path / "debs" / "libc6_2.36-9+deb12u13_amd64.deb"
    deb.write_bytes(b"a deb")
    image = sbom._Archive(_archive(tmp_path / "weft-image.oci.tar", "nodeimage/build.py: Debian bookworm "
                                   "libc6=2.36-9+deb12u13 python3.11=3.11.2-6+deb12u6"))
    doc = sbom.complete(_syft_doc(), image, lockfile=tmp_path / "requirements.lock",
                        pinfile=tmp_path / "debian-packages.pins", cache=tmp_path)
    by_name = {c["name"]: c for c in doc["components"]}
    assert set(by_name) == {"anyio", "grpcio", "libc6", "python3.11", "tini", "weft-oci-hook"}
    libc = by_name["libc6"]
    assert libc["purl"] == "pkg:deb/debian/libc6@2.36-9+deb12u13?arch=amd64&distro=debian-12"
    assert libc["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(b"a deb").hexdigest()}]
    assert {"name": sbom.SOURCE, "value": "base layer history"} in libc["properties"]
    assert by_name["python3.11"]["purl"] == "pkg:deb/debian/python3.11@3.11.2-6+deb12u6?distro=debian-12"
    assert "hashes" not in by_name["python3.11"]  # its .deb is not in this cache
    assert by_name["tini"]["version"] == "0.19.0-1+b3"
    assert by_name["weft-oci-hook"]["hashes"] == [{"alg": "SHA-256", "content": hashlib.sha256(HOOK).hexdigest()}]
    assert [h["content"] for h in by_name["anyio"]["hashes"]] == ["a" * 64]
    assert [h["content"] for h in by_name["grpcio"]["hashes"]] == ["b" * 64, "c" * 64]  # no duplicate


def test_a_locked_package_syft_missed_is_added_and_one_it_found_is_not_twice(tmp_path: Path) -> None:
    (tmp_path / "requirements.lock").write_text(LOCK)
    (tmp_path / "debian-packages.pins").write_text(PINS)
    image = sbom._Archive(_archive(tmp_path / "weft-image.oci.tar", "no Debian history"))
    doc = _syft_doc()
    del doc["components"][1]
    doc = sbom.complete(doc, image, lockfile=tmp_path / "requirements.lock",
                        pinfile=tmp_path / "debian-packages.pins", cache=tmp_path)
    pypi = [c for c in doc["components"] if c.get("purl", "").startswith("pkg:pypi/")]
    assert [c["name"] for c in pypi] == ["anyio", "grpcio"]
    assert pypi[1]["properties"] == [{"name": sbom.SOURCE, "value": "requirements.lock"}]


def test_the_sbom_goes_beside_the_archive() -> None:
    assert sbom.sbom_path(Path("/out/weft-image.oci.tar")) == Path("/out/weft-image.cdx.json")
    assert sbom.sbom_path(Path("/out/other.oci.tar")) == Path("/out/other.cdx.json")
    assert sbom.sbom_path(Path("/out/weft-image.oci.tar"), "arm64") == Path("/out/weft-image.arm64.cdx.json")


def test_the_build_writes_no_sbom_unless_asked(monkeypatch, tmp_path: Path, capsys) -> None:
    made = []

    class Image:
        def __init__(self, arch: str) -> None:
            self.arch, self.manifest_digest = arch, f"sha256:{arch}"

    class Built:
        archive, name, manifest_digest = tmp_path / "weft-image.oci.tar", "weft/node", "sha256:0"
        images = (Image("amd64"),)

    monkeypatch.setattr("nodeimage.build.__main__.build", lambda out, **kw: Built)
    monkeypatch.setattr("nodeimage.build.__main__.make_sbom",
                        lambda archive, arch: made.append((archive, arch)) or sbom.sbom_path(archive, arch))
    assert build_main(["--out", str(tmp_path)]) == 0
    assert made == [] and "sbom:" not in capsys.readouterr().out
    assert build_main(["--out", str(tmp_path), "--sbom"]) == 0
    assert made == [(Built.archive, "amd64")] and f"sbom: {tmp_path / 'weft-image.cdx.json'}" in capsys.readouterr().out
    # A multi-architecture build: one SBOM per architecture, each beside the archive.
    Built.images = (Image("amd64"), Image("arm64"))
    assert build_main(["--out", str(tmp_path), "--sbom", "--platform", "linux/amd64,linux/arm64"]) == 0
    out = capsys.readouterr().out
    assert made[1:] == [(Built.archive, "amd64"), (Built.archive, "arm64")]
    assert f"sbom: {tmp_path / 'weft-image.arm64.cdx.json'}" in out and "linux/arm64 sha256:arm64" in out
