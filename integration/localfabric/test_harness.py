"""The harness keeps its own promises, checked against the real daemons.

Every other integration test trusts ``shim.localfabric.containerd.Containerd`` to give
it a node of its own and to leave the machine as it found it, so these check
exactly that: side-by-side instances get their own subnets; ``close()`` leaves
no process, mount, node namespace, work directory or cgroup behind, even when
a test left a pod running and containerd stopped; and a holder killed with
SIGKILL, which never gets to ``close()``, is reaped by the next instance that
claims its slot.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc

from shim.localfabric import images, pods
from shim.localfabric.containerd import NETNS_DIR, Containerd, RuntimeHandler, cgroup_hierarchies, selected_line

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

# (pid, start time): a pid alone could have been reused by the time we look.
Procs = set[tuple[int, float]]


class Snapshot:
    """What an instance runs, taken while it runs: its processes and the network namespaces they are in.

    It holds each namespace open until ``release()``: the kernel hands a freed
    namespace's inode number to the next new one (the successor's node
    namespace, another test's pod), and a namespace held open keeps its number.
    """

    def __init__(self, workdir: Path) -> None:
        self.procs = _instance_procs(workdir)
        own = os.stat("/proc/self/ns/net").st_ino
        self._fds: dict[int, int] = {}
        for pid, _ in self.procs:
            with contextlib.suppress(OSError):  # gone already
                fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
                ino = os.fstat(fd).st_ino
                if ino == own or ino in self._fds:
                    os.close(fd)
                else:
                    self._fds[ino] = fd

    @property
    def net_namespaces(self) -> set[int]:
        return set(self._fds)

    def release(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@pytest.fixture
def snapshot() -> Iterator[Callable[[Path], Snapshot]]:
    taken: list[Snapshot] = []

    def take(workdir: Path) -> Snapshot:
        taken.append(Snapshot(workdir))
        return taken[-1]

    yield take
    for snap in taken:
        snap.release()


def _run_pod(ctrd: Containerd, name: str) -> tuple[str, str]:
    """A running sleeper pod, as kubelet would start it; returns its sandbox id and IP."""
    with ctrd.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        sb_cfg = pods.sandbox_config(name, ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root)
        sandbox = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb_cfg), timeout=60).pod_sandbox_id
        c_cfg = pods.container_config("sleeper", ["sleep", "3600"])
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sandbox, config=c_cfg,
                                                            sandbox_config=sb_cfg), timeout=60).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
        ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox), timeout=30).status.network.ip
    return sandbox, ip


def _instance_procs(workdir: Path) -> Procs:
    """containerd and shims (their command lines name the work directory) and everything under them: the pods."""
    found: Procs = set()
    for p in psutil.process_iter(["cmdline"]):
        if str(workdir) in " ".join(p.info["cmdline"] or ()):
            with_children = [p, *p.children(recursive=True)]
            found |= {(c.pid, c.create_time()) for c in with_children if c.is_running()}
    return found


def _alive(procs: Procs) -> list[str]:
    alive = []
    for pid, started in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def _cgroups_under(root: str) -> list[str]:
    return [d for h in cgroup_hierarchies() for d, _, _ in os.walk(h / root.lstrip("/"))]


def _mountinfo() -> list[list[str]]:
    with open("/proc/self/mountinfo") as f:
        return [line.split() for line in f]


def _mounts_under(base: Path) -> list[str]:
    mounts = [fields[4].replace("\\040", " ") for fields in _mountinfo()]
    return [m for m in mounts if m == str(base) or m.startswith(f"{base}/")]


def _netns_mounts(inodes: set[int]) -> list[str]:
    """Bind mounts, wherever they are, that keep one of these network namespaces alive (pods' included)."""
    roots = {f"net:[{i}]" for i in inodes}
    return [fields[4] for fields in _mountinfo() if fields[3] in roots]


def _leftovers(workdir: Path, slot: int, cgroup_root: str, snap: Snapshot | None, *,
               netns: bool = True) -> dict[str, list]:
    """Whatever an instance with this work directory and slot left; empty lists when it left nothing."""
    left = {
        "processes": sorted(f"{pid}" for pid, _ in _instance_procs(workdir)),
        "mounts": _mounts_under(workdir),
        "workdir": [str(workdir)] if workdir.exists() else [],
        "cgroups": _cgroups_under(cgroup_root),
    }
    if snap is not None:
        left["processes"] += _alive(snap.procs)
        left["network namespaces"] = _netns_mounts(snap.net_namespaces)
    if netns:
        left["node namespace"] = [f"weftnode{slot}"] if (NETNS_DIR / f"weftnode{slot}").exists() else []
    return left


def _nothing(left: dict[str, list]) -> bool:
    return not any(left.values())


def test_instances_side_by_side_run_pods_in_their_own_subnets() -> None:
    with Containerd() as a, Containerd() as b:
        assert a.slot != b.slot
        assert a.netns != b.netns and a.cgroup_root != b.cgroup_root and a.workdir != b.workdir
        net_a, net_b = ipaddress.ip_network(a.subnet), ipaddress.ip_network(b.subnet)
        assert not net_a.overlaps(net_b)
        _, ip_a = _run_pod(a, "side-a")
        _, ip_b = _run_pod(b, "side-b")
        assert ipaddress.ip_address(ip_a) in net_a, (ip_a, a.subnet)
        assert ipaddress.ip_address(ip_b) in net_b, (ip_b, b.subnet)
        # Each sees only its own pod.
        for ctrd, name in ((a, "side-a"), (b, "side-b")):
            with ctrd.channel() as ch:
                rt = api_pb2_grpc.RuntimeServiceStub(ch)
                items = rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items
            assert [sb.metadata.name for sb in items] == [name]


def test_the_chosen_containerd_takes_every_setting_the_harness_writes() -> None:
    """WEFT_CONTAINERD's containerd runs, and what the harness's config asks for (version 2 for 1.6 and 1.7,
    version 3 for 2.x) took effect: a setting a release no longer reads would be dropped without a word."""
    line = selected_line()
    handler = RuntimeHandler("weft-test", pod_annotations=("weft.io/*",), container_annotations=("weft.io/*",))
    with Containerd(handlers=[handler]) as ctrd:
        assert ctrd.line == line and ctrd.workdir is not None
        with ctrd.channel() as ch:
            rt = api_pb2_grpc.RuntimeServiceStub(ch)
            version = rt.Version(cri.VersionRequest(), timeout=10).runtime_version
            assert version.lstrip("v").startswith(f"{line}."), (line, version)
            status = rt.Status(cri.StatusRequest(verbose=True), timeout=10)
            conditions = {c.type: c for c in status.status.conditions}
            assert conditions["RuntimeReady"].status and conditions["NetworkReady"].status, status.status
            # 1.7 and 2.x say what they deprecate; nothing may be the config's (a cgroup v1 host is the machine's).
            warned = conditions.get("ContainerdHasNoDeprecationWarnings")
            if warned is not None and not warned.status:
                assert set(json.loads(warned.message)) <= {"io.containerd.deprecation/cgroup-v1"}, warned.message
            config = json.loads(status.info["config"])
            runtimes = config["containerd"]["runtimes"]
            assert config["containerd"]["defaultRuntimeName"] == "runc"
            assert set(runtimes) == {"runc", "weft-test"}, runtimes
            for name in runtimes:
                assert runtimes[name]["runtimeType"] == "io.containerd.runc.v2"
                assert runtimes[name]["options"]["Root"] == str(ctrd.runc_root)
                assert runtimes[name]["options"]["SystemdCgroup"] is False
            assert runtimes["weft-test"]["PodAnnotations"] == ["weft.io/*"]
            assert runtimes["weft-test"]["ContainerAnnotations"] == ["weft.io/*"]
            assert config["cni"]["confDir"] == str(ctrd.workdir / "cni")
            assert config["cni"].get("binDirs", [config["cni"].get("binDir")]) == ["/usr/lib/cni"]
            assert config["netnsMountsUnderStateDir"] is True and config["restrictOOMScoreAdj"] is True
            if line != "2":  # 2.x keeps the image service's and the streaming server's settings elsewhere
                assert config["containerd"]["snapshotter"] == "overlayfs"
                assert config["sandboxImage"] == images.PAUSE_IMAGE
                assert config["registry"]["configPath"] == str(ctrd.registry_config_dir)
                assert config["streamServerAddress"] == "127.0.0.1"
            if line == "2":  # the handlers CRI's Status lists since 2.0; CDI specs from the harness's directory
                assert {h.name for h in status.runtime_handlers} >= {"runc", "weft-test"}
                assert config["cdiSpecDirs"] == [str(ctrd.cdi_spec_dir)], config

            sandbox, ip = _run_pod(ctrd, "configured")
            # The sandbox ran on the harness's pause image (there is no other: no network to pull one) ...
            imgs = api_pb2_grpc.ImageServiceStub(ch).ListImages(cri.ListImagesRequest(), timeout=30).images
            pause_images = [i for i in imgs if images.PAUSE_IMAGE in i.repo_tags]
            assert pause_images, [i.repo_tags for i in imgs]
            if line != "1.6":
                assert pause_images[0].pinned, "the sandbox image is not pinned: the setting did not take"
            # ... in the pod subnet of the harness's CNI config, with its netns under the state directory ...
            assert ipaddress.ip_address(ip) in ipaddress.ip_network(ctrd.subnet)
            info = json.loads(rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox, verbose=True),
                                                  timeout=30).info["info"])
            netns = next(ns["path"] for ns in info["runtimeSpec"]["linux"]["namespaces"] if ns["type"] == "network")
            assert netns.startswith(f"{ctrd.state}/"), netns
            # ... on the overlayfs snapshotter, with runc's state under the harness's runc root ...
            assert any((ctrd.root / "io.containerd.snapshotter.v1.overlayfs" / "snapshots").iterdir())
            assert any(ctrd.runc_root.iterdir())
            # ... and its streams served on loopback.
            container = rt.ListContainers(cri.ListContainersRequest(), timeout=30).containers[0]
            url = rt.Exec(cri.ExecRequest(container_id=container.id, cmd=["true"], stdout=True), timeout=30).url
            assert url.startswith("http://127.0.0.1:"), url


