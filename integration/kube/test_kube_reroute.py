"""Two real nodes: a GPU origin (simulated broker) and a CPU host, each with its own kubelet v1.34 and weft agent.

A two-stage pod (``runtimeClassName: weft``): ``model`` asks for a GPU and stays on the origin,
``prep`` is a CPU stage that weft reroutes to the host. Through the real kubelet and API server, as
a cluster user sees it: the pod turns Ready through an HTTP readiness probe on the rerouted
container; the stages reach each other over localhost both ways; ``kubectl logs``, ``exec -it``,
``attach`` and ``port-forward`` work on the rerouted container; its ConfigMap and Secret volumes and
their updates and its projected service-account token reach it; a failing liveness probe restarts
it; deleting the pod leaves nothing on either node; and the host's kubelet neither lists nor kills
the shadow. The real ``crictl`` drives every verb through the origin's agent on the rerouted
container and on a local one alike.
"""

from __future__ import annotations

import base64
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from cri_api.v1.api_pb2 import CONTAINER_RUNNING

from harness import fixture
from harness.cluster import KubeCluster, NodeSpec
from harness.workloads import (
    Terminal,
    apply,
    container,
    container_status,
    crictl,
    crictl_argv,
    delete,
    get_pod,
    http_get,
    pod,
    port_forward,
    sandbox_of,
    wait_ready,
)
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

ORIGIN, HOST = "gpu-1", "cpu-1"
AUDIENCE = "weft-test"
# The host kubelet's housekeeping runs every 2 s: a dozen of its rounds pass while the shadow is watched.
WATCH_SHADOW_S = 25.0

MODEL = ('echo "model up on GPU ${NVIDIA_VISIBLE_DEVICES:-none}"; mkdir -p /www; echo model-says-hi > /www/index.html; '
         "exec httpd -f -p 9090 -h /www")
PREP = ("echo prep starting; mkdir -p /www; echo prep-says-hi > /www/index.html; touch /tmp/alive; "
        "httpd -p 8080 -h /www; "
        'while read line; do echo "prep got $line"; done; echo prep stdin closed; sleep 3600')


def two_stage(name: str, *, rerouted: bool = True) -> list[dict]:
    """The pod (and its ConfigMap and Secret); with ``rerouted`` false every stage is pinned ``local``."""
    annotations = {"weft.io/gpu-memory.model": "20Gi", "weft.io/gpu-compute.model": "50"}
    if not rerouted:
        annotations.update({"weft.io/stage.model": "local", "weft.io/stage.prep": "local"})
    prep = container(
        "prep", PREP, port=8080, stdin=True,
        readinessProbe={"httpGet": {"path": "/index.html", "port": 8080}, "periodSeconds": 1},
        livenessProbe={"exec": {"command": ["test", "-f", "/tmp/alive"]}, "periodSeconds": 2, "failureThreshold": 2},
        resources={"requests": {"cpu": "100m", "memory": "32Mi"}, "limits": {"cpu": "500m", "memory": "64Mi"}},
        volumeMounts=[{"name": "config", "mountPath": "/etc/config"}, {"name": "secret", "mountPath": "/etc/secret"},
                      {"name": "token", "mountPath": "/var/run/secrets/tokens"}])
    model = container("model", MODEL, port=9090, env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                      readinessProbe={"httpGet": {"path": "/index.html", "port": 9090}, "periodSeconds": 1})
    volumes = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "secret", "secret": {"secretName": f"{name}-secret"}},
        {"name": "token", "projected": {"sources": [
            {"serviceAccountToken": {"path": "token", "audience": AUDIENCE, "expirationSeconds": 3600}}]}},
    ]
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
         "data": {"greeting": "hello"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{name}-secret"},
         "stringData": {"password": "first-secret"}},
        pod(name, [model, prep], runtime_class="weft", annotations=annotations,
            node_selector={"weft.io/role": "gpu"}, volumes=volumes),
    ]


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    yield from fixture.cluster(request, tmp_path_factory, [NodeSpec(ORIGIN, "gpu"), NodeSpec(HOST, "cpu")])


def shadows(kube: KubeCluster) -> list:
    """Containers the host's containerd runs for the origin (not through any agent)."""
    return [c for c in kube.containers(HOST) if c.labels.get("weft.io/origin-node") == ORIGIN]


