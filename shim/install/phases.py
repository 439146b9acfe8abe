"""The installer's steps as phases, in one table: what each does on install, how it is undone, what it journals.

Each step is one :class:`Phase`: its name (the record in the install journal's ``started`` and the failpoint
``install.<name>``), what it does on install (``apply``), how uninstall and a rollback take it back (``undo``,
recorded in the journal's ``undone`` as ``undo_name``, failpoint ``uninstall.<undo_name>``), where its undo comes
in the uninstall order (``undo_at``), the host files it writes (``files``: what the journal records it wrote, and
what its undo gives back or removes), and what it checks (``check``: whether it is done already, so that a
re-install that would change nothing says so). :data:`PHASES` lists them in install order; install, rollback,
uninstall and a re-run after a crash all walk it (:mod:`shim.install.run`, around the journal).

Every ``apply`` and ``undo`` converges: it writes the planned bytes, removes what weft added or restarts a
service, so running it again after ``kill -9`` finishes the job. An undo runs whatever the journal says; one
that acts on a service acts only where the install phase that needs it had begun (``Context.began``).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shim.errors import InstallError
from shim.install import bundle, containerd, kubelet, services
from shim.install.host import JOURNAL, Host, Journal, sha256
from shim.install.plan import AGENT_UNIT, BROKER_UNIT, INSTALL_DIR, OPT, Options, Plan

KUBELET_FILES = (kubelet.CONFIG_YAML, *kubelet.FLAG_FILES)


@dataclass
class Settings:
    root: Path = Path("/")
    services: services.Services = field(default_factory=services.NoServices)
    agent_socket: Path | None = None  # as the installer sees it; default <root>/run/weft/cri.sock
    containerd_socket: Path | None = None  # for uninstall's pod check; default <root>/<containerd's socket>
    kubelet_health_url: str = "http://127.0.0.1:10248/healthz"
    kubelet_timeout: float = 120.0
    agent_timeout: float = 60.0
    source: Path | None = None
    options: Options = field(default_factory=Options)
    purge: bool = False  # uninstall: also what the DaemonSet kept on the host (run.PURGED)
    say: Callable[[str], None] = print


@dataclass
class Context:
    """What a phase runs with: the settings, the host and its journal; on install also the plan and the copy of weft
    (its files and their digest); on uninstall what it gathers (the service actions that failed, the files it
    keeps because containerd's configuration still names them)."""

    settings: Settings
    host: Host
    journal: Journal
    plan: Plan | None = None  # install only
    sources: list[tuple[Path, str]] = field(default_factory=list)  # install only: bundle.source_files
    stamp: str = ""  # install only: bundle.digest of the sources
    problems: list[str] = field(default_factory=list)  # uninstall: service actions that failed (it goes on)
    kept: set[str] = field(default_factory=set)  # uninstall: what containerd's configuration still names

    @property
    def services(self) -> services.Services:
        return self.settings.services

    @property
    def agent_socket(self) -> Path:
        return agent_socket(self.settings, self.host)

    def say(self, line: str) -> None:
        self.settings.say(line)

    def began(self, name: str) -> bool:
        """Whether the install phase ``name`` had begun (the journal's ``started``): what its undo must take back."""
        return name in self.journal.started

    def attempt(self, *args: str) -> None:
        """A service action whose failure is said and noted, and the uninstall goes on."""
        try:
            self.services.systemctl(*args)
        except InstallError as exc:
            self.problems.append(exc.message)
            self.say(f"warning: {exc.message}")


def agent_socket(settings: Settings, host: Host) -> Path:
    return settings.agent_socket or host.path("/run/weft/cri.sock")


Step = Callable[[Context, "Phase"], None]
Check = Callable[[Context, "Phase"], bool]


@dataclass(frozen=True)
class Phase:
    name: str  # the journal's record of its start (``started``), and its failpoint install.<name>
    apply: Step | None  # what install does; None: nothing (the journal's own phase, made before any)
    undo: Step | None  # what uninstall and a rollback do; None: nothing to take back (a check)
    undo_at: int = 0  # its place in the uninstall order (1 first); 0 where it has no undo
    undo_name: str = ""  # the journal's record of its undo (``undone``), and its failpoint; default: name
    # The host files it writes: a path, or a directory ending in "/" for every file under it. The journal records
    # what weft last wrote into each (``written``) and which it added (``added``); the undo gives back or removes
    # them.
    files: tuple[str, ...] = ()
    check: Check | None = None  # done already (a re-install changes nothing); None: nothing to check

    @property
    def undone_as(self) -> str:
        return self.undo_name or self.name

    def owns(self, path: str) -> bool:
        return any(path == f or (f.endswith("/") and path.startswith(f)) for f in self.files)

    def planned(self, plan: Plan) -> dict[str, bytes]:
        """The files of ``plan`` this phase writes, in the plan's order."""
        return {p: c for p, c in {**plan.modified, **plan.added}.items() if self.owns(p)}


# -- bundle: the self-contained copy of weft in /opt/weft ------------------------------------------------------
def _copy_bundle(ctx: Context, phase: Phase) -> None:
    host = ctx.host
    new, old = f"{OPT}.new", f"{OPT}.old"
    host.remove(new)
    if host.read(f"{OPT}/{bundle.MARKER}") != (ctx.stamp + "\n").encode():
        bundle.build(ctx.sources, host.path(new), ctx.stamp, launchers=ctx.settings.source is None)
        if host.exists(OPT):
            os.replace(host.path(OPT), host.path(old))
        os.replace(host.path(new), host.path(OPT))
        Host.sync_dir(host.path(OPT).parent)
        ctx.say(f"copied weft to {OPT}")
    host.remove(old)
    if ctx.settings.source is None and ctx.services.active:
        # Before anything is started from it: a host that lacks what the copy needs (a C library too old)
        # is named here, not in the agent's journal after kubelet's switch was attempted.
        loader = bundle.elf_interpreter(host.path(f"{OPT}/bin/python3"))
        if loader and not host.exists(loader):  # a tree laid out like a node, not a node's root
            ctx.say(f"the copy of weft in {OPT} was not run: {ctx.settings.root} has no {loader}")
            return
        problem = services.run_on_host(ctx.settings.root, bundle.check_argv(OPT), timeout=120)
        if problem:
            raise InstallError(f"the copy of weft in {OPT} does not run on this host: {problem}")
        ctx.say(f"the copy of weft in {OPT} runs on this host")


def _remove_bundle(ctx: Context, phase: Phase) -> None:
    for p in (f"{OPT}.new", f"{OPT}.old", OPT):
        ctx.host.remove(p)


def _bundle_copied(ctx: Context, phase: Phase) -> bool:
    return ctx.host.read(f"{OPT}/{bundle.MARKER}") == (ctx.stamp + "\n").encode()


# -- the phases that write files: units, containerd-config, kubelet-config ----------------------------------------
def _write_files(ctx: Context, phase: Phase) -> None:
    assert ctx.plan is not None
    host, j, modes = ctx.host, ctx.journal, ctx.plan.modes
    for path, content in phase.planned(ctx.plan).items():
        o = j.originals.get(path)
        mode = o.mode if o else modes.get(path, 0o644)
        if host.read(path) != content or (path in modes and host.mode(path) != mode):
            if o is not None:  # what weft writes into a host file, known before it is there
                j.written[path] = sha256(content)
                j.save(host)
            host.write(path, content, mode, (o.uid, o.gid) if o else None)
            ctx.say(f"wrote {path}" + (f" (mode {mode:04o})" if path in modes else ""))
        elif o is not None and j.written.get(path) != sha256(content):
            j.written[path] = sha256(content)
            j.save(host)


def _files_written(ctx: Context, phase: Phase) -> bool:
    assert ctx.plan is not None
    return all(ctx.host.read(p) == c for p, c in phase.planned(ctx.plan).items()) and \
        all(ctx.host.mode(p) == m for p, m in ctx.plan.modes.items() if phase.owns(p))


def _restore(ctx: Context, paths: list[str]) -> bool:
    """Each file as it was before weft, or, where someone else changed it since weft wrote it, as it is with
    weft's own edit taken out (their changes kept, and said)."""
    host, j = ctx.host, ctx.journal
    changed = False
    for path in paths:
        if path in j.originals:
            (data, kept), o = j.without_weft(host, path), j.originals[path]
            current = host.read(path)
            if current != data:
                mode = (host.mode(path) or o.mode) if kept else o.mode
                host.write(path, data, mode, (o.uid, o.gid))
                ctx.say(f"took weft's edit out of {path}, keeping the changes made to it since weft's install"
                        if kept else f"restored {path}")
                changed = True
            if kept:
                j.rebackup(host, path, data)
            if path in j.written:
                del j.written[path]
                j.save(host)
    return changed


def _remove_units(ctx: Context, phase: Phase) -> None:
    # With them, the agent's configuration: /etc/weft may hold what weft did not add (the node's mesh key, kept
    # there by weft mesh-identity), so each added file goes, not the directory.
    for p in [*ctx.journal.added]:
        if phase.owns(p) and ctx.host.remove(p):
            ctx.say(f"removed {p}")
    if ctx.began("units"):
        ctx.attempt("daemon-reload")


def _restore_containerd(ctx: Context, phase: Phase) -> None:
    _restore(ctx, [p for p in ctx.journal.originals if phase.owns(p)])
    keep = ctx.kept = _scrub_copies(ctx)
    for p in [*ctx.journal.added]:
        if phase.owns(p) and p not in keep and ctx.host.remove(p):
            ctx.say(f"removed {p}")


def _scrub_copies(ctx: Context) -> set[str]:
    """Copies of weft's runtime handler another tool took into containerd's files (the toolkit's drop-in with
    the whole CRI section, a config.toml written from ``containerd config dump``): taken out, or containerd
    would not start its CRI plugin once weft's base spec is gone. Where one cannot be, the base spec stays
    (returned), and that is said."""
    host = ctx.host
    raw = host.read(containerd.CONFIG)
    try:
        doc = tomllib.loads((raw or b"").decode())
        paths = [containerd.CONFIG, *containerd.imported_files(host, containerd.CONFIG, doc)]
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, InstallError):
        paths = [containerd.CONFIG]
    for path in paths:
        data = host.read(path)
        if data is None:
            continue
        try:
            new = containerd.without_weft_runtime(data.decode(), path).encode()
        except (UnicodeDecodeError, InstallError) as exc:
            why = exc.message if isinstance(exc, InstallError) else f"{path}: not UTF-8 text"
            ctx.problems.append(why)
            ctx.say(f"warning: {why}; {containerd.BASE_SPEC} is kept")
            return {containerd.BASE_SPEC}
        if new != data:
            host.write(path, new, host.mode(path) or 0o644)
            ctx.say(f"took the copy of weft's runtime handler out of {path} (another tool had copied it there)")
    return set()