def test_close_leaves_nothing_behind(snapshot: Callable[[Path], Snapshot]) -> None:
    ctrd = Containerd()
    with ctrd:
        assert ctrd.workdir is not None
        workdir, slot, root = ctrd.workdir, ctrd.slot, ctrd.cgroup_root
        sandbox, _ = _run_pod(ctrd, "closed")
        # The pod's cgroup parent is real: containerd 1.6 answers pod stats only then.
        with ctrd.channel() as ch:
            stats = api_pb2_grpc.RuntimeServiceStub(ch).ListPodSandboxStats(cri.ListPodSandboxStatsRequest(),
                                                                          timeout=30).stats
        assert [s.attributes.id for s in stats] == [sandbox]
        assert _cgroups_under(root), "the pod made no cgroup under the harness's cgroup root"
        snap = snapshot(workdir)
        assert len(snap.procs) >= 4, snap.procs  # containerd, a shim, pause, sleep
        assert len(snap.net_namespaces) == 2, snap.net_namespaces  # the node's and the pod's
    left = _leftovers(workdir, slot, root, snap)
    assert _nothing(left), str(left)


def test_close_cleans_up_after_a_stopped_containerd_with_a_running_pod(snapshot: Callable[[Path], Snapshot]) -> None:
    ctrd = Containerd()
    with ctrd:
        assert ctrd.workdir is not None
        workdir, slot, root = ctrd.workdir, ctrd.slot, ctrd.cgroup_root
        _run_pod(ctrd, "orphaned")
        snap = snapshot(workdir)
        ctrd.stop()
        assert not ctrd.running
        # The pod outlives containerd, as on a real node: close() must not rely on it.
        assert _alive(snap.procs)
    left = _leftovers(workdir, slot, root, snap)
    assert _nothing(left), str(left)


