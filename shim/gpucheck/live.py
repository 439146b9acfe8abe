"""The live enforcement test: two leases on one GPU through the broker, a CUDA client in each.

It plays two containers on the node itself. Each lease is bound, as the OCI
hook would bind it, to a holder process in a cgroup of its own; each client
joins its lease's cgroup and runs in a mount namespace with the lease's
mounts (the MPS pipes at MPS's default ``/tmp/nvidia-mps``, the lease's
``/dev/shm``), as in a container. Then, step by step, each a check:

    live.broker          the node's broker (or a private one, when none answers)
    live.leases          two shares of one GPU (or of one MIG instance where the GPUs have MIG on), each
                         with its own MPS daemon
    live.mps-limits      each daemon holds its lease's limits (read back from it)
    live.memory-within   each client allocates half its lease
    live.memory-beyond   over its lease, a client's allocation fails; the neighbour still allocates
    live.compute-shares  a busy kernel in each, with blocks for every SM of the device, runs on its
                         share of them alone (the device's count read first by a client outside MPS)
    live.cleared-env     a client with no CUDA_MPS_* variables is still held to its lease
    live.watchdog        a client that leaves MPS and takes more is killed with its lease's
                         processes; the neighbour runs on
    live.released        leases released, daemons gone, no process or cgroup left

Every wait is bounded; a step that fails ends the test with a check naming
what failed, and the clean-up runs whatever happened. It changes no device
setting.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from shim import log
from shim._pb import broker_pb2 as pb
from shim._pb import broker_pb2_grpc as pb_grpc
from shim.broker.mps import control, memory_matches, parse_memory, parse_percent
from shim.gpucheck import cgroups, cuda_client
from shim.gpucheck.brokerlink import BrokerLink, NoBroker
from shim.gpucheck.clientproc import Client, ClientError
from shim.gpucheck.report import Check, fail, ok, warn

_log = log.get("weft.gpucheck")
DEFAULT_BROKER_SOCKET = Path("/run/weft/broker.sock")
MPS_DEFAULT_PIPE = Path("/tmp/nvidia-mps")
CLIENT = Path(cuda_client.__file__).resolve()
# Binds the lease's mounts in the client's own mount namespace, joins the lease's cgroup, then becomes the client
# (each step an exec, so the PID weft-gpu-check started is the client's).
_ENTER = """set -e
if [ -n "$1" ]; then mount --bind "$1" /dev/shm; fi
if [ -n "$2" ]; then mount --bind "$2" /tmp/nvidia-mps; fi
echo $$ > "$3"
shift 3
exec "$@"
"""
_JOIN = 'echo $$ > "$1" && exec sleep "$2"'


@dataclass(frozen=True)
class LiveSettings:
    broker_socket: Path | None = None  # None: the node's broker if it answers, else a private one
    default_socket: Path = DEFAULT_BROKER_SOCKET
    mps_binary: str = "nvidia-cuda-mps-control"
    libcuda: str = "libcuda.so.1"
    work_parent: Path = Path("/run")  # the private broker's and the test's files (a tmpfs on most nodes)
    lease_bytes: int = 1 << 30
    shares: tuple[int, int] = (25, 50)
    busy_ms: int = 300
    step_timeout: float = 60.0  # one client command, MPS server start and PTX compile included
    watchdog_timeout: float = 30.0
    free_bytes: Mapping[str, int] = field(default_factory=dict)  # device UUID -> free memory, from NVML
    # For tests: variables every client gets, the pynvml stand-in of a private broker and where it reads MIG
    # capability files, a hook before each step.
    client_env: Mapping[str, str] = field(default_factory=dict)
    nvml_library: Any = None
    nvml_proc_root: Path = Path("/proc")
    on_step: Callable[[str, LiveTest], None] | None = None


def pick_device(devices: list[pb.Device], need: int, free_need: int, free_bytes: Mapping[str, int]) -> str | None:
    """The device the test's two shares go on: ``need`` bytes unleased, ``free_need`` free (where known).

    A MIG-enabled GPU is never leased, so never picked; its MIG instances are devices of their own and may be,
    after every GPU without MIG, the largest first: an instance has few SMs, and a share of few SMs, in whole
    TPCs, is a coarse measure of the compute share.
    """
    fit = [d for d in devices if not d.mig_enabled and not d.exclusive and d.memory_total - d.memory_leased >= need
           and free_bytes.get(d.uuid, free_need) >= free_need]
    # sorted() is stable: GPUs keep the broker's order.
    fit.sort(key=lambda d: (d.uuid.startswith("MIG-"), -d.memory_total if d.uuid.startswith("MIG-") else 0))
    return fit[0].uuid if fit else None


class _Stop(Exception):
    def __init__(self, check: Check) -> None:
        super().__init__(check.detail)
        self.check = check


@dataclass
class _Lease:
    name: str  # a, b
    share: int
    lease: pb.Lease
    cgroup: str  # as /proc/<pid>/cgroup shows it
    cgroup_dir: Path
    holder: subprocess.Popen[bytes]
    pipe_dir: str = ""
    shm_dir: str = ""


class LiveTest:
    def __init__(self, settings: LiveSettings) -> None:
        self.s = settings
        self.work: Path | None = None
        self.broker = BrokerLink()
        self.leases: dict[str, _Lease] = {}
        self.clients: list[Client] = []
        self.cgroup_parent: Path | None = None
        self.made_default_pipe = False
        self.device = ""
        self.device_sms: int | None = None  # read outside MPS before the leases; None: it could not be
        self.device_sms_why = ""
        self.tag = f"weft-gpu-check-{os.getpid()}-{int(time.time())}"

    # -- the steps --------------------------------------------------------------------------
    def run(self) -> list[Check]:
        checks: list[Check] = []
        try:
            self._steps(checks)
        except _Stop as stop:
            checks.append(stop.check)
        except Exception as exc:  # noqa: BLE001 - whatever broke, it is reported and cleaned up after
            _log.exception("gpu_check.live_failed")
            checks.append(fail("live", f"the live test stopped on an unexpected error: {type(exc).__name__}: {exc}"))
        checks.append(self._cleanup())
        for c in checks:
            _log.info("gpu_check.step", check=c.name, result=c.result.value)
        return checks

    def _step(self, name: str) -> None:
        if self.s.on_step is not None:
            self.s.on_step(name, self)

    def _steps(self, out: list[Check]) -> None:
        self._step("live.broker")
        out.append(self._broker())
        self._step("live.leases")
        out.append(self._leases())
        self._step("live.mps-limits")
        out.append(self._limits())
        a, b = (self._client(self.leases[n], "env") for n in ("a", "b"))
        self._step("live.memory-within")
        out.append(self._within(a, b))
        self._step("live.memory-beyond")
        out.append(self._beyond(a, b))
        self._step("live.compute-shares")
        out.append(self._compute(a, b))
        self._step("live.cleared-env")
        out.append(self._cleared())
        self._step("live.watchdog")
        out.append(self._watchdog(a, b))

    def _broker(self) -> Check:
        name = "live.broker"
        if os.geteuid() != 0:
            raise _Stop(fail(name, "the live test needs root (it makes cgroups and mount namespaces, as containers "
                                   "have). Change: run weft gpu-check as root, or pass --skip-live"))
        if shutil.which("unshare") is None:
            raise _Stop(fail(name, "unshare (util-linux) is not on PATH; the clients need it for their mount "
                                   "namespaces. Change: install util-linux"))
        self.work = Path(tempfile.mkdtemp(prefix="wgc-", dir=self.s.work_parent))
        candidates = [self.s.broker_socket] if self.s.broker_socket else [self.s.default_socket]
        for socket in candidates:
            backend = self.broker.connect(socket)
            if backend is not None:
                if backend != "nvml":
                    raise _Stop(fail(name, f"the broker at {socket} runs {backend} devices: nothing real to test. "
                                           "Change: run weft broker --backend nvml on this node"))
                return ok(name, f"the node's broker at {socket} (backend nvml)")
            if self.s.broker_socket:
                raise _Stop(fail(name, f"no broker answers at {socket}. Change: start weft broker there, or omit "
                                       "--broker-socket to test with a private broker"))
        return ok(name, self._start_private())

    def _start_private(self) -> str:
        assert self.work is not None
        try:
            socket = self.broker.start_private(self.work, mps_binary=self.s.mps_binary,
                                               ready_timeout=self.s.step_timeout, nvml_library=self.s.nvml_library,
                                               proc_root=self.s.nvml_proc_root)
        except NoBroker as exc:
            raise _Stop(fail("live.broker", str(exc))) from None
        return (f"no broker answers at {self.s.default_socket}: a private one for this test (backend nvml, "
                f"--enforce kill) at {socket}")

    @property
    def private_broker(self) -> Any:
        """The private broker (shim.brokerd.Broker) when none answered, else None."""
        return self.broker.private

    @property
    def stub(self) -> pb_grpc.BrokerStub | None:
        return self.broker.stub

    def _leases(self) -> Check:
        name = "live.leases"
        assert self.stub is not None
        devices = self.stub.Devices(pb.DevicesRequest(), timeout=10).devices
        need = 2 * self.s.lease_bytes
        free_need = 3 * self.s.lease_bytes + (2 << 30)  # the clients' allocations and three CUDA contexts
        device = pick_device(devices, need, free_need, self.s.free_bytes)
        if device is None:
            leased = ", ".join(f"{d.uuid}: {d.memory_leased >> 20} MiB leased" for d in devices if not d.mig_enabled)
            raise _Stop(fail(name, f"no GPU or MIG instance has {need >> 30} GiB unleased and {free_need >> 30} GiB "
                                   f"free ({leased}). Change: run the test when a GPU is idle"))
        self.device = device
        self.device_sms, self.device_sms_why = self._read_device_sms()
        try:
            self.cgroup_parent = cgroups.make_parent(self.tag)
        except cgroups.NoCgroup as exc:
            raise _Stop(fail(name, str(exc))) from None
        for n, share in zip(("a", "b"), self.s.shares, strict=True):
            req = pb.AcquireRequest(key=f"{self.tag}/{n}/0", namespace="weft-gpu-check", pod=self.tag, container=n,
                                    sandbox_id=self.tag, memory_bytes=self.s.lease_bytes, compute_percent=share,
                                    allowed_uuids=[self.device])
            try:
                lease = self.stub.Acquire(req, timeout=self.s.step_timeout)
            except grpc.RpcError as exc:
                raise _Stop(fail(name, f"the broker refused lease {n} ({self.s.lease_bytes >> 20} MiB, {share}%) on "
                                       f"{self.device}: {exc.code().name}: {exc.details()}")) from None
            cg_dir = self.cgroup_parent / n
            cg_dir.mkdir()
            holder = subprocess.Popen(["sh", "-c", _JOIN, "weft-gpu-check", str(cg_dir / "cgroup.procs"), "3600"],
                                      start_new_session=True, stdin=subprocess.DEVNULL)
            rec = _Lease(n, share, lease, cgroups.as_seen(cg_dir), cg_dir, holder)
            self.leases[n] = rec
            self._wait(lambda h=holder, c=cg_dir: str(h.pid) in (c / "cgroup.procs").read_text().split(),
                       f"lease {n}'s holder to join its cgroup", name)
            try:
                self.stub.Bind(pb.BindRequest(lease_id=lease.lease_id, container_id=f"{self.tag}-{n}",
                                              pid=holder.pid, cgroup=rec.cgroup), timeout=10)
            except grpc.RpcError as exc:
                raise _Stop(fail(name, f"the broker refused to bind lease {lease.lease_id}: {exc.details()}")) \
                    from None
            mounts = {m.container_path: m.host_path for m in lease.mounts}
            rec.pipe_dir, rec.shm_dir = mounts.get(str(MPS_DEFAULT_PIPE), ""), mounts.get("/dev/shm", "")
            if not lease.shared or not rec.pipe_dir:
                raise _Stop(fail(name, f"lease {lease.lease_id} came without an MPS pipe directory (shared "
                                       f"{lease.shared}, mounts {dict(mounts)}): this broker does not enforce shares "
                                       "with MPS. Change: run weft broker --backend nvml"))
        a, b = self.leases["a"], self.leases["b"]
        if a.lease.device_uuids != b.lease.device_uuids or a.pipe_dir == b.pipe_dir:
            raise _Stop(fail(name, f"the two leases are not two MPS servers on one GPU: {list(a.lease.device_uuids)} "
                                   f"({a.pipe_dir}) and {list(b.lease.device_uuids)} ({b.pipe_dir})"))
        return ok(name, f"on {self.device}: {a.lease.lease_id} ({self.s.lease_bytes >> 20} MiB, {a.share}%) and "
                        f"{b.lease.lease_id} ({self.s.lease_bytes >> 20} MiB, {b.share}%), each bound to a process in "
                        f"a cgroup of its own, each with its own MPS daemon")

    def _limits(self) -> Check:
        name = "live.mps-limits"
        binary = shutil.which(self.s.mps_binary)
        if binary is None:
            raise _Stop(fail(name, f"{self.s.mps_binary} is not on PATH to ask the daemons"))
        parts = []
        for rec in self.leases.values():
            threads = control(binary, Path(rec.pipe_dir), "get_default_active_thread_percentage", 10)
            memory = control(binary, Path(rec.pipe_dir), "get_default_device_pinned_mem_limit 0", 10)
            shown_t = parse_percent(threads.stdout) if threads and threads.returncode == 0 else None
            shown_m = parse_memory(memory.stdout) if memory and memory.returncode == 0 else None
            mib = -(-self.s.lease_bytes // (1 << 20))
            if shown_t != float(rec.share) or shown_m is None or not memory_matches(shown_m, mib):
                raise _Stop(fail(name, f"lease {rec.name}'s MPS daemon ({rec.pipe_dir}) shows "
                                       f"{_said(threads)} threads and {_said(memory)} memory, not {rec.share} and "
                                       f"{mib}M: its clients are not held to the lease"))
            parts.append(f"lease {rec.name}: {shown_m >> 20} MiB, {shown_t:g}% on its daemon")
        return ok(name, "; ".join(parts))

    def _within(self, a: Client, b: Client) -> Check:
        half = self.s.lease_bytes >> 21
        seen = {}
        for c in (a, b):
            got = self._ok(c, "init", "live.memory-within")
            seen[c.name] = got
            self._ok(c, f"alloc {half}", "live.memory-within")
        return ok("live.memory-within", "; ".join(
            f"client {n} sees {v['total_bytes'] >> 20} MiB of {v['name']} ({v['sms']} SMs) and allocated {half} MiB"
            for n, v in seen.items()))

    def _beyond(self, a: Client, b: Client) -> Check:
        name = "live.memory-beyond"
        half, more = self.s.lease_bytes >> 21, (self.s.lease_bytes >> 21) + 128
        refused_a = self._refused(a, f"alloc {more}", name, f"{half + more} MiB against its "
                                                            f"{self.s.lease_bytes >> 20} MiB lease")
        self._ok(b, "alloc 16", name)  # the neighbour is untouched by a's refusal
        refused_b = self._refused(b, f"alloc {more}", name, f"{half + 16 + more} MiB against its "
                                                            f"{self.s.lease_bytes >> 20} MiB lease")
        return ok(name, f"client a was refused {more} MiB more ({refused_a}) while client b went on allocating; "
                        f"client b was then refused too ({refused_b})")

    def _read_device_sms(self) -> tuple[int | None, str]:
        """The device's SM count, from a client with a context of its own before any lease's daemon runs: an MPS
        client is shown only its share of the SMs, so the share can be judged only against this."""
        proc = subprocess.Popen(self._client_argv(self.s.step_timeout), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**self._client_env(), **self._outside_mps("probe")}, start_new_session=True)
        probe = Client("device-probe", proc, self.s.step_timeout)
        try:
            if not probe.read(what="whether it loaded libcuda").get("ok"):
                return None, "the probe could not load libcuda"
            got = probe.ask("init")
            if not got.get("ok"):
                return None, f"a client outside MPS could not make a context: {_cuda_error(got)}"
            return int(got["sms"]), ""
        except ClientError as exc:
            return None, str(exc)
        finally:
            probe.stop()

    def _compute(self, a: Client, b: Client) -> Check:
        name = "live.compute-shares"
        whole = self.device_sms
        for c in (a, b):  # both busy at once, each with blocks enough for the whole device
            c.send(f"busy {self.s.busy_ms}" + (f" {whole}" if whole else ""))
        got = {}
        for c in (a, b):
            try:
                got[c.name] = c.read(what=f"'busy {self.s.busy_ms}'")
            except ClientError as exc:
                raise _Stop(fail(name, str(exc))) from None
            if not got[c.name].get("ok"):
                raise _Stop(fail(name, f"client {c.name}: busy failed: {_cuda_error(got[c.name])}"))
        if not whole:
            seen = "; ".join(f"client {c.name} ({share}%) sees {got[c.name]['sms_total']} SMs and ran on "
                             f"{got[c.name]['sms_used']}" for c, share in ((a, self.s.shares[0]),
                                                                           (b, self.s.shares[1])))
            return warn(name, f"the device's SM count could not be read outside MPS ({self.device_sms_why}), so "
                              f"the shares cannot be judged against it: {seen}")
        parts, bad = [], []
        for c, share in ((a, self.s.shares[0]), (b, self.s.shares[1])):
            used, seen = got[c.name]["sms_used"], got[c.name]["sms_total"]
            frac = used / whole
            parts.append(f"client {c.name} ({share}%), given blocks for all {whole} SMs, ran on {used} ({frac:.0%}; "
                         f"it sees {seen})")
            if not used or abs(frac - share / 100) > 0.1:
                bad.append(c.name)
        text = "; ".join(parts)
        if bad:
            return fail(name, f"{text}: the active thread percentage does not hold for client "
                              f"{', '.join(bad)}. Change: check the driver's MPS support (compute capability 7.0+)")
        return ok(name, text)

    def _cleared(self) -> Check:
        name = "live.cleared-env"
        rec = self.leases["a"]
        c = self._client(rec, "cleared")
        quarter, mib = self.s.lease_bytes >> 22, self.s.lease_bytes >> 20
        try:
            got = self._ok(c, "init", name)
            self._ok(c, f"alloc {quarter}", name)
            refused = self._refused(c, f"alloc {mib}", name, f"{quarter + mib} MiB with its environment cleared, "
                                                             f"against a {mib} MiB lease")
        finally:
            c.stop()
        return ok(name, f"a client of lease a with no CUDA_MPS_* or CUDA_VISIBLE_DEVICES variables found the lease's "
                        f"daemon at {MPS_DEFAULT_PIPE}, saw {got['total_bytes'] >> 20} MiB and was refused "
                        f"{mib} MiB more ({refused})")

    def _watchdog(self, a: Client, b: Client) -> Check:
        name = "live.watchdog"
        rec = self.leases["a"]
        c = self._client(rec, "bypass")
        more = (self.s.lease_bytes >> 20) + 256
        got = c.ask("init", self.s.step_timeout)
        if not got.get("ok"):
            c.stop()
            return ok(name, f"a client of lease a pointed away from its MPS daemon could not make a context of its "
                            f"own ({_cuda_error(got)}): nothing escaped for the watchdog to act on")
        got = c.ask(f"alloc {more}", self.s.step_timeout)
        if not got.get("ok"):
            c.stop()
            return ok(name, f"a client of lease a outside MPS was refused {more} MiB ({_cuda_error(got)}): nothing "
                            "escaped for the watchdog to act on")
        deadline = time.monotonic() + self.s.watchdog_timeout
        while time.monotonic() < deadline and (c.alive() or a.alive() or rec.holder.poll() is None):
            time.sleep(0.1)
        left = [n for n, alive in (("the client outside MPS", c.alive()), ("client a", a.alive()),
                                   ("lease a's holder", rec.holder.poll() is None)) if alive]
        if left:
            return fail(name, f"a client of lease a outside MPS took {more} MiB and {', '.join(left)} still ran "
                              f"after {self.s.watchdog_timeout:g}s. Change: run the broker with --enforce kill "
                              "(the default)")
        try:
            self._ok(b, "free", name)
        except _Stop as stop:
            return fail(name, f"the watchdog killed lease a's processes, but client b did not survive it: "
                              f"{stop.check.detail}")
        return ok(name, f"a client of lease a that left MPS and took {more} MiB was killed with lease a's processes; "
                        "client b still answers")

    # -- pieces -----------------------------------------------------------------------------
    def _ok(self, c: Client, command: str, name: str) -> dict:
        try:
            got = c.ask(command, self.s.step_timeout)
        except ClientError as exc:
            raise _Stop(fail(name, str(exc))) from None
        if not got.get("ok"):
            raise _Stop(fail(name, f"client {c.name}: {command!r} failed: {_cuda_error(got)}"))
        return got

    def _refused(self, c: Client, command: str, name: str, what: str) -> str:
        try:
            got = c.ask(command, self.s.step_timeout)
        except ClientError as exc:
            raise _Stop(fail(name, str(exc))) from None
        if got.get("ok"):
            raise _Stop(fail(name, f"client {c.name} was given {what}: the lease's memory limit does not hold"))
        if got.get("error") != "CUDA_ERROR_OUT_OF_MEMORY":
            raise _Stop(fail(name, f"client {c.name}: {command!r} failed, but not for memory: {_cuda_error(got)}"))
        return "CUDA_ERROR_OUT_OF_MEMORY"

    def _client(self, rec: _Lease, mode: str) -> Client:
        """A client in the lease's cgroup and mounts: ``env`` as the container gets it, ``cleared`` with no CUDA
        variables, ``bypass`` pointed at a directory with no MPS daemon (a context of its own)."""
        assert self.work is not None
        name = {"env": rec.name, "cleared": f"{rec.name}-cleared", "bypass": f"{rec.name}-outside-mps"}[mode]
        env = self._client_env()
        if mode == "env":
            env.update({k: v for k, v in rec.lease.env.items()})
            env["CUDA_MPS_PIPE_DIRECTORY"] = rec.pipe_dir  # the container sees it at /run/weft-mps
        elif mode == "bypass":
            env.update(self._outside_mps(rec.name))
        if not MPS_DEFAULT_PIPE.exists():
            MPS_DEFAULT_PIPE.mkdir(mode=0o755)  # a mount point only; removed at clean-up
            self.made_default_pipe = True
        argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _ENTER, "weft-gpu-check",
                rec.shm_dir, rec.pipe_dir, str(rec.cgroup_dir / "cgroup.procs"),
                "env", "-i", *(f"{k}={v}" for k, v in sorted(env.items())),
                *self._client_argv(self.s.step_timeout * 8 + self.s.watchdog_timeout)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        client = Client(name, proc, self.s.step_timeout)
        self.clients.append(client)
        try:
            first = client.read(what="whether it loaded libcuda")
        except ClientError as exc:
            raise _Stop(fail(f"live.{'cleared-env' if mode == 'cleared' else 'memory-within'}", str(exc))) from None
        if not first.get("ok"):
            raise _Stop(fail("live.memory-within", f"client {name}: {first.get('error')}. Change: install the NVIDIA "
                                                   "driver's libcuda.so.1"))
        return client

    def _client_env(self) -> dict[str, str]:
        """What every client starts with: a plain PATH, the test's own variables, and where libcuda is found."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **self.s.client_env}
        if os.environ.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        return env

    def _outside_mps(self, name: str) -> dict[str, str]:
        """A client's variables pointing it at a directory with no MPS daemon: a context of its own."""
        assert self.work is not None
        empty = self.work / f"no-mps-{name}"
        empty.mkdir(exist_ok=True)
        return {"CUDA_VISIBLE_DEVICES": self.device, "CUDA_MPS_PIPE_DIRECTORY": str(empty)}

    def _client_argv(self, max_seconds: float) -> list[str]:
        return [sys.executable, "-I", "-S", str(CLIENT), "--libcuda", self.s.libcuda,
                "--max-seconds", str(int(max_seconds))]

    def _wait(self, condition: Callable[[], bool], what: str, name: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                if condition():
                    return
            if time.monotonic() >= deadline:
                raise _Stop(fail(name, f"timed out after {timeout:g}s waiting for {what}"))
            time.sleep(0.02)

    # -- clean-up -----------------------------------------------------------------------------
    def _cleanup(self) -> Check:
        problems: list[str] = []
        for c in self.clients:
            c.stop()
        for rec in self.leases.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(rec.holder.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                rec.holder.wait(10)
        released = []
        if self.stub is not None:
            for rec in self.leases.values():
                try:
                    self.stub.Release(pb.ReleaseRequest(lease_id=rec.lease.lease_id, reason="gpu-check"), timeout=10)
                    released.append(rec.lease.lease_id)
                except grpc.RpcError as exc:
                    problems.append(f"release of {rec.lease.lease_id} failed: {exc.details()}")
            with contextlib.suppress(grpc.RpcError):
                left = [le.lease_id for le in self.stub.List(pb.ListRequest(), timeout=10).leases
                        if le.namespace == "weft-gpu-check" and le.pod == self.tag]
                if left:
                    problems.append(f"leases still bound: {', '.join(left)}")
        binary = shutil.which(self.s.mps_binary)
        for rec in self.leases.values():
            if binary and rec.pipe_dir:
                answer = control(binary, Path(rec.pipe_dir), "get_default_active_thread_percentage", 5)
                if answer is not None and answer.returncode == 0:
                    problems.append(f"lease {rec.name}'s MPS daemon still answers at {rec.pipe_dir}")
        problems += self.broker.close()
        for c in self.clients:
            if c.alive():
                problems.append(f"client {c.name} (pid {c.proc.pid}) still runs")
        if self.cgroup_parent is not None:
            for rec in self.leases.values():
                cgroups.remove(rec.cgroup_dir, problems)
            cgroups.remove(self.cgroup_parent, problems)
        if self.made_default_pipe:
            with contextlib.suppress(OSError):
                MPS_DEFAULT_PIPE.rmdir()
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
        if problems:
            return fail("live.released", "; ".join(problems))
        what = f"leases {', '.join(released)} released" if released else "no lease was taken"
        return ok("live.released", f"{what}; no client, MPS daemon or cgroup of the test left")


def _said(answer: subprocess.CompletedProcess[str] | None) -> str:
    if answer is None:
        return "no answer"
    return repr((answer.stdout or answer.stderr).strip()[:80])


def _cuda_error(doc: dict) -> str:
    where = f" ({doc['call']})" if doc.get("call") else ""
    return f"{doc.get('error', 'no error given')}{where}"


def run(settings: LiveSettings) -> list[Check]:
    return LiveTest(settings).run()

