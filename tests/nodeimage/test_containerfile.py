"""The image nodeimage/build.py writes is the one nodeimage/Containerfile describes.

The build runs here on the Debian-packages base (apt's mirror is reachable
wherever the tests run; Docker Hub may not be), cached under
/var/cache/weft/nodeimage, so after the first run it takes a few seconds. What
it adds on top of the base is the same whichever base: that is what these
tests hold against the Containerfile.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from hooks import native
from nodeimage import build
from nodeimage.build import containerfile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan() -> build.Plan:
    return build.parse_containerfile(build.CONTAINERFILE.read_text())


def _build(tmp_path_factory, what: str, **kw) -> build.Built:
    try:
        return build.build(tmp_path_factory.mktemp("image"), **kw)
    except build.BuildError as exc:
        pytest.fail(f"{what} failed (a first build downloads Debian packages with apt-get and the locked wheels "
                    f"with pip, so it needs apt's mirror and the package index): {exc}")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> build.Built:
    return _build(tmp_path_factory, "the image build", base="debian-packages")


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> build.Built:
    """The multi-architecture image (what a release ships): amd64 and arm64 in one index."""
    return _build(tmp_path_factory, "the amd64 and arm64 build", platforms="linux/amd64,linux/arm64")


def _layout_json(built: build.Built, digest: str) -> dict:
    return json.loads(build.Layout(built.layout).read_blob(digest))


def _layer_members(built: build.Built) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(built.layer)) as tar:
        return {m.name: m for m in tar.getmembers()}


def test_containerfile_pins_a_python_311_slim_base_by_digest(plan):
    assert re.fullmatch(r"docker\.io/library/python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", plan.base)


def test_image_config_is_the_containerfiles_user_entrypoint_env_and_labels(built, plan):
    c = built.config["config"]
    assert c["User"] == plan.user == "65532:65532"  # non-root
    assert c["Entrypoint"] == plan.entrypoint == ["/opt/weft/bin/tini", "-s", "--", "/opt/weft/bin/weft"]
    assert c["Cmd"] == plan.cmd
    env = dict(e.split("=", 1) for e in c["Env"])
    assert {k: env[k] for k in plan.env} == plan.env
    assert env["PYTHONPATH"] == "/opt/weft/lib"
    assert c["Labels"].items() >= plan.labels.items()
    assert c["Labels"]["org.opencontainers.image.version"] == build.DEFAULT_NAME.rsplit(":", 1)[1]


def test_manifest_config_and_layers_carry_correct_digests_and_diff_ids(built):
    index = json.loads((built.layout / "index.json").read_text())
    (desc,) = index["manifests"]
    assert desc["annotations"]["io.containerd.image.name"] == build.DEFAULT_NAME
    manifest = _layout_json(built, desc["digest"])  # read_blob checks every digest
    config = _layout_json(built, manifest["config"]["digest"])
    assert config == built.config
    assert config["rootfs"]["diff_ids"][-1] == "sha256:" + hashlib.sha256(built.layer).hexdigest()
    assert len(config["rootfs"]["diff_ids"]) == len(manifest["layers"])
    for layer in manifest["layers"]:
        assert build.Layout(built.layout).blob_path(layer["digest"]).stat().st_size == layer["size"]


def test_the_layer_holds_what_the_containerfile_copies_and_installs(built, plan):
    members = _layer_members(built)
    files = {n for n, m in members.items() if m.isfile()}
    for src, dest in plan.copies:
        for p in (ROOT / src).rglob("*") if (ROOT / src).is_dir() else [ROOT / src]:
            rel = p.relative_to(ROOT / src).as_posix() if (ROOT / src).is_dir() else ""
            if p.is_file() and not containerfile._ignored(rel, build.ignore_patterns()):
                target = f"{dest.strip('/')}/{rel}" if rel else dest.strip("/")
                assert target in files, f"COPY {src} {dest}: {target} missing"
    assert not [n for n in files if "__pycache__" in n or n.endswith(".pyc") or "/." in n]
    for exe in ("opt/weft/bin/weft", "opt/weft/bin/weft-oci-hook", "opt/weft/bin/weft-oci-hook-python",
                "opt/weft/lib/hooks/weft-oci-hook"):
        assert members[exe].mode & 0o111
    assert "opt/weft/lib/shim/cli.py" in files and "opt/weft/lib/hooks/weft_oci_hook.py" in files
    assert not [n for n in members if n.startswith("opt/weft/lib/bin")]  # the RUN line removes pip's scripts
    # Every locked distribution installed, compiled parts for CPython 3.11 on x86-64.
    installed = {n.split("/")[3].split("-")[0].lower().replace("_", "-")
                 for n in members if n.startswith("opt/weft/lib/") and n.endswith(".dist-info/METADATA")}
    assert installed == set(_lock())
    assert [n for n in files if n.startswith("opt/weft/lib/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu")]
    epoch = build.source_date_epoch(ROOT)  # the last commit's time: the image's one date
    assert all(m.uid == 0 and m.mtime == epoch for m in members.values())


def test_the_oci_hook_is_the_native_one_from_the_hook_stage(built, plan):
    assert plan.stages.keys() == {"hook", "init"} and plan.stages["hook"].base == plan.base
    assert [c for c in plan.copies_from if c[0] == "hook"] == [
        ("hook", "/out/weft-oci-hook", "/opt/weft/bin/weft-oci-hook"),
        ("hook", "/out/weft-oci-hook", "/opt/weft/lib/hooks/weft-oci-hook")]
    with tarfile.open(fileobj=io.BytesIO(built.layer)) as tar:
        binary = tar.extractfile("opt/weft/bin/weft-oci-hook").read()  # type: ignore[union-attr]
        beside = tar.extractfile("opt/weft/lib/hooks/weft-oci-hook").read()  # type: ignore[union-attr]
    assert binary == beside and binary.startswith(b"\x7fELF")
    # The same program hooks/native.py builds (the same source and flags the stage's RUN line names).
    assert binary == native.build().read_bytes()
    assert " ".join(native.CFLAGS) in plan.stages["hook"].runs[0]


def test_the_entrypoint_runs_weft_under_the_static_tini_of_debian_s_package(built, plan):
    """The containers' PID 1 is tini, which blocks signals from its first instructions (a PID 1 ignores a SIGTERM
    it has no handler for; Python would take milliseconds to set one): docs/operations.md, "How weft's containers
    end"."""
    from nodeimage.build import layer

    assert plan.stages["init"].base == plan.base and plan.stages["init"].copies == []
    assert [c for c in plan.copies_from if c[0] == "init"] == [("init", "/usr/bin/tini-static", "/opt/weft/bin/tini")]
    members = _layer_members(built)
    assert members["opt/weft/bin/tini"].mode & 0o111
    with tarfile.open(fileobj=io.BytesIO(built.layer)) as tar:
        binary = tar.extractfile("opt/weft/bin/tini").read()  # type: ignore[union-attr]
    assert binary == layer.init_stage()["/usr/bin/tini-static"].read_bytes()
    assert binary.startswith(b"\x7fELF") and b"tini" in binary
    assert plan.entrypoint[:3] == ["/opt/weft/bin/tini", "-s", "--"]  # -s: no warning where it is not PID 1


