"""Day one on a real cluster: weft installed from its image and manifests onto nodes run by systemd, and
backed out, as a platform team does it.

The cluster (``harness/nodes/cluster.py``): the control plane on this machine (etcd, kube-apiserver,
kube-scheduler, kube-controller-manager with a cluster's workload controllers), three nodes booted with
systemd under systemd-nspawn and laid out as kubeadm lays out workers (containerd and kubelet as units,
the kubelet's own client certificate), Debian's containerd 1.6 on ``cpu-1`` and 2.4 on ``gpu-1`` and
``cpu-2``, a flat pod network, and a registry the nodes pull from. The user's steps, as
``docs/operations.md`` gives them: the image built with ``python -m nodeimage.build --base
debian-packages`` and pushed; ``kubectl apply -k`` of an overlay that only names it; the mesh CA Secret;
then, to back out, ``kubectl apply -k`` of the back-out overlay, its rollout, ``kubectl delete -k`` and
the nodes' CSRs (or the same through the Helm chart, in the power-cut test).

Day two, on weft installed once (``on_weft``): a rolling upgrade to a second image and back while a
rerouted stage runs, a CPU host's and the GPU node's reboot through their systemd, and an upgrade to an
image that cannot start, which stops at its first node and rolls back.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness import binaries, fixture
from harness.nodes import nspawn
from harness.nodes.cluster import Cluster
from harness.nodes.kubeadm import NodeSpec
from integration.nodes.conftest import OUTCOME
from nodeimage import build
from shim.install import containerd as ctrd_config
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NODES = [NodeSpec("gpu-1", "gpu", "2", "10.245.1.0/24"), NodeSpec("cpu-1", "cpu", "1.6", "10.245.2.0/24"),
         NodeSpec("cpu-2", "cpu", "2", "10.245.3.0/24")]
# The host files weft install changes, to be given back byte for byte.
HOST_FILES = ("/etc/containerd/config.toml", "/var/lib/kubelet/config.yaml", "/var/lib/kubelet/kubeadm-flags.env")
# What weft leaves on a node while installed, and must not after the back-out.
WEFT_PATHS = ("/opt/weft", "/etc/weft", "/var/lib/weft", "/etc/systemd/system/weft-agent.service",
              "/etc/containerd/weft")
TAG = "0.1.0-test"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("day-one"), NODES)
    try:
        c.up()
        t = time.monotonic()
        image = build.build(c.workdir / "image", base="debian-packages")
        assert c.registry is not None
        c.registry.push(image.archive, f"weft/node:{TAG}")
        c.timings["image built and pushed"] = time.monotonic() - t
        fixture.report(request.config, "day one: cluster up in " + ", ".join(
            f"{k} {v:.1f} s" for k, v in c.timings.items()))
        yield c
    finally:
        left = c.down()
        assert not left, f"the cluster left: {left}"


def _overlay(c: Cluster, name: str, base: Path) -> Path:
    """The user's overlay of ``base``: it names the registry's image, nothing else."""
    assert c.registry is not None
    where = c.workdir / name
    where.mkdir(exist_ok=True)
    (where / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(base, where)}\n"
        f"images:\n  - name: localhost/weft/node\n    newName: {c.registry.host}/weft/node\n    newTag: {TAG}\n")
    return where


def _pod(c: Cluster, name: str, node: str, runtime_class: str | None = None) -> None:
    assert c.registry is not None
    spec: dict = {"nodeName": node, "terminationGracePeriodSeconds": 1, "containers": [{
        "name": "main", "image": f"{c.registry.host}/weft-test/busybox:1",
        "command": ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "32Mi"}}}]}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    c.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Pod",
                                                     "metadata": {"name": name, "namespace": "default"},
                                                     "spec": spec}))


def _containers(c: Cluster, names: list[str], timeout: float = 120) -> dict[str, tuple[str, int]]:
    """Each pod's container ID and restart count, once all run."""
    deadline = time.monotonic() + timeout
    while True:
        items = json.loads(c.kubectl("get", "pods", "-n", "default", "-o", "json").stdout)["items"]
        found = {p["metadata"]["name"]: p["status"].get("containerStatuses", [{}])[0] for p in items}
        running = {n: (s["containerID"], s["restartCount"]) for n, s in found.items()
                   if n in names and s.get("state", {}).get("running")}
        if len(running) == len(names):
            return running
        if time.monotonic() > deadline:
            raise AssertionError(f"pods not running within {timeout:g}s: {found}")
        time.sleep(1)


# The two-stage pod (integration/kube/test_kube_reroute.py has the whole of it): ``model`` holds a GPU lease on the
# GPU node, ``prep`` is a CPU stage weft reroutes to a CPU node; the pod is Ready through prep's HTTP probe.
MODEL = ('echo "model up on GPU ${NVIDIA_VISIBLE_DEVICES:-none}"; mkdir -p /www; echo model-says-hi > /www/index.html; '
         "exec httpd -f -p 9090 -h /www")
PREP = "echo prep starting; mkdir -p /www; echo prep-says-hi > /www/index.html; exec httpd -f -p 8080 -h /www"


def _two_stage(c: Cluster, name: str, runtime_class: str | None, prep: str = PREP) -> None:
    assert c.registry is not None
    image = f"{c.registry.host}/weft-test/busybox:1"

    def stage(stage_name: str, script: str, port: int, **extra: object) -> dict:
        return {"name": stage_name, "image": image, "command": ["sh", "-c", script],
                "ports": [{"containerPort": port}],
                "readinessProbe": {"httpGet": {"path": "/index.html", "port": port}, "periodSeconds": 1}, **extra}

    spec: dict = {"nodeSelector": {"weft.io/role": "gpu"}, "terminationGracePeriodSeconds": 2, "containers": [
        stage("model", MODEL, 9090, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
        stage("prep", prep, 8080, resources={"requests": {"cpu": "100m", "memory": "32Mi"},
                                             "limits": {"cpu": "500m", "memory": "64Mi"}})]}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    c.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": "default", "labels": {"app": name},
        "annotations": {"weft.io/gpu-memory.model": "20Gi", "weft.io/gpu-compute.model": "50"}}, "spec": spec}))


def _time_to_ready(c: Cluster, name: str, runtime_class: str | None, timeout: float = 180) -> float:
    t = time.monotonic()
    _two_stage(c, name, runtime_class)
    res = c.kubectl("wait", "--for=condition=Ready", f"pod/{name}", f"--timeout={int(timeout)}s", check=False,
                    timeout=timeout + 30)
    if res.returncode != 0:
        described = c.kubectl("describe", "pod", name, check=False).stdout
        raise AssertionError(f"{name} not Ready within {timeout:g}s: {res.stderr}\n{described}")
    return time.monotonic() - t


def _crictl(c: Cluster, node: str, *args: str) -> dict:
    """What the node's containerd itself says (crictl on the node, at containerd's socket: not through weft)."""
    return json.loads(c.nodes[node].run(["crictl", args[0], "-o", "json", *args[1:]]).stdout)  # flags before IDs


def _said_by_weft(c: Cluster, node: str) -> str:
    """What a person asks first when a stage is not where it should be: ``weft status`` and the agent's log."""
    status = c.nodes[node].run(["/opt/weft/bin/weft", "status", "--socket", "/run/weft/cri.sock"], check=False)
    log = c.nodes[node].run(["journalctl", "-u", "weft-agent.service", "-o", "cat", "--no-pager", "-n", "60"],
                            check=False)
    return f"weft status on {node}:\n{status.stdout}{status.stderr}\nits agent's log:\n{log.stdout}"


