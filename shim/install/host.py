"""The host's files under an install root, and the install journal kept beside them.

Every write is atomic (temporary file in the same directory, fsync, rename,
fsync of the directory), so a crash leaves either the old or the new bytes of
a file, never a mix. The journal (``/var/lib/weft/install/journal.json``) is
written the same way, after the backups it names and before each step, so a
re-run after ``kill -9`` knows the originals and which steps had begun::

    (none) --install--> installing --all steps--> installed
       ^                    |  \\                      |
       |            failure / uninstall            uninstall
       |                    v                          v
       +--- last step --- uninstalling <---------------+

Backups hold the original bytes, mode and owner of every host file weft
changes, and the journal what weft last wrote into each. Where a file is as
weft wrote it, uninstall writes the backup back byte for byte; where someone
else has changed it since (NVIDIA's toolkit adding its runtime to containerd's
``config.toml``, an admin), the file as it is now with weft's own edit taken
out (:func:`shim.install.plan.unapply`) is the original from then on: a
re-install plans from it and uninstall leaves it, so weft never erases another
tool's later change.
"""

from __future__ import annotations

import contextlib
import enum
import glob
import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shim.errors import InstallError
from shim.install.plan import INSTALL_DIR, unapply
from shim.shadowhost.volumes import unmount_under

SCHEMA = 1
JOURNAL = f"{INSTALL_DIR}/journal.json"
BACKUPS = f"{INSTALL_DIR}/backups"