@dataclass
class Infer:
    name: str
    first_shadow: str
    seen_at: float


@pytest.fixture(scope="module")
def infer(kube: KubeCluster) -> Iterator[Infer]:
    apply(kube, *two_stage("infer"))
    try:
        wait_ready(kube, "infer")
        running = [c for c in shadows(kube) if c.metadata.name == "prep" and c.state == CONTAINER_RUNNING]
        assert len(running) == 1, _placements(kube)
        yield Infer("infer", running[0].id, time.monotonic())
    finally:
        delete(kube, "infer")
        kube.kubectl("delete", "configmap,secret", "infer-config", "infer-secret", "--ignore-not-found")


def _placements(kube: KubeCluster) -> list[dict]:
    return [e for e in kube.agents[ORIGIN].events() if e.get("event") == "placement.decided"]


def exec_out(kube: KubeCluster, container_name: str, *cmd: str) -> str:
    return kube.kubectl("exec", "infer", "-c", container_name, "--", *cmd).stdout


def test_the_rerouted_stage_is_ready_through_its_http_probe(kube: KubeCluster, infer: Infer) -> None:
    p = get_pod(kube, "infer")
    assert p["spec"]["nodeName"] == ORIGIN
    assert all(s["ready"] for s in p["status"]["containerStatuses"])
    # prep runs on the host, and not on the origin; model runs on the origin.
    origin_names = {c.metadata.name for c in kube.containers(ORIGIN) if c.state == CONTAINER_RUNNING}
    assert "model" in origin_names and "prep" not in origin_names
    assert "GPU" in kube.kubectl("logs", "infer", "-c", "model").stdout
    assert "prep starting" in kube.kubectl("logs", "infer", "-c", "prep").stdout


def test_the_stages_reach_each_other_on_localhost_both_ways(kube: KubeCluster, infer: Infer) -> None:
    assert exec_out(kube, "model", "wget", "-qO-", "http://localhost:8080/").strip() == "prep-says-hi"
    assert exec_out(kube, "prep", "wget", "-qO-", "http://localhost:9090/").strip() == "model-says-hi"


