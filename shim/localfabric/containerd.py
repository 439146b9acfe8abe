"""A throwaway containerd: real containerd + runc + CNI, owned by one test.

Each instance gets a slot number (held by an flock, so parallel processes and
several instances in one process never collide; the lowest free one unless the
caller names one) and from it:

- a network namespace ``weftnode<N>`` (containerd runs inside it through
  ``nsenter --net``, not ``ip netns exec``, which would also hide the cgroup
  mounts from runc), so its CNI bridge
  ``weftbr<N>`` and pod subnet ``10.244.<N>.0/24`` live and die with it;
- its own root, state, socket, runc root, CNI config and IPAM directory under a
  temporary work directory, with pod network namespaces mounted under its state
  directory rather than /var/run/netns;
- a cgroup root ``/weft-harness<N>`` for pods' cgroup parents (see
  ``shim.localfabric.pods.sandbox_config``);
- the test images, imported from locally built OCI archives.

Which containerd runs is ``WEFT_CONTAINERD``: ``1.6`` (the default: the
``containerd`` on PATH, Debian 12's), or ``1.7`` or ``2``, the releases the
checkout's ``components/containerd/build.sh`` builds from Go modules (its bin
directory goes first on containerd's PATH, so containerd finds its own runc
shim; runc stays the machine's). Tests that depend on one release's behaviour
ask ``Containerd.line``.

``close()`` removes everything the instance made, even after a failed test or
a containerd that a test killed: it restarts containerd if needed, removes
every pod sandbox through CRI (which tears down pod network namespaces and
mounts), then kills leftover shims, force-deletes leftover runc containers,
unmounts what is left under its directories, removes the cgroups under its
cgroup root and deletes the node namespace. A holder killed outright never gets
to ``close()``; the next instance to claim its slot reaps what it left.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric import builds, cpuset, daemon, images
from shim.localfabric.daemon import Opened
from shim.shadowhost.volumes import unmount_under

SLOT_DIR = Path("/run/weft-harness")
CGROUP_FS = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")
# The test images built from busybox (and anything carried in): under the one cache root, or where
# WEFT_HARNESS_CACHE says (the GPU proof points it at what it carries).
IMAGE_CACHE = Path(os.environ.get("WEFT_HARNESS_CACHE")
                   or Path(os.environ.get("WEFT_CACHE_ROOT") or "/var/cache/weft", "harness"))
MAX_SLOTS = 200
# The CNI plugins (bridge, host-local, loopback, portmap): Debian's, or where WEFT_CNI_BIN says (the GPU proof
# carries them to a machine without any).
CNI_BIN = os.environ.get("WEFT_CNI_BIN") or "/usr/lib/cni"

VERSION_ENV = "WEFT_CONTAINERD"
BIN_ENV = "WEFT_CONTAINERD_BIN"
LINES = ("1.6", "1.7", "2")
# The other 2.x lines upstream ships, built too for the installer's tests (their config default, --version);
# the harness itself runs on LINES.
RELEASE_LINES = ("2.0", "2.1", "2.2", "2.3")
DEFAULT_LINE = "1.6"
# Only a checkout has the build script; an installed weft runs the containerd on PATH.
CONTAINERD_BUILD = Path(__file__).resolve().parents[2] / "components" / "containerd" / "build.sh"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, check=check, capture_output=True, text=True)


def selected_line() -> str:
    """The containerd release line ``WEFT_CONTAINERD`` asks for (``1.6`` when unset)."""
    line = os.environ.get(VERSION_ENV) or DEFAULT_LINE
    if line not in LINES:
        raise ValueError(f"{VERSION_ENV}={line!r}: want one of {', '.join(LINES)}")
    return line


@functools.cache
def bin_dir(line: str) -> Path | None:
    """Where ``line``'s containerd and runc shim are; None for the default, the ones on PATH.

    Runs components/containerd/build.sh, which answers at once from its cache and builds (minutes) when the
    pins are not built yet; scripts/test.sh starts that build in the background first.
    """
    if line == DEFAULT_LINE:
        return None
    if line not in (*LINES, *RELEASE_LINES):
        raise ValueError(f"containerd line {line!r}: want one of {', '.join((*LINES, *RELEASE_LINES))}")
    carried = os.environ.get(BIN_ENV)
    if carried:
        if not (Path(carried) / "containerd").is_file():
            raise RuntimeError(f"{BIN_ENV}={carried}: no containerd there")
        return Path(carried)
    if not CONTAINERD_BUILD.is_file():
        raise RuntimeError(f"containerd {line} is built by components/containerd/build.sh, which only a checkout has")
    found = Path(builds.run(CONTAINERD_BUILD, line))
    if not (found / "containerd").is_file():
        raise RuntimeError(f"{found} has no containerd: components/containerd/build.sh did not build it")
    return found


def cgroup_hierarchies() -> list[Path]:
    """Every cgroup hierarchy mounted under /sys/fs/cgroup: each v1 controller and, on a hybrid host, the v2 one."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            fstype = fields[fields.index("-") + 1]
            mnt = Path(fields[4].replace("\\040", " "))
            if fstype in ("cgroup", "cgroup2") and (mnt == CGROUP_FS or CGROUP_FS in mnt.parents):
                found.append(mnt)
    return found