def _use(c: Cluster) -> tuple[float, float]:
    """The two-stage pod on weft, and the same pod plain beside it: (time to Ready opted in, plain)."""
    plain = _time_to_ready(c, "two-stage-plain", None)
    opted_in = _time_to_ready(c, "two-stage", "weft")
    # model runs on the GPU node under a lease of its simulated GPUs; prep does not run there.
    on_gpu = {x["metadata"]["name"]: x for x in _crictl(c, "gpu-1", "ps", "--label",
                                                          "io.kubernetes.pod.name=two-stage")["containers"]}
    assert set(on_gpu) == {"model"}, _said_by_weft(c, "gpu-1")
    status = json.loads(c.nodes["gpu-1"].run(["/opt/weft/bin/weft", "status", "--json", "--socket",
                                              "/run/weft/cri.sock"]).stdout)
    (lease,) = [x for x in status["leases"] if x["container_id"] == on_gpu["model"]["id"]]
    assert lease["state"] == "bound", lease
    assert f"model up on GPU {lease['devices'][0]}" in c.kubectl("logs", "two-stage", "-c", "model").stdout
    # prep runs on a CPU node, started by that node's containerd for gpu-1's agent, and only there.
    shadows = {n: [x for x in _crictl(c, n, "ps", "--label", "weft.io/origin-node=gpu-1")["containers"]
                   if x["metadata"]["name"] == "prep"] for n in ("cpu-1", "cpu-2")}
    (host,) = [n for n, found in shadows.items() if found]
    assert len(shadows[host]) == 1, shadows
    # Its reservation, where a cluster user sees it.
    reservations = json.loads(c.kubectl("get", "pods", "-A", "-l", "weft.io/role=hosted-stage",
                                        "-o", "json").stdout)["items"]
    assert [(r["spec"]["nodeName"], r["metadata"]["labels"]["weft.io/origin-pod"], r["status"]["phase"])
            for r in reservations] == [(host, "two-stage", "Running")], reservations
    # kubectl logs, exec and port-forward on the rerouted stage, and the stages reach each other on localhost.
    assert "prep starting" in c.kubectl("logs", "two-stage", "-c", "prep").stdout
    assert c.kubectl("exec", "two-stage", "-c", "prep", "--", "cat", "/www/index.html").stdout.strip() == \
        "prep-says-hi"
    assert c.kubectl("exec", "two-stage", "-c", "model", "--", "wget", "-qO-",
                     "http://localhost:8080/index.html").stdout.strip() == "prep-says-hi"
    assert c.kubectl("exec", "two-stage", "-c", "prep", "--", "wget", "-qO-",
                     "http://localhost:9090/index.html").stdout.strip() == "model-says-hi"
    assert _port_forwarded(c, "pod/two-stage", 8080) == "prep-says-hi"
    # The plain pod beside it: every stage on the GPU node, on containerd's runc handler, as if weft were not there.
    (sandbox,) = _crictl(c, "gpu-1", "pods", "--name", "^two-stage-plain$", "--state", "ready")["items"]
    assert sandbox["runtimeHandler"] == "", sandbox  # containerd's default runtime
    stages = {x["metadata"]["name"]: x["id"] for x in _crictl(c, "gpu-1", "ps", "--pod", sandbox["id"])["containers"]}
    assert set(stages) == {"model", "prep"}
    for cid in stages.values():
        inspected = _crictl(c, "gpu-1", "inspect", cid)
        assert inspected["info"]["runtimeType"] == "io.containerd.runc.v2", inspected["info"]
    (ours,) = _crictl(c, "gpu-1", "pods", "--name", "^two-stage$", "--state", "ready")["items"]
    assert ours["runtimeHandler"] == "weft"
    c.kubectl("delete", "pod", "two-stage", "two-stage-plain", "--wait=true", timeout=180)
    deadline = time.monotonic() + 120
    while c.kubectl("get", "pods", "-A", "-l", "weft.io/role=hosted-stage", "-o", "name").stdout.strip() or \
            _crictl(c, host, "ps", "-a", "--label", "weft.io/origin-node=gpu-1")["containers"]:
        assert time.monotonic() < deadline, "the rerouted stage or its reservation outlived the pod"
        time.sleep(1)
    return opted_in, plain


