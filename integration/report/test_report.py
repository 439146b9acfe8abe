"""``weft report`` against a real Prometheus holding recorded dcgm-exporter, kube-state-metrics, cAdvisor and weft data.

One server for the module (backfilled from ``tests/data/report/`` and from the
stories written below, stopped and removed afterwards even when a test fails);
each test runs the command as a user would and asserts on what it prints. The
workloads opted in at 2025-03-03T12:00:00Z and have three hours of history
before (the stories six) and three after, so every report is taken ``--now``
just after.
"""

from __future__ import annotations

import functools
import json
import math
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.prometheus import T0, History, PrometheusServer
from shim.cli import main

NOW = "2025-03-03T15:05:00Z"
PRICES = ["--price", "p5.48xlarge=6.88,0.04", "--price", "c7i.16xlarge=0,0.05"]


# ---------------------------------------------------------------------------------------------------------------------
# Stories written sample by sample beside the recorded scrapes (harness.prometheus.History): what a
# real cluster holds around a rollout. All opt in at T0 (12:00Z) and run from 06:00Z to 15:00Z, scraped every 30 s.

H = 3600.0
START, END = T0 - 6 * H, T0 + 3 * H
DEVICE_BYTES = 80 * 2**30  # weft_gpu_device_memory_bytes of the story's devices
FB_MIB = 81559  # DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE of one of them


@dataclass
class Pod:
    """One pod and its GPU container: what kube-state-metrics, cAdvisor, dcgm-exporter and weft publish of it."""

    namespace: str
    name: str
    owner: tuple[str, str]  # (kind, name) as kube_pod_owner has it
    app: str
    node: str
    created: float
    runs: list[tuple[float, float]]  # each run of the container: (started, terminated or deleted)
    gpu: str  # index of the device it uses, on its node
    active: float  # the device's DCGM_FI_PROF_GR_ENGINE_ACTIVE while the pod runs
    restarts_before: int = 0  # restarts before the first run listed
    terminated_before: float | None = None
    requests: float = 1.0  # nvidia.com/gpu
    lease_bytes: float | None = None  # weft's lease while the container runs
    opted_in: float | None = None
    dcgm_from: float | None = None  # dcgm-exporter's pod mapping from (default: the first start)
    exported_labels: bool = False  # dcgm-exporter scraped with honor_labels false
    cpu: dict[str, tuple[str, float]] = field(default_factory=lambda: {"model": ("", 2.0)})  # container: node, cores

    @property
    def uuid(self) -> str:
        return f"GPU-{self.node}-{self.gpu}"

    @property
    def gone(self) -> float:
        return self.runs[-1][1]

    def started(self, t: float) -> float | None:
        return next((a for a, b in self.runs if a <= t < b), None)

    def restarts(self, t: float) -> int:
        return self.restarts_before + max(0, sum(a <= t for a, _ in self.runs) - 1)

    def last_terminated(self, t: float) -> float | None:
        ends = [b for a, b in self.runs[:-1] if b <= t]
        return max(ends) if ends else self.terminated_before

    def starts(self) -> list[tuple[float, float]]:
        """(started, seconds it took) of each run: from creation, or from the end of the run it replaced."""
        out = []
        for i, (a, _) in enumerate(self.runs):
            before = self.runs[i - 1][1] if i else self.terminated_before if self.restarts_before else self.created
            out.append((a, a - before))
        return out


