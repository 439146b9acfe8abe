"""A kubectl-like client of CRI streaming URLs, over WebSocket as containerd serves them.

``v4.channel.k8s.io``: each binary message starts with its channel (0 stdin,
1 stdout, 2 stderr, 3 the error/status channel, 4 resize); the session ends
with a ``metav1.Status`` on channel 3 whose causes hold the exit code. Port
forwarding (``?port=N``) uses channel 0 for data and 1 for errors, and each
channel's first message from the server starts with the port (2 bytes, little
endian). The connection is made inside a node's network namespace, where
kubelet would reach the URL.
"""

from __future__ import annotations

import contextlib
import json
import time
from urllib.parse import urlsplit

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from shim.crishared.netns import Netns

PROTOCOL = "v4.channel.k8s.io"


class ChannelStream:
    def __init__(self, url: str, netns: str, timeout: float = 10.0) -> None:
        parts = urlsplit(url)
        self.ns = Netns(netns)
        sock = self.ns.connect(parts.hostname, parts.port, timeout)
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(url.replace("http://", "ws://"), sock=sock,
                                                    subprotocols=[PROTOCOL], max_size=None, open_timeout=timeout,
                                                    compression=None))
        self.out: dict[int, bytes] = {}

    def send(self, channel: int, data: bytes) -> None:
        self.ws.send(bytes([channel]) + data)

    def resize(self, width: int, height: int) -> None:
        self.send(4, json.dumps({"Width": width, "Height": height}).encode())

    def recv(self, timeout: float = 10.0) -> tuple[int, bytes] | None:
        try:
            msg = self.ws.recv(timeout=timeout)
        except ConnectionClosed:
            return None
        if isinstance(msg, str):
            msg = msg.encode()
        if not msg:
            return -1, b""
        self.out[msg[0]] = self.out.get(msg[0], b"") + msg[1:]
        return msg[0], msg[1:]

    def read_until(self, channel: int, needle: bytes, timeout: float = 10.0) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.out.get(channel, b""):
            left = deadline - time.monotonic()
            if left <= 0 or self.recv(left) is None:
                raise TimeoutError(f"{needle!r} not on channel {channel}: {self.out}")
        return self.out[channel]

    def exit_code(self, timeout: float = 10.0) -> int:
        """Read to the end; the exit code from the status on channel 3."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.recv(deadline - time.monotonic()) is None:
                break
        status = json.loads(self.out.get(3) or b"{}")
        if status.get("status") == "Success":
            return 0
        for cause in status.get("details", {}).get("causes", []):
            if cause.get("reason") == "ExitCode":
                return int(cause["message"])
        raise AssertionError(f"no exit status: {self.out}")

    def close(self) -> None:
        self._stack.close()
        self.ns.close()