def _port_forwarded(c: Cluster, target: str, port: int, timeout: float = 30) -> str:
    """The page at ``port`` of ``target`` through ``kubectl port-forward`` (kubelet's streaming, on the node)."""
    assert c.control is not None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local = s.getsockname()[1]
    forward = subprocess.Popen(c.control.kubectl_argv("port-forward", target, f"{local}:{port}"),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{local}/index.html", timeout=5) as r:
                    return r.read().decode().strip()
            except OSError:
                assert forward.poll() is None and time.monotonic() < deadline, "kubectl port-forward did not serve"
                time.sleep(0.5)
    finally:
        forward.kill()
        forward.wait()


def _host_files(c: Cluster) -> dict[str, dict[str, bytes]]:
    return {n: {f: node.path(f).read_bytes() for f in HOST_FILES} for n, node in c.nodes.items()}


def _down_intervals(c: Cluster, node: str, since: float, unit: str) -> list[tuple[float, float]]:
    """When the node's ``unit`` was down since ``since``: systemd's journal, from each stop it began to the
    start that followed (the nodes share this machine's clock)."""
    out = c.nodes[node].run(["journalctl", "-u", unit, "-o", "short-unix", "--no-pager",
                             f"--since=@{int(since)}"]).stdout
    down, stopping = [], None
    for line in out.splitlines():
        stamp, _, text = line.partition(" ")
        if f"Stopping {unit}" in text:
            stopping = float(stamp)
        elif f"Started {unit}" in text and stopping is not None:
            down.append((stopping, float(stamp)))
            stopping = None
    return down


def _kubelet_down_s(c: Cluster, node: str, since: float, unit: str = "kubelet.service") -> float:
    """How long the node's kubelet (or ``unit``) was down across its restarts since ``since``."""
    return sum(end - start for start, end in _down_intervals(c, node, since, unit))


def _rolled_out(c: Cluster, timeout: float = 300) -> float:
    t = time.monotonic()
    res = c.kubectl("-n", "weft-system", "rollout", "status", "daemonset/weft", f"--timeout={int(timeout)}s",
                    check=False, timeout=timeout + 30)
    if res.returncode != 0:
        pods = c.kubectl("-n", "weft-system", "get", "pods", "-o", "wide", check=False).stdout
        logs = c.kubectl("-n", "weft-system", "logs", "daemonset/weft", "--all-containers", "--tail=30",
                         check=False).stdout
        raise AssertionError(f"the DaemonSet did not roll out: {res.stdout}{res.stderr}\n{pods}\n{logs}")
    return time.monotonic() - t


def _helm(c: Cluster, *args: str, check: bool = True) -> str:
    assert c.control is not None
    res = subprocess.run([binaries.helm(), *args, "--kubeconfig", str(c.control.kubeconfig("admin"))],
                         capture_output=True, text=True, timeout=300)
    if not check:
        return res.stdout + res.stderr if res.returncode else ""
    assert res.returncode == 0, f"helm {' '.join(args)}: {res.stdout}\n{res.stderr}"
    return res.stdout


CHART = REPO / "charts" / "weft"


def _chart_version() -> str:
    for line in (CHART / "Chart.yaml").read_text().splitlines():
        if line.startswith("version:"):
            return line.split(":", 1)[1].strip().strip('"')
    raise AssertionError("charts/weft/Chart.yaml names no version")


def _chart_in_registry(c: Cluster) -> str:
    """The chart as a platform team takes it: packaged and pushed to a registry (the cluster's, plain HTTP),
    installed from there by its oci:// reference. Returns that reference."""
    assert c.registry is not None
    out = c.workdir / "chart"
    out.mkdir(exist_ok=True)
    _helm(c, "package", str(CHART), "--destination", str(out))
    _helm(c, "push", str(out / f"weft-{_chart_version()}.tgz"), f"oci://{c.registry.host}/charts", "--plain-http")
    return f"oci://{c.registry.host}/charts/weft"


def _install(c: Cluster, before_secret: Callable[[], None] = lambda: None, via: str = "kustomize") -> None:
    """As docs/operations.md says: the manifests through an overlay naming the image (or the chart, with the
    image in its values), then the mesh CA Secret."""
    assert c.registry is not None
    if via == "helm":
        chart = _chart_in_registry(c)
        # A version the registry does not hold: refused, saying which, and nothing installed.
        said = _helm(c, "install", "weft", chart, "--version", "9.9.9", "--plain-http", check=False)
        assert "9.9.9" in said and "not found" in said, said
        assert "weft" not in _helm(c, "list", "-A", "-q").split()
        _helm(c, "install", "weft", chart, "--version", _chart_version(), "--plain-http",
              "--set", f"image.registry={c.registry.host}", "--set", f"image.tag={TAG}")
    else:
        c.kubectl("apply", "-k", str(_overlay(c, "install", REPO / "nodeimage" / "manifests")))
    before_secret()
    ca = c.workdir / "mesh-ca"
    if not (ca / "ca.key").exists():
        subprocess.run([sys.executable, "-m", "shim", "mesh-signer", "--init-ca", "--ca-dir", str(ca)], check=True,
                       capture_output=True, timeout=60)
    c.kubectl("-n", "weft-system", "create", "secret", "generic", "weft-mesh-ca",
              f"--from-file=ca.crt={ca / 'ca.crt'}", f"--from-file=ca.key={ca / 'ca.key'}")


def _back_out(c: Cluster, via: str = "kustomize") -> None:
    if via == "helm":
        assert c.registry is not None
        _helm(c, "upgrade", "weft", f"oci://{c.registry.host}/charts/weft", "--version", _chart_version(),
              "--plain-http", "--reuse-values", "--set", "backout=true")
    else:
        c.kubectl("apply", "-k", str(_overlay(c, "backout", REPO / "nodeimage" / "backout")))
    _rolled_out(c)


def _remove_manifests(c: Cluster, via: str = "kustomize") -> None:
    """The back-out's last steps, as nodeimage/backout (or the chart's notes) say; then nothing of weft is left
    in the cluster."""
    if via == "helm":
        _helm(c, "uninstall", "weft", "--wait", "--timeout", "300s")
        assert "weft" not in _helm(c, "list", "-A", "-q").split()
    else:
        c.kubectl("delete", "-k", str(c.workdir / "backout"), "--wait=true", timeout=300)
    c.kubectl("delete", "csr", "--field-selector", "spec.signerName=weft.io/mesh")
    left = c.kubectl("get", "namespaces,clusterroles,clusterrolebindings,runtimeclasses,csr", "-A", "-o", "name",
                     "-l", "app.kubernetes.io/name=weft").stdout.split()
    left += c.kubectl("get", "namespace", "weft-system", "--ignore-not-found", "-o", "name").stdout.split()
    left += c.kubectl("get", "csr", "-o", "name").stdout.split()
    assert not left, f"left of weft after the back-out: {left}"


def test_weft_installs_from_its_image_and_manifests_onto_every_node_and_backs_out_in_one_step(
        cluster: Cluster, request: pytest.FixtureRequest) -> None:
    c = cluster
    names = [f"before-{s.name}" for s in NODES]
    for spec, name in zip(NODES, names, strict=True):
        _pod(c, name, spec.name)
    before_pods = _containers(c, names)
    before_files = _host_files(c)
    started = time.time()
    # gpu-1 has no NVIDIA device, and the nodes share this machine: the platform team says which broker gpu-1
    # gets and what the CPU nodes offer, as docs/operations.md shows (measured, each would see the whole
    # machine's load).
    c.kubectl("label", "node", "gpu-1", "weft.io/broker=simulated", "weft.io/simulated-devices=2x80Gi",
              "--overwrite")
    c.kubectl("label", "node", "cpu-1", "cpu-2", "weft.io/fixed-capacity=2_4Gi", "--overwrite")

    # Install, as the docs say: the overlay, then the mesh CA Secret into the namespace it made.
    t = time.monotonic()

    def waits_for_the_ca() -> None:
        """Until the CA Secret is there, the signer's pods wait to mount it and say so, and no node is touched."""
        deadline = time.monotonic() + 90
        while not any("weft-mesh-ca" in e["message"] for e in json.loads(c.kubectl(
                "-n", "weft-system", "get", "events", "--field-selector", "reason=FailedMount", "-o", "json",
        ).stdout)["items"]):
            assert time.monotonic() < deadline, "the signer's pods did not say that the CA Secret is missing"
            time.sleep(1)
        assert _host_files(c) == before_files
        assert not [n for n, node in c.nodes.items() if node.path("/opt/weft").exists()]

    _install(c, waits_for_the_ca)
    _rolled_out(c)
    switched = time.monotonic() - t
    for name, node in c.nodes.items():
        flags = node.path("/var/lib/kubelet/kubeadm-flags.env").read_text()
        assert "--container-runtime-endpoint=unix:///run/weft/cri.sock" in flags, (name, flags)
        assert node.systemctl("is-active", "weft-agent.service", "kubelet.service").stdout.split() == [
            "active", "active"], name
    # Each node's mesh certificate was asked for with its kubelet's own credentials and signed.
    csrs = json.loads(c.kubectl("get", "csr", "-o", "json").stdout)["items"]
    issued = {r["spec"]["username"] for r in csrs if r["spec"]["signerName"] == "weft.io/mesh"
              and r.get("status", {}).get("certificate")}
    assert issued == {f"system:node:{s.name}" for s in NODES}
    c.wait_ready(list(c.nodes), 60)
    downtime = {n: _kubelet_down_s(c, n, started) for n in c.nodes}
    assert _containers(c, names) == before_pods, "a pod from before the install lost its container"

    # Use, on weft: an opted-in pod runs; the two-stage pod, its CPU stage rerouted; the plain ones untouched.
    _pod(c, "opted-in", "gpu-1", runtime_class="weft")
    _containers(c, [*names, "opted-in"])
    opted_in, plain = _use(c)

    # Back out in one step, then take the manifests away.
    t = time.monotonic()
    _back_out(c)
    backed_out = time.monotonic() - t
    assert _host_files(c) == before_files, "containerd's and kubelet's files are not as before the install"
    for name, node in c.nodes.items():
        assert [p for p in WEFT_PATHS if node.path(p).exists()] == [], name
        assert node.systemctl("is-active", "kubelet.service").stdout.strip() == "active"
    c.wait_ready(list(c.nodes), 60)
    after = _containers(c, [*names, "opted-in"])
    assert {n: after[n] for n in names} == before_pods, "a pod from before the install lost its container"
    _remove_manifests(c)
    c.kubectl("delete", "pod", *names, "opted-in", "--wait=true", timeout=180)

    fixture.report(request.config, f"day one: kubectl apply to every node switched {switched:.1f} s; kubelet down "
                   + ", ".join(f"{n} {s:.1f} s" for n, s in sorted(downtime.items()))
                   + f"; back-out rolled out in {backed_out:.1f} s; containers restarted by install and back-out: "
                   f"{sum(after[n][1] for n in names)}; the two-stage pod Ready in {opted_in:.1f} s opted in "
                   f"(CPU stage rerouted), {plain:.1f} s plain")


def test_a_node_weft_cannot_take_says_why_on_its_pod_and_is_left_as_it_was(cluster: Cluster) -> None:
    """cpu-2's containerd reads an import that imports another file, which the installer does not follow: its
    pod says so (an Event and its last message), its files stay, its kubelet is never restarted, and the other
    nodes install as usual."""
    c = cluster
    node = c.nodes["cpu-2"]
    config = node.path("/etc/containerd/config.toml")
    original = config.read_bytes()
    node.path("/etc/containerd/conf.d").mkdir(exist_ok=True)
    node.path("/etc/containerd/conf.d/10-site.toml").write_text(
        'version = 3\nimports = ["/etc/containerd/conf.d/20-more.toml"]\n')
    node.path("/etc/containerd/conf.d/20-more.toml").write_text("version = 3\n")
    config.write_text(original.decode().replace("version = 3\n", 'version = 3\nimports = '
                                                '["/etc/containerd/conf.d/10-site.toml"]\n', 1))
    backed_out = False
    try:
        node.systemctl("restart", "containerd.service")  # containerd itself takes it
        before = {f: node.path(f).read_bytes() for f in HOST_FILES}
        kubelet_pid = node.systemctl("show", "-p", "MainPID", "--value", "kubelet.service").stdout.strip()
        _install(c)

        def pod_on(name: str) -> dict:
            """The DaemonSet's pod on the node; an empty one until the controller has made it."""
            pods = json.loads(c.kubectl("-n", "weft-system", "get", "pods", "-l",
                                        "app.kubernetes.io/component=node", "-o", "json").stdout)["items"]
            found = [p for p in pods if p["spec"].get("nodeName") == name]
            assert len(found) <= 1, f"{len(found)} of the DaemonSet's pods on {name}"
            return found[0] if found else {"status": {}}

        deadline = time.monotonic() + 240
        while True:
            refused = pod_on("cpu-2")
            statuses = refused["status"].get("initContainerStatuses", [])
            install = [s for s in statuses if s["name"] == "install"]
            others_ready = all(any(cond["type"] == "Ready" and cond["status"] == "True"
                                   for cond in pod_on(n)["status"].get("conditions", [])) for n in ("gpu-1", "cpu-1"))
            if others_ready and install and install[0]["restartCount"] >= 1:
                break
            assert time.monotonic() < deadline, f"cpu-2's install was not tried twice, or the others not Ready: " \
                                                f"{statuses}"
            time.sleep(2)
        described = c.kubectl("-n", "weft-system", "describe", "pod", refused["metadata"]["name"]).stdout
        assert "WeftInstallRefused" in described and "its own `imports` is not supported" in described, described
        last = install[0]["lastState"]["terminated"]
        assert last["exitCode"] == 2 and "nothing was changed" in last["message"], last
        assert {f: node.path(f).read_bytes() for f in HOST_FILES} == before
        assert node.systemctl("show", "-p", "MainPID", "--value", "kubelet.service").stdout.strip() == kubelet_pid
        assert not node.path("/opt/weft").exists()
        _back_out(c)
        _remove_manifests(c)
        backed_out = True
        assert {f: node.path(f).read_bytes() for f in HOST_FILES} == before
    finally:
        if not backed_out:  # the cluster's next tests start from no weft; this test's own failure is the one told
            with contextlib.suppress(Exception):
                _back_out(c)
                _remove_manifests(c)
        config.write_bytes(original)
        for name in ("10-site.toml", "20-more.toml"):
            node.path(f"/etc/containerd/conf.d/{name}").unlink(missing_ok=True)
        node.systemctl("restart", "containerd.service", check=False)


def test_a_node_that_goes_down_during_its_install_finishes_it_when_it_boots_again(
        cluster: Cluster, request: pytest.FixtureRequest) -> None:
    """cpu-1's power is cut the moment its kubelet is switched (the kubelet-restart step): booted again, its
    units bring containerd, weft and kubelet back, the DaemonSet's pod runs the installer again, which finishes
    the journal's install, and says so; the node is Ready on weft. Installed, backed out and uninstalled with
    Helm, the chart packaged and pushed to the cluster's registry and installed from there
    (``helm install weft oci://REGISTRY/charts/weft --version X``), as docs/operations.md gives it."""
    c = cluster
    node = c.nodes["cpu-1"]
    flags = node.path("/var/lib/kubelet/kubeadm-flags.env")
    before_files = _host_files(c)
    _install(c, via="helm")
    deadline = time.monotonic() + 240
    while "weft/cri.sock" not in flags.read_text():
        assert time.monotonic() < deadline, "cpu-1's kubelet was never switched"
        time.sleep(0.05)
    cut = time.monotonic()
    node.boot_again(stop_timeout=0)  # the power cut: SIGKILL for everything at once
    _rolled_out(c)
    back = time.monotonic() - cut
    c.wait_ready(list(c.nodes), 120)
    assert node.systemctl("is-active", "weft-agent.service", "kubelet.service").stdout.split() == [
        "active", "active"]
    assert "--container-runtime-endpoint=unix:///run/weft/cri.sock" in flags.read_text()
    pod = next(p for p in json.loads(c.kubectl("-n", "weft-system", "get", "pods", "-l",
                                           "app.kubernetes.io/component=node", "-o", "json").stdout)["items"]
           if p["spec"]["nodeName"] == "cpu-1")["metadata"]["name"]
    said = c.kubectl("-n", "weft-system", "logs", pod, "-c", "install").stdout
    assert "installed: kubelet -> weft agent" in said or "already installed" in said, said
    assert json.loads(node.path("/var/lib/weft/install/journal.json").read_text())["state"] == "installed"
    fixture.report(request.config, f"day one: cpu-1 powered off at its kubelet's switch, Ready on weft again "
                   f"{back:.1f} s later (reboot {node.timings.get('reboot_running', 0):.1f} s); the installer said: "
                   + said.strip().splitlines()[-1])
    _back_out(c, via="helm")
    assert _host_files(c) == before_files, "containerd's and kubelet's files are not as before the install"
    for name, n in c.nodes.items():
        assert [p for p in WEFT_PATHS if n.path(p).exists()] == [], name
    _remove_manifests(c, via="helm")


@pytest.fixture(scope="module")
def on_weft(cluster: Cluster) -> Iterator[Cluster]:
    """Day two's cluster: weft installed once, as day one's test installs it, for the tests of what a platform
    team does to it every week; backed out at the end, leaving nothing."""
    c = cluster
    # Day two starts from a cluster with no workload of day one's left on it (a bare pod would stop a drain).
    c.kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", timeout=180)
    c.kubectl("label", "node", "gpu-1", "weft.io/broker=simulated", "weft.io/simulated-devices=2x80Gi",
              "--overwrite")
    c.kubectl("label", "node", "cpu-1", "cpu-2", "weft.io/fixed-capacity=2_4Gi", "--overwrite")
    _install(c)
    _rolled_out(c)
    yield c
    _back_out(c)
    # Whatever another tool did to containerd's files meanwhile (NVIDIA's toolkit, last), nothing of weft's is
    # left in them, and containerd's CRI plugin came back after the back-out's restart.
    for name, n in c.nodes.items():
        _default, runtimes = _runtimes_on(c, name)
        assert "weft" not in runtimes, (name, sorted(runtimes))
        assert not [str(f) for f in n.path("/etc/containerd").rglob("*.toml")
                    if ctrd_config.BASE_SPEC in f.read_text()], name
        n.run(["crictl", "info"])
    _remove_manifests(c)


@pytest.fixture(autouse=True)
def _left_as_found_after_a_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a day-two test that failed half way: every node uncordoned and no pod of its left in default (a
    bare pod stops a drain, a cordoned node takes no stage), so the tests after it fail only for their own
    reasons. A test that passes cleans up after itself, and is checked to."""
    yield
    report = request.node.stash.get(OUTCOME, None)
    if "on_weft" not in request.fixturenames or report is None or report.passed:
        return
    c: Cluster = request.getfixturevalue("on_weft")
    # What each node's weft said meanwhile, kept past the nodes' teardown (pytest keeps its last temporary dirs).
    kept = c.workdir / f"failed-{request.node.name[:80]}"
    kept.mkdir(exist_ok=True)
    for name, n in c.nodes.items():
        for unit in ("weft-agent", "weft-broker", "kubelet", "containerd"):
            res = n.run(["journalctl", "-u", unit, "--no-pager", "-o", "short-monotonic"], check=False)
            (kept / f"{name}-{unit}.log").write_text(res.stdout + res.stderr)
    print(f"the nodes' logs of the failed test: {kept}")
    c.kubectl("uncordon", *c.nodes, check=False)
    c.kubectl("delete", "pods", "--all", "-n", "default", "--wait=true", timeout=180, check=False)


# Day two. The rerouted stage of the upgrade's pod counts as it runs: its log, read on the GPU node where kubelet
# reads it, must hold every number once, in order, across every agent's restart.
COUNTING_PREP = ("mkdir -p /www; echo prep-says-hi > /www/index.html; httpd -f -p 8080 -h /www & "
                 "i=0; while :; do echo \"seq $i\"; i=$((i+1)); sleep 0.2; done")
UPGRADE_VERSION = "0.1.0+day-two"


def _image_of_version(c: Cluster, version: str, tag: str, agent_exits: bool = False) -> None:
    """A second node image, weft's own version changed (``weft --version`` says it), pushed as ``tag``;
    ``agent_exits``: one whose agent exits at start (everything else in it works, its installer included)."""
    assert c.registry is not None
    tree = c.workdir / f"repo-{tag}"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "--", "shim", "hooks",
                            "nodeimage"], capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / f).is_file():
            (tree / f).write_bytes((REPO / f).read_bytes())
            (tree / f).chmod((REPO / f).stat().st_mode)
    init = tree / "shim" / "__init__.py"
    text = init.read_text()
    assert '__version__ = "' in text
    init.write_text(text.replace(text.split('__version__ = "', 1)[1].split('"', 1)[0], version, 1))
    if agent_exits:
        cli = tree / "shim" / "cli.py"
        start = "    Agent(cfg, host_check=check,"
        assert start in cli.read_text()
        cli.write_text(cli.read_text().replace(
            start, f'    raise SystemExit("weft agent: a test build that never starts")\n{start}', 1))
    image = build.build(c.workdir / f"image-{tag}", base="debian-packages", repo=tree)
    c.registry.push(image.archive, f"weft/node:{tag}")


def _set_image(c: Cluster, tag: str) -> None:
    """What a user does: the DaemonSet's image, every container and init container, to ``tag``."""
    assert c.registry is not None
    c.kubectl("-n", "weft-system", "set", "image", "daemonset/weft", f"*={c.registry.host}/weft/node:{tag}")


class Copies:
    """Running copies of a rerouted stage on the CPU nodes, asked of each node's containerd every 0.5 s. A
    node whose containerd does not answer (restarting, or the node powered off) is left out of that sample and
    named in it."""

    def __init__(self, c: Cluster, *filters: str) -> None:
        self.c, self.filters, self._stop = c, ["--label", "weft.io/origin-node=gpu-1", *filters], threading.Event()
        self.samples: list[tuple[float, int, tuple[str, ...]]] = []  # (when, copies seen, nodes not asked)
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def of_pod(cls, c: Cluster, origin_pod: str) -> Copies:
        """The copies of ``origin_pod``'s stage, for its sandbox on gpu-1 now."""
        (sandbox,) = _crictl(c, "gpu-1", "pods", "--name", f"^{origin_pod}$", "--state", "ready")["items"]
        return cls(c, "--label", f"weft.io/origin-sandbox={sandbox['id']}")

    def _sample(self) -> tuple[int, tuple[str, ...]]:
        total, missed = 0, []
        for n in ("cpu-1", "cpu-2"):
            try:
                res = self.c.nodes[n].run(["crictl", "ps", "-o", "json", *self.filters], check=False, timeout=10)
                total += len(json.loads(res.stdout)["containers"]) if res.returncode == 0 else 0
                if res.returncode != 0:
                    missed.append(n)
            except (nspawn.NodeError, subprocess.TimeoutExpired, ValueError):
                missed.append(n)
        return total, tuple(missed)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), *self._sample()))
            self._stop.wait(0.5)

    def counts(self, complete: bool = True) -> list[int]:
        """Copies seen in each sample (``complete``: only the samples in which every node answered)."""
        return [n for _, n, missed in self.samples if not (complete and missed)]

    def __enter__(self) -> Copies:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def _stage_state(c: Cluster, pod: str) -> tuple[dict[str, tuple[str, int]], str]:
    """The pod's containers (ID, restarts) as kubelet reports them, and its reservation pod's UID."""
    status = json.loads(c.kubectl("get", "pod", pod, "-o", "json").stdout)["status"]
    containers = {s["name"]: (s["containerID"], s["restartCount"]) for s in status["containerStatuses"]}
    (reservation,) = json.loads(c.kubectl("get", "pods", "-A", "-l", "weft.io/role=hosted-stage,"
                                          f"weft.io/origin-pod={pod}", "-o", "json").stdout)["items"]
    return containers, reservation["metadata"]["uid"]


