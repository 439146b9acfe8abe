"""weft's containerd drop-in kept current with the files it copies from, and weft's place in containerd's config.

The drop-in holds a copy of what it builds on: on containerd 1.x the host's whole effective CRI section (an
import's plugin section replaces the one before, so a drop-in with only the ``weft`` runtime would wipe the
rest), on 2.x the default runtime the ``weft`` handler is made from. A copy taken once would freeze another
tool's later change: NVIDIA's toolkit adding its ``nvidia`` runtime to ``config.toml`` after weft, or changing
its options, would be hidden on 1.x by weft's older copy imported last. So the copy is made again from the files
as they are:

- before every start of containerd (``weft containerd-dropin``, an ``ExecStartPre`` of containerd's unit that
  ``weft install`` adds): whoever restarts containerd to apply a change (the toolkit's installer, an admin, a
  reboot), containerd reads a drop-in made from that change;
- by the agent, when it sees the files change (:class:`Watch`), so ``containerd config dump`` agrees at once.

The one edit of ``config.toml`` made here is weft's own entry in ``imports`` moved last again where another
tool appended its own after it (the toolkit's ``conf.d`` glob: on 1.x its copy of the CRI section would
replace weft's). Where ``imports`` no longer names the drop-in at all (a tool or an admin wrote the file anew),
nothing is written: that is reported (the agent's log, its status, an Event on weft's pod on the node,
``weft gpu-check``), and the DaemonSet's next start (``weft install``) puts it back.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shim import log
from shim.errors import WeftError
from shim.install import containerd, services
from shim.install.host import Host, Journal, JournalState
from shim.install.plan import BROKER_SOCKET, HOOK


class State(enum.Enum):
    """Where weft stands in containerd's configuration, as one value with its reason."""

    NOT_INSTALLED = "not-installed"  # no install journal: an agent run by hand, the local fabric
    CURRENT = "current"  # the drop-in is imported last and made from the files as they are
    REGENERATED = "regenerated"  # it was made again just now from files that had changed
    NOT_IMPORTED = "not-imported"  # config.toml no longer imports it: containerd loses weft's handler at its restart
    NOT_LAST = "not-last"  # another import comes after it (on 1.x its CRI section replaces weft's)
    UNREADABLE = "unreadable"  # a file weft copies from could not be read: the drop-in is left as it was


PROBLEMS = (State.NOT_IMPORTED, State.NOT_LAST, State.UNREADABLE)
# The Event reason of each problem, on weft's pod on the node.
REASONS = {State.NOT_IMPORTED: "WeftNotImported", State.NOT_LAST: "WeftNotImportedLast",
           State.UNREADABLE: "WeftContainerdConfigUnreadable"}
INTERVAL = 30.0  # seconds between the agent's looks

_log = log.get("weft.agent")


@dataclass(frozen=True)
class Status:
    state: State
    detail: str = ""
    containerd: str = ""  # the version the drop-in was made for
    wrote: list[str] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        return self.state in PROBLEMS

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "state": self.state.value, "problem": self.problem}


def _digest(*parts: bytes | None) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(b"\0" if p is None else p)
    return h.hexdigest()


def installed(host: Host) -> bool:
    j = Journal.load(host)
    return j is not None and j.state is JournalState.INSTALLED


def containerd_of(host: Host, socket: Path | None = None) -> containerd.Containerd:
    """The node's containerd, as the installer asks it: its CRI socket, else its binary (containerd is stopped
    while its unit's ExecStartPre runs)."""
    sock = socket or host.path(containerd.socket(host))
    found = services.containerd_version(sock, [host.path(b) for b in containerd.BINARIES])
    if found is None:
        raise WeftError(f"{sock}: cannot tell which containerd this node runs (no CRI Version there and no "
                        f"{' or '.join(containerd.BINARIES)} under {host.root} answers --version)")
    return containerd.Containerd.parse(*found)