def _restore_kubelet(ctx: Context, phase: Phase) -> None:
    _restore(ctx, [p for p in ctx.journal.originals if phase.owns(p)])


# -- the phases that act on services ----------------------------------------------------------------------------
def _restart_containerd(ctx: Context, phase: Phase) -> None:
    ctx.services.systemctl("daemon-reload")
    ctx.services.systemctl("restart", "containerd.service")


def _restart_containerd_again(ctx: Context, phase: Phase) -> None:
    if ctx.began("containerd-config"):
        ctx.attempt("restart", "containerd.service")


def _start_weft(ctx: Context, phase: Phase) -> None:
    assert ctx.plan is not None
    ctx.services.systemctl("enable", *ctx.plan.units)
    ctx.services.systemctl("restart", *ctx.plan.units)


def _stop_weft(ctx: Context, phase: Phase) -> None:
    if ctx.began("weft-start"):
        ctx.services.systemctl("disable", "--now", BROKER_UNIT, AGENT_UNIT, check=False)


def _verify_agent(ctx: Context, phase: Phase) -> None:
    if ctx.services.active:
        version = services.agent_version(ctx.agent_socket, ctx.settings.agent_timeout)
        ctx.say(f"the weft agent answers CRI on {ctx.agent_socket} ({version})")
    else:
        ctx.say("no service manager (--root without --systemctl): services not restarted, agent not checked")