def _sequence_problems(log: str) -> tuple[int, list[str]]:
    """(numbers seen, what is wrong): a number missing or seen twice."""
    seen = [int(line.split()[1]) for line in log.splitlines() if line.startswith("seq ")]
    problems = [f"seq {b} after seq {a}" for a, b in itertools.pairwise(seen) if b != a + 1]
    return len(seen), problems


def _roll(c: Cluster, tag: str, version: str, during: str | None) -> dict[str, float]:
    """The DaemonSet moved to ``tag`` as a user moves it, one node at a time; each node's agent then runs
    ``version``. ``during``: an opted-in pod created once the first node has switched. Returns each node's
    agent downtime and the rollout's duration."""
    started, t = time.time(), time.monotonic()
    _set_image(c, tag)
    if during:
        deadline = time.monotonic() + 180
        while not any(_agent_version(c, n) == version for n in c.nodes):
            assert time.monotonic() < deadline, "no node's agent moved to the new version"
            time.sleep(0.5)
        _two_stage(c, during, "weft", prep=COUNTING_PREP)
    rolled = _rolled_out(c, timeout=600)
    assert {n: _agent_version(c, n) for n in c.nodes} == dict.fromkeys(c.nodes, version)
    intervals = {n: _down_intervals(c, n, started, "weft-agent.service") for n in c.nodes}
    # One node at a time, as the update strategy says: no two nodes' agents were ever down together.
    spans = sorted((a, b, n) for n, found in intervals.items() for a, b in found)
    assert all(b1 <= a2 for (_, b1, _), (a2, _, _) in itertools.pairwise(spans)), spans
    down = {n: sum(b - a for a, b in found) for n, found in intervals.items()}
    switched = {n: max(b for _, b in found) - started for n, found in intervals.items() if found}
    return {"rollout": time.monotonic() - t, "rollout status": rolled,
            **{f"agent down {n}": d for n, d in down.items()},
            **{f"switched {n}": s for n, s in switched.items()}}