def test_the_build_refuses_an_init_stage_it_would_not_reproduce():
    text = build.CONTAINERFILE.read_text().replace("--no-install-recommends tini", "--no-install-recommends dumb-init")
    with pytest.raises(build.BuildError, match="and the 'init' stage"):
        build.parse_containerfile(text)


def test_the_hook_stage_compiles_the_build_contexts_own_source(plan, tmp_path):
    """A build from another tree (another version of weft) compiles that tree's hook, not this checkout's."""
    from nodeimage.build import layer

    tree = tmp_path / "tree"
    (tree / "hooks").mkdir(parents=True)
    (tree / "hooks" / "weft_oci_hook.c").write_text('#error "the tree\'s own source"\n')
    with pytest.raises(build.BuildError, match="the tree's own source"):
        layer.hook_stage(plan, tree, tmp_path / "out")
    (tree / "hooks" / "weft_oci_hook.c").write_bytes(native.SOURCE.read_bytes())
    made = layer.hook_stage(plan, tree, tmp_path / "out")["/out/weft-oci-hook"]
    assert made.read_bytes() == native.build().read_bytes()


def test_the_build_refuses_a_hook_stage_it_would_not_reproduce():
    text = build.CONTAINERFILE.read_text().replace("-Werror -o /out", "-Werror -DEXTRA -o /out", 1)
    with pytest.raises(build.BuildError, match="builds only the 'hook' stage"):
        build.parse_containerfile(text)
    text = build.CONTAINERFILE.read_text().replace("--from=hook", "--from=elsewhere", 1)
    with pytest.raises(build.BuildError, match="--from names an earlier stage"):
        build.parse_containerfile(text)


