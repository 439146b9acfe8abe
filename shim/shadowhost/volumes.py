"""A shadow's copied read-only volumes: checked, written under the host's state directory, bound read-only.

A rerouted container's ConfigMap, Secret and projected volumes stay on the
origin; the origin sends their files (``RunShadowRequest.volumes``) and this
module writes them on the host::

    <root>/<origin>/<key digest>/
        volumes.json      what was mounted: [{container_path, single_file}], for SyncVolumes to check
        0/                a directory volume: its files, bound at its container_path
        1/file            a single-file volume (a subPath, /etc/hosts): this one file is bound

Everything the origin sends is untrusted: a relative path may not be
absolute, hold ``.``/``..``/empty components or NUL, and nothing is written
through a symlink (there are none unless someone else made one; we check
anyway, with ``O_NOFOLLOW`` and ``lstat``). A container's volumes are capped
at ``MAX_BYTES`` and ``MAX_FILES`` in all, and an origin's, all its
containers' together, at ``MAX_ORIGIN_BYTES``. The directories above a
container's own are root's alone (0700): what came from a Secret is read by
the container through its bind mount, and by no one else on the host. As
kubelet keeps a Secret, each volume is written to a tmpfs of its own
(``write(tmpfs=True)``, as the host agent writes them): never to the host's
disk, gone with the shadow or a reboot; ``remove`` unmounts it.

The files arrive in parts (``shim.mesh.upload``), counted against the same
caps as they come (``UPLOAD_CAPS``, and the origin's in
``Lifecycle.receiving``); ``plan`` checks them again once they are all in.

``plan`` is pure (the checks); ``write`` and ``sync`` touch the disk. A file
is replaced atomically (a temporary file in the same directory, then
``rename``), so a container reading through its directory bind mount sees the
old content or the new, never half. A single-file volume is bound by inode,
so like a Kubernetes subPath mount it does not see later updates.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import grpc

from shim.errors import WeftError
from shim.mesh.upload import UploadCaps

MAX_BYTES = 64 << 20
MAX_ORIGIN_BYTES = 256 << 20
MAX_FILES = 4096
# The same caps, held part by part while the volumes arrive (shim.mesh.upload).
UPLOAD_CAPS = UploadCaps(max_bytes=MAX_BYTES, max_files=MAX_FILES)
MAX_PATH = 4096
DEFAULT_MODE = 0o644
SINGLE = "file"
MANIFEST = "volumes.json"
_TMP = ".weft-tmp-"


_libc = ctypes.CDLL(None, use_errno=True)
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


class VolumesUnwritable(WeftError):
    """This host cannot make the memory-backed directory a copied volume is written to (no tmpfs here)."""

    code = grpc.StatusCode.UNAVAILABLE


class BadVolume(WeftError):
    """The origin sent a volume this host will not write: a path that escapes, a conflict, a bad shape."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class VolumesTooLarge(BadVolume):
    """A container's volumes exceed what a host keeps for one container."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class VolumesChanged(BadVolume):
    """SyncVolumes asked for other mounts than the container was created with (mounts are fixed at create)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True)
class VolumePlan:
    container_path: str
    single_file: bool
    # relative path ("file" for a single-file volume) -> (data, mode)
    files: dict[str, tuple[bytes, int]]


def relative(path: str) -> str:
    """``path`` if it is a plain relative path inside a volume; BadVolume naming it otherwise."""
    if not path or len(path) > MAX_PATH or "\0" in path:
        raise BadVolume(f"volume file path {path!r} is empty, too long or holds NUL")
    if path.startswith("/"):
        raise BadVolume(f"volume file path {path!r} is absolute")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise BadVolume(f"volume file path {path!r} has an empty, '.' or '..' component")
    return path


def container_path(path: str) -> str:
    if not path.startswith("/") or len(path) > MAX_PATH or "\0" in path:
        raise BadVolume(f"volume container_path {path!r} must be an absolute path without NUL")
    parts = path.split("/")[1:]
    if path == "/" or any(part in (".", "..") for part in parts):
        raise BadVolume(f"volume container_path {path!r} is the root or has a '.' or '..' component")
    return str(PurePosixPath(path))