def _agent_version(c: Cluster, node: str) -> str:
    res = c.nodes[node].run(["/opt/weft/bin/weft", "--version"], check=False)
    return res.stdout.strip().removeprefix("weft ") if res.returncode == 0 else ""




def test_weft_upgrades_and_rolls_back_through_its_daemonset_while_a_rerouted_stage_runs_on(
        on_weft: Cluster, request: pytest.FixtureRequest) -> None:
    """Day two: a new image through the DaemonSet's rolling update, then back, while the two-stage pod runs with
    its CPU stage rerouted: no container of it restarts, one copy of the stage runs throughout, its log has
    every line once, its reservation stays, and a pod created during the rollout is placed as usual."""
    c = on_weft
    rounds = int(os.environ.get(fixture.ROUNDS_ENV) or 1)  # a fault seen once in a few rounds needs many
    t = time.monotonic()
    _image_of_version(c, UPGRADE_VERSION, "0.2.0-test")
    built = time.monotonic() - t
    _mesh_up(c)
    first = {n: _agent_version(c, n) for n in c.nodes}
    assert set(first.values()) == {"0.1.0"}, first
    _two_stage(c, "steady", "weft", prep=COUNTING_PREP)
    c.kubectl("wait", "--for=condition=Ready", "pod/steady", "--timeout=180s", timeout=210)
    before = _stage_state(c, "steady")
    done: list[dict[str, dict[str, float]]] = []
    during_host: list[str] = []
    with Copies.of_pod(c, "steady") as copies:
        for i in range(rounds):
            figures: dict[str, dict[str, float]] = {}
            during = "during-upgrade" if i == 0 else None
            figures["upgrade"] = _roll(c, "0.2.0-test", UPGRADE_VERSION, during=during)
            if during:
                c.kubectl("wait", "--for=condition=Ready", f"pod/{during}", "--timeout=180s", timeout=210)
                (sandbox,) = _crictl(c, "gpu-1", "pods", "--name", f"^{during}$", "--state", "ready")["items"]
                during_host = [n for n in ("cpu-1", "cpu-2") if _crictl(
                    c, n, "ps", "--label", f"weft.io/origin-sandbox={sandbox['id']}")["containers"]]
                c.kubectl("delete", "pod", during, "--wait=true", timeout=180)
            assert _stage_state(c, "steady") == before, \
                f"round {i + 1}: a container of the pod restarted at the upgrade, or its reservation went"
            figures["rollback"] = _roll(c, TAG, "0.1.0", during=None)
            c.kubectl("wait", "--for=condition=Ready", "pod/steady", "--timeout=180s", timeout=210)
            assert _stage_state(c, "steady") == before, \
                f"round {i + 1}: a container of the pod restarted at the roll-back, or its reservation went"
            done.append(figures)
            fixture.report(request.config, f"day two, round {i + 1} of {rounds}: " + "; ".join(
                f"{what}: all nodes {f['rollout']:.1f} s, agent down " + ", ".join(
                    f"{k.removeprefix('agent down ')} {v:.1f} s" for k, v in sorted(f.items())
                    if k.startswith("agent down")) for what, f in figures.items()) + "; nothing restarted")
        time.sleep(2)  # the last lines reach the GPU node's log
    after = _stage_state(c, "steady")
    assert after == before, f"a container of the pod restarted, or its reservation went: {before} -> {after}"
    counts = copies.counts()
    assert counts and set(counts) == {1}, f"copies of the rerouted stage over time: {copies.samples}"
    lines, problems = _sequence_problems(c.kubectl("logs", "steady", "-c", "prep").stdout)
    assert lines > 0 and not problems, problems
    c.kubectl("delete", "pod", "steady", "--wait=true", timeout=180)
    worst = {what: {n: max(r[what][f"agent down {n}"] for r in done) for n in c.nodes}
             for what in ("upgrade", "rollback")}
    fixture.report(request.config, f"day two: second image built and pushed in {built:.1f} s; {rounds} round(s) of "
                   "upgrade and roll-back; " + "; ".join(
        f"{what}: all nodes {done[0][what]['rollout']:.1f} s, each node's agent new at " + ", ".join(
            f"{k.removeprefix('switched ')} {v:.1f} s" for k, v in sorted(done[0][what].items())
            if k.startswith("switched"))
        + ", agent down at most " + ", ".join(f"{n} {v:.1f} s" for n, v in sorted(worst[what].items()))
        for what in ("upgrade", "rollback"))
        + f"; containers restarted 0; copies of the rerouted stage sampled {len(counts)} times, always 1; "
        f"its log {lines} lines, none lost or doubled; the pod created during the upgrade: prep on "
        f"{during_host or ['gpu-1 (local)']}",
        figures={"image built and pushed s": built, **done[0], "rounds": len(done),
                 "each round": done, "agent down most": worst,
                 "containers restarted": 0, "reservations replaced": 0, "stage copies sampled": len(counts),
                 "most stage copies": max(counts), "stage log lines": lines,
                 "stage log lines lost or doubled": len(problems),
                 "pod created during the upgrade, its stage on": during_host[0] if during_host else "gpu-1"})


def _started_order(c: Cluster, node: str, units: tuple[str, ...]) -> list[str]:
    """The units in the order this boot's journal says systemd started them."""
    out = c.nodes[node].run(["journalctl", "-b", "-o", "short-unix", "--no-pager", *[f"-u{u}" for u in units]]).stdout
    started = {}
    for line in out.splitlines():
        stamp, _, text = line.partition(" ")
        for u in units:
            if f"Started {u}" in text and u not in started:
                started[u] = float(stamp)
    return sorted(started, key=started.__getitem__)


def _peers_seen_by_gpu1(c: Cluster) -> dict[str, dict]:
    """gpu-1's agent's peers, by node name, as `weft status --json` gives them (none while it does not answer)."""
    res = c.nodes["gpu-1"].run(["/opt/weft/bin/weft", "status", "--json", "--socket", "/run/weft/cri.sock"],
                               check=False)
    return {p["node"]: p for p in (json.loads(res.stdout).get("peers", []) if res.returncode == 0 else [])}


def _mesh_up(c: Cluster, timeout: float = 60) -> None:
    """Until gpu-1's agent has heard from both CPU nodes (healthy, with their free capacity): before that, a
    stage created is placed locally, as it should be while no host has said it can take one."""
    deadline = time.monotonic() + timeout
    while True:
        peers = _peers_seen_by_gpu1(c)
        if all(n in peers and peers[n]["healthy"] and peers[n].get("free_cpu_cores") is not None
               for n in ("cpu-1", "cpu-2")):
            return
        assert time.monotonic() < deadline, f"gpu-1 has not heard from both CPU nodes: {peers}"
        time.sleep(0.5)


def _heard_from_since(c: Cluster, node: str, since: float, timeout: float = 180) -> None:
    """Until ``node`` is Ready by a kubelet heartbeat after ``since`` (wall clock): a Node's condition outlives
    its kubelet for a while, so Ready alone says nothing of a reboot."""
    deadline = time.monotonic() + timeout
    while True:
        doc = json.loads(c.kubectl("get", "node", node, "-o", "json").stdout)
        ready = [x for x in doc["status"].get("conditions", []) if x["type"] == "Ready"]
        if ready and ready[0]["status"] == "True" and datetime.datetime.fromisoformat(
                ready[0]["lastHeartbeatTime"]).timestamp() >= int(since):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{node} not Ready by a heartbeat since its reboot within {timeout:g}s: {ready}\n"
                                 + c.nodes[node].run(["journalctl", "-b", "-u", "kubelet.service", "-n", "40",
                                                      "--no-pager"], check=False).stdout)
        time.sleep(0.5)


