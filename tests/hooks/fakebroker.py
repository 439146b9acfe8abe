"""A real unix socket server standing in for the broker's hook endpoint (``<broker socket>.hook``)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path


class FakeHookServer:
    """Answers each JSON line with ``answer`` (bytes: written as they are) and records the requests."""

    def __init__(self, broker_socket: Path, answer: dict | bytes) -> None:
        self.broker_socket = broker_socket
        self.answer = answer
        self.requests: list[dict] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(broker_socket) + ".hook")
        self._sock.listen()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rwb") as f:
                line = f.readline()
                if line:
                    self.requests.append(json.loads(line))
                    raw = self.answer if isinstance(self.answer, bytes) else json.dumps(self.answer).encode() + b"\n"
                    f.write(raw)
                    f.flush()

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (Linux), where close() alone does not
        self._sock.close()
        self._thread.join(2)
        assert not self._thread.is_alive()
