"""systemd's readiness protocol (``sd_notify``): a service of ``Type=notify`` tells systemd it is ready.

With it, a unit ordered after weft's (kubelet, ``Before=kubelet.service`` in the agent's unit) starts only once
the agent serves, not the moment its process exists: at boot kubelet would otherwise find no socket yet, exit,
and come back only after its own restart delay. The protocol is one datagram to the socket systemd names in
``NOTIFY_SOCKET``; the maintained Python bindings (systemd-python) need libsystemd to build, so the few lines
are here.
"""

from __future__ import annotations

import os
import socket


def notify(state: str = "READY=1") -> bool:
    """Send ``state`` to systemd; False where no systemd asked for it (no ``NOTIFY_SOCKET``) or it is gone."""
    where = os.environ.get("NOTIFY_SOCKET", "")
    if not where or where[0] not in "/@":
        return False
    address = "\0" + where[1:] if where[0] == "@" else where  # "@": an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.sendall(state.encode())
    except OSError:
        return False
    return True