def write(h: History, p: Pod) -> None:
    uid = f"{p.name}-{p.created:.0f}"
    pod = {"namespace": p.namespace, "pod": p.name, "uid": uid}
    alive = (max(p.created, START), min(p.gone, END))
    first = p.runs[0][0]
    h.add("kube_pod_owner", {**pod, "owner_kind": p.owner[0], "owner_name": p.owner[1], "owner_is_controller": "true"},
          *alive, 1)
    h.add("kube_pod_labels", {**pod, "label_app": p.app}, *alive, 1)
    h.add("kube_pod_info", {**pod, "host_ip": "10.0.4.5", "pod_ip": "10.244.4.9", "node": p.node,
                            "created_by_kind": p.owner[0], "created_by_name": p.owner[1], "priority_class": "",
                            "host_network": "false"}, *alive, 1)
    h.add("kube_pod_created", pod, *alive, p.created)
    for phase, value in (("Pending", lambda t: float(t < first)), ("Running", lambda t: float(t >= first))):
        h.add("kube_pod_status_phase", {**pod, "phase": phase}, *alive, value)
    c = {**pod, "container": "model"}
    h.add("kube_pod_container_resource_requests", {**c, "node": p.node, "resource": "nvidia_com_gpu",
                                                   "unit": "integer"}, *alive, p.requests)
    h.add("kube_pod_container_status_restarts_total", c, *alive, p.restarts)
    h.add("kube_pod_container_state_started", c, *alive, p.started)
    h.add("kube_pod_container_status_last_terminated_timestamp", c, *alive, p.last_terminated)
    # The pod's own cgroup and its pause container are series too; neither may count.
    cpu = {**p.cpu, "": (p.node, 20.0), "POD": (p.node, 5.0)}
    for container, (node, cores) in cpu.items():
        cid = f"/kubepods/pod{uid}" + (f"/{container}" if container else "")
        h.add("container_cpu_usage_seconds_total", {"id": cid, "namespace": p.namespace, "pod": p.name,
                                                     "container": container, "node": node or p.node, "cpu": "total"},
              *alive, lambda t, cores=cores: cores * max(0.0, t - first))
    labels = {"gpu": p.gpu, "UUID": p.uuid, "device": f"nvidia{p.gpu}", "modelName": "NVIDIA H100 80GB HBM3",
              "Hostname": p.node}
    if p.exported_labels:  # what Prometheus makes of the exporter's labels when the target has its own
        labels |= {"exported_container": "model", "exported_namespace": p.namespace, "exported_pod": p.name,
                   "container": "nvidia-dcgm-exporter", "namespace": "gpu-operator",
                   "pod": f"nvidia-dcgm-exporter-{p.node}", "instance": "10.0.4.2:9400", "job": "nvidia-dcgm-exporter",
                   "endpoint": "gpu-metrics", "service": "nvidia-dcgm-exporter"}
    else:
        labels |= {"container": "model", "namespace": p.namespace, "pod": p.name}
    dcgm = (max(p.dcgm_from or first, START), alive[1])
    used = 30000.0
    h.add("DCGM_FI_PROF_GR_ENGINE_ACTIVE", labels, *dcgm, p.active)
    h.add("DCGM_FI_DEV_GPU_UTIL", labels, *dcgm, p.active * 100)
    h.add("DCGM_FI_DEV_FB_USED", labels, *dcgm, used)
    h.add("DCGM_FI_DEV_FB_FREE", labels, *dcgm, FB_MIB - used)
    if p.lease_bytes is not None:
        for i, (a, b) in enumerate(p.runs):
            h.add("weft_gpu_lease_bytes", {"gpu": p.gpu, "UUID": p.uuid, "pod": p.name, "namespace": p.namespace,
                                           "container": "model", "lease": f"{p.name}-model-{i}"},
                  max(a, START), min(b, END), p.lease_bytes)
        h.add("weft_gpu_device_memory_bytes", {"gpu": p.gpu, "UUID": p.uuid}, START, END, DEVICE_BYTES)
    if p.opted_in is not None:
        h.add("weft_sandbox_opted_in_timestamp_seconds", {"namespace": p.namespace, "pod": p.name}, p.opted_in, END,
              p.opted_in)


def replicaset(h: History, namespace: str, deployment: str, name: str) -> None:
    h.add("kube_replicaset_owner", {"namespace": namespace, "replicaset": name, "owner_kind": "Deployment",
                                    "owner_name": deployment, "owner_is_controller": "true"}, START, END, 1)


def crash_loop(created: float, up: float, backoff: float) -> list[tuple[float, float]]:
    """A container that runs ``up`` seconds, dies, and is started again ``backoff`` seconds later, until the end."""
    runs, t = [], created + 15
    while t < END:
        runs.append((t, min(t + up, END)))
        t += up + backoff
    return runs