def _ready_again(c: Cluster, pod: str, restarted: str, before: int, timeout: float = 240) -> float:
    """Seconds until ``pod`` is Ready with its ``restarted`` container past ``before`` restarts (or in a new
    sandbox: its restart count back at 0 under a new container)."""
    t = time.monotonic()
    deadline = t + timeout
    while True:
        status = json.loads(c.kubectl("get", "pod", pod, "-o", "json").stdout)["status"]
        ready = any(x["type"] == "Ready" and x["status"] == "True" for x in status.get("conditions", []))
        stage = {s["name"]: s for s in status.get("containerStatuses", [])}.get(restarted, {})
        if ready and stage.get("containerID") and stage["containerID"] != before:
            return time.monotonic() - t
        if time.monotonic() > deadline:
            raise AssertionError(f"{pod} not Ready again with a new {restarted} within {timeout:g}s: {status}\n"
                                 + _said_by_weft(c, "gpu-1"))
        time.sleep(1)


def test_a_rebooted_cpu_host_and_gpu_node_come_back_on_weft_and_the_pod_is_ready_again(
        on_weft: Cluster, request: pytest.FixtureRequest) -> None:
    """Day two: the CPU host that runs the rerouted stage, then the GPU node, powered off cleanly through their
    systemd and booted again: containerd, weft and kubelet come back in that order with kubelet on weft, at most
    one copy of the stage lives at any time, the GPU node's leases are its running containers' only, and the
    pod is Ready again each time."""
    c = on_weft
    _mesh_up(c)
    _two_stage(c, "rebooted", "weft")
    c.kubectl("wait", "--for=condition=Ready", "pod/rebooted", "--timeout=180s", timeout=210)
    (host,) = [n for n in ("cpu-1", "cpu-2") if _crictl(c, n, "ps", "--label", "weft.io/origin-node=gpu-1",
                                                        "--name", "^prep$")["containers"]]
    figures: dict[str, float] = {}
    units = ("containerd.service", "weft-agent.service", "kubelet.service")
    with Copies(c, "--name", "^prep$") as copies:
        for node, stage in ((host, "prep"), ("gpu-1", "model")):
            containers = {x["name"]: (x["containerID"], x["restartCount"]) for x in json.loads(c.kubectl(
                "get", "pod", "rebooted", "-o", "json").stdout)["status"]["containerStatuses"]}
            t, wall = time.monotonic(), time.time()
            c.nodes[node].boot_again()  # SIGRTMIN+3 to its systemd: a clean poweroff, then the same disk booted
            if c.nodes[node].stop_killed:  # a unit waited out its stop timeout: the node was killed at 30 s
                said = c.nodes[node].run(["journalctl", "-b", "-1", "-o", "short-unix", "--no-pager",
                                          f"--since=@{int(wall)}"]).stdout
                raise AssertionError(f"{node}'s poweroff was not done in 30 s; the end of its journal then (journald "
                                     f"leaves /var late in a shutdown):\n{said[-12000:]}")
            _heard_from_since(c, node, wall)
            figures[f"{node} Ready"] = time.monotonic() - t
            figures[f"{node} poweroff"] = c.nodes[node].timings["reboot_stop"]  # SIGRTMIN+3 to its systemd gone
            figures[f"{node} pod Ready"] = figures[f"{node} Ready"] + _ready_again(c, "rebooted", stage,
                                                                                 containers[stage][0])
            # In order, each once: kubelet found weft serving when it started (it did not fail and wait out
            # its restart delay).
            assert _started_order(c, node, units) == list(units), _started_order(c, node, units)
            kubelet = c.nodes[node].run(["journalctl", "-b", "-u", "kubelet.service", "-o", "cat", "--no-pager"]).stdout
            assert "kubelet.service: Main process exited" not in kubelet, kubelet[-3000:]
            flags = c.nodes[node].path("/var/lib/kubelet/kubeadm-flags.env").read_text()
            assert "--container-runtime-endpoint=unix:///run/weft/cri.sock" in flags
            assert c.nodes[node].systemctl("is-active", *units).stdout.split() == ["active"] * 3
    counts = copies.counts(complete=False)
    assert counts and max(counts) <= 1, f"copies of the rerouted stage over time: {copies.samples}"
    # The GPU node's leases after its reboot: the model container running now holds one, bound; nothing else
    # (the leases of the containers the poweroff ended were released).
    status = json.loads(c.nodes["gpu-1"].run(["/opt/weft/bin/weft", "status", "--json", "--socket",
                                              "/run/weft/cri.sock"]).stdout)
    running = {x["id"] for x in _crictl(c, "gpu-1", "ps")["containers"]}
    assert [x["state"] for x in status["leases"]] == ["bound"] and status["leases"][0]["container_id"] in running, \
        status["leases"]
    c.kubectl("delete", "pod", "rebooted", "--wait=true", timeout=180)
    fixture.report(request.config, "day two: reboots, clean poweroff to " + ", ".join(
        f"{k} {v:.1f} s" for k, v in figures.items()) + f"; at most {max(counts)} copy of the rerouted stage "
        f"in {len(counts)} samples",
        figures={"reboot": {"stage host": host, **figures, "most stage copies": max(counts),
                            "stage copies sampled": len(counts)}})


def _daemonset_pods(c: Cluster) -> dict[str, dict]:
    pods = json.loads(c.kubectl("-n", "weft-system", "get", "pods", "-l", "app.kubernetes.io/component=node",
                                "-o", "json").stdout)["items"]
    return {p["spec"]["nodeName"]: p for p in pods if p["spec"].get("nodeName")}


def _failing(pod: dict, why: tuple[str, ...]) -> bool:
    """Whether a container of ``pod`` waits for one of ``why`` or has exited in failure."""
    for st in pod["status"].get("initContainerStatuses", []) + pod["status"].get("containerStatuses", []):
        if (st.get("state", {}).get("waiting") or {}).get("reason") in why:
            return True
        for state in (st.get("state", {}), st.get("lastState", {})):
            if (state.get("terminated") or {}).get("exitCode", 0) != 0:
                return True
    return False


def _ready(pod: dict) -> bool:
    return any(x["type"] == "Ready" and x["status"] == "True" for x in pod["status"].get("conditions", []))


def _stuck_at_one_node(c: Cluster, tag: str, why: tuple[str, ...], hold: float = 10) -> str:
    """The node whose pod moved to ``tag`` and cannot start (a container waiting for one of ``why``, or
    exited in failure), once the rollout has gone no further for ``hold`` seconds, the others' pods still
    the old ones and Ready."""
    deadline, failing_since = time.monotonic() + 300, None
    while True:
        pods = _daemonset_pods(c)
        moved = {n for n, p in pods.items() if any(x["image"].endswith(f":{tag}")
                                                   for x in p["spec"]["containers"])}
        assert len(moved) <= 1, f"the rollout went past a node whose pod cannot start: {sorted(moved)}"
        if moved:
            (node,) = moved
            assert not _ready(pods[node]), f"{node}'s pod on {tag} is Ready"
            if failing_since is None and _failing(pods[node], why):
                failing_since = time.monotonic()
            if failing_since is not None and time.monotonic() - failing_since >= hold:
                assert all(_ready(p) for n, p in pods.items() if n != node), \
                    "a node beside the stuck one lost its weft pod"
                return node
        assert time.monotonic() < deadline, f"no node's pod got stuck on {tag}: " + json.dumps(
            {n: p["status"] for n, p in pods.items()})[:4000]
        time.sleep(1)


def test_an_upgrade_to_an_image_that_cannot_start_stops_at_its_first_node_and_rolls_back(
        on_weft: Cluster, request: pytest.FixtureRequest) -> None:
    """A tag that does not exist, then an image whose agent exits at start: the rollout stops at its first node,
    the other nodes keep their agents, the first node's kubelet keeps its pods running (through weft, or
    containerd once the installer has rolled that node back), and setting the old tag again restores it."""
    c = on_weft
    names = [f"kept-{n}" for n in c.nodes]
    for name, node in zip(names, c.nodes, strict=True):
        _pod(c, name, node)
    before = _containers(c, names)
    said = []
    _image_of_version(c, "0.1.0+exits", "0.3.0-exits", agent_exits=True)
    for tag, why in (("0.0.0-no-such-tag", ("ErrImagePull", "ImagePullBackOff")),
                     ("0.3.0-exits", ("CrashLoopBackOff",))):
        t = time.monotonic()
        _set_image(c, tag)
        node = _stuck_at_one_node(c, tag, why)
        stuck = time.monotonic() - t
        flags = c.nodes[node].path("/var/lib/kubelet/kubeadm-flags.env").read_text()
        on = "weft" if "weft/cri.sock" in flags else "containerd"
        assert {n: _agent_version(c, n) for n in c.nodes if n != node} == \
            dict.fromkeys([n for n in c.nodes if n != node], "0.1.0")
        assert _containers(c, names) == before, f"a pod lost its container while {node} was stuck on {tag}"
        t = time.monotonic()
        _set_image(c, TAG)
        _rolled_out(c)
        back = time.monotonic() - t
        assert {n: _agent_version(c, n) for n in c.nodes} == dict.fromkeys(c.nodes, "0.1.0")
        for n in c.nodes:
            assert "weft/cri.sock" in c.nodes[n].path("/var/lib/kubelet/kubeadm-flags.env").read_text(), n
        assert _containers(c, names) == before, f"a pod lost its container rolling back from {tag}"
        said.append(f"{tag}: stopped at {node} ({stuck:.1f} s; its kubelet on {on} meanwhile), "
                    f"rolled back in {back:.1f} s")
    c.kubectl("delete", "pod", *names, "--wait=true", timeout=180)
    fixture.report(request.config, "day two: an image that cannot start: " + "; ".join(said)
                   + "; containers restarted 0")


