"""How a host knows its own shadows from a pod that only carries their labels.

Any pod may carry the label ``weft.io/origin-node`` (kubelet passes a pod's
labels to its sandbox), and the list verbs hide what is labelled a shadow
from kubelet: a pod could hide itself. So a host marks what it creates with
``weft.io/shadow-mark``, an HMAC of what it made under a key only it holds
(``<state dir>/shadow-mark.key``, 0600, made on first use): a sandbox by
its origin and UID (a shadow sandbox's UID is the origin pod's plus
``-shadow``; the API server gives each pod its own), a container by its
origin and key label (container labels are kubelet's alone). Only what bears
a mark this host could have made counts as a shadow.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import threading
from pathlib import Path

from shim.crishared.labels import KEY_LABEL, ORIGIN_LABEL

MARK_LABEL = "weft.io/shadow-mark"
KEY_FILE = "shadow-mark.key"


class ShadowMark:
    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def load(cls, state_dir: Path) -> ShadowMark:
        """The host's key from ``state_dir``, made there (0600) on first use."""
        path = state_dir / KEY_FILE
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_bytes(32))
            finally:
                os.close(fd)
        key = path.read_bytes()
        if len(key) < 32:  # a torn first write: make it again
            path.unlink()
            return cls.load(state_dir)
        return cls(key)

    def _mac(self, *parts: str) -> str:
        return hmac.new(self._key, "\0".join(parts).encode(), hashlib.sha256).hexdigest()[:40]

    def sandbox(self, origin: str, uid: str) -> str:
        return self._mac("sandbox", origin, uid)

    def container(self, origin: str, key_label: str) -> str:
        return self._mac("container", origin, key_label)

    def reservation_stop(self, name: str) -> str:
        """The token kubelet presents (the reservation's preStop hook) to have its shadow stopped."""
        return self._mac("reservation-stop", name)

    def is_sandbox(self, labels, uid: str) -> bool:
        """Whether a sandbox with these labels and UID is one this host made for a peer."""
        origin = labels.get(ORIGIN_LABEL)
        return origin is not None and hmac.compare_digest(labels.get(MARK_LABEL, ""), self.sandbox(origin, uid))

    def is_container(self, labels) -> bool:
        origin = labels.get(ORIGIN_LABEL)
        return origin is not None and hmac.compare_digest(
            labels.get(MARK_LABEL, ""), self.container(origin, labels.get(KEY_LABEL, "")))


class ShadowsSeen:
    """This node's mark, and whether its containerd holds shadows now: the host side sets ``present`` when it
    makes one (the reconciler when it finds one), and the list verbs, on every call, hide what bears the mark
    only while it is set. One object, shared by both, made with the agent; ``mark`` None (a fabric made
    without one, as unit tests make it): the origin label alone says shadow. The agent makes it ``present``:
    a restarted agent hides its shadows from its first answer to kubelet, before anything has looked (kubelet
    kills a running pod it does not know, and a shadow is one), until the reconciler finds there are none."""

    def __init__(self, mark: ShadowMark | None = None, present: bool = False) -> None:
        self.mark = mark
        self.present = present
        self._made = 0  # shadows begun: a look at containerd older than the newest says nothing of it
        self._lock = threading.Lock()

    def making(self) -> None:
        """A shadow is about to be made: hidden from now, before containerd has it and kubelet could list it."""
        with self._lock:
            self._made += 1
            self.present = True

    def looking(self) -> int:
        """Before listing containerd: the token ``looked`` takes."""
        with self._lock:
            return self._made

    def looked(self, found: bool, since: int) -> bool:
        """What a list of containerd begun at ``since`` found; ``present`` is cleared only if no shadow was
        begun meanwhile (that list may have been taken before it existed). Whether ``present`` changed."""
        with self._lock:
            present = found or (self.present and self._made != since)
            changed, self.present = present != self.present, present
            return changed
