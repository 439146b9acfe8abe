"""``weft install`` / ``weft uninstall``: the steps, their order, the journal around them, rollback.

Install, after a plan that reads everything and changes nothing (the node's
containerd is asked its version first; an unrecognised host or an untested
containerd is refused here)::

    backups, journal -> bundle -> units -> containerd-config -> containerd-restart
      -> weft-start -> agent-verify -> kubelet-config -> kubelet-restart -> kubelet-health

kubelet is switched only after the agent answers CRI ``Version``; if kubelet
is not healthy within ``--kubelet-timeout`` after its restart, or any step
fails, everything is undone by the uninstall steps. Uninstall puts kubelet
back on containerd *first* and waits for it, and only then stops the agent, so
kubelet never points at a dead socket::

    kubelet-config -> kubelet-restart -> kubelet-health -> weft-stop -> units
      -> containerd-config -> containerd-restart -> bundle -> journal

Every step converges (writes the planned bytes, removes what weft added,
restarts a service) and is marked begun in the journal before it runs, so
after ``kill -9`` at any point a re-run of either command finishes the job.
``WEFT_FAILPOINTS=install.<step>`` / ``uninstall.<step>`` kills the process
right after that step (and ``install.backups`` before the journal exists).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shim import failpoint
from shim.errors import InstallError, UnrecognisedHost
from shim.install import bundle, containerd, kubelet, services
from shim.install.host import JOURNAL, Host, Journal, JournalState, OriginalFiles, sha256
from shim.install.plan import AGENT_SOCKET, AGENT_UNIT, BROKER_UNIT, INSTALL_DIR, OPT, STATE_DIR, Options, Plan, make

INSTALL_STEPS = ("bundle", "units", "containerd-config", "containerd-restart", "weft-start", "agent-verify",
                 "kubelet-config", "kubelet-restart", "kubelet-health")
UNINSTALL_STEPS = ("kubelet-config", "kubelet-restart", "kubelet-health", "weft-stop", "units",
                   "containerd-config", "containerd-restart", "bundle", "journal")
KUBELET_FILES = (kubelet.CONFIG_YAML, *kubelet.FLAG_FILES)
PURGED = ("/etc/weft", STATE_DIR)


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
    purge: bool = False  # uninstall: also what the DaemonSet kept on the host (PURGED)
    say: Callable[[str], None] = print


def _created_dirs(host: Host, paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        chain = []
        d = os.path.dirname(p)
        while d not in ("/", "") and not host.exists(d):
            chain.append(d)
            d = os.path.dirname(d)
        out += [c for c in reversed(chain) if c not in out]
    return out


class _Installer:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.host = Host(s.root)
        self.say = s.say
        self._kept: set[str] = set()  # what uninstall leaves because containerd's configuration still names it

    @property
    def agent_socket(self) -> Path:
        return self.s.agent_socket or self.host.path("/run/weft/cri.sock")

    # -- install -------------------------------------------------------------
    def install(self) -> None:
        j = Journal.load(self.host)
        originals = OriginalFiles(self.host, j)
        plan = make(originals, self.s.options, self._containerd(originals))
        self._warn_runtime(plan)
        files = bundle.source_files(self.s.source)
        stamp = bundle.digest(files)
        if j is None:
            foreign = [p for p in [*plan.added, OPT] if self.host.exists(p)]
            if foreign:
                raise UnrecognisedHost(f"{foreign[0]}: exists, but no weft install journal does ({JOURNAL}): "
                                       "remove what was installed by hand first; nothing was changed")
        else:
            self._keep_others_changes(j, originals, plan)
            if j.state is JournalState.INSTALLED and self._converged(plan, stamp):
                self.say("weft is already installed; nothing changed")
                return
        if j is None:
            self._clear_leftovers()
            j = Journal(created_dirs=_created_dirs(self.host, [*plan.added, f"{OPT}/bin", JOURNAL]))
            for path in plan.modified:
                j.backup(self.host, path)
            failpoint.hit("install.backups")
        else:
            for path in plan.modified:
                if path not in j.originals:  # never changed by weft: what is there is the original
                    j.backup(self.host, path)
        j.state = JournalState.INSTALLING
        j.added = sorted(set(j.added) | set(plan.added))
        j.containerd_socket = plan.containerd_socket
        j.save(self.host)
        failpoint.hit("install.journal")
        step = ""
        try:
            for step in INSTALL_STEPS:
                j.begin(self.host, step)
                self._install_step(step, plan, j, files, stamp)
                failpoint.hit(f"install.{step}")
        except (InstallError, OSError) as exc:
            why = exc.message if isinstance(exc, InstallError) else str(exc)
            self.say(f"step {step} failed: {why}; rolling back")
            try:
                problems = self._uninstall(j)
            except (InstallError, OSError) as again:
                raise InstallError(f"{step} failed: {why}; the rollback stopped too ({again}): run weft uninstall "
                                   "again to finish it") from exc
            also = f" (but: {'; '.join(problems)})" if problems else ""
            raise InstallError(f"{step} failed: {why}; rolled back, containerd's and kubelet's files are as "
                               f"before{also}") from exc
        j.state = JournalState.INSTALLED
        j.save(self.host)
        self.say(f"installed: kubelet -> weft agent (unix://{AGENT_SOCKET}) -> containerd ({plan.containerd_socket})")

    def _warn_runtime(self, plan: Plan) -> None:
        """The default runtime's program missing (NVIDIA's toolkit made its runtime the default, then its files
        went): every container of the node fails to start, weft's handler's too, which copies it. Said, not
        refused: the toolkit may be installing it right now."""
        binary = containerd.binary_of((plan.runtimes or {}).get(plan.default_runtime, {}))
        if binary.startswith("/") and not self.host.exists(binary):
            self.say(f"warning: containerd's default runtime {plan.default_runtime!r} runs {binary}, which is not "
                     "on this host; the 'weft' handler copies that runtime, so its containers will not start either "
                     "until it is there (NVIDIA's toolkit installs it; weft gpu-check says so too)")

    def _keep_others_changes(self, j: Journal, originals: OriginalFiles, plan: Plan) -> None:
        """A file someone else changed since weft wrote it: that file without weft's edit is its original from now
        on (what uninstall gives back), and weft's edit is made again on it."""
        for path in plan.modified:
            if path in j.originals and originals.changed(path):
                j.rebackup(self.host, path, originals.read(path) or b"")
                current = self.host.read(path)
                if current == plan.modified[path]:  # weft's edit is still in it: nothing to write
                    j.written[path] = sha256(current)
                else:
                    j.written.pop(path, None)
                j.save(self.host)
                self.say(f"{path} was changed since weft's install; those changes are kept" + (
                    "" if current == plan.modified[path] else ", and weft's own edit is made again"))

    def _containerd(self, files: OriginalFiles) -> containerd.Containerd:
        """The node's containerd, asked before anything changes (an untested one is refused by the plan)."""
        sock = self.s.containerd_socket or self.host.path(containerd.socket(files))
        found = services.containerd_version(sock, [self.host.path(b) for b in containerd.BINARIES])
        if found is None:
            raise UnrecognisedHost(
                f"{sock}: cannot tell which containerd this node runs (nothing answers CRI Version there and no "
                f"{' or '.join(containerd.BINARIES)} under {self.s.root} runs `--version`); start containerd and "
                "run again; nothing was changed")
        return containerd.Containerd.parse(*found)

    def _converged(self, plan: Plan, stamp: str) -> bool:
        want = {**plan.modified, **plan.added}
        return all(self.host.read(p) == c for p, c in want.items()) and \
            all(self.host.mode(p) == m for p, m in plan.modes.items()) and \
            self.host.read(f"{OPT}/{bundle.MARKER}") == (stamp + "\n").encode()

    def _write_all(self, wanted: dict[str, bytes], j: Journal, modes: dict[str, int]) -> None:
        for path, content in wanted.items():
            o = j.originals.get(path)
            mode = o.mode if o else modes.get(path, 0o644)
            if self.host.read(path) != content or (path in modes and self.host.mode(path) != mode):
                if o is not None:  # what weft writes into a host file, known before it is there
                    j.written[path] = sha256(content)
                    j.save(self.host)
                self.host.write(path, content, mode, (o.uid, o.gid) if o else None)
                self.say(f"wrote {path}" + (f" (mode {mode:04o})" if path in modes else ""))
            elif o is not None and j.written.get(path) != sha256(content):
                j.written[path] = sha256(content)
                j.save(self.host)

    def _install_step(self, step: str, plan: Plan, j: Journal, files: list, stamp: str) -> None:
        sv = self.s.services
        if step == "bundle":
            self._bundle(files, stamp)
        elif step in ("units", "containerd-config", "kubelet-config"):
            self._write_all(plan.step_files(step), j, plan.modes)
        elif step == "containerd-restart":
            sv.systemctl("daemon-reload")
            sv.systemctl("restart", "containerd.service")
        elif step == "weft-start":
            sv.systemctl("enable", *plan.units)
            sv.systemctl("restart", *plan.units)
        elif step == "agent-verify":
            if sv.active:
                version = services.agent_version(self.agent_socket, self.s.agent_timeout)
                self.say(f"the weft agent answers CRI on {self.agent_socket} ({version})")
            else:
                self.say("no service manager (--root without --systemctl): services not restarted, agent not checked")
        elif step == "kubelet-restart":
            sv.systemctl("restart", "kubelet.service")
        elif step == "kubelet-health" and sv.active and not services.wait_healthy(
                self.s.kubelet_health_url, self.s.kubelet_timeout):
            raise InstallError(f"kubelet did not come back healthy at {self.s.kubelet_health_url} "
                               f"within {self.s.kubelet_timeout:g}s on the weft agent")

    def _bundle(self, files: list, stamp: str) -> None:
        new, old = f"{OPT}.new", f"{OPT}.old"
        self.host.remove(new)
        if self.host.read(f"{OPT}/{bundle.MARKER}") != (stamp + "\n").encode():
            bundle.build(files, self.host.path(new), stamp, launchers=self.s.source is None)
            if self.host.exists(OPT):
                os.replace(self.host.path(OPT), self.host.path(old))
            os.replace(self.host.path(new), self.host.path(OPT))
            Host.sync_dir(self.host.path(OPT).parent)
            self.say(f"copied weft to {OPT}")
        self.host.remove(old)
        if self.s.source is None and self.s.services.active:
            # Before anything is started from it: a host that lacks what the copy needs (a C library too old)
            # is named here, not in the agent's journal after kubelet's switch was attempted.
            loader = bundle.elf_interpreter(self.host.path(f"{OPT}/bin/python3"))
            if loader and not self.host.exists(loader):  # a tree laid out like a node, not a node's root
                self.say(f"the copy of weft in {OPT} was not run: {self.s.root} has no {loader}")
                return
            problem = services.run_on_host(self.s.root, bundle.check_argv(OPT), timeout=120)
            if problem:
                raise InstallError(f"the copy of weft in {OPT} does not run on this host: {problem}")
            self.say(f"the copy of weft in {OPT} runs on this host")

    # -- uninstall -----------------------------------------------------------
    def uninstall(self) -> None:
        j = Journal.load(self.host)
        if j is None:
            left = self._clear_leftovers()
            self.say("weft is not installed here (no install journal); nothing to undo"
                     + (f" (removed leftovers: {', '.join(left)})" if left else ""))
            self._purge()
            return
        self._warn_pods(j)
        problems = self._uninstall(j)
        if problems:
            raise InstallError(f"files restored and weft removed, but: {'; '.join(problems)}")
        self.say("uninstalled: kubelet -> containerd, as before weft")
        self._purge()

    def _purge(self) -> None:
        """With --purge, what weft's DaemonSet keeps on the host besides the install: the node's mesh identity
        and the agent's API credentials (/etc/weft), the agent's state (/var/lib/weft)."""
        if not self.s.purge:
            return
        for path in PURGED:
            if self.host.exists(path):
                self.host.remove(path)
                self.say(f"removed {path}")

    def _clear_leftovers(self) -> list[str]:
        """What a crash left with no journal: backups written before it (install) or after it was removed."""
        left = [p for p in (INSTALL_DIR, f"{OPT}.new") if self.host.exists(p)]
        for p in left:
            self.host.remove(p)
        state = self.host.path(os.path.dirname(INSTALL_DIR))  # made with the journal, which is gone
        if INSTALL_DIR in left and state.is_dir() and not any(state.iterdir()):
            state.rmdir()
        return left

    def _warn_pods(self, j: Journal) -> None:
        sockets = [self.agent_socket, self.s.containerd_socket or self.host.path(j.containerd_socket or
                                                                                 containerd.DEFAULT_SOCKET)]
        for sock in sockets:
            pods = services.weft_pods(sock)
            if pods is not None:
                break
        if pods:
            self.say(f"{len(pods)} pod(s) run on the 'weft' runtime handler: {', '.join(pods)}. They keep running "
                     "on containerd, but once weft is gone their GPU leases are no longer enforced (the broker "
                     "stops), kubelet cannot start new containers in them (containerd loses the 'weft' handler) "
                     "and runc warns that their stop hook is missing. Delete them, or install weft again.")

    def _restore(self, j: Journal, paths: list[str]) -> bool:
        """Each file as it was before weft, or, where someone else changed it since weft wrote it, as it is with
        weft's own edit taken out (their changes kept, and said)."""
        changed = False
        for path in paths:
            if path in j.originals:
                (data, kept), o = j.without_weft(self.host, path), j.originals[path]
                current = self.host.read(path)
                if current != data:
                    mode = (self.host.mode(path) or o.mode) if kept else o.mode
                    self.host.write(path, data, mode, (o.uid, o.gid))
                    self.say(f"took weft's edit out of {path}, keeping the changes made to it since weft's install"
                             if kept else f"restored {path}")
                    changed = True
                if kept:
                    j.rebackup(self.host, path, data)
                if path in j.written:
                    del j.written[path]
                    j.save(self.host)
        return changed

    def _uninstall(self, j: Journal) -> list[str]:
        """The uninstall steps; returns the service actions that failed (all but kubelet's restart go on).

        A failed kubelet restart stops here, before the agent is stopped: kubelet may still be on the agent.
        """
        sv = self.s.services
        problems: list[str] = []

        def attempt(*args: str) -> None:
            try:
                sv.systemctl(*args)
            except InstallError as exc:
                problems.append(exc.message)
                self.say(f"warning: {exc.message}")

        j.state = JournalState.UNINSTALLING
        j.save(self.host)
        ours = [*j.added]
        for step in UNINSTALL_STEPS:
            j.begin(self.host, step, undo=True)
            if step == "kubelet-config":
                self._restore(j, [p for p in j.originals if p in KUBELET_FILES])
            elif step == "kubelet-restart" and "kubelet-config" in j.started:
                sv.systemctl("restart", "kubelet.service")
            elif step == "kubelet-health" and "kubelet-config" in j.started and sv.active:
                if not services.wait_healthy(self.s.kubelet_health_url, self.s.kubelet_timeout):
                    self.say(f"warning: kubelet is not healthy at {self.s.kubelet_health_url} on containerd either")
            elif step == "weft-stop" and "weft-start" in j.started:
                sv.systemctl("disable", "--now", BROKER_UNIT, AGENT_UNIT, check=False)
            elif step == "units":
                # With them, the agent's configuration: /etc/weft may hold what weft did not add (the node's
                # mesh key, kept there by weft mesh-identity), so each added file goes, not the directory.
                for p in ours:
                    if p.startswith(("/etc/systemd/", "/etc/weft/")) and self.host.remove(p):
                        self.say(f"removed {p}")
                if "units" in j.started:
                    attempt("daemon-reload")
            elif step == "containerd-config":
                self._restore(j, [p for p in j.originals if p.startswith("/etc/containerd/")])
                keep = self._kept = self._scrub_copies(problems)
                for p in ours:
                    if p.startswith("/etc/containerd/") and p not in keep and self.host.remove(p):
                        self.say(f"removed {p}")
            elif step == "containerd-restart" and "containerd-config" in j.started:
                attempt("restart", "containerd.service")
            elif step == "bundle":
                for p in (f"{OPT}.new", f"{OPT}.old", OPT):
                    self.host.remove(p)
            elif step == "journal":
                self._restore(j, list(j.originals))  # anything else weft changed (none today)
                self._remove_dirs(j)
            failpoint.hit(f"uninstall.{step}")
        return problems

    def _scrub_copies(self, problems: list[str]) -> set[str]:
        """Copies of weft's runtime handler another tool took into containerd's files (the toolkit's drop-in with
        the whole CRI section, a config.toml written from ``containerd config dump``): taken out, or containerd
        would not start its CRI plugin once weft's base spec is gone. Where one cannot be, the base spec stays
        (returned), and that is said."""
        import tomllib

        raw = self.host.read(containerd.CONFIG)
        try:
            doc = tomllib.loads((raw or b"").decode())
            paths = [containerd.CONFIG, *containerd.imported_files(self.host, containerd.CONFIG, doc)]
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, InstallError):
            paths = [containerd.CONFIG]
        for path in paths:
            data = self.host.read(path)
            if data is None:
                continue
            try:
                new = containerd.without_weft_runtime(data.decode(), path).encode()
            except (UnicodeDecodeError, InstallError) as exc:
                why = exc.message if isinstance(exc, InstallError) else f"{path}: not UTF-8 text"
                problems.append(why)
                self.say(f"warning: {why}; {containerd.BASE_SPEC} is kept")
                return {containerd.BASE_SPEC}
            if new != data:
                self.host.write(path, new, self.host.mode(path) or 0o644)
                self.say(f"took the copy of weft's runtime handler out of {path} (another tool had copied it there)")
        return set()

    def _remove_dirs(self, j: Journal) -> None:
        """The directories weft created, deepest first; the journal's own last, so a crash here is repaired too."""
        holds_journal = {d for d in j.created_dirs if JOURNAL.startswith(d + "/")}
        for d in reversed(j.created_dirs):
            if d in holds_journal:
                p = self.host.path(d)
                for child in p.iterdir() if p.is_dir() else ():
                    if not INSTALL_DIR.startswith(f"{d}/{child.name}"):
                        self.host.remove(f"{d}/{child.name}")  # e.g. the agent's state under /var/lib/weft
            else:
                self._remove_dir(d)
        self.host.remove(JOURNAL)
        self.host.remove(INSTALL_DIR)
        for d in reversed([d for d in j.created_dirs if d in holds_journal]):
            self._remove_dir(d)

    def _remove_dir(self, d: str) -> None:
        p = self.host.path(d)
        if any(k.startswith(d + "/") for k in self._kept):  # a file containerd still needs (_scrub_copies)
            return
        if "weft" in os.path.basename(d):
            self.host.remove(d)
        elif p.is_dir() and not any(p.iterdir()):
            p.rmdir()


def install(settings: Settings) -> None:
    _Installer(settings).install()


def uninstall(settings: Settings) -> None:
    _Installer(settings).uninstall()