def regenerate(host: Host, ctrd: containerd.Containerd, write: bool = True) -> Status:
    """Make the drop-in and its base spec again from the host's files as they are; write them where they differ.

    Refusals (a file that is no TOML, a default runtime weft cannot copy) leave both files as they are.
    """
    try:
        plan = containerd.plan(host, [HOOK], BROKER_SOCKET, ctrd)
    except WeftError as exc:
        return Status(State.UNREADABLE, exc.message, ctrd.version)
    wrote = []
    placed = _placement(host)
    if placed is not None and placed[0] is State.NOT_LAST:
        # Another tool's import appended after weft's (the toolkit's conf.d glob): weft's own entry is moved last
        # again, the one edit of config.toml made here, so that on 1.x no older copy of the CRI section replaces it.
        if write:
            text = (host.read(containerd.CONFIG) or b"").decode()
            host.write(containerd.CONFIG, containerd.with_import(text, tomllib.loads(text), containerd.DROPIN).encode(),
                       host.mode(containerd.CONFIG) or 0o644)
        wrote.append(containerd.CONFIG)
    for path, data in ((containerd.DROPIN, plan.dropin), (containerd.BASE_SPEC, plan.base_spec)):
        if host.read(path) != data:
            if write:
                host.write(path, data, 0o644)
            wrote.append(path)
    placed = _placement(host)
    if placed is not None:
        return Status(placed[0], placed[1], ctrd.version, wrote)
    return Status(State.REGENERATED if wrote else State.CURRENT, "", ctrd.version, wrote)


def _placement(host: Host) -> tuple[State, str] | None:
    """Whether config.toml still imports the drop-in, and last; None where it does."""
    raw = host.read(containerd.CONFIG)
    try:
        doc = tomllib.loads((raw or b"").decode())
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        return State.UNREADABLE, f"{containerd.CONFIG}: not valid TOML ({exc})"
    imports = doc.get("imports", [])
    imports = imports if isinstance(imports, list) else []
    if containerd.DROPIN not in imports:
        return State.NOT_IMPORTED, (
            f"{containerd.CONFIG} no longer imports {containerd.DROPIN} (the file was written anew without it): "
            "containerd loses the 'weft' runtime handler at its next restart; weft's DaemonSet puts the import "
            "back at its next start (or run weft install)")
    if imports[-1] != containerd.DROPIN:
        return State.NOT_LAST, (
            f"{containerd.CONFIG} imports {imports[-1]} after {containerd.DROPIN}: on containerd 1.x its CRI "
            "section, if it has one, replaces weft's; weft's DaemonSet puts weft's import last again at its "
            "next start (or run weft install)")
    return None


