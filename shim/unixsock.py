"""Exclusive, private unix sockets for weft's daemons (agent, broker, hook endpoint).

A socket is claimed before it is bound: an flock on ``<socket>.lock`` plus a
connect probe, so a second daemon on the same path refuses with a clear error
instead of unlinking and stealing a live socket, while a stale socket left by
a killed daemon is replaced. Release removes the socket only if it is still
the one this process bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket as socketlib
from pathlib import Path

from shim.errors import SocketInUse


class SocketClaim:
    """Exclusive ownership of a unix socket path for this process's lifetime."""

    def __init__(self, path: Path, what: str = "agent") -> None:
        self.path = path
        self.what = what
        self.lock_path = path.with_name(path.name + ".lock")
        self._fd: int | None = None
        self._inode: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SocketInUse(
                f"another weft {self.what} is serving {self.path} (it holds {self.lock_path}); stop it first"
            ) from None
        self._fd = fd
        if self.path.exists() or self.path.is_symlink():
            probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # stale: nobody answers on it
            else:
                self.release()
                raise SocketInUse(f"{self.path} is already served by another process; refusing to take it over")
            finally:
                probe.close()

    def bound(self) -> None:
        """Remember the inode we bound, so release never removes someone else's socket."""
        self._inode = self.path.stat().st_ino

    def release(self) -> None:
        if self._inode is not None:
            with contextlib.suppress(FileNotFoundError):
                if self.path.stat().st_ino == self._inode:
                    self.path.unlink()
            self._inode = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