def test_kubectl_exec_attach_logs_and_port_forward_on_the_rerouted_stage(kube: KubeCluster, infer: Infer) -> None:
    assert kube.control is not None
    assert kube.kubectl("exec", "infer", "-c", "prep", "--", "sh", "-c", "exit 7", check=False).returncode == 7
    with Terminal(kube.control.kubectl_argv("exec", "-it", "infer", "-c", "prep", "--", "sh")) as tty:
        tty.send("echo $((6*7))x; hostname\n")
        tty.expect("42x")
        tty.send("exit\n")
        assert tty.wait() == 0
    follow = subprocess.Popen(kube.control.kubectl_argv("logs", "-f", "infer", "-c", "prep"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        with Terminal(kube.control.kubectl_argv("attach", "-i", "infer", "-c", "prep")) as attach:
            time.sleep(1)  # kubectl attaches before it reads its stdin
            attach.send("ping-from-attach\n")
            attach.expect("prep got ping-from-attach")
        assert follow.stdout is not None
        deadline = time.monotonic() + 30
        for line in follow.stdout:
            if "prep got ping-from-attach" in line or time.monotonic() > deadline:
                break
        assert "prep got ping-from-attach" in line
    finally:
        follow.kill()
        follow.wait()
        if follow.stdout is not None:
            follow.stdout.close()
    with port_forward(kube, "pod/infer", 8080) as local:
        assert http_get(f"http://127.0.0.1:{local}/index.html").strip() == "prep-says-hi"


def test_crictl_drives_every_verb_on_the_rerouted_stage_as_on_a_local_one(kube: KubeCluster, infer: Infer) -> None:
    sock = kube.agents[ORIGIN].socket
    netns = kube.node(ORIGIN).netns_path
    ids = {}
    for name in ("prep", "model"):
        found = crictl(sock, "ps", "--name", f"^{name}$", "--state", "running", "-q", netns=netns).stdout.split()
        assert len(found) == 1, (name, found)
        ids[name] = found[0]
    for name, cid in ids.items():
        info = json.loads(crictl(sock, "inspect", cid, netns=netns).stdout)
        assert info["status"]["state"] == "CONTAINER_RUNNING" and info["status"]["metadata"]["name"] == name
        assert f"{name} " in crictl(sock, "logs", cid, netns=netns).stdout + crictl(sock, "logs", cid,
                                                                                      netns=netns).stderr
        assert crictl(sock, "exec", cid, "cat", "/www/index.html", netns=netns).stdout.strip() == f"{name}-says-hi"
        with Terminal(crictl_argv(sock, "exec", "-it", cid, "sh", netns=netns)) as tty:
            tty.send("echo $((6*7))y\n")
            tty.expect("42y")
            tty.send("exit\n")
            assert tty.wait() == 0
        stats = json.loads(crictl(sock, "stats", "-o", "json", "--id", cid, netns=netns).stdout)
        assert [s["attributes"]["id"] for s in stats["stats"]] == [cid]
        assert int(stats["stats"][0]["memory"]["workingSetBytes"]["value"]) > 0
    # logs -f and attach on the rerouted one: a line sent through attach is followed in its log.
    prep = ids["prep"]
    follow = subprocess.Popen(crictl_argv(sock, "logs", "-f", "--tail", "0", prep, netns=netns),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        with Terminal(crictl_argv(sock, "attach", "-i", prep, netns=netns)) as attach:
            time.sleep(1)
            attach.send("ping-from-crictl\n")
            attach.expect("prep got ping-from-crictl")
        assert follow.stdout is not None
        assert any("prep got ping-from-crictl" in line for line in _lines_until(follow, "ping-from-crictl", 30))
    finally:
        follow.kill()
        follow.wait()
        if follow.stdout is not None:
            follow.stdout.close()
    # port-forward by sandbox: both stages' ports answer through the origin's pod.
    sandbox = crictl(sock, "pods", "--name", "^infer$", "--state", "ready", "-q", netns=netns).stdout.split()
    assert len(sandbox) == 1
    for port, page in ((8080, "prep-says-hi"), (9090, "model-says-hi")):
        local = _free_port_in(kube, ORIGIN)
        forward = subprocess.Popen(crictl_argv(sock, "port-forward", sandbox[0], f"{local}:{port}", netns=netns),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{local}/index.html"
            got = wait_for(lambda url=url: _wget_in(kube, ORIGIN, url), timeout=30,
                           what=f"crictl port-forward to {port}", every=0.5)
            assert got.strip() == page
        finally:
            forward.kill()
            forward.wait()


def _lines_until(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if needle in line or time.monotonic() > deadline:
            break
    return lines


def _free_port_in(kube: KubeCluster, node: str) -> int:
    out = kube.node(node).run("python3", "-c", "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); "
                                               "print(s.getsockname()[1])").stdout
    return int(out)


def _wget_in(kube: KubeCluster, node: str, url: str) -> str:
    res = kube.node(node).run("python3", "-c", f"import urllib.request; print(urllib.request.urlopen({url!r}, "
                                               "timeout=3).read().decode(), end='')", check=False)
    return res.stdout if res.returncode == 0 else ""


def test_configmap_secret_and_token_volumes_reach_the_rerouted_stage(kube: KubeCluster, infer: Infer) -> None:
    assert exec_out(kube, "prep", "cat", "/etc/config/greeting") == "hello"
    assert exec_out(kube, "prep", "cat", "/etc/secret/password") == "first-secret"
    kube.kubectl("patch", "configmap", "infer-config", "-p", json.dumps({"data": {"greeting": "hello again"}}))
    kube.kubectl("patch", "secret", "infer-secret", "-p", json.dumps({"stringData": {"password": "second-secret"}}))
    wait_for(lambda: exec_out(kube, "prep", "cat", "/etc/config/greeting") == "hello again", timeout=120,
             what="the ConfigMap update in the rerouted container", every=1)
    wait_for(lambda: exec_out(kube, "prep", "cat", "/etc/secret/password") == "second-secret", timeout=120,
             what="the Secret update in the rerouted container", every=1)
    token = exec_out(kube, "prep", "cat", "/var/run/secrets/tokens/token").strip()
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["aud"] == [AUDIENCE] and claims["sub"] == "system:serviceaccount:default:default"
    assert claims["kubernetes.io"]["pod"]["name"] == "infer"
    review = kube.kubectl("create", "-o", "json", "-f", "-", stdin=json.dumps({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
        "spec": {"token": token, "audiences": [AUDIENCE]}}))
    status = json.loads(review.stdout)["status"]
    assert status["authenticated"] and status["user"]["username"] == "system:serviceaccount:default:default"


def test_the_host_kubelet_neither_lists_nor_kills_the_shadow(kube: KubeCluster, infer: Infer) -> None:
    assert kube.control is not None
    host_ip = kube.node(HOST).mesh_ip
    while True:
        running = [c.id for c in shadows(kube) if c.state == CONTAINER_RUNNING]
        assert running == [infer.first_shadow]
        # kubelet's own view of what runs on its node (its runtime cache), over its API as the API server reaches it.
        status, body = _kubelet_get(kube, host_ip, "/runningpods/")
        assert status == 200, body
        assert [p["metadata"]["name"] for p in json.loads(body).get("items") or []] == []
        if time.monotonic() - infer.seen_at > WATCH_SHADOW_S:
            break
        time.sleep(5)
    assert container_status(get_pod(kube, "infer"), "prep")["restartCount"] == 0


def _kubelet_get(kube: KubeCluster, ip: str, path: str) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # kubelet's self-signed serving certificate
    try:
        with urllib.request.urlopen(f"https://{ip}:10250{path}", timeout=10, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_failing_liveness_probe_restarts_the_rerouted_stage(kube: KubeCluster, infer: Infer) -> None:
    exec_out(kube, "prep", "rm", "/tmp/alive")
    wait_for(lambda: container_status(get_pod(kube, "infer"), "prep")["restartCount"] >= 1, timeout=120,
             what="kubelet to restart prep after its liveness probe failed", every=0.5)
    p = wait_ready(kube, "infer")
    status = container_status(p, "prep")
    assert status["restartCount"] == 1 and status["ready"]
    running = [c for c in shadows(kube) if c.metadata.name == "prep" and c.state == CONTAINER_RUNNING]
    assert len(running) == 1 and running[0].id != infer.first_shadow  # placed afresh on the host
    assert exec_out(kube, "model", "wget", "-qO-", "http://localhost:8080/").strip() == "prep-says-hi"


def test_deleting_the_pod_leaves_nothing_on_either_node(kube: KubeCluster, infer: Infer) -> None:
    uid = get_pod(kube, "infer")["metadata"]["uid"]
    delete(kube, "infer")

    def gone() -> bool:
        left = [c for node in (ORIGIN, HOST) for c in kube.containers(node)
                if c.labels.get("io.kubernetes.pod.uid") == uid or c.labels.get("weft.io/origin-node") == ORIGIN]
        sandboxes = sandbox_of(kube, ORIGIN, "infer") + [s for s in kube.sandboxes(HOST)
                                                         if s.labels.get("weft.io/origin-node") == ORIGIN]
        return not left and not sandboxes

    # kubelet removes a deleted pod's stopped sandbox on its container GC pass, about once a minute.
    wait_for(gone, timeout=180, what="the pod's containers and sandboxes gone from both nodes", every=1)
    assert kube.agent_status(HOST).get("hosted") in ([], None)
    pods_dir = kube.kubelets[ORIGIN].pods_dir
    assert not (pods_dir / uid).exists() or not any((pods_dir / uid).rglob("*"))


def test_time_to_ready_opted_in_and_plain(request: pytest.FixtureRequest, kube: KubeCluster) -> None:
    """Figures only: seconds from ``kubectl apply`` to Ready, rerouted vs every stage ``local``."""
    times: dict[str, list[float]] = {"rerouted": [], "local": []}
    for round_ in range(2):
        for kind in ("rerouted", "local"):
            name = f"fig-{kind}-{round_}"
            t0 = time.monotonic()
            apply(kube, *two_stage(name, rerouted=kind == "rerouted"))
            try:
                wait_ready(kube, name)
                times[kind].append(time.monotonic() - t0)
                where = {c.metadata.name for c in shadows(kube) if c.state == CONTAINER_RUNNING}
                assert ("prep" in where) == (kind == "rerouted")
            finally:
                delete(kube, name)
                kube.kubectl("delete", "configmap,secret", f"{name}-config", f"{name}-secret", "--ignore-not-found")
    fixture.report(request.config, "two-stage pod, kubectl apply to Ready: " + ", ".join(
        f"{kind} {' / '.join(f'{t:.1f}' for t in ts)} s" for kind, ts in times.items()))
    assert all(len(ts) == 2 for ts in times.values())