_HOLDER = textwrap.dedent("""
    import time
    from shim.localfabric.containerd import Containerd
    from integration.localfabric.test_harness import _run_pod

    ctrd = Containerd()
    ctrd.open()
    _run_pod(ctrd, "abandoned")
    print(ctrd.workdir, ctrd.slot, flush=True)
    time.sleep(3600)
""")


def test_next_instance_on_the_slot_reaps_a_killed_holder(tmp_path: Path, snapshot: Callable[[Path], Snapshot]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(tmp_path / "holder.err", "w+b") as err:
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                  stderr=err, text=True)
        try:
            line = holder.stdout.readline()  # type: ignore[union-attr]
            err.seek(0)
            assert line, f"the holder died before its pod ran:\n{err.read().decode(errors='replace')[-3000:]}"
            workdir, slot = Path(line.split()[0]), int(line.split()[1])
            snap = snapshot(workdir)
            root = f"/weft-harness{slot}"
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
            holder.stdout.close()  # type: ignore[union-attr]

    # Killed outright, it left all of it behind.
    left = _leftovers(workdir, slot, root, snap)
    assert all(left.values()), str(left)

    with Containerd(slot=slot) as successor:
        assert successor.slot == slot and successor.workdir != workdir
        left = _leftovers(workdir, slot, root, snap, netns=False)  # the name weftnode<slot> is the successor's now
        assert _nothing(left), str(left)
        successor_dir = successor.workdir
    assert successor_dir is not None
    assert _nothing(_leftovers(successor_dir, slot, root, None))