def lock_held(name: str) -> bool:
    """Whether a live holder has slot lock ``name`` (``slot3``, ``mesh2``) now: what carries it is theirs."""
    try:
        fd = os.open(SLOT_DIR / f"{name}.lock", os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def claim_slot(kind: str, wanted: int, limit: int) -> tuple[int, int]:
    """An exclusive slot number (``wanted``, or the lowest free one for 0) and the fd holding its flock.

    The lock dies with its holder, so a slot is free exactly when nobody alive holds it, whichever
    process or test session that was.
    """
    SLOT_DIR.mkdir(parents=True, exist_ok=True)
    if not 0 <= wanted < limit:
        raise ValueError(f"{kind} slot {wanted}: want 0 (any free one) or 1..{limit - 1}")
    for slot in [wanted] if wanted else range(1, limit):
        fd = os.open(SLOT_DIR / f"{kind}{slot}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return slot, fd
    if wanted:
        raise RuntimeError(f"{kind} slot {wanted} is held by a live holder")
    raise RuntimeError(f"no free {kind} slot under {SLOT_DIR}")


@dataclass
class RuntimeHandler:
    """An extra CRI runtime handler (for example weft's, with OCI hooks)."""

    name: str
    base_runtime_spec: Path | None = None
    pod_annotations: tuple[str, ...] = ()
    container_annotations: tuple[str, ...] = ()
    binary_name: str = ""  # the runtime binary runc v2 runs ("" runc; NVIDIA's on a GPU Operator's node)


def _in_workdir(name: str) -> property:
    """A path in the node's workdir (the one given, or the temporary one ``open`` makes)."""

    def get(self: Containerd) -> Path:
        assert self.workdir is not None
        return self.workdir / name

    return property(get)


@dataclass
class Containerd(Opened):
    """One containerd with everything of its own. Use as a context manager.

    ``slot`` 0 takes the lowest free slot; any other number claims exactly that
    one, and fails if a live holder has it. ``line`` is the containerd release
    line that runs (see the module's docstring).
    """

    workdir: Path | None = None
    handlers: list[RuntimeHandler] = field(default_factory=list)
    default_runtime: str = "runc"  # containerd's default handler (one of handlers, or runc)
    slot: int = 0
    line: str = field(default_factory=selected_line)
    # CPUs this node's containerd, shims and pods run on (``0``, ``1-3``), as a machine of its own; "": all.
    cpus: str = ""
    _lock_fd: int | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _owns_workdir: bool = False
    _log: object = None

    # -- paths -------------------------------------------------------------
    @property
    def netns(self) -> str:
        return f"weftnode{self.slot}"

    @property
    def netns_path(self) -> Path:
        return NETNS_DIR / self.netns

    @property
    def bridge(self) -> str:
        return f"weftbr{self.slot}"

    @property
    def subnet(self) -> str:
        return f"10.244.{self.slot}.0/24"

    @property
    def cgroup_root(self) -> str:
        """The cgroup parent under which pods go, as kubelet's ``/kubepods`` on a node."""
        return f"/weft-harness{self.slot}"

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    socket = _in_workdir("containerd.sock")
    root = _in_workdir("root")
    state = _in_workdir("state")
    runc_root = _in_workdir("runc")
    log_path = _in_workdir("containerd.log")
    # containerd's ``hosts.toml`` directory: ``<dir>/<registry host>/hosts.toml``, read at each pull.
    registry_config_dir = _in_workdir("certs.d")
    # Where containerd 2.x reads CDI specs (CDI is on by default there), instead of the host's /etc/cdi.
    cdi_spec_dir = _in_workdir("cdi")
    pod_log_dir = _in_workdir("pod-logs")

    # -- lifecycle ---------------------------------------------------------
    def open(self) -> None:
        self._claim_slot()
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"weft-ctrd{self.slot}-"))
            self._owns_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        for d in (self.root, self.state, self.runc_root, self.pod_log_dir, self.workdir / "cni",
                  self.registry_config_dir, self.cdi_spec_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._make_netns()
        self._write_config()
        if self.cpus:
            cpuset.confine_cgroup(self.cgroup_root, self.cpus)
        self.start()
        self._import_images()

    def _claim_slot(self) -> None:
        self.slot, self._lock_fd = claim_slot("slot", self.slot, MAX_SLOTS)
        self._reap_previous()

    def _reap_previous(self) -> None:
        """Remove what an earlier holder of this slot left when it was killed outright."""
        for old in Path(tempfile.gettempdir()).glob(f"weft-ctrd{self.slot}-*"):
            self._kill_processes_mentioning(str(old))
            for runc_ns in (old / "runc").glob("*"):
                res = _run("runc", "--root", str(runc_ns), "list", "-q", check=False)
                for cid in res.stdout.split():
                    _run("runc", "--root", str(runc_ns), "delete", "--force", cid, check=False)
            unmount_under(old)
            shutil.rmtree(old, ignore_errors=True)
        # After the containers are gone: a cgroup with tasks in it cannot be removed.
        self._remove_cgroups()

    @staticmethod
    def _kill_processes_mentioning(needle: str) -> None:
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                cmdline = (pid_dir / "cmdline").read_bytes()
            except OSError:
                continue
            if needle.encode() in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid_dir.name), signal.SIGKILL)

    def _make_netns(self) -> None:
        if self.netns_path.exists():  # left by a run that was killed
            _run("ip", "netns", "delete", self.netns, check=False)
        _run("ip", "netns", "add", self.netns)
        _run("ip", "-n", self.netns, "link", "set", "lo", "up")

    def _write_config(self) -> None:
        assert self.workdir is not None
        cni = {
            "cniVersion": "0.4.0",
            "name": f"weft-test-{self.slot}",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": self.bridge,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.subnet}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.workdir / "cni-ipam"),
                    },
                },
                # portmap runs iptables, even to remove nothing: left out on a machine without it (the GPU
                # proof's, whose pods map no ports).
                *([{"type": "portmap", "capabilities": {"portMappings": True}}] if shutil.which("iptables") else []),
            ],
        }
        (self.workdir / "cni" / "10-weft-test.conflist").write_text(json.dumps(cni, indent=2))
        common = f"""root = "{self.root}"
state = "{self.state}"
oom_score = 0

[grpc]
  address = "{self.socket}"

[ttrpc]
  address = "{self.socket}.ttrpc"

[debug]
  address = ""
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "{self.workdir / 'opt'}"
"""
        config = self._config_v3(common) if self.line == "2" else self._config_v2(common)
        (self.workdir / "config.toml").write_text(config)

    def _config_v2(self, common: str) -> str:
        """containerd 1.6 and 1.7: one CRI plugin section holds runtime, images, CNI and streaming."""
        assert self.workdir is not None
        cri_section = 'plugins."io.containerd.grpc.v1.cri"'
        runtimes = "".join(self._runtime_toml(f"{cri_section}.containerd.runtimes", h) for h in self._all_handlers())
        return f"""version = 2
{common}
[{cri_section}]
  sandbox_image = "{images.PAUSE_IMAGE}"
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false

[{cri_section}.registry]
  config_path = "{self.registry_config_dir}"

[{cri_section}.cni]
  bin_dir = "{CNI_BIN}"
  conf_dir = "{self.workdir / 'cni'}"

[{cri_section}.containerd]
  default_runtime_name = "{self.default_runtime}"
  snapshotter = "overlayfs"
{runtimes}"""

    def _config_v3(self, common: str) -> str:
        """containerd 2.x, written as its own format rather than left to its migration of version 2: the
        CRI runtime (handlers, CNI, pod settings), its image service (snapshotter, sandbox image, registry
        hosts) and its gRPC front (streaming) are separate plugins. 2.x turns NRI on by default at one
        host-wide socket, so each test containerd gets its own or parallel ones fail to start."""
        assert self.workdir is not None
        runtime = 'plugins."io.containerd.cri.v1.runtime"'
        images_section = 'plugins."io.containerd.cri.v1.images"'
        runtimes = "".join(self._runtime_toml(f"{runtime}.containerd.runtimes", h) for h in self._all_handlers())
        return f"""version = 3
{common}
[{runtime}]
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  enable_selinux = false
  cdi_spec_dirs = ["{self.cdi_spec_dir}"]

[{runtime}.cni]
  bin_dirs = ["{CNI_BIN}"]
  conf_dir = "{self.workdir / 'cni'}"

[{runtime}.containerd]
  default_runtime_name = "{self.default_runtime}"
{runtimes}
[{images_section}]
  snapshotter = "overlayfs"

[{images_section}.pinned_images]
  sandbox = "{images.PAUSE_IMAGE}"

[{images_section}.registry]
  config_path = "{self.registry_config_dir}"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins."io.containerd.nri.v1.nri"]
  socket_path = "{self.workdir / 'nri.sock'}"
  plugin_path = "{self.workdir / 'nri-plugins'}"
  plugin_config_path = "{self.workdir / 'nri-conf'}"
"""

    def _all_handlers(self) -> list[RuntimeHandler]:
        return [RuntimeHandler("runc"), *self.handlers]

    def _runtime_toml(self, prefix: str, h: RuntimeHandler) -> str:
        base = f'  base_runtime_spec = "{h.base_runtime_spec}"\n' if h.base_runtime_spec else ""
        return f"""
[{prefix}.{h.name}]
  runtime_type = "io.containerd.runc.v2"
{base}  pod_annotations = {json.dumps(list(h.pod_annotations))}
  container_annotations = {json.dumps(list(h.container_annotations))}

[{prefix}.{h.name}.options]
  Root = "{self.runc_root}"
  SystemdCgroup = false
""" + (f'  BinaryName = "{h.binary_name}"\n' if h.binary_name else "")

    def start(self, timeout: float = 30.0) -> None:
        """Start containerd (again) in the node namespace and wait until it answers CRI."""
        if self.running:
            return
        env = dict(os.environ)
        binaries = bin_dir(self.line)
        if binaries is not None:  # containerd finds its runc shim on its PATH
            env["PATH"] = f"{binaries}{os.pathsep}{env.get('PATH', os.defpath)}"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the process
        self._proc = subprocess.Popen(
            cpuset.pinned(["nsenter", f"--net={self.netns_path}", "containerd", "--config",
                           str(self.workdir / "config.toml")], self.cpus),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
        daemon.wait_up(self._proc, lambda: self.socket.exists() and self._answers(), timeout,
                       lambda code: f"containerd exited ({code}); see {self.log_path}:\n{self._tail()}",
                       lambda: f"containerd did not answer CRI within {timeout}s; see {self.log_path}:\n{self._tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Stop containerd only (its shims and containers go on, as on a real node)."""
        if self._proc is None:
            return
        daemon.stop(self._proc, sig, timeout)
        self._proc = None
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    def _tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def _answers(self) -> bool:
        with grpc.insecure_channel(self.address) as ch:
            try:
                cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=2)
                return True
            except grpc.RpcError:
                return False

    def _import_images(self) -> None:
        for archive in images.cached_archives(IMAGE_CACHE):
            self._ctr_import(archive)
        self._await_images_in_cri([spec.name for spec in images.IMAGES])

    def import_image(self, archive: Path, name: str) -> None:
        """Import one more OCI archive (an image named ``name``) and wait until CRI lists it."""
        self._ctr_import(archive)
        self._await_images_in_cri([name])

    def _ctr_import(self, archive: Path) -> None:
        res = _run("ctr", "-a", str(self.socket), "-n", "k8s.io", "images", "import", str(archive), check=False)
        if res.returncode != 0:
            raise RuntimeError(f"ctr images import {archive} failed: {res.stderr.strip()}")

    def _await_images_in_cri(self, names: list[str], timeout: float = 30.0) -> None:
        """Wait until the CRI plugin lists what ``ctr`` imported.

        The CRI plugin learns of an import from containerd's event stream, not
        from the import itself; a RunPodSandbox that comes first finds no pause
        image and tries to pull it, which these machines cannot.
        """
        deadline = time.monotonic() + timeout
        missing = list(names)
        with grpc.insecure_channel(self.address) as ch:
            img = cri_grpc.ImageServiceStub(ch)
            while True:
                missing = [n for n in missing
                           if not img.ImageStatus(cri.ImageStatusRequest(image=cri.ImageSpec(image=n)),
                                                  timeout=10).HasField("image")]
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"containerd's CRI plugin did not list the imported images "
                                       f"{', '.join(missing)} within {timeout:.0f} s")
                time.sleep(0.05)

    # -- teardown ----------------------------------------------------------
    def close(self) -> None:
        """Remove everything this instance made. Safe to call more than once."""
        if self._lock_fd is None:
            return
        errors: list[str] = []
        if self.workdir is not None and (self.workdir / "config.toml").exists():
            try:
                self.start()
                self._remove_all_pods()
            except Exception as exc:  # noqa: BLE001 - teardown goes on regardless
                errors.append(f"CRI cleanup: {exc}")
            self.stop()
            self._kill_leftovers()
            unmount_under(self.workdir)
        left = self._remove_cgroups()
        if left:
            errors.append(f"cgroups still in use: {', '.join(map(str, left))}")
        _run("ip", "netns", "delete", self.netns, check=False)
        if self._owns_workdir and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        if errors:
            raise RuntimeError("; ".join(errors))

    def _remove_all_pods(self) -> None:
        with grpc.insecure_channel(self.address) as ch:
            rt = cri_grpc.RuntimeServiceStub(ch)
            for sb in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items:
                rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)
                rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb.id), timeout=60)
            # Containers created outside any listed sandbox cannot exist in CRI,
            # but a failed test may leave one mid-creation; remove what is listed.
            for c in rt.ListContainers(cri.ListContainersRequest(), timeout=30).containers:
                rt.RemoveContainer(cri.RemoveContainerRequest(container_id=c.id), timeout=60)

    def _kill_leftovers(self) -> None:
        # Shims carry containerd's address on their command line.
        self._kill_processes_mentioning(str(self.socket))
        if self.runc_root.exists():
            for ns_root in self.runc_root.iterdir():
                res = _run("runc", "--root", str(ns_root), "list", "-q", check=False)
                for cid in res.stdout.split():
                    _run("runc", "--root", str(ns_root), "delete", "--force", cid, check=False)

    def _remove_cgroups(self, settle: float = 2.0) -> list[Path]:
        """rmdir every cgroup under the cgroup root, deepest first; returns those that would not go.

        runc removes a container's own cgroup but not the ``pod<uid>`` parent it
        created on the way. A cgroup whose last task was only just killed can
        read busy for a moment, hence the retries for up to ``settle`` seconds.
        """
        deadline = time.monotonic() + settle
        while True:
            left = []
            for hierarchy in cgroup_hierarchies():
                top = hierarchy / self.cgroup_root.lstrip("/")
                dirs = [Path(d) for d, _, _ in os.walk(top)]
                for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
                    try:
                        d.rmdir()
                    except FileNotFoundError:
                        pass
                    except OSError:
                        left.append(d)
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.05)

    # -- helpers for tests ---------------------------------------------------
    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)