def _peer_draining(c: Cluster, timeout: float = 60, **want: bool) -> None:
    """Until gpu-1's agent sees each named CPU node draining (cordoned, or ``weft drain``) or not, as ``want``
    says (a host says so in its next Hello)."""
    deadline = time.monotonic() + timeout
    while True:
        peers = _peers_seen_by_gpu1(c)
        if all(n in peers and peers[n]["healthy"] and bool(peers[n].get("draining")) is on
               for n, on in want.items()):
            return
        assert time.monotonic() < deadline, f"gpu-1 does not see {want}: {peers}"
        time.sleep(0.5)


def _stage_host(c: Cluster, pod: str) -> str | None:
    """The CPU node running ``pod``'s rerouted stage now (its origin sandbox's), or None (it runs on gpu-1)."""
    (sandbox,) = _crictl(c, "gpu-1", "pods", "--name", f"^{pod}$", "--state", "ready")["items"]
    found = [n for n in ("cpu-1", "cpu-2") if _crictl(c, n, "ps", "--label",
                                                      f"weft.io/origin-sandbox={sandbox['id']}")["containers"]]
    assert len(found) <= 1, found
    return found[0] if found else None


def _stage_budgets(c: Cluster, host: str) -> list[dict]:
    return json.loads(c.kubectl("get", "pdb", "-n", "weft-system", "-l", f"weft.io/host={host}",
                                "-o", "json").stdout)["items"]


def _drain_waits_on_the_workloads_budget(c: Cluster, host: str, pod: str) -> float:
    """With a PodDisruptionBudget on ``pod`` that allows no disruption, `kubectl drain` of its stage's host
    cannot evict the reservation (the host's stage budget refuses it) and the stage runs on; once the
    workload's budget is gone, so is the stage budget. How long the stage budget took to go (s)."""
    c.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": pod, "namespace": "default"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": pod}}}}))
    deadline = time.monotonic() + 60
    while not ((budgets := _stage_budgets(c, host)) and (budgets[0].get("status") or {}).get("expectedPods") == 1
               and budgets[0]["status"].get("observedGeneration") == budgets[0]["metadata"]["generation"]):
        assert time.monotonic() < deadline, f"no stage budget on {host} for default/{pod}: {budgets}"
        time.sleep(0.5)
    (budget,) = budgets
    assert budget["metadata"]["annotations"]["weft.io/budget-of"] == f"default/{pod}"
    assert (budget["spec"]["minAvailable"], budget["status"]["disruptionsAllowed"]) == (1, 0), budget
    state = _stage_state(c, pod)
    held = c.kubectl("drain", host, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=15s",
                     check=False, timeout=60)
    said = held.stdout + held.stderr
    assert held.returncode != 0 and "violate the pod's disruption budget" in said, said
    assert _stage_host(c, pod) == host and _stage_state(c, pod) == state  # nothing restarted, the same reservation
    c.kubectl("delete", "pdb", pod)
    t = time.monotonic()
    while _stage_budgets(c, host):
        assert time.monotonic() - t < 30, f"the stage budget on {host} outlived default/{pod}'s"
        time.sleep(0.5)
    return time.monotonic() - t


def test_kubectl_drain_of_the_stages_host_moves_the_stage_and_uncordon_takes_stages_again(
        on_weft: Cluster, request: pytest.FixtureRequest) -> None:
    """`kubectl drain` (no --force) of the CPU node running a rerouted stage: its reservation is evicted through
    the Eviction API, the stage stops there and kubelet on gpu-1 restarts it on the other CPU node, nothing of it
    is left on the drained one, and no new stage goes there while it is cordoned; uncordoned, it takes new
    stages again. First, a PodDisruptionBudget on the workload that allows no disruption holds the drain back."""
    c = on_weft
    _mesh_up(c)
    _two_stage(c, "drained", "weft")
    c.kubectl("wait", "--for=condition=Ready", "pod/drained", "--timeout=180s", timeout=210)
    host = _stage_host(c, "drained")
    assert host is not None, "the stage was not rerouted"
    other = "cpu-2" if host == "cpu-1" else "cpu-1"
    budget_gone = _drain_waits_on_the_workloads_budget(c, host, "drained")
    before = {x["name"]: x["containerID"] for x in json.loads(c.kubectl(
        "get", "pod", "drained", "-o", "json").stdout)["status"]["containerStatuses"]}
    t = time.monotonic()
    said = c.kubectl("drain", host, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=120s",
                     timeout=180).stdout
    drained = time.monotonic() - t
    assert "evicting pod weft-system/" in said and f"node/{host} drained" in said, said
    moved = _ready_again(c, "drained", "prep", before["prep"])
    assert _stage_host(c, "drained") == other
    status = json.loads(c.kubectl("get", "pod", "drained", "-o", "json").stdout)["status"]
    assert {x["name"]: x["containerID"] for x in status["containerStatuses"]}["model"] == before["model"]
    # No container or sandbox of it runs on the drained node and no reservation is there. The stopped shadow
    # stays, as kubelet keeps a pod's last ended container, until kubelet on gpu-1 removes that container
    # (with the pod, below).
    deadline = time.monotonic() + 120
    while (left := c.kubectl("get", "pods", "-A", "-l", "weft.io/role=hosted-stage", "--field-selector",
                             f"spec.nodeName={host}", "-o", "name").stdout.split()
           + [x["id"] for x in _crictl(c, host, "ps", "--label", "weft.io/origin-node=gpu-1")["containers"]]
           + [x["id"] for x in _crictl(c, host, "pods", "--state", "ready", "--label",
                                       "weft.io/origin-node=gpu-1")["items"]]):
        assert time.monotonic() < deadline, f"running or reserved on the drained {host}: {left}"
        time.sleep(1)
    # While it is cordoned its agent admits nothing; uncordoned (and the other cordoned), a new stage goes there.
    _peer_draining(c, **{host: True})
    c.kubectl("uncordon", host)
    c.kubectl("cordon", other)
    try:
        _peer_draining(c, **{host: False, other: True})
        _two_stage(c, "after-drain", "weft")
        c.kubectl("wait", "--for=condition=Ready", "pod/after-drain", "--timeout=180s", timeout=210)
        assert _stage_host(c, "after-drain") == host
    finally:
        c.kubectl("uncordon", other)
    c.kubectl("delete", "pod", "drained", "after-drain", "--wait=true", timeout=180)
    deadline = time.monotonic() + 120
    while left := ([x["id"] for x in _crictl(c, host, "ps", "-a", "--label", "weft.io/origin-node=gpu-1")["containers"]]
                   + [x["id"] for x in _crictl(c, host, "pods", "--label", "weft.io/origin-node=gpu-1")["items"]]):
        assert time.monotonic() < deadline, f"left on {host} after the pods went: {left}"
        time.sleep(1)
    fixture.report(request.config, f"day two: kubectl drain {host} held back by the workload's budget (its "
                   f"stage budget gone {budget_gone:.1f} s after it); then took {drained:.1f} s (its reservation "
                   f"evicted), the stage running again on {other} {moved:.1f} s after; nothing of it left on {host}",
                   figures={"drain": {"drained host": host, "kubectl drain s": drained,
                                      "stage budget gone after the workload's s": budget_gone,
                                      "stage running elsewhere after the drain s": moved,
                                      "stage moved to": other}})


# NVIDIA's toolkit on the nodes, as the GPU Operator's toolkit DaemonSet runs it: its installer (built from the
# module: v1.20 on the 2.x GPU node, v1.17 on the 1.6 CPU node) installs the toolkit, configures containerd with
# its `nvidia` runtime as the default, and restarts containerd through the node's systemd. The driver's own
# programs (nvidia-container-cli, libnvidia-container) are C, not in the module: stubs stand in for them, as there
# is no GPU (the installed runtime then runs runc, as it does on a node whose driver is not loaded).
TOOLKIT_SOURCES = ("nvidia-ctk", "nvidia-cdi-hook", "nvidia-container-runtime", "nvidia-container-runtime.cdi",
                   "nvidia-container-runtime.legacy", "nvidia-container-cli", "nvidia-container-runtime-hook")


