"""One-time tokens for tunnels: what the mesh's gRPC service grants, and the tunnel port takes."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

TOKEN_TTL_S = 10.0


@dataclass
class Grant:
    origin: str
    # Opens the far end once the token is presented (connects to the target, or hands over an accepted socket).
    connect: Callable[[], socket.socket]
    tls: bool
    what: str
    expires: float
    on_expire: Callable[[], None] | None = None
    interactive: bool = False  # a person's stream (exec, attach): its pipe busy-polls (see Pipe)


class Grants:
    """One-time tokens for tunnels, each valid for ``ttl`` seconds."""

    def __init__(self, ttl: float = TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Grant] = {}

    def add(self, origin: str, connect: Callable[[], socket.socket], *, tls: bool, what: str,
            on_expire: Callable[[], None] | None = None, interactive: bool = False) -> bytes:
        token = secrets.token_bytes(24)
        self.expire()
        with self._lock:
            self._by_token[token] = Grant(origin, connect, tls, what, self.clock() + self.ttl, on_expire,
                                          interactive)
        return token

    def take(self, token: bytes) -> Grant | None:
        with self._lock:
            grant = self._by_token.pop(token, None)
        if grant is not None and grant.expires < self.clock():
            if grant.on_expire is not None:
                grant.on_expire()
            return None
        return grant

    def expire(self) -> int:
        now = self.clock()
        with self._lock:
            old = [t for t, g in self._by_token.items() if g.expires < now]
            gone = [self._by_token.pop(t) for t in old]
        for g in gone:
            if g.on_expire is not None:
                g.on_expire()
        return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_token)