def _restart_kubelet(ctx: Context, phase: Phase) -> None:
    ctx.services.systemctl("restart", "kubelet.service")


def _restart_kubelet_again(ctx: Context, phase: Phase) -> None:
    """A failure stops the uninstall here, before the agent is stopped: kubelet may still be on the agent."""
    if ctx.began("kubelet-config"):
        ctx.services.systemctl("restart", "kubelet.service")


def _wait_kubelet(ctx: Context, phase: Phase) -> None:
    s = ctx.settings
    if ctx.services.active and not services.wait_healthy(s.kubelet_health_url, s.kubelet_timeout):
        raise InstallError(f"kubelet did not come back healthy at {s.kubelet_health_url} "
                           f"within {s.kubelet_timeout:g}s on the weft agent")


def _wait_kubelet_again(ctx: Context, phase: Phase) -> None:
    s = ctx.settings
    if ctx.began("kubelet-config") and ctx.services.active and \
            not services.wait_healthy(s.kubelet_health_url, s.kubelet_timeout):
        ctx.say(f"warning: kubelet is not healthy at {s.kubelet_health_url} on containerd either")


# -- the journal: made before any phase (shim.install.run), taken away after all --------------------------------
def _remove_journal(ctx: Context, phase: Phase) -> None:
    _restore(ctx, list(ctx.journal.originals))  # anything else weft changed (none today)
    _remove_dirs(ctx)


