"""A shadow's copied volumes: what the origin may not send, and files replaced in place as it updates them."""

import os
from pathlib import Path

import pytest

from shim._pb import mesh_pb2 as pb
from shim.shadowhost import volumes as sv


def _dir(where: str, **files: bytes | tuple[bytes, int]) -> pb.Volume:
    out = []
    for path, value in files.items():
        data, mode = value if isinstance(value, tuple) else (value, 0)
        out.append(pb.VolumeFile(path=path.replace("__", "/"), data=data, mode=mode))
    return pb.Volume(container_path=where, files=out)


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", "a\0b", "", "a/.."],
                         ids=["dotdot", "absolute", "dotdot-inside", "empty-component", "dot", "nul", "empty",
                              "trailing-dotdot"])
def test_a_file_path_that_could_escape_the_volume_is_refused(path: str) -> None:
    with pytest.raises(sv.BadVolume, match="volume file path"):
        sv.plan([pb.Volume(container_path="/etc/config", files=[pb.VolumeFile(path=path, data=b"x")])])


@pytest.mark.parametrize("where", ["etc/config", "/", "/etc/../root", "/a\0b"],
                         ids=["relative", "root", "dotdot", "nul"])
def test_a_container_path_must_be_a_plain_absolute_path(where: str) -> None:
    with pytest.raises(sv.BadVolume, match="container_path"):
        sv.plan([_dir(where, a=b"x")])


@pytest.mark.parametrize(("volumes", "message"), [
    ([_dir("/c", a=b"1"), _dir("/c", b=b"2")], "two volumes"),
    ([pb.Volume(container_path="/c", files=[pb.VolumeFile(path="a"), pb.VolumeFile(path="a")])], "twice"),
    ([_dir("/c", a=b"1", a__b=b"2")], "both as a file and a directory"),
    ([pb.Volume(container_path="/etc/hosts", single_file=True, files=[pb.VolumeFile(path="hosts")])],
     "exactly one file"),
], ids=["same-mount-twice", "same-file-twice", "file-and-directory", "single-file-with-a-path"])
def test_conflicting_volumes_are_refused(volumes: list[pb.Volume], message: str) -> None:
    with pytest.raises(sv.BadVolume, match=message):
        sv.plan(volumes)


