"""Nodes booted the way kind boots them, without Docker: systemd as PID 1 of a Debian root under systemd-nspawn.

Each node runs on a writable copy of the cached root (``rootfs.sh``): an overlay whose lower directory is the
cache, or a full copy where overlayfs is not there. It gets a cgroup of its own in every hierarchy and nspawn
is launched from inside them: nspawn then mounts those groups as the node's /sys/fs/cgroup/*, so the node sees
only its own groups (not the machine's root, nor another node's ``kubepods``). Its network namespace is made
before the launch: its ``eth0`` is one end of a veth pair whose other end is on a bridge in the host's
namespace, so nodes reach each other and the host over their addresses.

Everything a node makes is named after it and removed by ``Node.cleanup``, which is safe to call twice and
after a launch that failed halfway: processes, cgroups in every hierarchy, the veth and the namespace,
mounts under the node's directory, the directory.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from shim.localfabric import builds

ROOTFS_SCRIPT = Path(__file__).with_name("rootfs.sh")
ENTRYPOINT = "/usr/local/sbin/weft-node-init"
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The v1 hierarchies a node gets a group of its own in, at the hierarchy's root; memory is the exception (below).
HIERARCHIES = ("blkio", "cpu", "cpuacct", "cpuset", "devices", "freezer", "pids", "systemd", "unified")
BRIDGE = os.environ.get("WEFT_NODES_BRIDGE", "weftn0")
# Away from the fabrics' and the kube tests' subnets (each containerd of theirs has a bridge and subnet of its own).
SUBNET = os.environ.get("WEFT_NODES_SUBNET", "10.244.250.0/24")
# Inside a node, with a clean environment: the test process's PATH (a virtual environment) means nothing there.
NODE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
            "LANG": "C.UTF-8", "TERM": "dumb"}
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,11}$")  # short enough for "wn" + name as an interface name
_RUNNING = {"running", "degraded"}
_overlay_ok: bool | None = None  # overlayfs mounts here: found out by the first node
# Who owns each node, so that a later run removes the nodes of a run that was killed (sweep_stale).
REGISTRY = Path(os.environ.get("WEFT_NODES_REGISTRY", "/run/weft/nodes"))


class NodeError(RuntimeError):
    pass


@dataclass(frozen=True)
class Root:
    """The node root from ``rootfs.sh`` and what getting it cost: ``seconds`` this call (``built``: it built
    the root), ``build_seconds`` the build that made it, whenever that was."""

    path: Path
    seconds: float
    built: bool
    build_seconds: float | None


def build_root(timeout: float = 1800) -> Root:
    """The cached node root, built first if it is not there (a few minutes: debootstrap)."""
    built = subprocess.run(["bash", str(ROOTFS_SCRIPT), "--cached"], capture_output=True).returncode != 0
    started = time.monotonic()
    try:
        path = Path(builds.run(ROOTFS_SCRIPT, timeout=timeout))
    except builds.BuildError as exc:
        raise NodeError(str(exc)) from None
    marker = re.search(r"BUILD_SECONDS=(\d+)", (path / ".complete").read_text())
    return Root(path, time.monotonic() - started, built, float(marker.group(1)) if marker else None)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise NodeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


class Bridge:
    """The bridge in the host's root namespace that every node's veth joins, and the addresses handed out on it.

    One run at a time owns a bridge (its addresses are handed out in that run's process): another run on the
    same machine is refused and sets ``WEFT_NODES_BRIDGE`` and ``WEFT_NODES_SUBNET``; a bridge whose owner
    died is taken over.
    """

    def __init__(self, name: str = BRIDGE, subnet: str = SUBNET) -> None:
        self.name = name
        self.network = ipaddress.ip_network(subnet)
        hosts = self.network.hosts()
        self.gateway = next(hosts)
        self._free = hosts
        self.made = False
        self.record = REGISTRY / f"bridge-{name}.json"

    def __enter__(self) -> Bridge:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        if self.made:
            return
        owner = _read_record(self.record)
        if owner is not None and _alive(owner):
            raise NodeError(f"bridge {self.name} belongs to live process {owner['owner']}: "
                            f"set WEFT_NODES_BRIDGE and WEFT_NODES_SUBNET")
        if _link_exists(self.name):  # a run that was killed left it
            _ip("link", "del", self.name, check=False)
        # Another bridge or route on this subnet would take the nodes' traffic: refuse rather than steal it.
        for route in json.loads(_ip("-j", "route", "show", "table", "all").stdout or "[]"):
            dst = route.get("dst", "")
            if dst and dst != "default" and ":" not in dst and \
                    ipaddress.ip_network(dst, strict=False).overlaps(self.network):
                raise NodeError(f"subnet {self.network} overlaps route {dst} on {route.get('dev')}: "
                                f"set WEFT_NODES_SUBNET")
        _write_record(self.record, {})
        _ip("link", "add", self.name, "type", "bridge")
        self.made = True
        _ip("addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.name)
        _ip("link", "set", self.name, "up")

    def allocate(self) -> ipaddress.IPv4Interface:
        return ipaddress.ip_interface(f"{next(self._free)}/{self.network.prefixlen}")  # type: ignore[return-value]

    def down(self) -> None:
        if self.made:
            if _link_exists(self.name):
                _ip("link", "del", self.name, check=False)
            self.record.unlink(missing_ok=True)
        self.made = False


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with its PID, what tells it from a later one."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _write_record(path: Path, data: dict) -> None:
    """The registry's entry for something this process makes, written before it makes it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"owner": os.getpid(), "owner_start": _start_time(os.getpid()), **data}))
    tmp.rename(path)


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(record: dict) -> bool:
    return record.get("owner_start") is not None and _start_time(record["owner"]) == record["owner_start"]


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` in this mount namespace, deepest first."""
    prefix = str(path)
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if target == prefix or target.startswith(prefix + "/"):
                found.append(target)
    return sorted(set(found), key=lambda t: t.count("/"), reverse=True)


def _own_cgroup(hierarchy: str) -> str:
    """This process's group in a v1 hierarchy (``memory``), or ``/``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if hierarchy in controllers.split(",") or controllers == f"name={hierarchy}":
            return path
    return "/"


def _cgroup_procs(group: Path) -> set[int]:
    pids: set[int] = set()
    for dirpath, _, files in os.walk(group):
        if "cgroup.procs" in files:
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    return pids


def _ns_inode(pid: int, ns: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{ns}").st_ino
    except OSError:
        return None


def _pids_in_pidns(inode: int) -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _ns_inode(int(p), "pid") == inode}


@dataclass
class Node:
    """One node: its root, cgroups, network, and the nspawn process that runs its systemd.

    ``timings`` holds what each phase took, in seconds: ``root`` (getting the cached root), ``prepare`` (copy,
    cgroups, network), ``pid1`` (launch until its PID 1 is there), ``running`` (launch until systemd says
    running or degraded), ``stop``; ``boot_again`` adds ``reboot_stop`` and ``reboot_running``.
    """

    name: str
    root: Path
    workdir: Path  # the node's own directory (upper layer, logs, containerd's state) is made under it
    bridge: Bridge
    address_if: ipaddress.IPv4Interface | None = None
    timings: dict[str, float] = field(default_factory=dict)
    failed_units: list[str] = field(default_factory=list)
    pid1: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    overlay: bool | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise NodeError(f"node name {self.name!r}: lower-case letters, digits and '-', at most 12")
        self.dir = self.workdir / self.name
        self.merged = self.dir / "root"
        self.netns = f"weftn-{self.name}"
        self.veth = f"wn{self.name}"
        self.cgroup = f"weft-node-{self.name}"
        self.log = self.dir / "nspawn.log"
        self._pidns: int | None = None
        self._launched = 0.0
        self.clean_stop: bool | None = None  # the last stop: systemd powered off (True) or was killed (False)
        self.stop_killed: bool | None = None  # the last stop: ended by SIGKILL at its deadline (whatever the code)
        self.record = REGISTRY / f"{self.name}.json"
        self._cgroups = self._own_groups()

    @property
    def address(self) -> str:
        if self.address_if is None:
            raise NodeError(f"node {self.name} has no address yet")
        return str(self.address_if.ip)

    def path(self, inside: str) -> Path:
        """Where a path of the node's disk is on the host (not what nspawn or systemd mount over it at boot:
        ``/tmp``, ``/run``, ``/var/lib/containerd``)."""
        return self.merged / inside.lstrip("/")

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    # -- bring-up --------------------------------------------------------------------------------------------

    def cgroups(self) -> list[Path]:
        """The node's own group in every hierarchy this machine mounts (one group on a cgroup v2 machine)."""
        return list(self._cgroups)

    def _own_groups(self) -> list[Path]:
        if (CGROUP_ROOT / "cgroup.controllers").exists():
            return [CGROUP_ROOT / _own_cgroup("").lstrip("/") / self.cgroup]
        groups = [CGROUP_ROOT / h / self.cgroup for h in HIERARCHIES if (CGROUP_ROOT / h).is_dir()]
        # The machine may cap memory for the process that runs the tests: the node stays under that cap.
        if (CGROUP_ROOT / "memory").is_dir():
            groups.append(CGROUP_ROOT / "memory" / _own_cgroup("memory").lstrip("/") / self.cgroup)
        return groups

    def prepare(self) -> None:
        """The writable root, the cgroups and the network: all a launch needs."""
        started = time.monotonic()
        self._register()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._prepare_root()
        for group in self.cgroups():
            group.mkdir(exist_ok=True)
            if group.parent == CGROUP_ROOT / "cpuset":
                # A v1 cpuset group takes no task until it has CPUs and memory nodes; its children (nspawn's,
                # systemd's, runc's) inherit them.
                for knob in ("cpuset.cpus", "cpuset.mems"):
                    (group / knob).write_text((group.parent / knob).read_text())
                (group / "cgroup.clone_children").write_text("1")
        self._prepare_network()
        self.timings["prepare"] = time.monotonic() - started

    def _register(self) -> None:
        """Note who owns the node before making anything, for ``sweep_stale`` if this process dies first."""
        _write_record(self.record, {"workdir": str(self.workdir), "cgroups": [str(g) for g in self._cgroups]})

    def _prepare_root(self) -> None:
        if self.merged.is_dir() and os.path.ismount(self.merged):
            return  # a reboot: the node keeps its disk
        global _overlay_ok
        self.merged.mkdir(exist_ok=True)
        if self.overlay is None:
            self.overlay = _overlay_ok is not False
        if self.overlay:
            for sub in ("upper", "work"):
                (self.dir / sub).mkdir(exist_ok=True)
            res = subprocess.run(["mount", "-t", "overlay", f"weft-node-{self.name}", "-o",
                                  f"lowerdir={self.root},upperdir={self.dir / 'upper'},workdir={self.dir / 'work'}",
                                  str(self.merged)], capture_output=True, text=True, timeout=60)
            if res.returncode != 0 and _overlay_ok:
                raise NodeError(f"overlay mount for node {self.name}: {res.stderr.strip()}")
            # Not on this filesystem, or not in this sandbox: every node gets a full copy instead.
            _overlay_ok = self.overlay = res.returncode == 0
        if not self.overlay and not (self.merged / "usr").is_dir():
            subprocess.run(["cp", "-a", "--reflink=auto", f"{self.root}/.", str(self.merged)], check=True,
                           capture_output=True, timeout=900)
        # containerd's overlayfs snapshotter cannot put its layers on an overlay: its state is a plain
        # directory bound in, as kind makes /var/lib/containerd a volume.
        (self.dir / "containerd").mkdir(exist_ok=True)
        machine_id = self.merged / "etc" / "machine-id"
        if not machine_id.read_text().strip():  # each node its own, kept across reboots, as kind writes one
            machine_id.write_text(uuid.uuid4().hex + "\n")

    def _prepare_network(self) -> None:
        if Path("/run/netns", self.netns).exists():
            return
        if self.address_if is None:
            self.address_if = self.bridge.allocate()
        self.bridge.up()
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        _ip("link", "set", self.veth, "master", self.bridge.name, "up")
        _ip("-n", self.netns, "link", "set", "lo", "up")
        _ip("-n", self.netns, "addr", "add", str(self.address_if), "dev", "eth0")
        _ip("-n", self.netns, "link", "set", "eth0", "up")
        _ip("-n", self.netns, "route", "add", "default", "via", str(self.bridge.gateway))

    def launch(self, wait: bool = True) -> None:
        """Start nspawn from inside the node's cgroups and (``wait``) wait for the node's PID 1 to be there."""
        procs = [str(group / "cgroup.procs") for group in self.cgroups()]
        # A shell joins the node's groups and becomes nspawn: nspawn starts inside them (no preexec_fn, which
        # is not safe in a process with threads).
        enter = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 1; shift; done; shift; exec "$@"'
        nspawn = ["systemd-nspawn", "-D", str(self.merged), "--register=no", "--keep-unit", "--capability=all",
                  "--system-call-filter=@keyring bpf", f"--machine={self.name}", "--kill-signal=SIGRTMIN+3",
                  f"--network-namespace-path=/run/netns/{self.netns}", "--link-journal=no", "--console=read-only",
                  f"--bind={self.dir / 'containerd'}:/var/lib/containerd", ENTRYPOINT]
        cmd = ["/bin/sh", "-c", enter, "sh", *procs, "--", *nspawn]
        env = {**NODE_ENV, "SYSTEMD_NSPAWN_API_VFS_WRITABLE": "1"}
        self.pid1 = self._pidns = None
        started = time.monotonic()
        self._launched = started
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        deadline = started + 60
        while wait and self.pid1 is None:
            if self.proc.poll() is not None:
                raise NodeError(f"nspawn for {self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            if time.monotonic() > deadline:
                raise NodeError(f"no PID 1 in node {self.name} after 60 s: {self.log_tail()}")
            self.pid1 = self._find_pid1()
            if self.pid1 is None:
                time.sleep(0.02)
        if self.pid1 is not None:
            self._pidns = _ns_inode(self.pid1, "pid")
            self.timings["pid1"] = time.monotonic() - started

    def _find_pid1(self) -> int | None:
        """The process in the node's groups that is PID 1 of a namespace of its own (every group holds the
        same processes: the first says it)."""
        for pid in _cgroup_procs(self.cgroups()[0]):
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                nspid = next((ln.split()[1:] for ln in status.splitlines() if ln.startswith("NSpid:")), [])
                if len(nspid) == 2 and nspid[1] == "1":
                    return pid
        return None

    def wait_running(self, timeout: float = 120) -> str:
        """Wait for systemd to finish booting: ``running``, or ``degraded`` with its failed units in
        ``failed_units``; an error with what it was doing if it gets neither in time."""
        deadline = time.monotonic() + timeout
        state = ""
        while True:
            if self.proc is None or self.proc.poll() is not None:
                raise NodeError(f"node {self.name} is not running: {self.log_tail()}")
            res = self.run(["systemctl", "is-system-running"], check=False, timeout=30)
            state = res.stdout.strip()
            if state in _RUNNING:
                break
            if state in ("maintenance", "stopping"):
                raise NodeError(f"node {self.name}: systemd is {state}: {self.log_tail()}")
            if time.monotonic() > deadline:
                jobs = self.run(["systemctl", "list-jobs", "--no-pager"], check=False, timeout=30).stdout
                raise NodeError(f"node {self.name} not running after {timeout} s ({state or res.stderr.strip()}); "
                                f"jobs:\n{jobs}\n{self.log_tail()}")
            time.sleep(0.1)
        self.timings["running"] = time.monotonic() - self._launched
        failed = self.run(["systemctl", "list-units", "--failed", "--plain", "--no-legend", "--no-pager"],
                          check=False, timeout=30).stdout
        self.failed_units = [line.split()[0] for line in failed.splitlines() if line.strip()]
        return state

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    # -- inside the node -------------------------------------------------------------------------------------

    def run(self, cmd: list[str], *, check: bool = True, timeout: float = 120, stdin: str | None = None
            ) -> subprocess.CompletedProcess[str]:
        """Run a command inside the node, in all its namespaces, as ``docker exec`` would in a kind node."""
        if self.pid1 is None:
            raise NodeError(f"node {self.name} has no PID 1")
        res = subprocess.run(["nsenter", "-t", str(self.pid1), "-m", "-u", "-i", "-n", "-p", "--", *cmd],
                             capture_output=True, text=True, timeout=timeout, input=stdin, env=NODE_ENV)
        if check and res.returncode != 0:
            raise NodeError(f"{' '.join(cmd)} in node {self.name} failed ({res.returncode}): "
                            f"{res.stdout[-2000:]}{res.stderr[-2000:]}")
        return res

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run(["systemctl", "--no-pager", *args], check=check)

    # -- bring-down ------------------------------------------------------------------------------------------

    def stop(self, timeout: float = 30) -> None:
        """A clean poweroff (nspawn passes SIGTERM on to systemd as SIGRTMIN+3), then SIGKILL for whatever
        is still there after ``timeout``."""
        started = time.monotonic()
        deadline = started + timeout
        self.stop_killed = False
        while self.proc is not None and self.proc.poll() is None:
            # Again each second: a PID 1 that has not installed its handler yet (early in the boot) drops the
            # signal, as the kernel drops any signal a namespace's init does not handle.
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.clean_stop = self.proc.wait(max(0.0, min(1.0, deadline - time.monotonic()))) == 0
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    self.clean_stop = False
                    self.stop_killed = True
                    break
        self._kill_all()  # also what a node of a killed run still runs (sweep_stale): no nspawn child of ours
        if self.proc is not None:
            self.proc.wait(30)
        self.timings["stop"] = time.monotonic() - started

    def _kill_all(self) -> None:
        """SIGKILL to everything of the node: nspawn, its PID 1 (which takes its namespace down), and every
        process in its groups, in its PID namespace or naming it, until none is left."""
        for _ in range(200):
            pids = set()
            if self.proc is not None and self.proc.poll() is None:
                pids.add(self.proc.pid)
            for group in self.cgroups():
                pids |= _cgroup_procs(group)
            if self._pidns is not None:
                pids |= _pids_in_pidns(self._pidns)
            pids |= {pid for pid, _ in _processes_naming(self.name, self.dir)}
            pids.discard(os.getpid())
            if self.proc is not None:
                self.proc.poll()  # reaps nspawn: a zombie stays in its groups
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        raise NodeError(f"node {self.name}: processes still there after SIGKILL: {sorted(pids)}")

    def _remove_cgroups(self, keep_own: bool, timeout: float = 10) -> list[str]:
        """rmdir the node's groups deepest first (nspawn, systemd and runc make groups under them); a group
        whose last process is still exiting is busy for a moment, so passes repeat until ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            errors = []
            for group in self.cgroups():
                for d in [Path(d) for d, _, _ in os.walk(group, topdown=False)]:
                    if keep_own and d == group:
                        continue
                    try:
                        d.rmdir()
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        errors.append((d, exc))
            if not errors or time.monotonic() > deadline or any(e.errno != errno.EBUSY for _, e in errors):
                return [f"rmdir {d}: {e}" for d, e in errors]
            time.sleep(0.1)

    def boot_again(self, timeout: float = 120, stop_timeout: float = 30) -> str:
        """A reboot that keeps the node's disk: a clean poweroff, then the same root booted again."""
        self.stop(stop_timeout)
        self.timings["reboot_stop"] = self.timings["stop"]
        errors = self._remove_cgroups(keep_own=True)
        if errors:
            raise NodeError(f"node {self.name}: {errors}")
        self.launch()
        state = self.wait_running(timeout)
        self.timings["reboot_running"] = self.timings["running"]
        return state

    def cleanup(self) -> None:
        """Remove everything the node made; safe to call again, and after a launch that failed halfway."""
        errors: list[str] = []
        try:
            self.stop(timeout=10)
        except Exception as exc:  # noqa: BLE001 - what is left is removed below all the same
            errors.append(f"stop: {exc}")
            with contextlib.suppress(Exception):
                self._kill_all()
        self.proc = None
        errors += self._remove_cgroups(keep_own=False)
        if Path("/run/netns", self.netns).exists():
            res = _ip("netns", "delete", self.netns, check=False)
            if res.returncode != 0:
                errors.append(f"ip netns delete {self.netns}: {res.stderr.strip()}")
        if _link_exists(self.veth):  # goes with the namespace, unless its peer never got there
            _ip("link", "del", self.veth, check=False)
        for target in _mounts_under(self.dir):
            if subprocess.run(["umount", target], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", target], capture_output=True)
        if self.dir.exists() and not _mounts_under(self.dir):
            subprocess.run(["rm", "-rf", "--one-file-system", str(self.dir)], capture_output=True, timeout=300)
        errors += self.leftovers()
        self.pid1 = self._pidns = None
        if errors:
            raise NodeError(f"node {self.name} left: {errors}")
        self.record.unlink(missing_ok=True)

    def leftovers(self) -> list[str]:
        """What of the node is still there: processes, cgroups, links, the namespace, mounts, its directory."""
        left = [f"cgroup {g}" for g in self.cgroups() if g.exists()]
        for group in self.cgroups():
            left += [f"process {pid} in {group}" for pid in _cgroup_procs(group)]
        if self._pidns is not None:
            left += [f"process {pid} in its PID namespace" for pid in _pids_in_pidns(self._pidns)]
        left += [f"process {pid} ({cmd})" for pid, cmd in _processes_naming(self.name, self.dir)]
        left += [f"link {name}" for name in (self.veth,) if _link_exists(name)]
        if Path("/run/netns", self.netns).exists():
            left.append(f"netns {self.netns}")
        left += [f"mount {m}" for m in _mounts_under(self.dir)]
        if self.dir.exists():
            left.append(f"directory {self.dir}")
        return left


def _processes_naming(machine: str, directory: Path) -> list[tuple[int, str]]:
    """Processes whose arguments name the node: an nspawn that lost its owner, or the copy of its root that a
    killed owner started (neither is in the node's groups, nor needs to be)."""
    found = []
    flag, under = f"--machine={machine}".encode(), f"{directory}/".encode()
    for p in os.listdir("/proc"):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
            if flag in argv or any(a.startswith(under) or a == under[:-1] for a in argv):
                found.append((int(p), " ".join(a.decode(errors="replace") for a in argv if a)))
    return found


def sweep_stale() -> list[str]:
    """Remove the nodes and bridges whose owner is gone (a test run killed before its teardown): their names,
    and "NAME (not removed: why)" for any that could not be removed (tried again by the next sweep)."""
    swept = []
    records = sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []
    for record in sorted(records, key=lambda r: r.name.startswith("bridge-")):  # nodes first, then bridges
        owner = _read_record(record)
        if owner is None or _alive(owner):
            continue
        if record.name.startswith("bridge-"):
            bridge = Bridge(record.stem.removeprefix("bridge-"))
            bridge.made = True
            bridge.down()
            swept.append(bridge.name)
            continue
        node = Node(record.stem, Path("/nonexistent"), Path(owner["workdir"]), Bridge())
        node._cgroups = [Path(g) for g in owner["cgroups"]]  # where the owner made them, whatever this process is in
        try:
            node.cleanup()
            swept.append(node.name)
        except NodeError as exc:
            swept.append(f"{node.name} (not removed: {exc})")
    return swept


def boot(name: str, root: Root | Path, workdir: Path, bridge: Bridge, *, timeout: float = 120,
         wait: bool = True) -> Node:
    """A node booted to ``running`` (or ``degraded``) within ``timeout``; on any failure on the way,
    everything it made is removed before the error goes up."""
    node = Node(name, root.path if isinstance(root, Root) else root, workdir, bridge)
    if isinstance(root, Root):
        node.timings["root"] = root.seconds
    try:
        node.prepare()
        node.launch()
        if wait:
            node.wait_running(timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            node.cleanup()
        raise
    return node