def test_the_build_is_reproducible(built, tmp_path, monkeypatch):
    """The same tree and pins give the same image, byte for byte, from a build that shares nothing with the first
    but the downloads: its base made again from the .deb files (an empty base cache), another output directory,
    another umask, and pip run through another path to this interpreter (pip writes that path into the scripts
    it makes, and their hashes into each RECORD)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("debs", "wheels", "init"):  # downloads only, each checked against its pin or hash
        (cache / shared).symlink_to(build.CACHE / shared, target_is_directory=True)
    (tmp_path / "venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "venv" / "bin" / Path(sys.executable).name))
    umask = os.umask(0o077)
    try:
        again = build.build(tmp_path / "out", cache=cache)  # the default base: debian-packages
    finally:
        os.umask(umask)
    assert again.manifest_digest == built.manifest_digest
    assert again.archive.read_bytes() == built.archive.read_bytes()
    index = json.loads((again.layout / "index.json").read_text())
    assert index["manifests"][0]["digest"] == built.manifest_digest == build.archive_digest(again.archive)
    assert built.config["created"] == build.rfc3339(build.source_date_epoch(ROOT))


def _elf_machine(data: bytes) -> str:
    assert data[:4] == b"\x7fELF", data[:4]
    return {62: "amd64", 183: "arm64"}[int.from_bytes(data[18:20], "little")]


def _file(built: build.Built, arch: str, path: str) -> bytes:
    """The file at ``path`` in ``arch``'s image (the top layer that has it)."""
    layout = build.Layout(built.layout)
    found = None
    for desc in layout.image(arch)[0]["layers"]:
        with tarfile.open(fileobj=io.BytesIO(layout.read_blob(desc["digest"]))) as tar:
            for m in tar:
                if m.name == path and m.isfile():
                    found = tar.extractfile(m).read()  # type: ignore[union-attr]
    assert found is not None, f"{arch}'s image has no /{path}"
    return found


def test_the_multi_architecture_image_holds_the_tested_amd64_image_byte_for_byte_and_an_arm64_one(built, both):
    """What ships is what is tested: the amd64 image in the index is the one the tests import and run."""
    from nodeimage.build import layer

    assert [i.arch for i in both.images] == ["amd64", "arm64"]
    assert both.images[0].manifest_digest == built.manifest_digest and both.images[0].layer == built.layer
    index = _layout_json(both, both.manifest_digest)
    assert [(m["digest"], m["platform"]["architecture"]) for m in index["manifests"]] == [
        (i.manifest_digest, i.arch) for i in both.images]
    assert build.archive_digest(both.archive) == both.manifest_digest != built.manifest_digest
    arm = both.images[1]
    assert arm.config["architecture"] == "arm64" and arm.config["config"] == built.config["config"]
    # Every binary of the arm64 image is an AArch64 one: the interpreter, the native hook, tini, the wheels.
    assert _elf_machine(_file(both, "arm64", "usr/bin/python3.11")) == "arm64"
    hook = _file(both, "arm64", "opt/weft/bin/weft-oci-hook")
    assert _elf_machine(hook) == "arm64" and hook == native.build(arch="arm64").read_bytes()
    tini = _file(both, "arm64", "opt/weft/bin/tini")
    assert _elf_machine(tini) == "arm64" and tini == layer.init_stage(arch="arm64")["/usr/bin/tini-static"].read_bytes()
    with tarfile.open(fileobj=io.BytesIO(arm.layer)) as tar:
        names = tar.getnames()
    assert [n for n in names if n.startswith("opt/weft/lib/grpc/_cython/cygrpc.cpython-311-aarch64-linux-gnu")]
    assert not [n for n in names if "x86_64" in n], "no amd64 wheel in the arm64 image"
    assert _file(both, "arm64", "opt/weft/requirements.lock") == build.LOCKFILE.read_bytes()


def test_the_multi_architecture_image_is_reproducible(both, tmp_path):
    """Made again with an empty base cache (both bases made again from the same .deb files), the same index."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for shared in ("debs", "wheels", "init"):
        (cache / shared).symlink_to(build.CACHE / shared, target_is_directory=True)
    again = build.build(tmp_path / "out", cache=cache, platforms=("linux/amd64", "linux/arm64"))
    assert again.manifest_digest == both.manifest_digest
    assert again.archive.read_bytes() == both.archive.read_bytes()


def _lock() -> dict[str, str]:
    pins = {}
    for line in build.LOCKFILE.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("==")
            assert "--hash=sha256:" in rest, f"{name} is not hash-pinned"
            pins[name.lower()] = rest.split()[0]
    return pins


def test_the_lock_pins_every_runtime_dependency_within_pyprojects_ranges():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = _lock()
    for dep in map(Requirement, deps):
        name = re.sub(r"[-_.]+", "-", dep.name).lower()
        assert name in pins, f"{dep.name} is not in nodeimage/requirements.lock (python -m nodeimage.build lock)"
        assert dep.specifier.contains(pins[name]), f"lock has {name}=={pins[name]}, pyproject wants {dep}"


def test_the_build_refuses_a_run_line_it_would_not_reproduce():
    text = build.CONTAINERFILE.read_text().replace("RUN pip install", "RUN apt-get update && pip install", 1)
    with pytest.raises(build.BuildError, match="only runs"):
        build.parse_containerfile(text)


def test_an_unpinned_base_is_refused():
    with pytest.raises(build.BuildError, match="not pinned by digest"):
        build.fetch_registry_base("docker.io/library/python:3.11-slim-bookworm")