def _remove_dirs(ctx: Context) -> None:
    """The directories weft created, deepest first; the journal's own last, so a crash here is repaired too."""
    host, j = ctx.host, ctx.journal
    holds_journal = {d for d in j.created_dirs if JOURNAL.startswith(d + "/")}
    for d in reversed(j.created_dirs):
        if d in holds_journal:
            p = host.path(d)
            for child in p.iterdir() if p.is_dir() else ():
                if not INSTALL_DIR.startswith(f"{d}/{child.name}"):
                    host.remove(f"{d}/{child.name}")  # e.g. the agent's state under /var/lib/weft
        else:
            _remove_dir(ctx, d)
    host.remove(JOURNAL)
    host.remove(INSTALL_DIR)
    for d in reversed([d for d in j.created_dirs if d in holds_journal]):
        _remove_dir(ctx, d)


def _remove_dir(ctx: Context, d: str) -> None:
    p = ctx.host.path(d)
    if any(k.startswith(d + "/") for k in ctx.kept):  # a file containerd still needs (_scrub_copies)
        return
    if "weft" in os.path.basename(d):
        ctx.host.remove(d)
    elif p.is_dir() and not any(p.iterdir()):
        p.rmdir()


# Install order: top to bottom. Uninstall order (``undo_at``): kubelet back on containerd first and healthy, and only
# then the agent stopped, so kubelet never points at a dead socket; weft's units gone before containerd restarts
# on its own configuration; the journal last.
PHASES: tuple[Phase, ...] = (
    Phase("bundle", _copy_bundle, _remove_bundle, undo_at=8, check=_bundle_copied),
    # With the units, the agent's configuration and mesh keys.
    Phase("units", _write_files, _remove_units, undo_at=5, files=("/etc/systemd/", "/etc/weft/"),
          check=_files_written),
    Phase("containerd-config", _write_files, _restore_containerd, undo_at=6, files=("/etc/containerd/",),
          check=_files_written),
    Phase("containerd-restart", _restart_containerd, _restart_containerd_again, undo_at=7),
    Phase("weft-start", _start_weft, _stop_weft, undo_at=4, undo_name="weft-stop"),
    Phase("agent-verify", _verify_agent, None),
    Phase("kubelet-config", _write_files, _restore_kubelet, undo_at=1, files=KUBELET_FILES, check=_files_written),
    Phase("kubelet-restart", _restart_kubelet, _restart_kubelet_again, undo_at=2),
    Phase("kubelet-health", _wait_kubelet, _wait_kubelet_again, undo_at=3),
    Phase("journal", None, _remove_journal, undo_at=9),
)
INSTALL: tuple[Phase, ...] = tuple(p for p in PHASES if p.apply is not None)
UNINSTALL: tuple[Phase, ...] = tuple(sorted((p for p in PHASES if p.undo is not None), key=lambda p: p.undo_at))


def converged(ctx: Context) -> bool:
    """Every install phase done already (what a re-install that would change nothing finds)."""
    return all(p.check(ctx, p) for p in INSTALL if p.check is not None)