def test_a_containers_volumes_are_capped_in_size() -> None:
    big = b"x" * (sv.MAX_BYTES // 2 + 1)
    with pytest.raises(sv.VolumesTooLarge, match="at most 64 MiB"):
        sv.plan([_dir("/a", f=big), _dir("/b", f=big)])


def test_volumes_are_written_with_their_modes_and_updated_in_place(tmp_path: Path) -> None:
    root = tmp_path / "gpu-1" / "key"
    plans = sv.plan([_dir("/etc/config", a=(b"one", 0o644), sub__b=(b"two", 0o600)),
                     pb.Volume(container_path="/etc/extra.txt", single_file=True,
                               files=[pb.VolumeFile(data=b"single")])])
    sv.write(root, plans)
    assert _files(root / "0") == {"a": (b"one", 0o644), "sub/b": (b"two", 0o600)}
    assert sv.host_path(root, 1, plans[1]).read_bytes() == b"single"
    inode = (root / "0" / "a").stat().st_ino

    changed = sv.sync(root, sv.plan([_dir("/etc/config", a=(b"ONE", 0o644), c=b"three"),
                                     pb.Volume(container_path="/etc/extra.txt", single_file=True,
                                               files=[pb.VolumeFile(data=b"single")])]))
    assert changed == 3  # a rewritten, sub/b removed, c added; the single file unchanged
    assert _files(root / "0") == {"a": (b"ONE", 0o644), "c": (b"three", 0o644)}
    assert (root / "0" / "a").stat().st_ino != inode  # replaced by rename, never rewritten half-way
    assert not (root / "0" / "sub").exists()
    assert sv.sync(root, sv.plan([_dir("/etc/config", a=(b"ONE", 0o644), c=b"three"),
                                  pb.Volume(container_path="/etc/extra.txt", single_file=True,
                                            files=[pb.VolumeFile(data=b"single")])])) == 0


def test_a_path_may_turn_from_file_into_directory_and_back(tmp_path: Path) -> None:
    root = tmp_path / "o" / "k"
    sv.write(root, sv.plan([_dir("/c", a=b"file")]))
    sv.sync(root, sv.plan([_dir("/c", a__b=b"nested")]))
    assert _files(root / "0") == {"a/b": (b"nested", 0o644)}
    sv.sync(root, sv.plan([_dir("/c", a=b"file again")]))
    assert _files(root / "0") == {"a": (b"file again", 0o644)}


def test_nothing_is_written_through_a_symlink(tmp_path: Path) -> None:
    root = tmp_path / "o" / "k"
    outside = tmp_path / "outside"
    outside.mkdir()
    sv.write(root, sv.plan([_dir("/c", a=b"x")]))
    os.symlink(outside, root / "0" / "sub")  # however it got there
    sv.sync(root, sv.plan([_dir("/c", a=b"x", sub__evil=b"y")]))
    assert not list(outside.iterdir())
    assert not (root / "0" / "sub").is_symlink()
    assert _files(root / "0") == {"a": (b"x", 0o644), "sub/evil": (b"y", 0o644)}
    (root / "0").rename(root / "real")
    os.symlink(outside, root / "0")
    with pytest.raises(sv.BadVolume, match="symlink"):
        sv.sync(root, sv.plan([_dir("/c", a=b"x")]))
    assert not list(outside.iterdir())


def test_sync_cannot_change_what_is_mounted(tmp_path: Path) -> None:
    root = tmp_path / "o" / "k"
    sv.write(root, sv.plan([_dir("/c", a=b"x")]))
    with pytest.raises(sv.VolumesChanged, match="created with"):
        sv.sync(root, sv.plan([_dir("/other", a=b"x")]))


def test_remove_leaves_nothing_behind(tmp_path: Path) -> None:
    root = tmp_path / "volumes" / "gpu-1" / "key"
    sv.write(root, sv.plan([_dir("/c", a=b"x")]))
    sv.remove(root)
    assert list((tmp_path / "volumes").iterdir()) == []


def test_mount_points_are_read_with_their_escapes_deepest_first(tmp_path, monkeypatch) -> None:
    info = tmp_path / "mountinfo"
    info.write_bytes(b"1 0 0:1 / / rw - ext4 /dev/root rw\n"
                     b"2 1 0:2 / /srv/weft/shadow-volumes/gpu-1/abc/0 rw - tmpfs tmpfs rw\n"
                     b"3 1 0:3 / /srv/weft/shadow\\040volumes/x rw - tmpfs tmpfs rw\n"
                     b"4 1 0:4 / /srv/weft/shadow-volumes/gpu-1 rw - tmpfs tmpfs rw\n"
                     b"5 1 0:5 / /srv/weft/shadow-volumesX rw - tmpfs tmpfs rw\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/self/mountinfo"
                                                                         else path, *a, **k))
    assert sv.mounts_under(Path("/srv/weft/shadow-volumes")) == [
        Path("/srv/weft/shadow-volumes/gpu-1/abc/0"), Path("/srv/weft/shadow-volumes/gpu-1")]
    assert sv.mounts_under(Path("/srv/weft/shadow volumes")) == [Path("/srv/weft/shadow volumes/x")]


def test_an_origins_volumes_arriving_at_once_are_held_to_its_cap_with_what_it_has_here(tmp_path: Path) -> None:
    origin = tmp_path / "gpu-1"
    (origin / "held" / "0").mkdir(parents=True)
    (origin / "held" / "0" / "f").write_bytes(b"h" * 40)
    arriving = sv.Arriving(cap=100)
    with arriving.counting(origin, origin / "a") as take_a, arriving.counting(origin, origin / "b") as take_b:
        take_a(30)
        take_b(20)
        with pytest.raises(sv.VolumesTooLarge, match=r"at most 0 MiB on this host; 40 bytes are held, 30 are "
                                                     r"arriving for its other containers, and these add more "
                                                     r"\(31 bytes so far\)"):
            take_b(11)
        take_b(10)  # exactly the cap
        assert arriving.now(origin) == 60
    assert arriving.now(origin) == 0
    with arriving.counting(origin, origin / "held") as take:  # replacing its own: what it holds is not counted
        take(100)
    with arriving.counting(tmp_path / "gpu-2", tmp_path / "gpu-2" / "a") as take:  # another origin: its own cap
        take(100)
