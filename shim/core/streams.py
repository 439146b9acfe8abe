"""The pure half of the streaming relay (``shim.origin.stream_relay``).

* ``StreamTokens``: the origin's streaming URLs, one-time tokens that expire,
  each naming the host and the host's own URL.
* ``RequestHead``: the first lines of an HTTP request (the streaming client's
  upgrade request), parsed and rewritten to the host's path.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

MAX_HEAD = 16 << 10
T = TypeVar("T")


@dataclass(frozen=True)
class StreamTarget(Generic[T]):
    kind: str  # "exec" or "attach"
    target: T  # what the relay needs: which container, which host, the host's URL
    expires: float


class StreamTokens(Generic[T]):
    """One-time tokens for the origin's streaming URLs; like containerd's, they expire unused."""

    def __init__(self, ttl: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._lock = threading.Lock()
        self._by_token: dict[str, StreamTarget[T]] = {}

    def add(self, kind: str, target: T) -> str:
        token = secrets.token_urlsafe(24)
        now = self.clock()
        with self._lock:
            for old in [t for t, s in self._by_token.items() if s.expires < now]:
                del self._by_token[old]
            self._by_token[token] = StreamTarget(kind, target, now + self.ttl)
        return token

    def take(self, kind: str, token: str) -> StreamTarget[T] | None:
        with self._lock:
            found = self._by_token.get(token)
            if found is None or found.kind != kind:
                return None
            del self._by_token[token]
        return found if found.expires >= self.clock() else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_token)


class BadRequest(ValueError):
    """Not an HTTP request head weft can relay."""


@dataclass(frozen=True)
class RequestHead:
    method: str
    path: str
    query: str
    version: str
    headers: tuple[tuple[str, str], ...]

    @property
    def route(self) -> tuple[str, str]:
        """("exec", token) for ``/exec/<token>``; ("", "") for anything else."""
        parts = self.path.strip("/").split("/")
        if len(parts) == 2 and parts[0] in ("exec", "attach", "portforward") and parts[1]:
            return parts[0], parts[1]
        return "", ""

    def rewritten(self, path: str, host: str) -> bytes:
        """The same request for ``path`` (the host's, with its own query kept if it has one) at ``host``."""
        target = path if "?" in path or not self.query else f"{path}?{self.query}"
        lines = [f"{self.method} {target} {self.version}"]
        lines += [f"Host: {host}" if k.lower() == "host" else f"{k}: {v}" for k, v in self.headers]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def head_end(data: bytes) -> int:
    """Where the head ends (past its blank line), or -1 while incomplete; BadRequest when too long."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) > MAX_HEAD:
            raise BadRequest(f"request head longer than {MAX_HEAD} bytes")
        return -1
    return end + 4


def parse_head(data: bytes) -> RequestHead:
    try:
        text = data.decode("latin-1")
    except UnicodeDecodeError:  # latin-1 decodes everything; kept for clarity
        raise BadRequest("undecodable request head") from None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    method, target, version = parts
    path, _, query = target.partition("?")
    headers = []
    for line in lines[1:]:
        if not line:
            break
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(f"malformed header line {line[:80]!r}")
        headers.append((name, value.strip()))
    return RequestHead(method, path, query, version, tuple(headers))