class Host:
    """Host paths (``/etc/...``) mapped under ``root``; ``root`` is ``/`` on a real node."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, host_path: str) -> Path:
        return self.root / host_path.lstrip("/")

    def read(self, host_path: str) -> bytes | None:
        try:
            return self.path(host_path).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def glob(self, pattern: str) -> list[str]:
        base = str(self.root).rstrip("/")
        return ["/" + os.path.relpath(p, base) for p in glob.glob(str(self.path(pattern))) if os.path.isfile(p)]

    def exists(self, host_path: str) -> bool:
        return os.path.lexists(self.path(host_path))

    def mode(self, host_path: str) -> int | None:
        """Permission bits of a file, None if there is none."""
        try:
            return self.path(host_path).stat().st_mode & 0o7777
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write(self, host_path: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
        target = self.path(host_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.weft-tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode & 0o7777)
        try:
            os.write(fd, data)
            os.fchmod(fd, mode & 0o7777)
            if owner is not None:
                os.fchown(fd, *owner)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
        self.sync_dir(target.parent)

    @staticmethod
    def sync_dir(d: Path) -> None:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, host_path: str) -> bool:
        p = self.path(host_path)
        with contextlib.suppress(FileNotFoundError):
            p.with_name(f".{p.name}.weft-tmp").unlink()
        if p.is_dir() and not p.is_symlink():
            unmount_under(p)  # the tmpfs of a shadow's copied volume, under the agent's state
            shutil.rmtree(p)
            return True
        try:
            p.unlink()
        except FileNotFoundError:
            return False
        self.sync_dir(p.parent)
        return True


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Original:
    sha256: str
    mode: int
    uid: int
    gid: int
    backup: str  # host path of the backup copy


class JournalState(enum.Enum):
    """Where an install stands, as its journal records it::

        INSTALLING --all steps done--> INSTALLED --uninstall--> UNINSTALLING --all undone--> (journal removed)
            |                                                        ^
            +---- a step failed: undone at once ---------------------+

    A journal left INSTALLING or UNINSTALLING by a crash is finished on the
    next run, in the direction it was going.
    """

    INSTALLING = "installing"
    INSTALLED = "installed"
    UNINSTALLING = "uninstalling"


@dataclass
class Journal:
    state: JournalState = JournalState.INSTALLING
    started: list[str] = field(default_factory=list)  # install steps begun, in order
    undone: list[str] = field(default_factory=list)  # uninstall steps begun
    originals: dict[str, Original] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    created_dirs: list[str] = field(default_factory=list)  # directories that did not exist before, outermost first
    containerd_socket: str = ""
    written: dict[str, str] = field(default_factory=dict)  # sha256 of what weft last wrote into each file it changed
    schema: int = SCHEMA

    @classmethod
    def load(cls, host: Host) -> Journal | None:
        raw = host.read(JOURNAL)
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
            if doc.get("schema") != SCHEMA:
                raise ValueError(f"schema {doc.get('schema')!r}, this weft reads {SCHEMA}")
            doc["originals"] = {p: Original(**o) for p, o in doc["originals"].items()}
            doc["state"] = JournalState(doc.get("state", JournalState.INSTALLING.value))
            return cls(**doc)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise InstallError(f"{JOURNAL}: cannot read the install journal ({exc}); "
                               "restore the files from its backups/ by hand") from exc

    def save(self, host: Host) -> None:
        doc = {**asdict(self), "state": self.state.value}
        host.write(JOURNAL, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), 0o600)

    def begin(self, host: Host, step: str, undo: bool = False) -> None:
        steps = self.undone if undo else self.started
        if step not in steps:
            steps.append(step)
            self.save(host)

    def backup(self, host: Host, host_path: str) -> None:
        """Copy the original of ``host_path`` into the backups (idempotent; before the journal names it)."""
        data = host.read(host_path)
        assert data is not None
        st = host.path(host_path).stat()
        name = f"{BACKUPS}/{host_path.strip('/').replace('/', '__')}"
        host.write(name, data, 0o600)
        self.originals[host_path] = Original(sha256(data), st.st_mode & 0o7777, st.st_uid, st.st_gid, name)

    def original(self, host: Host, host_path: str) -> bytes:
        o = self.originals[host_path]
        data = host.read(o.backup)
        if data is None or sha256(data) != o.sha256:
            raise InstallError(f"{o.backup}: the backup of {host_path} is missing or damaged; nothing more was changed")
        return data

    def rebackup(self, host: Host, host_path: str, data: bytes) -> None:
        """``data`` is ``host_path``'s original from now on (someone else changed the file since weft's install)."""
        o = self.originals[host_path]
        host.write(o.backup, data, 0o600)
        self.originals[host_path] = Original(sha256(data), o.mode, o.uid, o.gid, o.backup)

    def without_weft(self, host: Host, host_path: str) -> tuple[bytes, bool]:
        """(the file as it would be without weft, whether someone else changed it since weft wrote it).

        Unchanged: the backup, byte for byte. Changed: the file as it is with weft's edit taken out. A journal
        older than ``written`` tells by taking weft's edit out and comparing with the backup.
        """
        original = self.original(host, host_path)
        current = host.read(host_path)
        if current is None:
            return original, False
        if host_path in self.written:
            if sha256(current) == self.written[host_path]:
                return original, False
            return unapply(host_path, current, original), True
        bare = unapply(host_path, current, original)
        return (original, False) if bare == original or current == original else (bare, True)


class OriginalFiles:
    """The host as it would be without weft (what plans are made from): each file weft changed as backed up, or,
    where someone else changed it since, as it is now with weft's edit taken out; every other file as it is."""

    def __init__(self, host: Host, journal: Journal | None) -> None:
        self.host, self.journal = host, journal

    def read(self, path: str) -> bytes | None:
        if self.journal is not None and path in self.journal.originals:
            return self.journal.without_weft(self.host, path)[0]
        return self.host.read(path)

    def changed(self, path: str) -> bool:
        """Whether someone else changed ``path`` since weft wrote it (then :meth:`read` is it without weft's edit)."""
        return self.journal is not None and path in self.journal.originals and \
            self.journal.without_weft(self.host, path)[1]

    def glob(self, pattern: str) -> list[str]:
        return self.host.glob(pattern)