class Watch:
    """The agent's look at containerd's configuration, every ``interval`` seconds (:meth:`check`).

    The files are read only when one of them changed (their bytes' digest); a new state is logged once and
    handed to ``on_change`` (the agent's Event on weft's pod).
    """

    def __init__(self, host: Host, ctrd: Callable[[], containerd.Containerd | None],
                 on_change: Callable[[Status], None] | None = None) -> None:
        self.host, self.ctrd, self.on_change = host, ctrd, on_change
        self.last: Status | None = None
        self._seen = ""

    def _files_digest(self) -> str:
        paths = [containerd.CONFIG, containerd.DROPIN, containerd.BASE_SPEC]
        with contextlib.suppress(WeftError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            paths += containerd.imported_files(self.host, containerd.CONFIG,
                                               tomllib.loads((self.host.read(containerd.CONFIG) or b"").decode()))
        return _digest(*(p.encode() + b"=" + (self.host.read(p) or b"") for p in paths))

    def check(self) -> Status | None:
        if not installed(self.host):
            self.last = Status(State.NOT_INSTALLED)
            return self.last
        digest = self._files_digest()
        if digest == self._seen and self.last is not None:
            return self.last
        ctrd = self.ctrd()
        if ctrd is None:
            return self.last  # containerd not answering: looked at again next time
        status = regenerate(self.host, ctrd)
        self._seen = self._files_digest()
        changed = self.last is None or (status.state, status.detail) != (self.last.state, self.last.detail) \
            or status.wrote
        self.last = status
        if changed:
            _said(status)
            if self.on_change is not None:
                self.on_change(status)
        return status


def _said(s: Status) -> None:
    """A state the agent's watch sees for the first time, logged (docs/metrics.md)."""
    what = {"detail": s.detail or None, "wrote": s.wrote or None, "containerd": s.containerd}
    if s.state is State.CURRENT:
        _log.info("containerd.config.current", **what)
    elif s.state is State.REGENERATED:
        _log.info("containerd.config.regenerated", **what)
    elif s.state is State.NOT_IMPORTED:
        _log.warning("containerd.config.not_imported", **what)
    elif s.state is State.NOT_LAST:
        _log.warning("containerd.config.not_last", **what)
    elif s.state is State.UNREADABLE:
        _log.warning("containerd.config.unreadable", **what)


def agent_watch(containerd_socket: Path, node: str, namespace: str, kubeconfig: Path | None,
                root: Path = Path("/")) -> Callable[[], dict[str, Any] | None]:
    """What the agent runs every :data:`INTERVAL` s on a node weft was installed onto: :class:`Watch` with the
    running containerd's version, and each new problem also an Event on weft's DaemonSet pod on this node."""
    host = Host(root)

    def version() -> containerd.Containerd | None:
        found = services.containerd_version(containerd_socket, [host.path(b) for b in containerd.BINARIES])
        return containerd.Containerd.parse(*found) if found else None

    def report(status: Status) -> None:
        if status.problem and node:
            _event(node, namespace, kubeconfig, REASONS[status.state], status.detail)

    watch = Watch(host, version, report)

    def check() -> dict[str, Any] | None:
        status = watch.check()
        return None if status is None or status.state is State.NOT_INSTALLED else status.as_dict()

    return check


def agent_sandbox_image(containerd_socket: Path, root: Path = Path("/")) -> Callable[[], str | None]:
    """For an agent whose containerd's Status names no sandbox image (2.x): the one its files name, or that
    release's own default, as ``weft install`` reads them; None where neither can be told (said in the log)."""
    host = Host(root)

    def image() -> str | None:
        found = services.containerd_version(containerd_socket, [host.path(b) for b in containerd.BINARIES])
        if not found:
            _log.warning("reservation.sandbox_image_unknown",
                         error=f"containerd's version: neither {containerd_socket} nor its binary answers")
            return None
        try:
            return containerd.running_sandbox_image(host, containerd.Containerd.parse(*found))
        except WeftError as exc:
            _log.warning("reservation.sandbox_image_unknown", error=str(exc))
            return None

    return image


def _event(node: str, namespace: str, kubeconfig: Path | None, reason: str, message: str) -> None:
    """An Event on weft's DaemonSet pod on ``node`` (where ``kubectl describe pod`` shows it); best effort."""
    from lightkube.resources.core_v1 import Pod

    from shim.kube import access, events

    try:
        client = access.resolve(kubeconfig).client()
        pods = list(client.list(Pod, namespace=namespace, fields={"spec.nodeName": node},
                                labels={"app.kubernetes.io/name": "weft", "app.kubernetes.io/component": "node"}))
        client.close()
    except Exception as exc:  # noqa: BLE001 (the API away or refusing: said, never the agent's failure)
        _log.warning("containerd.config.event_failed", reason=reason, error=str(exc))
        return
    for pod in pods:
        ref = events.PodRef(pod.metadata.name, namespace, pod.metadata.uid or "")
        problem = events.report(ref, reason, message, kubeconfig=kubeconfig, component="weft-agent", field_path=None)
        if problem:
            _log.warning("containerd.config.event_failed", reason=reason, error=problem)
