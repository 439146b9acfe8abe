"""``weft install`` / ``weft uninstall``: the journal, the walk through the phases both ways, rollback.

The steps themselves are the phases of :mod:`shim.install.phases`, one table
(``PHASES``): each phase's apply, its undo, the files it journals, what it
checks. Install, after a plan that reads everything and changes nothing (the
node's containerd is asked its version first; an unrecognised host or an
untested containerd is refused here)::

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

from shim import failpoint
from shim.errors import InstallError, UnrecognisedHost
from shim.install import bundle, containerd, phases, services
from shim.install.host import JOURNAL, Host, Journal, JournalState, OriginalFiles, sha256
from shim.install.phases import INSTALL, UNINSTALL, Context, Settings
from shim.install.plan import AGENT_SOCKET, INSTALL_DIR, OPT, STATE_DIR, Plan, make

# The names the journal records, in the order each command walks them (phases.PHASES says what each does).
INSTALL_STEPS = tuple(p.name for p in INSTALL)
UNINSTALL_STEPS = tuple(p.undone_as for p in UNINSTALL)
PURGED = ("/etc/weft", STATE_DIR)

__all__ = ["INSTALL_STEPS", "PURGED", "UNINSTALL_STEPS", "Settings", "install", "uninstall"]


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
            if j.state is JournalState.INSTALLED and phases.converged(Context(self.s, self.host, j, plan, files,
                                                                              stamp)):
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
        ctx = Context(self.s, self.host, j, plan, files, stamp)
        step = ""
        try:
            for phase in INSTALL:
                step = phase.name
                j.begin(self.host, step)
                phase.apply(ctx, phase)
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
        sockets = [phases.agent_socket(self.s, self.host),
                   self.s.containerd_socket or self.host.path(j.containerd_socket or containerd.DEFAULT_SOCKET)]
        for sock in sockets:
            pods = services.weft_pods(sock)
            if pods is not None:
                break
        if pods:
            self.say(f"{len(pods)} pod(s) run on the 'weft' runtime handler: {', '.join(pods)}. They keep running "
                     "on containerd, but once weft is gone their GPU leases are no longer enforced (the broker "
                     "stops), kubelet cannot start new containers in them (containerd loses the 'weft' handler) "
                     "and runc warns that their stop hook is missing. Delete them, or install weft again.")

    def _uninstall(self, j: Journal) -> list[str]:
        """The phases undone in uninstall order; returns the service actions that failed (all but kubelet's
        restart go on: a failed one stops here, before the agent is stopped, as kubelet may still be on it)."""
        ctx = Context(self.s, self.host, j)
        j.state = JournalState.UNINSTALLING
        j.save(self.host)
        for phase in UNINSTALL:
            j.begin(self.host, phase.undone_as, undo=True)
            phase.undo(ctx, phase)
            failpoint.hit(f"uninstall.{phase.undone_as}")
        return ctx.problems


def install(settings: Settings) -> None:
    _Installer(settings).install()


def uninstall(settings: Settings) -> None:
    _Installer(settings).uninstall()