def _install_toolkit(c: Cluster, node: str, line: str) -> float:
    """Run the toolkit's installer on ``node`` as the operator does; the seconds it took (its restart included)."""
    n = c.nodes[node]
    bins = binaries.nvidia_toolkit(line)
    src = n.path("/opt/weft-test/toolkit-src")
    (src / "usr/bin").mkdir(parents=True, exist_ok=True)
    (src / "usr/lib/x86_64-linux-gnu").mkdir(parents=True, exist_ok=True)
    for name in TOOLKIT_SOURCES:
        (src / "usr/bin" / name).write_text("#!/bin/sh\nexit 0\n")
        (src / "usr/bin" / name).chmod(0o755)
    for lib in ("libnvidia-container.so.1", "libnvidia-container-go.so.1"):
        (src / "usr/lib/x86_64-linux-gnu" / lib).write_bytes(b"")
    installer = "nvidia-toolkit" if line == "1.17" else "nvidia-ctk-installer"
    n.path("/opt/weft-test/bin").mkdir(parents=True, exist_ok=True)
    for b in (installer, "nvidia-ctk"):
        target = n.path(f"/opt/weft-test/bin/{b}")
        target.write_bytes((bins / b).read_bytes())
        target.chmod(0o755)
    argv = [f"/opt/weft-test/bin/{installer}", "--runtime=containerd", "--no-daemon",
            "--pid-file=/run/nvidia/toolkit/toolkit.pid", "--config=/etc/containerd/config.toml",
            "--socket=/run/containerd/containerd.sock", "--restart-mode=systemd", "--host-root=/"]
    if line == "1.17":  # its sources are fixed host paths: the stubs are put there, and those it misses skipped
        for name in TOOLKIT_SOURCES:
            if not n.path(f"/usr/bin/{name}").exists():
                n.path(f"/usr/bin/{name}").write_text("#!/bin/sh\nexit 0\n")
                n.path(f"/usr/bin/{name}").chmod(0o755)
        argv += ["--root=/usr/local/nvidia", "--ignore-errors"]
    else:
        argv += ["--toolkit-install-dir=/usr/local/nvidia", "--toolkit-source-root=/opt/weft-test/toolkit-src"]
    t = time.monotonic()
    res = n.run(argv, check=False, timeout=300)
    assert res.returncode == 0, f"the toolkit's installer on {node}: {res.stdout[-3000:]}{res.stderr[-3000:]}"
    return time.monotonic() - t


def _runtimes_on(c: Cluster, node: str) -> tuple[str, dict]:
    """(default runtime, every runtime) in the node's own containerd's `config dump`."""
    plugins = tomllib.loads(c.nodes[node].run(["containerd", "config", "dump"]).stdout)["plugins"]
    section = plugins.get("io.containerd.cri.v1.runtime") or plugins["io.containerd.grpc.v1.cri"]
    return section["containerd"]["default_runtime_name"], section["containerd"]["runtimes"]


def _leases_on_gpu_node(c: Cluster) -> list[tuple[str, str]]:
    """(lease, state) of every lease on gpu-1, as its agent's `weft status` says."""
    doc = json.loads(c.nodes["gpu-1"].run(["/opt/weft/bin/weft", "status", "--json", "--socket",
                                           "/run/weft/cri.sock"]).stdout)
    return sorted((x["lease_id"], x["state"]) for x in doc["leases"])


def _weft_pod_on(c: Cluster, node: str) -> str:
    (pod,) = [p["metadata"]["name"] for p in json.loads(c.kubectl(
        "-n", "weft-system", "get", "pods", "-l", "app.kubernetes.io/name=weft,app.kubernetes.io/component=node",
        "--field-selector", f"spec.nodeName={node}", "-o", "json").stdout)["items"]]
    return pod


def test_nvidia_s_toolkit_installed_after_weft_keeps_every_pod_and_weft_and_a_rewrite_is_said_and_put_back(
        on_weft: Cluster, request: pytest.FixtureRequest) -> None:
    """The GPU Operator's toolkit after weft, on the 2.x GPU node and the 1.6 CPU node hosting the stage: its
    containerd restarts leave every container, lease, shadow and reservation as they were and kubelet on weft;
    containerd then has runc, nvidia (the default) and weft. Then config.toml written anew without weft's import:
    weft says so within a minute (its status, an Event on its pod there), and its pod's next start puts it back.
    The back-out at the end of the module then leaves the toolkit's runtime and nothing of weft's."""
    c = on_weft
    _mesh_up(c)
    others = _leases_on_gpu_node(c)  # an earlier test's pod may still be going
    c.kubectl("cordon", "cpu-2")  # the stage goes to the 1.6 node, whose containerd the toolkit restarts too
    try:
        _two_stage(c, "beside", "weft", prep=COUNTING_PREP)
        c.kubectl("wait", "--for=condition=Ready", "pod/beside", "--timeout=180s", timeout=210)
    finally:
        c.kubectl("uncordon", "cpu-2")
    assert _stage_host(c, "beside") == "cpu-1"
    before = _stage_state(c, "beside")
    leases = _leases_on_gpu_node(c)
    mine = set(leases) - set(others)
    assert len(mine) == 1, (leases, others)
    since = time.time()
    took: dict[str, float] = {}
    with Copies.of_pod(c, "beside") as copies:
        for node, line in (("gpu-1", "1.20"), ("cpu-1", "1.17")):
            took[node] = _install_toolkit(c, node, line)
        c.kubectl("wait", "--for=condition=Ready", "pod/beside", "--timeout=180s", timeout=210)
        time.sleep(2)
    down = {n: _down_intervals(c, n, since, "containerd.service") for n in ("gpu-1", "cpu-1")}
    assert all(down.values()), f"the toolkit restarted containerd on each node: {down}"
    assert _stage_state(c, "beside") == before, "a container of the pod restarted, or its reservation went"
    assert set(copies.counts()) == {1}, f"copies of the rerouted stage over time: {copies.samples}"
    assert mine <= set(_leases_on_gpu_node(c)), "the GPU stage's lease is as it was"
    for node in ("gpu-1", "cpu-1"):
        default, runtimes = _runtimes_on(c, node)
        assert default == "nvidia" and {"runc", "nvidia", "weft"} <= set(runtimes), (node, sorted(runtimes))
        binary = runtimes["nvidia"]["options"]["BinaryName"]
        assert binary == "/usr/local/nvidia/toolkit/nvidia-container-runtime", binary
        assert runtimes["weft"]["options"]["BinaryName"] == binary, "weft's handler is the default runtime's"
        assert "unix:///run/weft/cri.sock" in c.nodes[node].path("/var/lib/kubelet/config.yaml").read_text() or \
            "/run/weft/cri.sock" in c.nodes[node].path("/var/lib/kubelet/kubeadm-flags.env").read_text()
        nodes = json.loads(c.kubectl("get", "node", node, "-o", "json").stdout)
        assert any(x["type"] == "Ready" and x["status"] == "True" for x in nodes["status"]["conditions"])
    kubelet_down = {n: _kubelet_down_s(c, n, since) for n in ("gpu-1", "cpu-1")}

    # config.toml written anew without weft's import (a tool, an admin): said within a minute, not written back.
    cfg = c.nodes["cpu-1"].path("/etc/containerd/config.toml")
    cfg.write_text(ctrd_config.without_import(cfg.read_text()))
    t = time.monotonic()
    pod = _weft_pod_on(c, "cpu-1")
    described = ""

    def said() -> bool:
        nonlocal described
        described = c.kubectl("-n", "weft-system", "describe", "pod", pod, check=False).stdout
        return "WeftNotImported" in described

    try:
        wait_for(said, timeout=60, what="the Event on weft's pod", every=1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{described[-3000:]}") from None
    noticed = time.monotonic() - t
    assert "no longer imports" in described
    assert ctrd_config.DROPIN not in cfg.read_text(), "weft does not write another tool's rewrite back"
    c.kubectl("-n", "weft-system", "delete", "pod", pod, "--wait=true", timeout=180)
    _rolled_out(c)
    assert ctrd_config.DROPIN in cfg.read_text(), "the pod's next start put weft's import back"
    _default, runtimes = _runtimes_on(c, "cpu-1")
    assert {"nvidia", "weft"} <= set(runtimes)
    c.kubectl("delete", "pod", "beside", "--wait=true", timeout=180)
    fixture.report(request.config, "day two: NVIDIA's toolkit installed after weft (v1.20 on gpu-1, 2.x; v1.17 on "
                   f"cpu-1, 1.6): installer {took['gpu-1']:.1f} s / {took['cpu-1']:.1f} s, containerd down "
                   + ", ".join(f"{n} {sum(b - a for a, b in d):.1f} s" for n, d in down.items())
                   + ", kubelet restarted " + ", ".join(f"{n} {s:.1f} s" for n, s in kubelet_down.items())
                   + f"; containers restarted 0, stage copies always 1; a rewrite without weft's import said on "
                   f"its pod {noticed:.1f} s after",
                   figures={"toolkit": {"installer gpu-1 s": took["gpu-1"], "installer cpu-1 s": took["cpu-1"],
                                        **{f"containerd down {n} s": sum(b - a for a, b in d) for n, d in down.items()},
                                        **{f"kubelet down {n} s": s for n, s in kubelet_down.items()},
                                        "containers restarted": 0, "rewrite said after s": noticed}})
