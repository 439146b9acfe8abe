"""The node image build's reproducible parts, on fakes: no apt, no pip, no compiler, no root, in a second.

What could make two builds of the same tree differ, each held fixed here: tar entries (order, times, owners,
extended headers), the archive's modes (the umask), the image's date, the Debian package versions (the pins,
never apt's candidate of the day), the hook's toolchain, and the interpreter path pip writes into RECORD.
The real build twice, compared digest for digest: ``test_containerfile.py::test_the_build_is_reproducible``.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from nodeimage import build
from nodeimage.build import __main__ as cli
from nodeimage.build import base, image, layer, pins
from nodeimage.build.layout import layer_tar

ROOT = Path(__file__).resolve().parents[2]


def _entries(order: list[str], mtime: int, uid: int) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    out = []
    for name in order:
        info = tarfile.TarInfo(name)
        info.mtime, info.uid, info.gid, info.uname, info.gname = mtime, uid, uid, f"u{uid}", f"g{uid}"
        info.pax_headers = {"mtime": f"{mtime}.5", "comment": name}
        if name.endswith("/"):
            info.name, info.type, info.mode = name.rstrip("/"), tarfile.DIRTYPE, 0o755
            out.append((info, None))
        else:
            info.mode = 0o644
            out.append((info, name.encode()))
    return out


def test_a_layer_depends_on_its_entries_alone():
    names = ["opt/weft/lib/b.py", "opt/weft/", "opt/weft/lib/a.py", "usr/bin/x"]
    one = layer_tar(_entries(names, 1_700_000_000, 1000))
    two = layer_tar(_entries(names[::-1], 12, 0))
    assert one == two
    with tarfile.open(fileobj=io.BytesIO(one)) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == ["opt", "opt/weft", "opt/weft/lib", "opt/weft/lib/a.py",
                                         "opt/weft/lib/b.py", "usr", "usr/bin", "usr/bin/x"]  # parents first
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "root", "root")}
    assert all(not m.pax_headers for m in members)


def test_a_layer_takes_the_date_it_is_given():
    data = layer_tar(_entries(["a/b"], 5, 5), mtime=1_796_652_071)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert {m.mtime for m in tar.getmembers()} == {1_796_652_071}
    assert layer_tar(_entries(["a/b"], 9, 9), mtime=1_796_652_071) == data


def test_the_archive_depends_on_the_layouts_names_and_contents_alone(tmp_path):
    archives = []
    for i, (umask, when) in enumerate(((0o022, 1_000), (0o077, 2_000_000_000))):
        old = os.umask(umask)
        try:
            layout = tmp_path / f"layout{i}"
            (layout / "blobs" / "sha256").mkdir(parents=True)
            for name in ("index.json", "oci-layout", "blobs/sha256/bb", "blobs/sha256/aa"):
                (layout / name).write_text(name)
                os.utime(layout / name, (when, when))
        finally:
            os.umask(old)
        image._archive(layout, tmp_path / f"a{i}.tar")
        archives.append((tmp_path / f"a{i}.tar").read_bytes())
    assert archives[0] == archives[1]
    with tarfile.open(tmp_path / "a0.tar") as tar:
        assert [(m.name, m.mode) for m in tar.getmembers()] == [
            ("blobs", 0o755), ("blobs/sha256", 0o755), ("blobs/sha256/aa", 0o644), ("blobs/sha256/bb", 0o644),
            ("index.json", 0o644), ("oci-layout", 0o644)]


def test_the_archive_names_the_image_digest(tmp_path):
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "index.json").write_text(json.dumps({"manifests": [{"digest": "sha256:" + "ab" * 32}]}))
    image._archive(layout, tmp_path / "x.tar")
    assert build.archive_digest(tmp_path / "x.tar") == "sha256:" + "ab" * 32


# -- the image's date ---------------------------------------------------------------------------------------------
def _git(repo: Path, *args: str, when: str | None = None) -> None:
    env = {**os.environ, "GIT_AUTHOR_DATE": when or "", "GIT_COMMITTER_DATE": when or ""}
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True, env=env)


def test_the_images_date_is_source_date_epoch_else_the_last_commits_else_0(tmp_path, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    repo = tmp_path / "repo"
    (repo / "sub").mkdir(parents=True)
    (repo / "sub" / "f").write_text("x")
    assert build.source_date_epoch(repo) == 0  # not a git tree
    _git(repo, "init", "-q")
    _git(repo, "add", "sub/f")
    _git(repo, "commit", "-q", "-m", "one", when="2026-01-02T03:04:05Z")
    assert build.source_date_epoch(repo) == 1767323045
    (repo / "sub" / "f").write_text("changed, not committed")
    assert build.source_date_epoch(repo) == 1767323045  # the build's own time never counts
    assert build.source_date_epoch(repo / "sub") == 0  # a tree inside another's git: not its commit
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1234567890")
    assert build.source_date_epoch(repo) == 1234567890
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "yesterday")
    with pytest.raises(build.BuildError, match="SOURCE_DATE_EPOCH"):
        build.source_date_epoch(repo)


def test_the_config_carries_the_images_date(tmp_path):
    plan = build.parse_containerfile(build.CONTAINERFILE.read_text())
    base_cfg = {"config": {"Env": ["PATH=/bin"]}, "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]},
                "history": [{"created": "1970-01-01T00:00:00Z"}]}
    cfg = build.image_config(base_cfg, plan, b"layer", created=1767323045)
    assert cfg["created"] == cfg["history"][-1]["created"] == "2026-01-02T03:04:05Z"
    assert build.image_config(base_cfg, plan, b"layer", created=1767323045) == cfg


# -- the base: Debian's packages at the pinned versions -------------------------------------------------------------
def test_the_pin_file_pins_the_base_tini_and_the_hooks_toolchain():
    p = build.read_pins()
    assert set(base.DEBIAN_ROOTS) <= set(p.base) and not set(p.base) & base.DEBIAN_EXCLUDE
    assert list(p.init) == ["tini"]
    assert set(p.host) == set(pins.HOST_TOOLCHAIN)
    assert pins.format_pins(p) == build.PINFILE.read_text()  # as `python -m nodeimage.build pins` writes it


def test_the_pin_file_pins_arm64s_base_tini_and_cross_toolchain_apart():
    p = build.read_pins()
    arm = p.of("base", "arm64")
    assert set(base.DEBIAN_ROOTS) <= set(arm) and not set(arm) & base.DEBIAN_EXCLUDE
    assert list(p.of("init", "arm64")) == ["tini"]
    assert set(p.of("host", "arm64")) == set(pins.HOST_TOOLCHAINS["arm64"])
    assert "[base-arm64]" in build.PINFILE.read_text()
    with pytest.raises(build.BuildError, match="no base packages for arm64"):
        pins.parse_pins("[base]\ndash=1\n[init]\ntini=1\n").of("base", "arm64")


def test_pins_are_read_strictly():
    good = "[base]\npython3.11-minimal=3.11.2-6+deb12u9  # a comment\nlibgmp10=2:6.2.1\n[init]\ntini=0.19.0-1+b3\n"
    p = pins.parse_pins(good)
    assert p.base == {"python3.11-minimal": "3.11.2-6+deb12u9", "libgmp10": "2:6.2.1"} and p.host == {}
    assert pins.parse_pins(pins.format_pins(p)) == p
    two = pins.parse_pins(good + "[base-arm64]\ndash=0.5.12-2\n[init-arm64]\ntini=0.19.0-1+b3\n")
    assert two.of("base", "arm64") == {"dash": "0.5.12-2"} and two.of("base") == p.base
    assert pins.parse_pins(pins.format_pins(two)) == two
    for bad, match in (("[base]\nfoo\n[init]\ntini=1\n", "PACKAGE=VERSION"), ("foo=1\n", "PACKAGE=VERSION"),
                       ("[extra]\nfoo=1\n", "unknown section"), ("[base]\nfoo=1\n", "tini under"),
                       ("[base-s390x]\nfoo=1\n", "unknown section")):
        with pytest.raises(build.BuildError, match=match):
            pins.parse_pins(bad)


class FakeApt:
    """``apt-get download`` and ``dpkg-deb --fsys-tarfile`` of made-up packages: each unpack gives other times
    and owners (as different builders' tars would), the same files. Another architecture's apt is this one
    with ``-o ARCH`` before its verb."""

    def __init__(self, monkeypatch) -> None:
        self.downloads: list[list[str]] = []
        self.unpacks = 0
        monkeypatch.setattr(base, "_run", self.run)
        monkeypatch.setattr(base, "_run_bytes", self.run_bytes)
        monkeypatch.setattr(base.apt, "options", lambda arch, cache=None: [] if arch == "amd64" else ["-o", arch])

    def run(self, argv, what, check=True, **kw):
        arch = argv[2] if argv[1] == "-o" else "amd64"
        argv = [argv[0], *argv[3:]] if argv[1] == "-o" else argv
        assert argv[:2] == ["apt-get", "download"], argv
        self.downloads.append(argv[2:] if arch == "amd64" else [arch, *argv[2:]])
        for want in argv[2:]:
            name, version = want.split("=", 1)
            (Path(kw["cwd"]) / f"{name}_{version.replace(':', '%3a')}_{arch}.deb").write_text(want)
        return subprocess.CompletedProcess(argv, 0, "", "")

    def run_bytes(self, argv, what):
        assert argv[:2] == ["dpkg-deb", "--fsys-tarfile"], argv
        self.unpacks += 1
        name, version = Path(argv[2]).read_text().split("=", 1)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for path, data in ((f"./bin/{name}", version.encode()), (f"./usr/share/doc/{name}/copyright", b"x")):
                info = tarfile.TarInfo(path)
                info.size, info.mode, info.mtime, info.uid = len(data), 0o755, 1000 + self.unpacks, self.unpacks
                tar.addfile(info, io.BytesIO(data))
            link = tarfile.TarInfo(f"./usr/bin/{name}-again")
            link.type, link.linkname, link.mtime = tarfile.LNKTYPE, f"./bin/{name}", 7 * self.unpacks
            tar.addfile(link)
        return buf.getvalue()


def _fake_pins(**base_pins: str) -> pins.Pins:
    return pins.Pins(base=base_pins, init={"tini": "0.19.0-1+b3"})


def test_the_base_is_made_of_the_pinned_versions_the_same_each_time(tmp_path, monkeypatch):
    apt = FakeApt(monkeypatch)
    p = _fake_pins(dash="0.5.12-2", libgmp10="2:6.2.1+dfsg1-1.1")
    one = base.build_debian_base(tmp_path / "c1", p)
    assert apt.downloads == [["dash=0.5.12-2", "libgmp10=2:6.2.1+dfsg1-1.1"]]  # exactly the pins, not apt's choice
    (tmp_path / "c2").mkdir()
    (tmp_path / "c2" / "debs").symlink_to(tmp_path / "c1" / "debs")
    two = base.build_debian_base(tmp_path / "c2", p)  # made again from the same .deb files: nothing downloaded
    assert len(apt.downloads) == 1 and apt.unpacks == 4
    assert one.root.name == two.root.name and one.image() == two.image()
    manifest, config = one.image()
    layer = one.read_blob(manifest["layers"][0]["digest"])
    with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert members["usr/bin/dash"].mtime == 0 and members["usr/bin/dash-again"].isfile()
    assert not [n for n in members if n.startswith("usr/share/doc")]
    assert config["history"][0]["created"] == "1970-01-01T00:00:00Z"
    # Another pinned version is another base, and downloads only what the cache lacks.
    three = base.build_debian_base(tmp_path / "c1", _fake_pins(dash="0.5.12-3", libgmp10="2:6.2.1+dfsg1-1.1"))
    assert three.root != one.root and apt.downloads[-1] == ["dash=0.5.12-3"]


def test_arm64s_base_is_made_of_its_own_packages_and_kept_apart_from_amd64s(tmp_path, monkeypatch):
    apt = FakeApt(monkeypatch)
    p = _fake_pins(dash="0.5.12-2")
    p.section("base-arm64").update(dash="0.5.12-2")
    amd = base.build_debian_base(tmp_path, p)
    arm = base.build_debian_base(tmp_path, p, arch="arm64")
    assert apt.downloads == [["dash=0.5.12-2"], ["arm64", "dash=0.5.12-2"]]  # the same version, arm64's .deb
    assert (tmp_path / "debs" / "dash_0.5.12-2_arm64.deb").exists() and arm.root != amd.root
    assert arm.image("arm64")[1]["architecture"] == "arm64" and amd.image()[1]["architecture"] == "amd64"
    with pytest.raises(build.BuildError, match="no linux/amd64 image"):
        arm.image("amd64")
    assert amd.root == base._base_dir(tmp_path, {"dash": "0.5.12-2"}), "amd64's key as before arm64 came"


def test_a_build_of_several_platforms_is_an_index_of_them(tmp_path):
    from nodeimage.build.layout import write_image, write_index

    descs = []
    for arch in ("amd64", "arm64"):
        config = {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}
        descs.append(write_image(tmp_path, [("application/vnd.oci.image.layer.v1.tar", arch.encode())], config,
                                 arch=arch)[1])
    top = write_index(tmp_path, descs, "localhost/weft/node:0.1.0")
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["manifests"] == [top] and top["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert top["annotations"]["io.containerd.image.name"] == "localhost/weft/node:0.1.0"
    inner = json.loads(build.Layout(tmp_path).read_blob(top["digest"]))
    assert [m["platform"] for m in inner["manifests"]] == [{"architecture": "amd64", "os": "linux"},
                                                          {"architecture": "arm64", "os": "linux"}]
    for arch in ("amd64", "arm64"):
        assert build.Layout(tmp_path).image(arch)[1]["architecture"] == arch
    with pytest.raises(build.BuildError, match="no linux/s390x image"):
        build.Layout(tmp_path).image("s390x")


@pytest.mark.parametrize(("text", "says"), [
    ("linux/amd64,linux/arm64", ("amd64", "arm64")), (" linux/arm64 ", ("arm64",)),
    ("linux/s390x", "is built for linux/amd64, linux/arm64"), ("windows/amd64", "is built for"),
    ("linux/arm64,linux/arm64", "named twice"), ("", "no platform named")])
def test_platforms_are_read_strictly(text, says):
    if isinstance(says, tuple):
        assert build.parse_platforms(text) == says
    else:
        with pytest.raises(build.BuildError, match=says):
            build.parse_platforms(text)


def test_a_pinned_version_the_mirror_no_longer_carries_is_built_at_apts_and_said(tmp_path, monkeypatch, capsys):
    """Debian's mirror keeps only the newest version: a fresh machine still builds (and tests), a different
    image that says so, with the refresh to run."""
    apt = FakeApt(monkeypatch)
    fake_run = apt.run

    def run(argv, what, check=True, **kw):
        if any(want == "dash=0.1" for want in argv[2:]):
            raise build.BuildError("apt-get download ... failed: E: Can't find a source to download version '0.1'")
        return fake_run(argv, what, check, **kw)

    monkeypatch.setattr(base, "_run", run)
    monkeypatch.setattr(base, "candidate", lambda name: "0.2")
    made = base.build_debian_base(tmp_path, _fake_pins(dash="0.1", libgmp10="2:6.2.1+dfsg1-1.1"))
    assert ["dash=0.2"] in apt.downloads and ["libgmp10=2:6.2.1+dfsg1-1.1"] in apt.downloads
    said = capsys.readouterr().err
    assert "dash 0.1 -> 0.2" in said and "refresh the pins (apt-get update && python -m nodeimage.build pins)" in (
        said.replace("Refresh", "refresh"))
    _manifest, config = made.image()
    assert "dash=0.2" in config["history"][0]["created_by"], "the image says what it was made of"
    # Not cached as the pinned base: the pinned versions, once downloadable, make the pinned one.
    assert made.root != base._base_dir(tmp_path, {"dash": "0.1", "libgmp10": "2:6.2.1+dfsg1-1.1"})


def test_the_init_stage_takes_the_pinned_tini(tmp_path, monkeypatch):
    apt = FakeApt(monkeypatch)
    deb = tmp_path / "debs" / "tini_0.19.0-1+b3_amd64.deb"

    def unpack(argv, what):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("./usr/bin/tini-static")
            info.size = 4
            tar.addfile(info, io.BytesIO(b"\x7fELF"))
        return buf.getvalue()

    monkeypatch.setattr(layer, "_run_bytes", unpack)
    made = layer.init_stage(tmp_path, _fake_pins(dash="1"))["/usr/bin/tini-static"]
    assert apt.downloads == [["tini=0.19.0-1+b3"]] and deb.exists()
    assert made.read_bytes() == b"\x7fELF" and made.stat().st_mode & 0o111


def test_a_hook_compiled_with_another_toolchain_than_the_pinned_is_said(monkeypatch, capsys):
    p = pins.Pins(base={"dash": "1"}, init={"tini": "1"}, host={"gcc-12": "12.2.0-14", "libc6-dev": "2.36-9"})
    monkeypatch.setattr(pins, "compiler_package", lambda: "gcc-12")
    monkeypatch.setattr(pins, "installed", lambda names: {"gcc-12": "12.2.0-14", "libc6-dev": "2.36-9"})
    pins.check_host(p)
    assert capsys.readouterr().err == "", "the pinned toolchain: nothing to say"
    monkeypatch.setattr(pins, "installed", lambda names: {"gcc-12": "12.2.0-14", "libc6-dev": "2.36-9+deb12u99"})
    pins.check_host(p)
    assert re.search(r"libc6-dev=2.36-9 \(here: 2.36-9\+deb12u99\).*not the pinned one|not the pinned one.*"
                     r"libc6-dev=2.36-9 \(here: 2.36-9\+deb12u99\)", capsys.readouterr().err)
    monkeypatch.setattr(pins, "installed", lambda names: {"gcc-12": "12.2.0-14", "libc6-dev": "2.36-9"})
    monkeypatch.setattr(pins, "compiler_package", lambda: "clang-14")
    pins.check_host(p)
    assert "comes from clang-14" in capsys.readouterr().err


# -- pip ----------------------------------------------------------------------------------------------------------
def test_records_of_the_deleted_scripts_go_with_them(tmp_path):
    """pip's scripts start with this host's interpreter path; their hashes in RECORD would carry it into the
    image. The RUN line deletes the scripts; their lines go too, and nothing else changes."""
    info = tmp_path / "idna-3.20.dist-info"
    info.mkdir()
    rows = ["idna/__init__.py,sha256=abc,849\n", "../../bin/idna,sha256=uS2hpXR72L9ez9rKli9nR5gEk8OAv7O,218\n",
            "idna-3.20.dist-info/RECORD,,\n"]
    (info / "RECORD").write_text("".join(rows))
    (tmp_path / "plain.dist-info").mkdir()
    (tmp_path / "plain.dist-info" / "RECORD").write_text("plain/__init__.py,sha256=x,1\n")
    layer._drop_outside_records(tmp_path)
    assert (info / "RECORD").read_text() == rows[0] + rows[2]
    assert (tmp_path / "plain.dist-info" / "RECORD").read_text() == "plain/__init__.py,sha256=x,1\n"


# -- the default base -----------------------------------------------------------------------------------------------
def test_the_default_base_is_debian_packages_for_the_command_and_the_function(monkeypatch, tmp_path):
    assert inspect.signature(build.build).parameters["base"].default == "debian-packages" == build.DEFAULT_BASE
    seen = []

    def fake_build(out, *, base, name, platforms):
        seen.append(base)
        raise build.BuildError("stop")

    monkeypatch.setattr(cli, "build", fake_build)
    assert cli.main(["--out", str(tmp_path)]) == 2 and seen == ["debian-packages"]

    def stop(base_ref, cache, p, arch):
        seen.append(base_ref)
        raise build.BuildError("stop")

    monkeypatch.setattr(image, "resolve_base", stop)
    for ref in (None, "debian-packages", "containerfile"):
        with pytest.raises(build.BuildError, match="stop"):
            build.build(tmp_path, base=ref)
    plan = build.parse_containerfile(build.CONTAINERFILE.read_text())
    assert seen[1:] == ["debian-packages", "debian-packages", plan.base]
    assert plan.base.startswith("docker.io/")  # the registry base: only where asked for by name


def test_the_pins_digest_is_what_keys_the_cached_base(tmp_path, monkeypatch):
    FakeApt(monkeypatch)
    made = base.build_debian_base(tmp_path, _fake_pins(dash="0.5.12-2"))
    key = hashlib.sha256(f"recipe={base._RECIPE}\ndash=0.5.12-2".encode()).hexdigest()[:16]
    assert made.root == tmp_path / "bases" / f"debian-python3.11-{key}"
