"""Day one on a real cluster: weft installed from its image and manifests onto nodes run by systemd, and
backed out, as a platform team does it.

The cluster (``integration/nodes/cluster.py``): the control plane on this machine (etcd, kube-apiserver,
kube-scheduler, kube-controller-manager with a cluster's workload controllers), three nodes booted with
systemd under systemd-nspawn and laid out as kubeadm lays out workers (containerd and kubelet as units,
the kubelet's own client certificate), Debian's containerd 1.6 on ``cpu-1`` and 2.4 on ``gpu-1`` and
``cpu-2``, a flat pod network, and a registry the nodes pull from. The user's steps, as
``docs/operations.md`` gives them: the image built with ``python -m nodeimage.build --base
debian-packages`` and pushed; ``kubectl apply -k`` of an overlay that only names it; the mesh CA Secret;
then, to back out, ``kubectl apply -k`` of the back-out overlay, its rollout, ``kubectl delete -k`` and
the nodes' CSRs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from integration.kube import fixture
from integration.nodes.cluster import Cluster
from integration.nodes.kubeadm import NodeSpec
from nodeimage import build

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


# The two-stage pod (integration/test_kube_reroute.py has the whole of it): ``model`` holds a GPU lease on the
# GPU node, ``prep`` is a CPU stage weft reroutes to a CPU node; the pod is Ready through prep's HTTP probe.
MODEL = ('echo "model up on GPU ${NVIDIA_VISIBLE_DEVICES:-none}"; mkdir -p /www; echo model-says-hi > /www/index.html; '
         "exec httpd -f -p 9090 -h /www")
PREP = "echo prep starting; mkdir -p /www; echo prep-says-hi > /www/index.html; exec httpd -f -p 8080 -h /www"


def _two_stage(c: Cluster, name: str, runtime_class: str | None) -> None:
    assert c.registry is not None
    image = f"{c.registry.host}/weft-test/busybox:1"

    def stage(stage_name: str, script: str, port: int, **extra: object) -> dict:
        return {"name": stage_name, "image": image, "command": ["sh", "-c", script],
                "ports": [{"containerPort": port}],
                "readinessProbe": {"httpGet": {"path": "/index.html", "port": port}, "periodSeconds": 1}, **extra}

    spec: dict = {"nodeSelector": {"weft.io/role": "gpu"}, "terminationGracePeriodSeconds": 2, "containers": [
        stage("model", MODEL, 9090, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
        stage("prep", PREP, 8080, resources={"requests": {"cpu": "100m", "memory": "32Mi"},
                                             "limits": {"cpu": "500m", "memory": "64Mi"}})]}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    c.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": name, "namespace": "default",
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


def _kubelet_down_s(c: Cluster, node: str, since: float) -> float:
    """How long the node's kubelet was down across its restarts since ``since``: systemd's journal, from each
    stop it began to the start that followed."""
    out = c.nodes[node].run(["journalctl", "-u", "kubelet.service", "-o", "short-unix", "--no-pager",
                             f"--since=@{int(since)}"]).stdout
    down, stopping = 0.0, None
    for line in out.splitlines():
        stamp, _, text = line.partition(" ")
        if "Stopping kubelet.service" in text:
            stopping = float(stamp)
        elif "Started kubelet.service" in text and stopping is not None:
            down, stopping = down + float(stamp) - stopping, None
    return down


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


def _install(c: Cluster, before_secret: Callable[[], None] = lambda: None) -> None:
    c.kubectl("apply", "-k", str(_overlay(c, "install", REPO / "nodeimage" / "manifests")))
    before_secret()
    ca = c.workdir / "mesh-ca"
    if not (ca / "ca.key").exists():
        subprocess.run([sys.executable, "-m", "shim", "mesh-signer", "--init-ca", "--ca-dir", str(ca)], check=True,
                       capture_output=True, timeout=60)
    c.kubectl("-n", "weft-system", "create", "secret", "generic", "weft-mesh-ca",
              f"--from-file=ca.crt={ca / 'ca.crt'}", f"--from-file=ca.key={ca / 'ca.key'}")


def _back_out(c: Cluster) -> None:
    c.kubectl("apply", "-k", str(_overlay(c, "backout", REPO / "nodeimage" / "backout")))
    _rolled_out(c)


def _remove_manifests(c: Cluster) -> None:
    """The back-out's last steps, as nodeimage/backout says; then nothing of weft is left in the cluster."""
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
    try:
        node.systemctl("restart", "containerd.service")  # containerd itself takes it
        before = {f: node.path(f).read_bytes() for f in HOST_FILES}
        kubelet_pid = node.systemctl("show", "-p", "MainPID", "--value", "kubelet.service").stdout.strip()
        _install(c)

        def pod_on(name: str) -> dict:
            pods = json.loads(c.kubectl("-n", "weft-system", "get", "pods", "-l",
                                        "app.kubernetes.io/component=node", "-o", "json").stdout)["items"]
            (pod,) = [p for p in pods if p["spec"].get("nodeName") == name]
            return pod

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
        assert {f: node.path(f).read_bytes() for f in HOST_FILES} == before
    finally:
        config.write_bytes(original)
        for name in ("10-site.toml", "20-more.toml"):
            node.path(f"/etc/containerd/conf.d/{name}").unlink(missing_ok=True)
        node.systemctl("restart", "containerd.service", check=False)


def test_a_node_that_goes_down_during_its_install_finishes_it_when_it_boots_again(
        cluster: Cluster, request: pytest.FixtureRequest) -> None:
    """cpu-1's power is cut the moment its kubelet is switched (the kubelet-restart step): booted again, its
    units bring containerd, weft and kubelet back, the DaemonSet's pod runs the installer again, which finishes
    the journal's install, and says so; the node is Ready on weft."""
    c = cluster
    node = c.nodes["cpu-1"]
    flags = node.path("/var/lib/kubelet/kubeadm-flags.env")
    _install(c)
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
    _back_out(c)
    _remove_manifests(c)