@functools.cache
def story() -> tuple[History, dict[str, list[Pod]]]:
    h = History()
    for node, kind, extra in (("gpu-node-3", "p5.48xlarge", {"label_nvidia_com_gpu_replicas": "4"}),
                              ("gpu-node-4", "p5.48xlarge", {}), ("cpu-node-2", "c7i.16xlarge", {})):
        h.add("kube_node_labels", {"node": node, "label_node_kubernetes_io_instance_type": kind, **extra},
              START, END, 1)
    # gpu-node-3's device plugin hands out each of its 8 GPUs as 4 time-sliced replicas.
    for node, gpus in (("gpu-node-3", 32), ("gpu-node-4", 8)):
        h.add("kube_node_status_capacity", {"node": node, "resource": "nvidia_com_gpu", "unit": "integer"},
              START, END, gpus)
    long_ago = T0 - 2 * 86400
    rs = {"embedder": ("embedder-6c8d9f7b5", "embedder-59f7c8d6b4"), "crashy": ("crashy-7b9c8d6f5", "crashy-5c6d7e8f9"),
          "transcoder": ("transcoder-64f5d7c8b9", "transcoder-7f8e9d6c5b")}
    ns = {"embedder": "nlp", "crashy": "batch", "transcoder": "media"}
    for d, (old, new) in rs.items():
        replicaset(h, ns[d], d, old)
        replicaset(h, ns[d], d, new)
    replicaset(h, "nlp", "embedder-canary", "embedder-canary-7d5b6c8f9")

    def rs_pod(d: str, which: int, suffix: str, **kw) -> Pod:
        name = rs[d][which]
        return Pod(ns[d], f"{name}-{suffix}", ("ReplicaSet", name), d, **kw)

    half = DEVICE_BYTES / 2
    pods = {
        # A Deployment rolled out to a new ReplicaSet at opt-in: two pods on whole GPUs (one restarted days ago,
        # one replaced at 10:00 and mapped by dcgm-exporter only 90 s after it started), then two 40 GiB leases
        # on one device with the decode stage on a CPU node.
        "embedder": [
            rs_pod("embedder", 0, "a1b2c", node="gpu-node-4", created=long_ago, runs=[(long_ago + 20, T0 + 45)],
                   gpu="0", active=0.10, restarts_before=3, terminated_before=long_ago + 10),
            rs_pod("embedder", 0, "d3e4f", node="gpu-node-4", created=START, runs=[(START + 15, T0 - 2 * H)],
                   gpu="1", active=0.10),
            rs_pod("embedder", 0, "g5h6i", node="gpu-node-4", created=T0 - 2 * H,
                   runs=[(T0 - 2 * H + 20, T0 + 90)], gpu="1", active=0.10, dcgm_from=T0 - 2 * H + 110),
            rs_pod("embedder", 1, "x7y8z", node="gpu-node-4", created=T0, runs=[(T0 + 15, END)], gpu="2",
                   active=0.30, lease_bytes=half, opted_in=T0, cpu={"model": ("", 1.0), "decode": ("cpu-node-2", 3.0)}),
            rs_pod("embedder", 1, "k9l0m", node="gpu-node-4", created=T0 + 40, runs=[(T0 + 58, END)], gpu="2",
                   active=0.30, lease_bytes=half, opted_in=T0 + 40,
                   cpu={"model": ("", 1.0), "decode": ("cpu-node-2", 3.0)}),
        ],
        # Its neighbour in the namespace, never opted in, far busier: none of it may count.
        "embedder-canary": [
            Pod("nlp", "embedder-canary-7d5b6c8f9-q1w2e", ("ReplicaSet", "embedder-canary-7d5b6c8f9"),
                "embedder-canary", node="gpu-node-4", created=long_ago, runs=[(long_ago + 20, END)], gpu="5",
                active=0.90),
        ],
        # A StatefulSet updated in place: each pod is recreated under its name, with restart counters from
        # days before; nothing restarts in the windows. The agent records the opt-in at a fraction of a second.
        "indexer": [
            Pod("ops", "indexer-0", ("StatefulSet", "indexer"), "indexer", node="gpu-node-4", created=long_ago,
                runs=[(long_ago + 10, T0 + 180)], gpu="6", active=0.30, restarts_before=5,
                terminated_before=long_ago + 5),
            Pod("ops", "indexer-0", ("StatefulSet", "indexer"), "indexer", node="gpu-node-4", created=T0 + 180,
                runs=[(T0 + 195, END)], gpu="6", active=0.30, lease_bytes=DEVICE_BYTES, opted_in=T0 + 180.2181),
            Pod("ops", "indexer-1", ("StatefulSet", "indexer"), "indexer", node="gpu-node-4", created=long_ago,
                runs=[(long_ago + 10, T0)], gpu="7", active=0.30, restarts_before=2, terminated_before=long_ago + 5),
            Pod("ops", "indexer-1", ("StatefulSet", "indexer"), "indexer", node="gpu-node-4", created=T0,
                runs=[(T0 + 14, END)], gpu="7", active=0.30, lease_bytes=DEVICE_BYTES, opted_in=T0 + 0.4567),
        ],
        # On time-sliced replicas (a quarter of a device each), then 20 GiB leases whose containers crash every
        # nine and a half minutes and are started again 90 s later, the lease gone in between.
        "crashy": [
            rs_pod("crashy", 0, "r1s2t", node="gpu-node-3", created=START, runs=[(START + 12, T0 + 60)], gpu="0",
                   active=0.20),
            rs_pod("crashy", 0, "u3v4w", node="gpu-node-3", created=START, runs=[(START + 12, T0 + 90)], gpu="0",
                   active=0.20),
            rs_pod("crashy", 1, "n1n2n", node="gpu-node-3", created=T0, runs=crash_loop(T0, 570, 90), gpu="0",
                   active=0.20, lease_bytes=DEVICE_BYTES / 4, opted_in=T0),
            rs_pod("crashy", 1, "m1m2m", node="gpu-node-3", created=T0 + 30, runs=crash_loop(T0 + 30, 570, 90),
                   gpu="0", active=0.20, lease_bytes=DEVICE_BYTES / 4, opted_in=T0 + 30),
        ],
        # dcgm-exporter scraped as its Helm chart's ServiceMonitor does by default (honorLabels: false).
        "transcoder": [
            rs_pod("transcoder", 0, "t1t2t", node="gpu-node-4", created=START, runs=[(START + 15, T0 + 60)], gpu="3",
                   active=0.10, exported_labels=True),
            rs_pod("transcoder", 1, "v1v2v", node="gpu-node-4", created=T0, runs=[(T0 + 15, END)], gpu="4",
                   active=0.20, lease_bytes=half, opted_in=T0, exported_labels=True),
        ],
    }
    for group in pods.values():
        for p in group:
            write(h, p)
    return h, pods