def plan(volumes: Sequence) -> list[VolumePlan]:
    """Check what the origin sent (``mesh_pb2.Volume`` messages); the plans to write, or BadVolume."""
    out: list[VolumePlan] = []
    total = count = 0
    seen: set[str] = set()
    for v in volumes:
        where = container_path(v.container_path)
        if where in seen:
            raise BadVolume(f"two volumes are mounted at {where}")
        seen.add(where)
        files: dict[str, tuple[bytes, int]] = {}
        if v.single_file:
            if len(v.files) != 1 or v.files[0].path:
                raise BadVolume(f"single-file volume at {where} must carry exactly one file with path ''")
            files[SINGLE] = (v.files[0].data, _mode(v.files[0].mode))
        else:
            for f in v.files:
                rel = relative(f.path)
                if rel in files:
                    raise BadVolume(f"volume at {where} lists {rel!r} twice")
                files[rel] = (f.data, _mode(f.mode))
            for rel in files:  # "a" and "a/b": a file cannot also be a directory
                for parent in PurePosixPath(rel).parents:
                    if str(parent) != "." and str(parent) in files:
                        raise BadVolume(f"volume at {where} has {str(parent)!r} both as a file and a directory")
        for data, _ in files.values():
            total += len(data)
        count += len(files)
        if total > MAX_BYTES or count > MAX_FILES:
            raise VolumesTooLarge(f"a hosted container's volumes may hold at most {MAX_BYTES >> 20} MiB in "
                                  f"{MAX_FILES} files; these hold more ({total} bytes so far, {count} files)")
        out.append(VolumePlan(where, bool(v.single_file), files))
    return out


def _mode(mode: int) -> int:
    # proto3 cannot tell 0 from unset: 0 means the default, as kubelet's defaultMode does.
    return (mode & 0o777) or DEFAULT_MODE


def manifest(plans: Iterable[VolumePlan]) -> list[dict]:
    return [{"container_path": p.container_path, "single_file": p.single_file} for p in plans]


def host_path(root: Path, index: int, p: VolumePlan) -> Path:
    """What is bound at ``p.container_path``."""
    return root / str(index) / SINGLE if p.single_file else root / str(index)


def plan_bytes(plans: Iterable[VolumePlan]) -> int:
    return sum(len(data) for p in plans for data, _ in p.files.values())


def used_bytes(path: Path, *, besides: Path | None = None) -> int:
    """Bytes of the regular files under ``path`` (not following links), those under ``besides`` left out."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        if besides is not None and Path(dirpath) == besides:
            dirnames[:] = []
            continue
        for name in filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def check_origin_cap(origin_root: Path, plans: list[VolumePlan], *, replacing: Path | None = None) -> None:
    """VolumesTooLarge if ``plans`` (in place of what is under ``replacing``) take the origin past its cap."""
    used = used_bytes(origin_root, besides=replacing) if origin_root.is_dir() else 0
    wanted = plan_bytes(plans)
    if used + wanted > MAX_ORIGIN_BYTES:
        raise VolumesTooLarge(f"an origin's hosted containers' volumes may hold at most {MAX_ORIGIN_BYTES >> 20} MiB "
                              f"on this host; {used} bytes are held and these add {wanted}")


class Arriving:
    """The bytes of copied volumes being received now, per origin: held against the origin's cap together with
    what it has on this host, so that its streams at once cannot hold more in memory than the cap."""

    def __init__(self, cap: int = MAX_ORIGIN_BYTES) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._bytes: dict[Path, int] = {}

    def now(self, origin_root: Path) -> int:
        with self._lock:
            return self._bytes.get(origin_root, 0)

    @contextlib.contextmanager
    def counting(self, origin_root: Path, root: Path) -> Iterator[Callable[[int], None]]:
        """``take(n)`` for one stream of the origin under ``origin_root`` (for the container at ``root``, whose
        volumes it replaces): VolumesTooLarge when ``n`` more bytes would take the origin past its cap."""
        held = used_bytes(origin_root, besides=root) if origin_root.is_dir() else 0
        mine = 0

        def take(n: int) -> None:
            nonlocal mine
            with self._lock:
                arriving = self._bytes.get(origin_root, 0)
                if held + arriving + n > self.cap:
                    raise VolumesTooLarge(f"an origin's hosted containers' volumes may hold at most {self.cap >> 20} "
                                          f"MiB on this host; {held} bytes are held, {arriving - mine} are arriving "
                                          f"for its other containers, and these add more ({mine + n} bytes so far)")
                self._bytes[origin_root] = arriving + n
                mine += n

        try:
            yield take
        finally:
            with self._lock:
                left = self._bytes.pop(origin_root, 0) - mine
                if left:
                    self._bytes[origin_root] = left


def write(root: Path, plans: list[VolumePlan], *, tmpfs: bool = False) -> None:
    """Write a new container's volumes under ``root`` (made here; must not exist), its parents root's alone;
    with ``tmpfs``, each volume on a tmpfs of its own (what came from a Secret never touches the disk)."""
    root.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (root.parent, root.parent.parent):
        with contextlib.suppress(OSError):
            d.chmod(0o700)
    root.mkdir(mode=0o755)
    for i, p in enumerate(plans):
        if tmpfs:
            os.mkdir(root / str(i), 0o755)
            _mount_tmpfs(root / str(i))
        _sync_one(root / str(i), p)
    (root / MANIFEST).write_text(json.dumps(manifest(plans)))


def _mount_tmpfs(path: Path) -> None:
    # Room for the container's whole cap (a sync may grow a volume up to it); tmpfs holds only what is written.
    options = f"mode=0755,size={MAX_BYTES + (1 << 20)},nr_inodes={MAX_FILES + 64}".encode()
    if _libc.mount(b"tmpfs", os.fsencode(path), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise VolumesUnwritable(f"cannot mount a tmpfs for a copied volume at {path}: {os.strerror(err)}")


def mounts_under(base: Path) -> list[Path]:
    """The mount points at or under ``base`` (this process's mount namespace), deepest first."""
    prefix = os.fsencode(base)
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            # Mount points escape space, tab, newline and backslash as octal (\040 ...).
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), line.split()[4])
            if point == prefix or point.startswith(prefix + b"/"):
                found.append(Path(os.fsdecode(point)))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def unmount_under(base: Path) -> None:
    """Detach every mount at or under ``base`` (a volume's tmpfs, and whatever else a crash left there)."""
    for point in mounts_under(base):
        _libc.umount2(os.fsencode(point), _MNT_DETACH)


