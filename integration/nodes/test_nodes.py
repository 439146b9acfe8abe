"""Nodes as kind boots them, without Docker: systemd as PID 1 of a Debian root under systemd-nspawn.

Two nodes booted once for the module: systemd reaches ``running`` in each, each sees only its own cgroups,
Debian's containerd runs a container as a unit inside one, a unit restarted from outside gets a new main
process, the nodes reach each other and the host over their bridge, and a reboot keeps the node's disk.
Throwaway nodes check that teardown leaves nothing: after a full boot, after a launch cut short, and after
a boot that failed.
"""

from __future__ import annotations

import ipaddress
import os
import select
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import fixture
from harness.nodes.nspawn import REGISTRY, Bridge, Node, NodeError, Root, boot, build_root, sweep_stale
from shim.localfabric import images
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

# Unique per run: a node's cgroups, links and namespace are named after it, machine-wide.
_RUN = uuid.uuid4().hex[:5]
_PONG_PORT = 7070


def _name(suffix: str) -> str:
    return f"n{_RUN}-{suffix}"


@pytest.fixture(scope="module")
def root(request: pytest.FixtureRequest) -> Root:
    first = build_root()
    warm = build_root()
    built = f"built now in {first.seconds:.0f} s" if first.built else f"cached, {first.seconds:.2f} s"
    fixture.report(request.config, f"node root: {built} (its build took {first.build_seconds:.0f} s); "
                                   f"warm {warm.seconds:.2f} s")
    return first


@pytest.fixture(scope="module")
def bridge(request: pytest.FixtureRequest) -> Iterator[Bridge]:
    swept = sweep_stale()
    if swept:
        fixture.report(request.config, f"nodes: removed what killed runs left: {swept}")
    with Bridge() as b:
        yield b


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("nodes")


@pytest.fixture(scope="module")
def nodes(request: pytest.FixtureRequest, root: Root, bridge: Bridge, workdir: Path) -> Iterator[tuple[Node, Node]]:
    booted: list[Node] = []
    try:
        for suffix in ("a", "b"):
            booted.append(boot(_name(suffix), root, workdir, bridge, timeout=120))
        fixture.report(request.config, "node boot to running: " + "; ".join(
            f"{n.name} {n.timings['running']:.2f} s (prepare {n.timings['prepare']:.2f} s, "
            f"PID 1 after {n.timings['pid1']:.2f} s)" for n in booted))
        yield booted[0], booted[1]
    finally:
        errors = []
        for n in booted:
            try:
                n.cleanup()
            except NodeError as exc:
                errors.append(str(exc))
        assert not errors, errors


def _traces(name: str, workdir: Path) -> list[str]:
    """What of a node is still on the machine, looked for without the node's own bookkeeping."""
    cgroup = f"weft-node-{name}"
    cg_root = Path("/sys/fs/cgroup")
    found = [str(p) for p in cg_root.glob(f"*/{cgroup}")]
    found += [str(p) for p in (cg_root / "memory").rglob(cgroup)] if (cg_root / "memory").is_dir() else []
    node_dir = str(workdir / name)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if f"--machine={name}" in argv or any(node_dir in a for a in argv):
            found.append(f"process {pid}: {' '.join(argv)}")
    found += [f"link {link}" for link in os.listdir("/sys/class/net") if name in link]
    found += [f"netns {ns}" for ns in (os.listdir("/run/netns") if os.path.isdir("/run/netns") else []) if name in ns]
    with open("/proc/self/mountinfo") as f:
        found += [f"mount {line.split()[4]}" for line in f if node_dir in line]
    if os.path.exists(node_dir):
        found.append(f"directory {node_dir}")
    if (REGISTRY / f"{name}.json").exists():
        found.append(f"registry entry {REGISTRY / f'{name}.json'}")
    return found


def _cgroup_paths(text: str) -> list[str]:
    """The paths of a /proc/PID/cgroup."""
    return [line.split(":", 2)[2] for line in text.splitlines() if line.strip()]