@pytest.fixture(scope="module")
def prom() -> Iterator[PrometheusServer]:
    with PrometheusServer(history=story()[0]) as p:
        yield p


def report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["report", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_workload_whose_utilisation_rose_is_kept(prom: PrometheusServer, capsys, tmp_path: Path) -> None:
    png = tmp_path / "trainer.png"
    code, out, _ = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", prom.url, "--now", NOW,
                          *PRICES, "--json", "--plot", str(png))
    assert code == 0
    doc = json.loads(out)
    assert doc["windows_from"] == "weft metrics"
    assert doc["opt_in"] == "2025-03-03T12:00:00Z"
    assert doc["active_metric"] == "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    b, a = doc["before"], doc["after"]
    assert b["held_from"] == ["device plugin"] and "weft leases" in a["held_from"]
    assert b["active_over_held"] == pytest.approx(0.09, rel=0.02)
    assert a["active_over_held"] > 3 * b["active_over_held"]
    assert a["gpu_seconds_held"] < 0.6 * b["gpu_seconds_held"]  # two 20 GiB leases instead of a whole GPU
    assert a["cpu_seconds_hosts"] > 0 and b["cpu_seconds_hosts"] == 0  # the decode stage moved to a CPU node
    assert a["costs"]["gpu_idle"] < b["costs"]["gpu_idle"]
    assert b["restarts"] == 1 and a["restarts"] == 0
    assert b["p95_container_start_s"] == 14 and a["p95_container_start_s"] == 22
    assert doc["verdict"]["outcome"] == "kept"
    assert "runtimeClassName" in doc["backout"] and "patch deployment trainer" in doc["backout"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_workload_whose_utilisation_did_not_rise_is_no_change(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "app=ranker", "-n", "search", "--prometheus", prom.url, "--now", NOW, *PRICES,
                          "--markdown")
    assert code == 0
    assert "**Verdict: no change** (within-margin)" in out
    assert "| GPU-active / held | 30.0% | 30.9% |" in out
    assert "To back out: remove `runtimeClassName: weft`" in out


def test_missing_dcgm_series_say_so_and_invent_no_verdict(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "deployment/asr", "-n", "speech", "--prometheus", prom.url, "--now", NOW, *PRICES)
    assert code == 3
    assert "verdict: no verdict (no-dcgm)" in out
    assert "no DCGM activity series for the pods in the before and after window" in out
    assert "DCGM_EXPORTER_KUBERNETES=true" in out
    assert "kept" not in out.split("rule:")[0]


def test_no_opt_in_record_asks_for_windows_and_flags_give_them(prom: PrometheusServer, capsys) -> None:
    code, _, err = report(capsys, "deployment/scorer", "-n", "ads", "--prometheus", prom.url, "--now", NOW)
    assert code == 2
    assert err.startswith("weft report: no record of when ads/deployment/scorer opted in")
    assert "--before START..END --after START..END" in err
    code, out, _ = report(capsys, "deployment/scorer", "-n", "ads", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T09:00:00Z..2025-03-03T12:00:00Z",
                          "--after", "2025-03-03T12:00:00Z..2025-03-03T15:00:00Z", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["windows_from"] == "flags" and doc["verdict"]["outcome"] == "kept"
    assert doc["before"]["costs"] is None  # no prices given: left out, not invented


def test_an_unknown_workload_names_what_to_check(prom: PrometheusServer, capsys) -> None:
    code, _, err = report(capsys, "deployment/nope", "-n", "vision", "--prometheus", prom.url, "--now", NOW)
    assert code == 2
    assert "no pods of vision/deployment/nope" in err and "--namespace" in err


def test_a_window_shorter_than_the_scrape_interval_is_refused(prom: PrometheusServer, capsys) -> None:
    code, _, err = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T11:00:00Z..2025-03-03T11:00:10Z",
                          "--after", "2025-03-03T12:00:00Z..2025-03-03T15:00:00Z")
    assert code == 2
    assert "--before: the before window is 10s, shorter than the scrape interval (30s)" in err


def test_too_little_data_gives_no_verdict_and_says_how_much_it_needs(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T11:55:00Z..2025-03-03T12:00:00Z",
                          "--after", "2025-03-03T12:00:00Z..2025-03-03T15:00:00Z")
    assert code == 3
    assert "verdict: no verdict (too-little-data)" in out
    assert "a verdict needs 30 (15min)" in out


def test_a_prometheus_that_is_down_is_a_clear_error(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    code, _, err = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", f"http://127.0.0.1:{port}")
    assert code == 2
    assert err.startswith(f"weft report: cannot reach Prometheus at http://127.0.0.1:{port}")


def test_a_prometheus_that_is_slow_times_out_with_a_clear_error(capsys) -> None:
    # A server that accepts and never answers: the report must give up after --timeout, not hang.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        code, _, err = report(capsys, "deployment/trainer", "-n", "vision", "--prometheus", url, "--timeout", "0.5")
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        server.close()
    assert code == 2
    assert f"Prometheus at {url} did not answer within 0.5 s" in err and "--timeout" in err


def as_json(capsys: pytest.CaptureFixture[str], prom: PrometheusServer, *args: str) -> dict:
    code, out, err = report(capsys, *args, "--prometheus", prom.url, "--json")
    assert code in (0, 3), err
    return json.loads(out)


def test_relative_windows_take_a_space_or_an_equals_sign(prom: PrometheusServer, capsys) -> None:
    args = ("deployment/trainer", "-n", "vision", "--now", "2025-03-03T15:00:00Z")
    spaced = as_json(capsys, prom, *args, "--before", "-6h..-3h", "--after", "-3h..now")
    joined = as_json(capsys, prom, *args, "--before=-6h..-3h", "--after=-3h..now")
    assert spaced == joined
    assert (spaced["before"]["start"], spaced["after"]["start"]) == ("2025-03-03T09:00:00Z", "2025-03-03T12:00:00Z")
    assert spaced["verdict"]["outcome"] == "kept"


def restarts_and_verdict(doc: dict) -> tuple[int, int, str]:
    return doc["before"]["restarts"], doc["after"]["restarts"], doc["verdict"]["outcome"]


FRACTIONS = [".0", ".25", ".5", ".7346", ".9996"]


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_windows_starting_at_any_fraction_of_a_second_count_no_old_restarts(prom: PrometheusServer, capsys,
                                                                              fraction: str) -> None:
    # The indexer's pods carry restart counters of 5 and 2 from days before; nothing restarts in the windows.
    doc = as_json(capsys, prom, "statefulset/indexer", "-n", "ops", "--now", NOW,
                  "--before", f"2025-03-03T08:55:00{fraction}Z..2025-03-03T11:59:00Z",
                  "--after", f"2025-03-03T12:00:00{fraction}Z..2025-03-03T15:05:00Z")
    assert restarts_and_verdict(doc) == (0, 0, "no change")


@pytest.mark.parametrize("fraction", FRACTIONS)
def test_the_default_windows_give_one_verdict_whatever_the_fraction_of_now(prom: PrometheusServer, capsys,
                                                                             fraction: str) -> None:
    # The agent recorded the opt-in at 12:00:00.4567, so the after window starts there.
    doc = as_json(capsys, prom, "statefulset/indexer", "-n", "ops", "--now", f"2025-03-03T15:05:00{fraction}Z")
    assert doc["windows_from"] == "weft metrics"
    assert restarts_and_verdict(doc) == (0, 0, "no change")


def test_a_rollout_is_measured_on_its_own_pods_and_containers(prom: PrometheusServer, capsys) -> None:
    doc = as_json(capsys, prom, "deployment/embedder", "-n", "nlp", "--now", NOW)
    assert not any("canary" in p for p in doc["pods"]) and len(doc["pods"]) == 5
    b, a = doc["before"], doc["after"]
    assert b["active_over_held"] == pytest.approx(0.10, rel=0.02)
    assert a["active_over_held"] == pytest.approx(0.30, rel=0.03)
    assert doc["verdict"]["outcome"] == "kept"
    # Two cores of model on the GPU node before; one each after, and three each of decode on the CPU node.
    # The pods' own cgroups and pause containers, far busier, are not counted.
    assert b["cpu_seconds_gpu_nodes"] == pytest.approx(4 * b["seconds"], rel=0.02) and b["cpu_seconds_hosts"] == 0
    assert a["cpu_seconds_hosts"] == pytest.approx(6 * (END - T0), rel=0.02)


def test_gpu_memory_held_uses_the_samples_there_are_and_says_what_was_missing(prom: PrometheusServer,
                                                                             capsys) -> None:
    # dcgm-exporter mapped the pod that replaced another at 10:00 only 90 s after it started.
    doc = as_json(capsys, prom, "deployment/embedder", "-n", "nlp", "--now", NOW)
    assert doc["before"]["gpu_memory_held_bytes_mean"] == pytest.approx(2 * FB_MIB * 2**20, rel=0.01)
    missing = [n for n in doc["notes"] if n.startswith("before: GPU memory held")]
    assert len(missing) == 1 and re.search(r"the mean over \d+ of \d+ steps", missing[0])
    assert "embedder-6c8d9f7b5-g5h6i" in missing[0]


def seen_starts(pod: Pod, start: float, end: float) -> list[float]:
    """How long each start in [start, end] took, of those a scrape saw running."""
    return [took for (a, b), (_, took) in zip(pod.runs, pod.starts(), strict=True)
            if start <= a <= end and math.ceil(a / 30) * 30 < b]


def test_each_container_start_is_timed_from_what_started_it(prom: PrometheusServer, capsys) -> None:
    doc = as_json(capsys, prom, "deployment/crashy", "-n", "batch", "--now", NOW)
    new = story()[1]["crashy"][2:]
    starts = [d for p in new for d in seen_starts(p, T0, END)]
    assert sorted(set(starts)) == [15, 90]  # first starts from the pod's creation; restarts from the crash before
    a = doc["after"]
    assert a["container_starts"] == len(starts) > 30
    assert a["p95_container_start_s"] == 90
    assert doc["before"]["container_starts"] == 0 and doc["before"]["p95_container_start_s"] is None
    assert doc["verdict"]["reason"] == "restarts-rose"


def test_a_pod_between_two_leases_holds_what_its_device_plugin_hands_out(prom: PrometheusServer, capsys) -> None:
    # gpu-node-3 advertises each GPU as four replicas: a pod holds a quarter of a device, before opting in and
    # in every gap between two leases of its crashing container.
    doc = as_json(capsys, prom, "deployment/crashy", "-n", "batch", "--now", NOW)
    b, a = doc["before"], doc["after"]
    assert b["gpu_seconds_held"] == pytest.approx(2 * 0.25 * b["seconds"], rel=0.01)
    running = sum(min(p.gone, END) - max(p.runs[0][0], T0) for p in story()[1]["crashy"])
    assert a["gpu_seconds_held"] == pytest.approx(0.25 * running, rel=0.02)


def test_dcgm_scraped_with_exported_labels_still_gives_a_verdict(prom: PrometheusServer, capsys) -> None:
    doc = as_json(capsys, prom, "deployment/transcoder", "-n", "media", "--now", NOW)
    assert doc["active_metric"] == "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
    assert doc["before"]["active_over_held"] == pytest.approx(0.10, rel=0.02)
    assert doc["after"]["active_over_held"] == pytest.approx(0.40, rel=0.02)
    assert doc["verdict"]["outcome"] == "kept"


@pytest.mark.parametrize("fmt", [[], ["--markdown"]], ids=["table", "markdown"])
def test_every_report_ends_with_the_step_to_back_out(prom: PrometheusServer, capsys, fmt: list[str]) -> None:
    # No DCGM: a report with notes.
    _, out, _ = report(capsys, "deployment/asr", "-n", "speech", "--prometheus", prom.url, "--now", NOW, *fmt)
    assert "notes:" in out.lower()
    last = out.strip().splitlines()[-1]
    assert last.lower().startswith("to back out: remove `runtimeclassname: weft`")


def test_with_explicit_windows_the_header_says_where_they_come_from(prom: PrometheusServer, capsys) -> None:
    code, out, _ = report(capsys, "deployment/scorer", "-n", "ads", "--prometheus", prom.url, "--now", NOW,
                          "--before", "2025-03-03T09:00:00Z..2025-03-03T11:00:00Z",
                          "--after", "2025-03-03T13:00:00Z..2025-03-03T15:00:00Z")
    assert code == 0
    header = out.split("\n\n")[0]
    assert "opted in at" not in header
    assert "windows from --before and --after" in header


def test_exit_codes_tell_a_verdict_from_no_verdict_and_from_an_error(prom: PrometheusServer) -> None:
    def weft_report(*args: str) -> int:
        return subprocess.run([sys.executable, "-m", "shim.cli", "report", *args, "--prometheus", prom.url,
                               "--now", NOW], capture_output=True, timeout=120).returncode

    assert weft_report("deployment/trainer", "-n", "vision") == 0  # kept
    assert weft_report("app=ranker", "-n", "search") == 0  # no change is a verdict too
    assert weft_report("deployment/asr", "-n", "speech") == 3  # no verdict: no DCGM
    assert weft_report("deployment/nope", "-n", "vision") == 2  # an error
    assert weft_report("deployment/trainer", "-n", "vision", "--window", "soon") == 2