def sync(root: Path, plans: list[VolumePlan]) -> int:
    """Make the files under ``root`` what ``plans`` say; the number of files written or removed."""
    try:
        mounted = json.loads((root / MANIFEST).read_text())
    except FileNotFoundError:
        mounted = []
    if mounted != manifest(plans):
        raise VolumesChanged(f"SyncVolumes must send the volumes the container was created with "
                             f"({[m['container_path'] for m in mounted]}), not "
                             f"{[p.container_path for p in plans]}")
    return sum(_sync_one(root / str(i), p) for i, p in enumerate(plans))


def _sync_one(vdir: Path, p: VolumePlan) -> int:
    _real_dir(vdir)
    changed = 0
    # Remove what is no longer wanted first: a path may turn from a file into a directory.
    for dirpath, dirnames, filenames in os.walk(vdir, topdown=False, followlinks=False):
        base = Path(dirpath)
        for name in filenames + [d for d in dirnames if (base / d).is_symlink()]:
            rel = (base / name).relative_to(vdir).as_posix()
            if rel not in p.files:
                os.unlink(base / name)
                changed += 0 if name.startswith(_TMP) else 1
        for name in dirnames:
            full = base / name
            if not full.is_symlink() and not any(f.startswith(full.relative_to(vdir).as_posix() + "/")
                                                 for f in p.files):
                shutil.rmtree(full)
    for rel, (data, mode) in sorted(p.files.items()):
        target = vdir / rel
        parent = vdir
        for part in PurePosixPath(rel).parts[:-1]:
            parent = parent / part
            _real_dir(parent)
        try:
            st = os.lstat(target)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == mode \
                and st.st_size == len(data) and target.read_bytes() == data:
            continue
        if st is not None and stat.S_ISDIR(st.st_mode):
            shutil.rmtree(target)
        _replace(target, data, mode)
        changed += 1
    return changed


def _real_dir(path: Path) -> None:
    """``path`` exists as a directory of its own, not a symlink to somewhere else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        os.mkdir(path, 0o755)
        return
    if stat.S_ISDIR(st.st_mode):
        return
    if stat.S_ISLNK(st.st_mode):
        raise BadVolume(f"{path} is a symlink; volumes are never written through one")
    os.unlink(path)  # was a file, is now a directory
    os.mkdir(path, 0o755)


def _replace(target: Path, data: bytes, mode: int) -> None:
    tmp = target.with_name(f"{_TMP}{target.name[:64]}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), mode)
        os.rename(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove(root: Path) -> None:
    """Delete a container's volumes (their tmpfs unmounted first), and its origin's directory once it is empty."""
    unmount_under(root)
    shutil.rmtree(root, ignore_errors=True)
    with contextlib.suppress(OSError):
        root.parent.rmdir()