def test_systemd_runs_and_each_node_sees_only_its_own_cgroups(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    for node, other in ((a, b), (b, a)):
        state = node.run(["systemctl", "is-system-running"], check=False).stdout.strip()
        assert state == "running", f"{node.name}: {state}, failed units {node.failed_units}"
        # The node's PID 1, as the host and the node see it, is in the node's own groups in every hierarchy.
        for view in (Path(f"/proc/{node.pid1}/cgroup").read_text(), node.run(["cat", "/proc/1/cgroup"]).stdout):
            paths = _cgroup_paths(view)
            assert paths and all(node.cgroup in p and other.cgroup not in p for p in paths), view
        # What the node mounts at /sys/fs/cgroup/* is its own subtree of each hierarchy, nothing above it.
        mountinfo = node.run(["cat", "/proc/self/mountinfo"]).stdout.splitlines()
        cgroup_mounts = [line.split() for line in mountinfo if " - cgroup" in line]
        assert len(cgroup_mounts) == len(node.cgroups())
        assert all(node.cgroup in fields[3] for fields in cgroup_mounts), cgroup_mounts
        listing = node.run(["find", "/sys/fs/cgroup", "-maxdepth", "3", "-type", "d"]).stdout
        assert other.cgroup not in listing and "weft-node-" not in listing
        for group in node.cgroups():
            assert node.pid1 in {int(p) for d, _, _ in os.walk(group)
                                 for p in Path(d, "cgroup.procs").read_text().split()}, group


def test_containerd_runs_a_container_as_a_unit(nodes: tuple[Node, Node], tmp_path: Path) -> None:
    node = nodes[0]
    node.systemctl("start", "containerd.service")
    assert node.systemctl("is-active", "containerd.service").stdout.strip() == "active"
    archive = images.build_archive(images.ImageSpec(images.BUSYBOX_IMAGE, ("sh",)), tmp_path / "busybox.tar")
    node.path("/root/images").mkdir(parents=True, exist_ok=True)
    shutil.copy(archive, node.path("/root/images/busybox.tar"))
    node.run(["ctr", "-n", "k8s.io", "images", "import", "/root/images/busybox.tar"])

    out = node.run(["ctr", "-n", "k8s.io", "run", "--rm", images.BUSYBOX_IMAGE, "weft-once",
                    "sh", "-c", "echo hello from a container in $0", node.name]).stdout
    assert out.strip() == f"hello from a container in {node.name}"

    # A container that stays: runc put it in a group under the node's own, in every hierarchy.
    node.run(["ctr", "-n", "k8s.io", "run", "-d", images.BUSYBOX_IMAGE, "weft-stays", "sleep", "300"])
    try:
        tasks = node.run(["ctr", "-n", "k8s.io", "tasks", "ls"]).stdout
        assert "weft-stays" in tasks and "RUNNING" in tasks, tasks
        for group in node.cgroups():
            found = [d for d, _, _ in os.walk(group) if d.endswith("/weft-stays")]
            assert found, f"no group of the container under {group}"
    finally:
        node.run(["ctr", "-n", "k8s.io", "tasks", "kill", "-s", "KILL", "weft-stays"], check=False)
        wait_for(lambda: "RUNNING" not in node.run(["ctr", "-n", "k8s.io", "tasks", "ls"]).stdout,
                 timeout=30, what="the container to stop")
        node.run(["ctr", "-n", "k8s.io", "tasks", "rm", "weft-stays"], check=False)
        node.run(["ctr", "-n", "k8s.io", "containers", "rm", "weft-stays"], check=False)


def _main_pid(node: Node, unit: str) -> int:
    return int(node.systemctl("show", "--property=MainPID", "--value", unit).stdout.strip())


def test_a_unit_restarted_from_outside_gets_a_new_main_process(nodes: tuple[Node, Node]) -> None:
    node = nodes[1]
    node.systemctl("start", "containerd.service")
    before = _main_pid(node, "containerd.service")
    assert before > 0
    # The node's PID 1 from outside, as a DaemonSet's privileged container in the host PID namespace would.
    subprocess.run(["nsenter", "-t", str(node.pid1), "-m", "-p", "--", "systemctl", "restart", "containerd.service"],
                   check=True, capture_output=True, timeout=60)
    after = _main_pid(node, "containerd.service")
    assert after > 0 and after != before
    assert node.systemctl("is-active", "containerd.service").stdout.strip() == "active"


def _busybox_in(node: Node) -> None:
    """busybox-static in the node (ping and nc; the node root has neither)."""
    dest = node.path("/usr/local/bin/busybox")
    if not dest.exists():
        shutil.copy(images.BUSYBOX, dest)


def test_nodes_reach_each_other_and_the_host(nodes: tuple[Node, Node], bridge: Bridge) -> None:
    a, b = nodes
    for node in nodes:
        _busybox_in(node)
    for src, dst in ((a, b), (b, a)):
        node_ping = src.run(["busybox", "ping", "-c", "1", "-W", "5", dst.address], check=False)
        assert node_ping.returncode == 0, node_ping.stdout + node_ping.stderr
    assert a.run(["busybox", "ping", "-c", "1", "-W", "5", str(bridge.gateway)], check=False).returncode == 0
    for node in nodes:
        host_ping = subprocess.run([str(images.BUSYBOX), "ping", "-c", "1", "-W", "5", node.address],
                                   capture_output=True, text=True, timeout=30)
        assert host_ping.returncode == 0, host_ping.stdout + host_ping.stderr

    # TCP: a listener run as a unit in b answers a and the host.
    b.path("/usr/local/bin/weft-pong").write_text('#!/bin/sh\necho "pong from $(hostname)"\n')
    b.path("/usr/local/bin/weft-pong").chmod(0o755)
    b.run(["systemd-run", "--unit=weft-pong", "busybox", "nc", "-ll", "-p", str(_PONG_PORT),
           "-e", "/usr/local/bin/weft-pong"])
    try:
        def answer_to_host() -> str:
            try:
                with socket.create_connection((b.address, _PONG_PORT), timeout=5) as s:
                    return s.makefile().readline().strip()
            except OSError:
                return ""

        assert wait_for(answer_to_host, timeout=30, what="b's listener") == f"pong from {b.name}"
        out = a.run(["busybox", "nc", "-w", "5", b.address, str(_PONG_PORT)]).stdout
        assert out.strip() == f"pong from {b.name}"
    finally:
        b.systemctl("stop", "weft-pong.service", check=False)


def test_a_reboot_keeps_the_disk(request: pytest.FixtureRequest, nodes: tuple[Node, Node]) -> None:
    node = nodes[1]
    token = uuid.uuid4().hex
    node.run(["sh", "-c", f"mkdir -p /var/lib/weft-test && echo {token} > /var/lib/weft-test/marker"])
    machine_id = node.run(["cat", "/etc/machine-id"]).stdout
    pid1_before = node.pid1
    state = node.boot_again(timeout=120)
    assert state == "running", node.failed_units
    assert node.clean_stop, f"systemd did not power off cleanly: {node.log_tail()}"
    assert node.pid1 != pid1_before
    assert node.run(["cat", "/var/lib/weft-test/marker"]).stdout.strip() == token
    assert node.run(["cat", "/etc/machine-id"]).stdout == machine_id
    assert node.systemctl("is-active", "containerd.service", check=False).stdout.strip() == "inactive"
    fixture.report(request.config, f"node reboot: poweroff {node.timings['reboot_stop']:.2f} s, "
                                   f"boot to running {node.timings['reboot_running']:.2f} s")


def test_teardown_after_a_boot_leaves_nothing(request: pytest.FixtureRequest, root: Root, bridge: Bridge,
                                              workdir: Path) -> None:
    node = boot(_name("c"), root, workdir, bridge, timeout=120)
    try:
        present = _traces(node.name, workdir)
        assert any(t.startswith("link ") for t in present) and any("/pids/" in t for t in present), present
        node.run(["systemctl", "start", "containerd.service"])  # groups and processes of its own under the node's
    finally:
        started = time.monotonic()
        node.cleanup()
        seconds = time.monotonic() - started
    assert node.leftovers() == []
    assert _traces(node.name, workdir) == []
    node.cleanup()  # twice is harmless
    fixture.report(request.config, f"node teardown after a boot: {seconds:.2f} s "
                                   f"(booted to running in {node.timings['running']:.2f} s)")


@pytest.mark.parametrize("after", [0.0, 0.3], ids=["at-launch", "mid-boot"])
def test_teardown_of_a_launch_cut_short_leaves_nothing(root: Root, bridge: Bridge, workdir: Path,
                                                       after: float) -> None:
    node = Node(_name(f"d{int(after * 10)}"), root.path, workdir, bridge)
    try:
        node.prepare()
        node.launch(wait=False)
        time.sleep(after)
    finally:
        node.cleanup()
    assert node.leftovers() == []
    assert _traces(node.name, workdir) == []


def test_a_node_on_a_full_copy_boots_and_leaves_nothing(request: pytest.FixtureRequest, root: Root, bridge: Bridge,
                                                        workdir: Path) -> None:
    """Where overlayfs does not mount, each node gets a copy of the root: that node boots as well."""
    node = Node(_name("f"), root.path, workdir, bridge, overlay=False)
    try:
        node.prepare()
        node.launch()
        assert node.wait_running(120) == "running", node.failed_units
        assert not os.path.ismount(node.merged)
    finally:
        node.cleanup()
    assert _traces(node.name, workdir) == []
    fixture.report(request.config, f"node on a full copy of the root: copy {node.timings['prepare']:.1f} s, "
                                   f"boot to running {node.timings['running']:.2f} s")


def test_a_boot_that_fails_leaves_nothing(root: Root, bridge: Bridge, workdir: Path) -> None:
    name = _name("e")
    with pytest.raises(NodeError, match="not running after"):
        boot(name, root, workdir, bridge, timeout=0)
    assert _traces(name, workdir) == []


def test_a_node_whose_owner_was_killed_is_swept(root: Root, bridge: Bridge, workdir: Path) -> None:
    """A run killed before its teardown leaves its nodes running; the next run's sweep removes them."""
    name, bridge_name = _name("k"), f"wb{_RUN}"
    subnet = ipaddress.ip_network((int(bridge.network.network_address) + bridge.network.num_addresses,
                                   bridge.network.prefixlen))
    code = ("import sys, time\n"
            "from pathlib import Path\n"
            "from harness.nodes.nspawn import Bridge, boot\n"
            f"node = boot({name!r}, Path({str(root.path)!r}), Path({str(workdir)!r}), "
            f"Bridge({bridge_name!r}, {str(subnet)!r}), timeout=120)\n"
            "print(node.pid1, flush=True)\n"
            "time.sleep(600)\n")
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=repo, env=env, stdout=subprocess.PIPE, text=True)
    swept: list[str] = []
    try:
        try:
            assert owner.stdout is not None
            ready, _, _ = select.select([owner.stdout], [], [], 180)
            line = owner.stdout.readline().strip() if ready else ""
            assert line.isdigit(), "the owner did not boot its node"
        finally:
            owner.kill()
            owner.wait()
            if owner.stdout is not None:
                owner.stdout.close()
        assert Path(f"/proc/{line}").exists() and _traces(name, workdir)  # the node outlived its owner
        swept = sweep_stale()
    finally:
        swept += sweep_stale()  # whatever the assertions above cut short
    assert name in swept and bridge_name in swept, swept
    assert _traces(name, workdir) == []
    assert not Path("/sys/class/net", bridge_name).exists()
    assert sweep_stale() == []
